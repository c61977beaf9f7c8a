//! The README's example: a request's blocks go down to G2 (host memory) and
//! G3 (disk), G1 forgets them, and a second request with the same prompt
//! gets them back. Host memory stands in for the GPU.
//!
//! ```text
//! cargo run -p kvbm-pool --example quickstart
//! ```

use kvbm_block::{DynamoXxh3, PageSize, TokenBlockSequence};
use kvbm_layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_pool::tier::{
    G1Lookup, OnboardTarget, TierEngine, TierEngineConfig, TierLayouts, TierPolicy,
};
use kvbm_transfer::disk::DiskConfig;
use kvbm_transfer::memory::{DiskAllocator, DiskOptions, SystemAllocator};
use kvbm_transfer::{Executor, ExecutorConfig, PhysicalLayout};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 16-token blocks of a 1-layer model with K and V, 128 bf16 per token.
    let shape = |blocks| LayoutConfig::new(blocks, 1, 2, 16, 128, 2);
    let layout = |blocks| Layout::new(shape(blocks)?, LayoutKind::FullyContiguous);
    let host = SystemAllocator::new();
    let dir = std::env::temp_dir().join("kvbm-quickstart");
    std::fs::create_dir_all(&dir)?;
    let disk = DiskAllocator::new(&dir, DiskOptions::default())?;
    let tiers = TierLayouts {
        g1: PhysicalLayout::allocate_system(layout(64)?, &host)?,
        g2: Some(PhysicalLayout::allocate_system(layout(16)?, &host)?),
        g3: Some(PhysicalLayout::allocate_disk(layout(256)?, &disk)?),
    };
    let executor = Executor::cpu(
        2,
        &DiskConfig::default(),
        4,
        1 << 20,
        ExecutorConfig::default(),
    )?;
    // Admit every block (the default, reuse-score, learns which blocks recur).
    let config = TierEngineConfig::new(16)
        .g2_policy(TierPolicy::WriteThrough)
        .g3_policy(TierPolicy::WriteThrough);
    let engine = TierEngine::new(config, tiers, executor)?;

    // The engine computes a 40-block prompt into G1 and registers it.
    let tokens: Vec<u32> = (0..40 * 16 + 5).collect();
    let seq = TokenBlockSequence::from_tokens(DynamoXxh3::default(), PageSize::new(16)?, &tokens);
    let hashes: Vec<_> = seq.sequence_hashes().collect();
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
    let found = engine.match_request(1u64, &hashes, tokens.len(), G1Lookup::Pool)?;
    println!(
        "G1 {} + G2 {} + G3 {} blocks: {} tokens of prefill skipped",
        found.g1_blocks,
        found.g2_blocks,
        found.g3_blocks,
        found.external_tokens()
    );
    let loaded = engine.onboard(1u64, OnboardTarget::Pool)?.wait()?;
    println!("onboarded {} blocks into G1", loaded.count);
    engine.release(1u64);
    Ok(())
}
