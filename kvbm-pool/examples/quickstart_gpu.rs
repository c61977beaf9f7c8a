//! The quickstart with G1 on a GPU: a Llama-3.1-8B-shaped KV cache in
//! device memory, G2 in pinned host memory, G3 on disk. A 40-block prompt
//! goes down, G1 forgets it, a second request gets it back, and every
//! byte of every onboarded block is checked. Without a GPU it says so and
//! exits cleanly (with `KVBM_REQUIRE_GPU=1`, it fails instead).
//!
//! ```text
//! cargo run --release -p kvbm-pool --features cuda --example quickstart_gpu
//! ```

use kvbm_block::{DynamoXxh3, sequence_hashes};
use kvbm_pool::KvShape;
use kvbm_pool::tier::{self, TierEngine, TierPolicy::WriteThrough};
use kvbm_transfer::cuda::{CudaDevice, DeviceBuffer, Probe, probe};

fn main() -> Result<()> {
    let Probe::Devices(_) = probe() else {
        if std::env::var_os("KVBM_REQUIRE_GPU").is_some_and(|v| v == "1") {
            return Err("KVBM_REQUIRE_GPU=1 and no CUDA device".into());
        }
        println!("skipped: no CUDA device");
        return Ok(());
    };
    // Llama-3.1-8B: 32 layers, 8 KV heads × 128, bf16, 16-token blocks (2 MiB).
    let shape = KvShape::mha(32, 8, 128);
    let device = CudaDevice::open(0)?;
    let dir = std::env::temp_dir().join("kvbm-quickstart-gpu");
    std::fs::create_dir_all(&dir)?;
    let engine = TierEngine::builder(shape)
        .g1_device(&device, 64)
        .g2_host_bytes(16 * shape.block_bytes())
        .g3_disk(&dir, 256 * shape.block_bytes())
        .g2_policy(WriteThrough) // admit every block (the default learns which recur)
        .offload_mode(tier::OffloadMode::WriteThrough) // copy to G2 at registration
        .build()?;

    let tokens: Vec<u32> = (0..40 * 16 + 5).collect();
    let hashes = sequence_hashes(DynamoXxh3::default(), shape.tokens_per_block(), &tokens)?;
    let mut complete = Vec::new();
    let mut parent = None;
    for (block, &hash) in engine.allocate_g1(hashes.len())?.into_iter().zip(&hashes) {
        // (the model's attention kernels write the block's KV here)
        for_each_chunk(&engine, block.block_id(), |buffer, offset, len, salt| {
            Ok(buffer.write(offset, &pattern(hash.0 ^ salt, len))?)
        })?;
        complete.push(block.complete(hash, parent)?);
        parent = Some(hash);
    }
    drop(engine.register_g1(complete)?);
    engine.flush();
    engine.g1().evict(64);

    let found = engine.match_request(1u64, &hashes, tokens.len(), tier::G1Lookup::Pool)?;
    let started = std::time::Instant::now();
    let loaded = engine.onboard(1u64, tier::OnboardTarget::Pool)?.wait()?;
    let took = started.elapsed();
    let mut checked = 0;
    for (&id, hash) in loaded.blocks.block_ids().iter().zip(&hashes) {
        for_each_chunk(&engine, id, |buffer, offset, len, salt| {
            let mut back = vec![0u8; len];
            buffer.read(offset, &mut back)?;
            if back != pattern(hash.0 ^ salt, len) {
                return Err(format!("block {id} (hash {hash:?}) came back different").into());
            }
            Ok(())
        })?;
        checked += 1;
    }
    println!(
        "GPU {}: G2 {} + G3 {} blocks onboarded in {:.2} ms ({:.1} GB/s); {checked} blocks checked byte for byte",
        device.name(),
        found.g2_blocks,
        found.g3_blocks,
        took.as_secs_f64() * 1e3,
        (loaded.count as u64 * shape.block_bytes()) as f64 / took.as_secs_f64() / 1e9,
    );
    engine.release(1u64);
    Ok(())
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Calls `f(device buffer, offset, length, salt)` for each chunk (layer,
/// K/V) of G1 block `id`; the salt tells the chunks apart.
fn for_each_chunk(
    engine: &TierEngine,
    id: u32,
    mut f: impl FnMut(&DeviceBuffer, usize, usize, u64) -> Result<()>,
) -> Result<()> {
    let g1 = engine.layout(kvbm_pool::Tier::G1).ok_or("no local G1")?;
    let cfg = *g1.layout().config();
    for layer in 0..cfg.num_layers() {
        for outer in 0..cfg.outer_dim() {
            let chunk = g1.layout().chunk(id as usize, layer, outer)?;
            let buffer = g1.regions()[chunk.region]
                .owner()
                .and_then(|o| o.downcast_ref::<DeviceBuffer>())
                .ok_or("G1 is not kvbm's device memory")?;
            let salt = ((layer as u64) << 1 | outer as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            f(buffer, chunk.offset as usize, chunk.len as usize, salt)?;
        }
    }
    Ok(())
}

/// Bytes that depend on `seed` and their position (xorshift).
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
