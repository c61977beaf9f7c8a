//! G3 write-behind in write-back mode: a G1 allocation under pressure
//! leaves its victims' disk writes queued behind it, yet every block read
//! back holds the bytes that went out — read after its write landed, never
//! from a slot rewritten early; the staging slots come back; a block whose
//! write failed is never loaded; dropping the engine writes what was
//! queued.

mod tier_support;

use std::os::unix::fs::FileExt;

use kvbm_block::SequenceHash;
use kvbm_pool::metrics::Path;
use kvbm_pool::tier::{G1Lookup, TierEngine, TierPolicy};
use kvbm_pool::{EvictionKind, Tier};
use kvbm_testkit::fault::{Fault, FaultRule};
use kvbm_transfer::disk::IoDir;
use kvbm_transfer::{Executor, PhysicalLayout};
use proptest::prelude::*;
use tier_support::*;

/// Staging slots; write-behind may take half of them (more than the tests
/// below leave on their way to G3 at once, so none is written directly).
const STAGING: usize = 64;
const G1: usize = 16;
const G2_POOL: usize = 4;

/// Write-back (the default), every block admitted everywhere, LRU
/// everywhere: the oldest blocks of a chain go down first.
fn wb_engine(exec: Executor, dir: &std::path::Path, g3: usize) -> TierEngine {
    let engine = tiers_with(G1, G2_POOL + STAGING, g3, dir, exec)
        .g1_eviction(EvictionKind::Lru)
        .g2_policy(TierPolicy::WriteThrough)
        .g3_policy(TierPolicy::WriteThrough)
        .g3_staging_bytes(STAGING as u64 * block_bytes())
        .build()
        .unwrap();
    assert_eq!(engine.staging_free_blocks(), STAGING);
    engine
}

#[test]
fn allocations_leave_g3_writes_behind_and_every_byte_comes_back() {
    let dir = tempdir();
    let engine = wb_engine(slow_writes(300), dir.path(), 64);
    // 40 blocks through 16 G1 and 4 G2 blocks: 20 G2 victims go to G3.
    let a = chain(1, 40);
    compute_each(&engine, &a);
    // The last allocations returned while writes were still queued or in
    // flight: their blocks sit in staging slots.
    assert!(engine.staging_free_blocks() < STAGING);
    let g3 = engine.pool(Tier::G3).unwrap();
    assert!(engine.stats().blocks_on(Path::G2ToG3) < 20);
    // Registered ahead of their writes: matchable at once.
    assert_eq!(g3.cached_prefix_len(&a[..20]), 20);
    engine.flush();
    assert_eq!(engine.stats().blocks_on(Path::G2ToG3), 20);
    assert_eq!(engine.staging_free_blocks(), STAGING, "the slots return");
    // Onboarding 12 of them from G3 evicts 12 more from G1 (their writes
    // queue behind the onboard); then read everything back.
    assert_eq!(load(&engine, "a", &a[..12]).unwrap(), 12);
    assert_eq!(load(&engine, "b", &a[..20]).unwrap(), 8);
    engine.flush();
    assert_eq!(engine.staging_free_blocks(), STAGING);
    assert_eq!(engine.stats().offload_copy_failures(), 0);
    for k in [0, 8, 16, 24, 32] {
        load(&engine, &format!("c{k}"), &a[k..k + 8]).unwrap();
    }
}

#[test]
fn a_match_of_a_block_being_written_reads_it_once_written() {
    let dir = tempdir();
    let engine = wb_engine(slow_writes(300), dir.path(), 64);
    // One G2 victim (a[0]) goes to G3.
    let a = chain(2, G1 + G2_POOL + 1);
    compute_each(&engine, &a);
    assert_eq!(engine.staging_free_blocks(), STAGING - 1);
    assert_eq!(engine.stats().blocks_on(Path::G2ToG3), 0);
    // Matched at once: the read waits for the write.
    assert_eq!(load(&engine, "a", &a[..1]).unwrap(), 1);
    assert_eq!(engine.stats().blocks_on(Path::G2ToG3), 1);
}

#[test]
fn slots_rewritten_while_writes_are_queued_keep_the_latest_bytes() {
    let dir = tempdir();
    // A G3 of 4 blocks turns over while its writes are still queued.
    let engine = wb_engine(slow_writes(20), dir.path(), 4);
    let a = chain(3, 60);
    compute_each(&engine, &a);
    engine.flush();
    assert_eq!(engine.staging_free_blocks(), STAGING);
    // G3 holds the last four G2 victims.
    let victims = &a[..a.len() - G1 - G2_POOL];
    let last = &victims[victims.len() - 4..];
    assert_eq!(engine.pool(Tier::G3).unwrap().cached_prefix_len(last), 4);
    assert_eq!(load(&engine, "last", last).unwrap(), 4);
}

