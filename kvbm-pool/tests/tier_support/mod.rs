//! Shared fixtures of the tier-engine tests: small real tiers (host memory
//! standing in for G1, host memory for G2, a file for G3) and blocks whose
//! bytes are a function of their sequence hash.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use kvbm_block::SequenceHash;
use kvbm_layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_pool::tier::{
    G1Lookup, LocalMover, MoverTiers, OffloadMode, OnboardTarget, TierEngine, TierEngineBuilder,
    TierLayouts, TierPolicy,
};
use kvbm_pool::{ImmutableBlock, ImmutableBlocks, TierError};
// Each test binary uses some of them.
#[allow(unused_imports)]
pub use kvbm_testkit::blocks::{chain, fill, holds, scribble};
use kvbm_testkit::fault::{Fault, FaultControl, FaultRule, FaultyEngine};
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::disk::{DefaultEngine, DiskBackend, EngineConfig, IoDir};
use kvbm_transfer::memory::{DiskAllocator, DiskOptions, SystemAllocator};
use kvbm_transfer::{Executor, ExecutorConfig, ExecutorSpec, PhysicalLayout};

/// Tokens per block in these tests.
pub const BLOCK_TOKENS: usize = 16;

/// How long a test waits for something it is owed before it fails.
pub const WAIT: Duration = Duration::from_secs(10);

/// One layer, K and V, 16 tokens × 128 × 2 bytes: 4 KiB chunks (the disk
/// alignment), 8 KiB blocks.
pub fn layout_config(blocks: usize) -> LayoutConfig {
    LayoutConfig::new(blocks, 1, 2, BLOCK_TOKENS, 128, 2).unwrap()
}

pub fn host(blocks: usize) -> PhysicalLayout {
    let l = Layout::new(layout_config(blocks), LayoutKind::FullyContiguous).unwrap();
    PhysicalLayout::allocate_system(l, &SystemAllocator::new()).unwrap()
}

pub fn disk(blocks: usize, dir: &std::path::Path) -> PhysicalLayout {
    let l = Layout::new(layout_config(blocks), LayoutKind::FullyContiguous).unwrap();
    let alloc = DiskAllocator::new(dir, DiskOptions::default()).unwrap();
    PhysicalLayout::allocate_disk(l, &alloc).unwrap()
}

pub fn executor() -> Executor {
    ExecutorSpec::host().disk(true).build().unwrap()
}

/// An executor whose disk I/O goes through a fault injector applying
/// `rule` (none: every I/O passes through unharmed).
pub fn faulty_executor_with(rule: Option<FaultRule>) -> Executor {
    let mut io = FaultyEngine::new(DefaultEngine::new(&EngineConfig::default()).unwrap());
    if let Some(rule) = rule {
        io = io.with(rule);
    }
    Executor::builder()
        .backend(Arc::new(MemcpyBackend::new(2).unwrap()))
        .backend(Arc::new(DiskBackend::with_engine(io, 1 << 20)))
        .config(ExecutorConfig::default())
        .build()
        .unwrap()
}

/// An executor whose disk reads wait at a gate until the test lets them
/// through ([`FaultControl::gate`], closed at first); writes pass.
pub fn gated_reads_executor() -> (Executor, Arc<FaultControl>) {
    let io = FaultyEngine::new(DefaultEngine::new(&EngineConfig::default()).unwrap())
        .with(FaultRule::always(Fault::Hold).on_dir(IoDir::Read));
    let control = io.control();
    let exec = Executor::builder()
        .backend(Arc::new(MemcpyBackend::new(2).unwrap()))
        .backend(Arc::new(DiskBackend::with_engine(io, 1 << 20)))
        .config(ExecutorConfig::default())
        .build()
        .unwrap();
    (exec, control)
}

/// An executor whose disk I/O fails as `rule` says.
pub fn faulty_executor(rule: FaultRule) -> Executor {
    faulty_executor_with(Some(rule))
}

/// Disk writes take `ms` milliseconds each.
pub fn slow_writes(ms: u64) -> Executor {
    faulty_executor(FaultRule::always(Fault::Delay(Duration::from_millis(ms))).on_dir(IoDir::Write))
}

/// Matches `hashes` (as request `id`), onboards into kvbm's G1 and checks
/// every loaded byte; returns how many blocks came from G2 or G3.
pub fn load(engine: &TierEngine, id: &str, hashes: &[SequenceHash]) -> Result<usize, TierError> {
    let m = engine.match_request(id, hashes, hashes.len() * BLOCK_TOKENS + 1, G1Lookup::Pool)?;
    let external = m.external_blocks();
    drop(m);
    if external == 0 {
        engine.release(id);
        return Ok(0);
    }
    let done = engine
        .onboard(id, OnboardTarget::Pool)
        .and_then(|h| h.wait());
    let blocks = match done {
        Ok(d) => d.blocks.into_blocks(),
        Err(e) => {
            engine.release(id);
            return Err(e);
        }
    };
    verify(engine, &blocks);
    drop(blocks);
    engine.release(id);
    Ok(external)
}

