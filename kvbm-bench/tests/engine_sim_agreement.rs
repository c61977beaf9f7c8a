//! The tier engine and the simulator of its default policy agree: the
//! replay drives kvbm-pool's `TierEngine` (default configuration, real
//! tiers, every onboarded block checked) and the tiered simulator with the
//! reuse-score policy over the same requests at the same capacities; their
//! hit rates must be within 0.3 points. On a slice of each Mooncake trace
//! when present, and always on the embedded synthetic workload.

mod replay_support;
mod sim_support;

use kvbm_bench::replay::{ReplayReport, run_replay};
use kvbm_testkit::trace::{MOONCAKE_BLOCK_TOKENS, Request, SyntheticConfig, generate_synthetic};
use replay_support::tiny_replay_config;

/// Points the engine may differ from the simulator.
const TOLERANCE: f64 = 0.3;

fn replay(requests: Vec<Request>, block_tokens: u32, fractions: [f64; 3]) -> ReplayReport {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_replay_config("agreement", requests, block_tokens, fractions, dir.path());
    run_replay(&cfg, |_, _| {}).expect("the replay runs")
}

fn check(what: &str, r: &ReplayReport) {
    let (engine, sim) = (r.hit_rate_pct, r.sim_reuse_hit_rate_pct);
    println!(
        "{what}: engine {engine:.2}%, simulator {sim:.2}%, LRU {:.2}%",
        r.lru_hit_rate_pct
    );
    assert!(
        r.verified_blocks > 0,
        "{what}: nothing was onboarded, the check is void"
    );
    assert!(
        (engine - sim).abs() <= TOLERANCE,
        "{what}: engine {engine:.2}% vs simulator {sim:.2}% (tiers {:?})",
        r.tiers
    );
}

#[test]
fn engine_matches_its_simulator_on_a_conversation_slice() {
    let Some((mut requests, _)) = sim_support::load("conversation") else {
        return;
    };
    requests.truncate(3000);
    for fractions in [[0.01, 0.04, 0.0], [0.02, 0.06, 0.12]] {
        let r = replay(requests.clone(), MOONCAKE_BLOCK_TOKENS, fractions);
        check(&format!("conversation[..3000] {fractions:?}"), &r);
    }
}

#[test]
fn engine_matches_its_simulator_on_a_synthetic_slice() {
    let Some((mut requests, _)) = sim_support::load("synthetic") else {
        return;
    };
    requests.truncate(2000);
    let r = replay(requests, MOONCAKE_BLOCK_TOKENS, [0.01, 0.09, 0.0]);
    check("synthetic[..2000] [0.01, 0.09, 0.0]", &r);
}

#[test]
fn engine_matches_its_simulator_on_the_embedded_workload() {
    let synth = SyntheticConfig {
        conversations: 150,
        ..SyntheticConfig::default()
    };
    let requests = generate_synthetic(&synth);
    let r = replay(requests, synth.block_tokens, [0.02, 0.06, 0.12]);
    check("embedded workload [0.02, 0.06, 0.12]", &r);
}
