//! The Mooncake traces through the real tier engine (tiny real blocks:
//! 1 layer × K/V × 16 tokens × 128 × 2 bytes, host G1 and G2, a disk G3),
//! hit rates per tier printed as a table, every onboarded block's bytes
//! checked: `cargo run --release -p kvbm-bench --bin studies --
//! mooncake_replay_table` (and `policy_experiments`, with
//! `KVBM_AGE_EXPONENTS=0.5,1` for the reuse score's age exponents). The
//! trace replays that always run are kvbm-bench's `engine_sim_agreement`
//! tests.
//!
//! The replay follows the simulators' rules (`kvbm_bench::sim::replay`):
//! a request's prompt blocks are looked up in order (G1, then G2/G3) up to
//! the first miss; then the engine computes the rest and every block of the
//! request is inserted (full blocks are registered in G1 and offered to
//! G2; a partial last block takes a G1 slot while the request runs and is
//! not cached after it). Capacities are
//! `floor(fraction × unique blocks)`.

use kvbm_block::SequenceHash;
use kvbm_layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_pool::tier::{
    G1Lookup, LocalMover, MoverTiers, OffloadMode, OnboardTarget, TierEngine, TierEngineBuilder,
    TierLayouts, TierPolicy,
};
use kvbm_pool::{ImmutableBlock, ImmutableBlocks};
use kvbm_testkit::blocks::{fill, holds};
use kvbm_testkit::trace::{MOONCAKE_BLOCK_TOKENS, Request};

use kvbm_transfer::memory::{DiskAllocator, DiskOptions, SystemAllocator};
use kvbm_transfer::{Executor, ExecutorSpec, PhysicalLayout};

fn capacity(fraction: f64, unique: usize) -> usize {
    (fraction * unique as f64).floor() as usize
}

#[derive(Debug, Default, Clone, Copy)]
struct Figures {
    lookups: u64,
    hits: [u64; 3],
    verified: u64,
}

impl Figures {
    fn pct(&self, n: u64) -> f64 {
        100.0 * n as f64 / self.lookups.max(1) as f64
    }
    fn total(&self) -> f64 {
        self.pct(self.hits.iter().sum())
    }
}

fn replay(engine: &TierEngine, requests: &[Request]) -> Figures {
    let mut f = Figures::default();
    let bs = engine.block_size();
    for (i, r) in requests.iter().enumerate() {
        let hashes: Vec<SequenceHash> = r.hash_ids.iter().map(|&h| SequenceHash(h)).collect();
        let n = hashes.len();
        // One token past the full blocks: no full-prompt give-back while
        // measuring; a partial last block is never matched.
        let full = r.full_blocks(MOONCAKE_BLOCK_TOKENS);
        let m = engine
            .match_request(i as u64, &hashes, full * bs + 1, G1Lookup::Pool)
            .unwrap();
        f.lookups += n as u64;
        f.hits[0] += m.g1_blocks as u64;
        f.hits[1] += m.g2_blocks as u64;
        f.hits[2] += m.g3_blocks as u64;
        let external = m.external_blocks();
        f.verified += serve(engine, i as u64, r, &hashes, external, m.g1.into_blocks());
    }
    f
}

/// Serves request `id` (`r`, whose blocks are `hashes`) after its match:
/// onboards the `external` blocks matched outside G1 (every byte checked)
/// next to the G1 blocks `held`, computes the rest (a partial last block
/// is not registered: its G1 slot is freed with the request), then
/// releases the request and drains the offloads. Returns how many blocks
/// it onboarded and checked.
pub(crate) fn serve(
    engine: &TierEngine,
    id: u64,
    r: &Request,
    hashes: &[SequenceHash],
    external: usize,
    mut held: Vec<ImmutableBlock>,
) -> u64 {
    let n = hashes.len();
    let mut verified = 0;
    if external > 0 {
        let done = engine
            .onboard(id, OnboardTarget::Pool)
            .unwrap()
            .wait()
            .unwrap();
        let loaded = done.blocks.into_blocks();
        verify(engine, &loaded);
        verified = loaded.len() as u64;
        held.extend(loaded);
    }
    let at = held.len();
    let mut partial_slot = None;
    if at < n {
        let full_end = r.full_blocks(MOONCAKE_BLOCK_TOKENS);
        let parent = at.checked_sub(1).map(|p| hashes[p]);
        if at < full_end {
            held.extend(compute(engine, &hashes[at..full_end], parent).into_blocks());
        }
        if full_end < n {
            let b = engine.allocate_g1(1).unwrap().pop().unwrap();
            fill(
                engine.layout(kvbm_pool::Tier::G1).unwrap(),
                b.block_id(),
                hashes[n - 1],
            );
            partial_slot = Some(b);
        }
    }
    drop(held);
    drop(partial_slot);
    engine.release(id);
    engine.flush();
    verified
}

fn run(
    name: &str,
    fractions: [f64; 3],
    policy: TierPolicy,
    mode: OffloadMode,
    limit: Option<usize>,
) -> Option<Figures> {
    run_with(name, fractions, policy, mode, limit, 1.0)
}

