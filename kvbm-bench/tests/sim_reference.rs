//! The reference simulators reproduce the figures of the policy study
//! (docs/policy-study.md).

mod sim_support;

use kvbm_bench::sim::{BeladySim, LruSim, capacity_for, replay};
use kvbm_testkit::trace::MOONCAKE_BLOCK_TOKENS;

fn assert_close(what: &str, got: f64, want: f64) {
    println!("{what}: {got:.3}% (reference {want}%)");
    assert!((got - want).abs() <= 0.1, "{what}: {got:.3}% vs {want}%");
}

#[test]
fn trace_facts_match_readme() {
    for (name, refs, unique, requests) in [
        ("conversation", 288_500, 182_790, 12_031),
        ("synthetic", 121_877, 43_924, 3_993),
    ] {
        let Some((_, facts)) = sim_support::load(name) else {
            return;
        };
        assert_eq!(facts.block_references, refs, "{name}");
        assert_eq!(facts.unique_blocks, unique, "{name}");
        assert_eq!(facts.requests, requests, "{name}");
    }
}

#[test]
fn lru_and_belady_reproduce_reference_figures() {
    for (name, fraction, lru_want, belady_want) in [
        ("conversation", 0.05, 19.5, 36.6),
        ("conversation", 0.20, 34.5, 36.6),
        ("synthetic", 0.10, 26.0, 50.6),
    ] {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let cap = capacity_for(fraction, facts.unique_blocks);
        let lru = replay(&requests, MOONCAKE_BLOCK_TOKENS, &mut LruSim::new(cap));
        assert_close(
            &format!("LRU {name} {fraction}"),
            lru.hit_rate_pct(),
            lru_want,
        );
        let belady = replay(
            &requests,
            MOONCAKE_BLOCK_TOKENS,
            &mut BeladySim::new(&requests, cap),
        );
        assert_close(
            &format!("Belady {name} {fraction}"),
            belady.hit_rate_pct(),
            belady_want,
        );
    }
}
