//! Scratch timing.
use kvbm_block::SequenceHash;
use kvbm_pool::{BlockPool, PoolConfig, Tier};
use std::time::Instant;
fn main() {
    let pool = BlockPool::new(PoolConfig::new(65_536, 16, Tier::G2)).unwrap();
    let hashes: Vec<SequenceHash> = (0..128u64)
        .map(|i| SequenceHash(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1))
        .collect();
    for round in 0..3 {
        let t = Instant::now();
        let n = 1_000_000;
        for _ in 0..n {
            std::hint::black_box(pool.match_prefix(std::hint::black_box(&hashes)));
        }
        println!("round {round}: absent {:?}/call", t.elapsed() / n);
    }
}
