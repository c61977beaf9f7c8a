//! Retention hints on the agentic workload, through the real tier engine:
//! `cargo run --release -p kvbm-bench --bin studies -- agentic_hints`.
//!
//! The workload is kvbm-testkit's agentic generator (tool-calling programs
//! with log-normal tool pauses among chat traffic); each program call
//! carries a hint of the given accuracy ([`AgenticTrace::hints`]: the
//! truth with that probability, otherwise "done" for one continuing call
//! in three and else a pause drawn afresh from the workload's pause
//! distribution), chat requests none. The engine's hint clock follows the trace's timestamps.
//! Each request is replayed as in `tier_replay` (match, onboard with every
//! byte checked, compute the rest, release, drain the offloads), its hint
//! given right after its match. LRU and Belady are the simulators' single
//! caches of the engine's total capacity; they take no hints (Belady needs
//! none). `KVBM_AGENTIC_PROGRAMS` scales the workload (programs and chat
//! conversations alike; default 300 each); `KVBM_HINT_SLACK` and
//! `KVBM_HINT_G1_S` override the engine's `hint_slack` and
//! `hint_g1_within` (seconds).

use std::time::Duration;

use kvbm_bench::sim::{BeladySim, LruSim, replay as sim_replay};
use kvbm_block::SequenceHash;
use kvbm_pool::tier::{G1Lookup, RetentionHint, TierEngine};
use kvbm_testkit::trace::{
    AgenticConfig, AgenticTrace, MOONCAKE_BLOCK_TOKENS, NextCall, SyntheticConfig, TraceFacts,
    generate_agentic,
};

use super::tier_replay::{BLOCK_TOKENS, serve, tiers};

/// The workload of the study, `programs` programs and as many chat
/// conversations.
fn workload(programs: usize) -> AgenticTrace {
    let base = AgenticConfig::default();
    generate_agentic(&AgenticConfig {
        programs,
        chat: SyntheticConfig {
            conversations: programs,
            ..base.chat.clone()
        },
        ..base
    })
}

fn hint_of(h: NextCall) -> Option<RetentionHint> {
    match h {
        NextCall::After(ms) => Some(RetentionHint::ReturnsWithin(Duration::from_millis(ms))),
        NextCall::Done => Some(RetentionHint::Done),
        NextCall::Unknown => None,
    }
}

/// Replays `trace` through `engine` with `hints` (none: no hints);
/// returns `(hit %, G1 hit %)`.
fn replay(engine: &TierEngine, trace: &AgenticTrace, hints: Option<&[NextCall]>) -> (f64, f64) {
    let (mut lookups, mut hits, mut g1_hits) = (0u64, 0u64, 0u64);
    for (i, r) in trace.requests.iter().enumerate() {
        let hashes: Vec<SequenceHash> = r.hash_ids.iter().map(|&h| SequenceHash(h)).collect();
        let n = hashes.len();
        engine.set_time(Duration::from_millis(r.timestamp_ms));
        // A partial last block is never matched (nor recorded).
        let full = r.full_blocks(MOONCAKE_BLOCK_TOKENS);
        let m = engine
            .match_request(i as u64, &hashes, full * BLOCK_TOKENS + 1, G1Lookup::Pool)
            .unwrap();
        if let Some(h) = hints.and_then(|h| hint_of(h[i])) {
            engine.hint_request(i as u64, h);
        }
        lookups += n as u64;
        hits += m.total_blocks() as u64;
        g1_hits += m.g1_blocks as u64;
        let external = m.external_blocks();
        serve(engine, i as u64, r, &hashes, external, m.g1.into_blocks());
    }
    let pct = |x: u64| 100.0 * x as f64 / lookups.max(1) as f64;
    (pct(hits), pct(g1_hits))
}

fn env_f64(name: &str) -> Option<f64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Replays `trace` through a tier engine of capacities `caps` (in a
/// scratch directory of its own), with `hints` or none; the hit rate, %.
fn run_hinted(trace: &AgenticTrace, caps: [usize; 3], hints: Option<Vec<NextCall>>) -> f64 {
    let dir = std::env::temp_dir().join(format!("kvbm-agentic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut builder = tiers(caps[0], caps[1], caps[2], &dir);
    if let Some(s) = env_f64("KVBM_HINT_SLACK") {
        builder = builder.hint_slack(s);
    }
    if let Some(s) = env_f64("KVBM_HINT_G1_S") {
        builder = builder.hint_g1_within(Duration::from_secs_f64(s));
    }
    let e = builder.build().unwrap();
    let started = std::time::Instant::now();
    let (hit, g1) = replay(&e, trace, hints.as_deref());
    e.g1().audit().unwrap();
    eprintln!(
        "  {caps:?} hints {}: {hit:.2}% (G1 {g1:.2}%), {:.1} s",
        hints.is_some(),
        started.elapsed().as_secs_f64()
    );
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
    hit
}

pub fn agentic_hints() {
    let programs = env_f64("KVBM_AGENTIC_PROGRAMS").map_or(300, |p| p as usize);
    let trace = workload(programs);
    let facts = TraceFacts::of(&trace.requests);
    let calls = trace
        .next
        .iter()
        .filter(|n| **n != NextCall::Unknown)
        .count();
    println!(
        "agentic workload: {} requests ({calls} program calls, {} chat), {} block references, {} distinct blocks",
        facts.requests,
        facts.requests - calls,
        facts.block_references,
        facts.unique_blocks
    );
    let longest = trace
        .requests
        .iter()
        .map(|r| r.hash_ids.len())
        .max()
        .unwrap_or(0);
    let accuracies = [1.0, 0.9, 0.7];
    println!(
        "| G1 / G2 / G3 % | LRU | Belady | no hints | 100% hints | 90% hints | 70% hints | 100% ÷ Belady |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for fractions in [[0.01, 0.04, 0.0], [0.01, 0.09, 0.0], [0.02, 0.06, 0.12]] {
        let u = facts.unique_blocks;
        let mut caps = fractions.map(|x| (x * u as f64).floor() as usize);
        caps[0] = caps[0].max(longest + 1);
        let total: usize = caps.iter().sum();
        let bt = MOONCAKE_BLOCK_TOKENS;
        let lru = sim_replay(&trace.requests, bt, &mut LruSim::new(total)).hit_rate_pct();
        let belady = sim_replay(
            &trace.requests,
            bt,
            &mut BeladySim::new(&trace.requests, total),
        )
        .hit_rate_pct();
        let run = |hints: Option<Vec<NextCall>>| run_hinted(&trace, caps, hints);
        let none = run(None);
        let hinted: Vec<f64> = accuracies
            .iter()
            .enumerate()
            .map(|(k, &p)| run(Some(trace.hints(p, 0x6869_6e74 + k as u64))))
            .collect();
        println!(
            "| {:.0} / {:.0} / {:.0} ({} / {} / {} blocks) | {lru:.2} | {belady:.2} | {none:.2} | {:.2} | {:.2} | {:.2} | {:.3} |",
            fractions[0] * 100.0,
            fractions[1] * 100.0,
            fractions[2] * 100.0,
            caps[0],
            caps[1],
            caps[2],
            hinted[0],
            hinted[1],
            hinted[2],
            hinted[0] / belady.max(1e-9),
        );
    }
}
