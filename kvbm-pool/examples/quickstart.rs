//! The README's example: a request's blocks go down to G2 (host memory) and
//! G3 (disk), G1 forgets them, and a second request with the same prompt
//! gets them back. Host memory stands in for the GPU (the `quickstart_gpu`
//! example puts G1 on one).
//!
//! ```text
//! cargo run -p kvbm-pool --example quickstart
//! ```

use kvbm_block::{DynamoXxh3, sequence_hashes};
use kvbm_pool::KvShape;
use kvbm_pool::tier::{self, TierEngine, TierPolicy::WriteThrough};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A 1-layer model: K and V of one 128-wide head per token, bf16, 16-token blocks.
    let shape = KvShape::mha(1, 1, 128);
    let dir = std::env::temp_dir().join("kvbm-quickstart");
    std::fs::create_dir_all(&dir)?;
    let engine = TierEngine::builder(shape)
        .g1_host(64)
        .g2_host_bytes(16 * shape.block_bytes())
        .g3_disk(&dir, 256 * shape.block_bytes())
        .g2_policy(WriteThrough) // admit every block (the default learns which recur)
        .offload_mode(tier::OffloadMode::WriteThrough) // copy to G2 at registration
        .build()?;

    // The engine computes a 40-block prompt into G1 and registers it.
    let tokens: Vec<u32> = (0..40 * 16 + 5).collect();
    let hashes = sequence_hashes(DynamoXxh3::default(), shape.tokens_per_block(), &tokens)?;
    let mut complete = Vec::new();
    let mut parent = None;
    for (block, &hash) in engine.allocate_g1(hashes.len())?.into_iter().zip(&hashes) {
        // (the engine's attention kernels write the block's KV here)
        complete.push(block.complete(hash, parent)?);
        parent = Some(hash);
    }
    drop(engine.register_g1(complete)?); // offloaded to G2, G2's victims to G3
    engine.flush();
    engine.g1().evict(64); // G1 forgets everything

    // A new request with the same prompt: G1 misses, G2 and G3 hit.
    let found = engine.match_request(1u64, &hashes, tokens.len(), tier::G1Lookup::Pool)?;
    println!(
        "G1 {} + G2 {} + G3 {} blocks: {} tokens of prefill skipped",
        found.g1_blocks,
        found.g2_blocks,
        found.g3_blocks,
        found.external_tokens()
    );
    let loaded = engine.onboard(1u64, tier::OnboardTarget::Pool)?.wait()?;
    println!("onboarded {} blocks into G1", loaded.count);
    engine.release(1u64);
    Ok(())
}