/// Offloads every block and admits it to G2 and G3 (write-through
/// everywhere).
pub fn write_through<T>(builder: TierEngineBuilder<T>) -> TierEngineBuilder<T> {
    builder
        .offload_mode(OffloadMode::WriteThrough)
        .g2_policy(TierPolicy::WriteThrough)
        .g3_policy(TierPolicy::WriteThrough)
}

/// A [`write_through`] engine of 64 G1 blocks, 4 G2 blocks (so offloads
/// go on to G3 soon) and 64 G3 blocks in `dir`, copying with `executor`.
pub fn write_through_engine(dir: &std::path::Path, executor: Executor) -> TierEngine {
    write_through(tiers_with(64, 4, 64, dir, executor))
        .build()
        .unwrap()
}

/// Bytes of one block of [`layout_config`].
pub fn block_bytes() -> u64 {
    layout_config(1).block_bytes()
}

/// Host G1/G2 and a disk G3 in `dir` (a tier of 0 blocks is left out),
/// ready for the knobs.
pub fn tiers(
    g1: usize,
    g2: usize,
    g3: usize,
    dir: &std::path::Path,
) -> TierEngineBuilder<MoverTiers> {
    tiers_with(g1, g2, g3, dir, executor())
}

/// [`tiers`] with an executor of your own.
pub fn tiers_with(
    g1: usize,
    g2: usize,
    g3: usize,
    dir: &std::path::Path,
    executor: Executor,
) -> TierEngineBuilder<MoverTiers> {
    let layouts = TierLayouts {
        g1: host(g1),
        g2: (g2 > 0).then(|| host(g2)),
        g3: (g3 > 0).then(|| disk(g3, dir)),
    };
    over(layouts, executor)
}

/// An engine builder over `layouts`, moved by `executor`.
pub fn over(layouts: TierLayouts, executor: Executor) -> TierEngineBuilder<MoverTiers> {
    let mover = LocalMover::new(layouts, executor).unwrap();
    TierEngine::builder_with_mover(Arc::new(mover), BLOCK_TOKENS)
}

/// `n` sequence hashes continuing `parent` (a new root without one),
/// told apart from other continuations of the same parent by `salt`: like
/// a real sequence hash, a block's hash depends on everything before it,
/// so requests that diverge after a shared prefix get distinct blocks.
pub fn branch(parent: Option<SequenceHash>, salt: u64, n: usize) -> Vec<SequenceHash> {
    let mut h =
        parent.map_or(0x5EED_0000_0000_0000, |p| p.0) ^ salt.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    (0..n)
        .map(|i| {
            h = (h ^ (i as u64 + 1))
                .wrapping_mul(0x94D0_49BB_1331_11EB)
                .rotate_left(29)
                | 1;
            SequenceHash(h)
        })
        .collect()
}

/// The engine computes `hashes` (a chain continuing `parent`) in fresh G1
/// blocks, fills their bytes and registers them (queuing their offload).
pub fn compute(
    engine: &TierEngine,
    hashes: &[SequenceHash],
    parent: Option<SequenceHash>,
) -> ImmutableBlocks {
    let blocks = engine.allocate_g1(hashes.len()).unwrap();
    let g1 = engine.layout(kvbm_pool::Tier::G1).unwrap();
    let mut prev = parent;
    let mut complete = Vec::new();
    for (b, &h) in blocks.into_iter().zip(hashes) {
        fill(g1, b.block_id(), h);
        complete.push(b.complete(h, prev).unwrap());
        prev = Some(h);
    }
    engine.register_g1(complete).unwrap()
}

/// Computes `hashes` (one chain) one block at a time, each block released
/// at once.
pub fn compute_each(engine: &TierEngine, hashes: &[SequenceHash]) {
    for (i, h) in hashes.iter().enumerate() {
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        drop(compute(engine, std::slice::from_ref(h), parent));
    }
}

/// Computes `chains` one block at a time so every block goes on to G3 (on
/// an engine built with [`write_through`]), pushes G2's last `g2_blocks`
/// out to G3 with fillers, then empties G1.
pub fn push_to_g3(engine: &TierEngine, chains: &[Vec<SequenceHash>], g2_blocks: usize) {
    for c in chains {
        for (i, h) in c.iter().enumerate() {
            let parent = i.checked_sub(1).map(|p| c[p]);
            drop(compute(engine, std::slice::from_ref(h), parent));
            engine.flush();
        }
    }
    for h in chain(99, g2_blocks) {
        drop(compute(engine, &[h], None));
        engine.flush();
    }
    engine.g1().evict(usize::MAX >> 1);
}

/// Checks every block of `blocks` against the hashes they are named by.
pub fn verify(engine: &TierEngine, blocks: &[ImmutableBlock]) {
    let g1 = engine.layout(kvbm_pool::Tier::G1).unwrap();
    for b in blocks {
        assert!(
            holds(g1, b.block_id(), b.sequence_hash()),
            "G1 block {} does not hold the bytes of {:?}",
            b.block_id(),
            b.sequence_hash()
        );
    }
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

pub fn shared(engine: TierEngine) -> Arc<TierEngine> {
    Arc::new(engine)
}