fn run_with(
    name: &str,
    fractions: [f64; 3],
    policy: TierPolicy,
    mode: OffloadMode,
    limit: Option<usize>,
    age_exponent: f64,
) -> Option<Figures> {
    let (mut requests, facts) = crate::sim_support::load(name)?;
    if let Some(l) = limit {
        requests.truncate(l);
    }
    let u = facts.unique_blocks;
    let caps = fractions.map(|x| capacity(x, u));
    let dir = std::env::temp_dir().join(format!("kvbm-studies-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let engine = tiers(caps[0].max(1), caps[1], caps[2], &dir)
        .g2_policy(policy)
        .g3_policy(policy)
        .offload_mode(mode)
        .reuse_age_exponent(age_exponent)
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let f = replay(&engine, &requests);
    println!(
        "| {name} | {:.0}%+{:.0}%+{:.0}% ({} / {} / {} blocks) | {policy:?} {mode:?} | {:.2} | {:.2} / {:.2} / {:.2} | {} verified | {:.1} s |",
        fractions[0] * 100.0,
        fractions[1] * 100.0,
        fractions[2] * 100.0,
        caps[0],
        caps[1],
        caps[2],
        f.total(),
        f.pct(f.hits[0]),
        f.pct(f.hits[1]),
        f.pct(f.hits[2]),
        f.verified,
        started.elapsed().as_secs_f64(),
    );
    let stats = engine.stats();
    println!("    engine stats: {stats:?}");
    engine.g1().audit().unwrap();
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
    Some(f)
}

pub fn mooncake_replay_table() {
    println!("| trace | G1+G2+G3 | policy | hit % | G1 / G2 / G3 % | bytes checked | time |");
    println!("|---|---|---|---|---|---|---|");
    for (name, f) in [
        ("conversation", [0.01, 0.04, 0.0]),
        ("conversation", [0.01, 0.04, 0.15]),
        ("synthetic", [0.01, 0.09, 0.0]),
    ] {
        for policy in [TierPolicy::WriteThrough, TierPolicy::ReuseScore] {
            for mode in [OffloadMode::WriteThrough, OffloadMode::WriteBack] {
                run(name, f, policy, mode, None);
            }
        }
    }
}

pub fn policy_experiments() {
    let exps: Vec<f64> = std::env::var("KVBM_AGE_EXPONENTS")
        .unwrap_or_else(|_| "0.5".into())
        .split(',')
        .map(|x| x.parse().unwrap())
        .collect();
    for (name, f) in [
        ("conversation", [0.01, 0.04, 0.0]),
        ("synthetic", [0.01, 0.09, 0.0]),
        ("conversation", [0.01, 0.04, 0.15]),
    ] {
        for &e in &exps {
            println!("age exponent {e}");
            run_with(
                name,
                f,
                TierPolicy::ReuseScore,
                OffloadMode::WriteBack,
                None,
                e,
            );
        }
    }
}

/// Tokens per block in these replays.
pub(crate) const BLOCK_TOKENS: usize = 16;

/// One layer, K and V, 16 tokens × 128 × 2 bytes: 4 KiB chunks (the disk
/// alignment), 8 KiB blocks.
fn layout_config(blocks: usize) -> LayoutConfig {
    LayoutConfig::new(blocks, 1, 2, BLOCK_TOKENS, 128, 2).unwrap()
}

fn host(blocks: usize) -> PhysicalLayout {
    let l = Layout::new(layout_config(blocks), LayoutKind::FullyContiguous).unwrap();
    PhysicalLayout::allocate_system(l, &SystemAllocator::new()).unwrap()
}

fn disk(blocks: usize, dir: &std::path::Path) -> PhysicalLayout {
    let l = Layout::new(layout_config(blocks), LayoutKind::FullyContiguous).unwrap();
    let alloc = DiskAllocator::new(dir, DiskOptions::default()).unwrap();
    PhysicalLayout::allocate_disk(l, &alloc).unwrap()
}

fn executor() -> Executor {
    ExecutorSpec::host().disk(true).build().unwrap()
}

/// Host G1/G2 and a disk G3 in `dir` (a tier of 0 blocks is left out),
/// ready for the knobs.
pub(crate) fn tiers(
    g1: usize,
    g2: usize,
    g3: usize,
    dir: &std::path::Path,
) -> TierEngineBuilder<MoverTiers> {
    let layouts = TierLayouts {
        g1: host(g1),
        g2: (g2 > 0).then(|| host(g2)),
        g3: (g3 > 0).then(|| disk(g3, dir)),
    };
    let mover = LocalMover::new(layouts, executor()).unwrap();
    TierEngine::builder_with_mover(std::sync::Arc::new(mover), BLOCK_TOKENS)
}

/// The engine computes `hashes` (a chain continuing `parent`) in fresh G1
/// blocks, fills their bytes and registers them (queuing their offload).
pub(crate) fn compute(
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

/// Checks every block of `blocks` against the hashes they are named by.
pub(crate) fn verify(engine: &TierEngine, blocks: &[ImmutableBlock]) {
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
