//! Replays the Mooncake traces through the real tier engine (tiny real
//! blocks: 1 layer × K/V × 16 tokens × 128 × 2 bytes, host G1 and G2, a disk
//! G3) and reports hit rates per tier, with every onboarded block's bytes
//! checked. Here a short prefix of the conversation trace; the full runs
//! are kvbm-bench's studies
//! (`cargo run --release -p kvbm-bench --bin studies -- mooncake_replay_table`).
//!
//! The replay follows the simulators' rules (kvbm-bench's `sim::replay`):
//! a request's prompt blocks are looked up in order (G1, then G2/G3) up to
//! the first miss; then the engine computes the rest and every block of the
//! request is inserted (full blocks are registered in G1 and offered to
//! G2; a partial last block only in G1). Capacities are
//! `floor(fraction × unique blocks)`.

mod tier_support;

use std::path::PathBuf;

use kvbm_block::SequenceHash;
use kvbm_pool::tier::{
    G1Lookup, OffloadMode, OnboardTarget, TierEngine, TierEngineConfig, TierPolicy,
};
use kvbm_testkit::trace::{MOONCAKE_BLOCK_TOKENS, Request, TraceFacts, read_mooncake};
use tier_support::*;

fn mooncake_dir() -> Option<PathBuf> {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|d| d.join("shared/data/mooncake"))
        .find(|p| p.join("conversation_trace.jsonl").is_file())
}

fn load(name: &str) -> Option<(Vec<Request>, TraceFacts)> {
    let Some(dir) = mooncake_dir() else {
        println!("skipped: Mooncake trace data not found (shared/data/mooncake)");
        return None;
    };
    let requests = read_mooncake(dir.join(format!("{name}_trace.jsonl"))).unwrap();
    let facts = TraceFacts::of(&requests);
    Some((requests, facts))
}

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
        // One token past the blocks: no full-prompt give-back while measuring.
        let m = engine
            .match_request(i as u64, &hashes, n * bs + 1, G1Lookup::Pool)
            .unwrap();
        f.lookups += n as u64;
        f.hits[0] += m.g1_blocks as u64;
        f.hits[1] += m.g2_blocks as u64;
        f.hits[2] += m.g3_blocks as u64;
        let external = m.external_blocks();
        let mut held = m.g1.into_blocks();
        if external > 0 {
            let done = engine
                .onboard(i as u64, OnboardTarget::Pool)
                .unwrap()
                .wait()
                .unwrap();
            let loaded = done.blocks.into_blocks();
            verify(engine, &loaded);
            f.verified += loaded.len() as u64;
            held.extend(loaded);
        }
        let at = held.len();
        if at < n {
            let partial = r.last_block_partial(MOONCAKE_BLOCK_TOKENS);
            let full_end = if partial { n - 1 } else { n };
            let parent = at.checked_sub(1).map(|p| hashes[p]);
            if at < full_end {
                held.extend(compute(engine, &hashes[at..full_end], parent).into_blocks());
            }
            if partial && at < n {
                // The partial last block is registered in G1 only (it
                // never goes to G2, in either mode).
                let b = engine.allocate_g1(1).unwrap().pop().unwrap();
                fill(
                    engine.layout(kvbm_pool::Tier::G1).unwrap(),
                    b.block_id(),
                    hashes[n - 1],
                );
                let c = b.complete(hashes[n - 1], n.checked_sub(2).map(|p| hashes[p]));
                held.push(engine.g1().register_block(c.unwrap()).unwrap());
            }
        }
        drop(held);
        engine.release(i as u64);
        engine.flush();
    }
    f
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
    let (mut requests, facts) = load(name)?;
    if let Some(l) = limit {
        requests.truncate(l);
    }
    let u = facts.unique_blocks;
    let caps = fractions.map(|x| capacity(x, u));
    let dir = tempdir();
    let config = TierEngineConfig::new(16)
        .g2_policy(policy)
        .g3_policy(policy)
        .offload_mode(mode)
        .reuse_age_exponent(age_exponent);
    let engine = engine(config, caps[0].max(1), caps[1], caps[2], dir.path());
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
    Some(f)
}

#[test]
fn short_conversation_replay_runs_and_verifies() {
    for mode in [OffloadMode::WriteThrough, OffloadMode::WriteBack] {
        let Some(f) = run(
            "conversation",
            [0.01, 0.04, 0.15],
            TierPolicy::ReuseScore,
            mode,
            Some(150),
        ) else {
            return;
        };
        assert!(f.lookups > 0);
        assert!(
            f.hits[1] + f.hits[2] > 0,
            "kvbm's tiers served nothing: {f:?}"
        );
    }
}