#[test]
fn a_block_whose_write_failed_is_never_loaded() {
    let dir = tempdir();
    let exec = faulty_executor(FaultRule::always(Fault::Errno(libc::EIO)).on_dir(IoDir::Write));
    let engine = wb_engine(exec, dir.path(), 64);
    let a = chain(4, G1 + G2_POOL + 1);
    compute_each(&engine, &a);
    engine.flush();
    assert_eq!(engine.staging_free_blocks(), STAGING);
    assert_eq!(engine.stats().offload_copy_failures(), 1);
    // Registered before its write, the block is not matched once the
    // write failed: nothing is loaded.
    assert_eq!(engine.pool(Tier::G3).unwrap().cached_prefix_len(&a[..1]), 1);
    let m = engine
        .match_request("a", &a[..1], BLOCK_TOKENS + 1, G1Lookup::Pool)
        .unwrap();
    assert_eq!(m.external_blocks(), 0);
    drop(m);
    engine.release("a");
    assert!(!engine.g1().contains(a[0]), "nothing was loaded");
}

/// Whether G3 block `block` of the file behind `layout` holds `hash`.
fn file_holds(layout: &PhysicalLayout, block: u32, hash: SequenceHash) -> bool {
    let g1 = host(1);
    let cfg = *layout.layout().config();
    let mut bytes = Vec::new();
    for layer in 0..cfg.num_layers() {
        for outer in 0..cfg.outer_dim() {
            let c = layout.layout().chunk(block as usize, layer, outer).unwrap();
            let (file, base) = layout.regions()[c.region].file_location().unwrap();
            let f = std::fs::File::open(file.path()).unwrap();
            let mut buf = vec![0u8; c.len as usize];
            f.read_exact_at(&mut buf, base + c.offset).unwrap();
            bytes.extend(buf);
        }
    }
    // Compare through a host block filled with the bytes read.
    let c = g1.layout().chunk(0, 0, 0).unwrap();
    let addr = g1.regions()[c.region].addr().unwrap() + c.offset;
    // SAFETY: `g1` is a one-block host layout of this test, fully
    // contiguous, as large as `bytes`; nothing else touches it.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
    holds(&g1, 0, hash)
}

#[test]
fn dropping_the_engine_writes_what_was_queued() {
    let dir = tempdir();
    let engine = wb_engine(slow_writes(300), dir.path(), 64);
    let a = chain(5, 40);
    compute_each(&engine, &a);
    assert!(engine.staging_free_blocks() < STAGING, "writes are pending");
    let layout = engine.layout(Tier::G3).unwrap().clone();
    let g3 = engine.pool(Tier::G3).unwrap();
    let ids: Vec<(u32, SequenceHash)> = a[..20]
        .iter()
        .map(|&h| {
            let b = g3.match_prefix(&[h]).into_blocks().pop().unwrap();
            (b.block_id(), h)
        })
        .collect();
    drop(engine);
    for (id, h) in ids {
        assert!(file_holds(&layout, id, h), "G3 block {id} lost {h:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Any mix of computing, loading and flushing, with slow writes and a
    /// small G3: every loaded byte is right and the slots all come back.
    #[test]
    fn any_workload_loads_only_the_bytes_that_went_out(
        ops in prop::collection::vec((0u8..3, 0usize..6, 1usize..10), 1..24),
        g3 in 4usize..24,
    ) {
        let dir = tempdir();
        let engine = wb_engine(slow_writes(2), dir.path(), g3);
        let chains: Vec<Vec<SequenceHash>> = (0..6).map(|c| chain(100 + c as u64, 12)).collect();
        for (i, &(op, c, n)) in ops.iter().enumerate() {
            let hashes = &chains[c][..n];
            match op {
                0 => compute_each(&engine, hashes),
                1 => {
                    // A failed read would be a lost byte: none may fail.
                    load(&engine, &format!("r{i}"), hashes).unwrap();
                }
                _ => engine.flush(),
            }
        }
        engine.flush();
        prop_assert_eq!(engine.staging_free_blocks(), STAGING);
        prop_assert_eq!(engine.stats().offload_copy_failures(), 0);
        prop_assert_eq!(engine.stats().onboard_copy_failures(), 0);
    }
}
