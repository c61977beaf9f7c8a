//! The policy study: every candidate kvbm policy on every tiered
//! configuration, printed as a table. Run with
//! `cargo test -p kvbm-testkit --test sim_policy_study -- --ignored --nocapture`.

mod sim_support;

use kvbm_testkit::sim::reuse_score::{ReuseScoreConfig, ReuseScoreTiers};
use kvbm_testkit::sim::{
    BeladySim, CacheSim, KvbmTiers, LruFeed, LruSim, LruTiers, ReplayStats, Tier, TierCapacities,
    TieredSim, capacity_for, replay,
};
use kvbm_testkit::trace::{MOONCAKE_BLOCK_TOKENS, Request};

const CONFIGS: [(&str, [f64; 3]); 3] = [
    ("conversation", [0.01, 0.04, 0.0]),
    ("conversation", [0.01, 0.04, 0.15]),
    ("synthetic", [0.01, 0.09, 0.0]),
];

fn row(policy: &str, name: &str, f: [f64; 3], s: &ReplayStats) {
    println!(
        "| {policy} | {name} | {:.0}%+{:.0}%+{:.0}% | {:.2} | {:.2} / {:.2} / {:.2} |",
        f[0] * 100.0,
        f[1] * 100.0,
        f[2] * 100.0,
        s.hit_rate_pct(),
        s.tier_rate_pct(Tier::G1),
        s.tier_rate_pct(Tier::G2),
        s.tier_rate_pct(Tier::G3),
    );
}

fn tiered<K: KvbmTiers>(requests: &[Request], g1: usize, kvbm: K) -> ReplayStats {
    replay(
        requests,
        MOONCAKE_BLOCK_TOKENS,
        &mut TieredSim::new(g1, kvbm),
    )
}

fn single<C: CacheSim>(requests: &[Request], mut c: C) -> ReplayStats {
    replay(requests, MOONCAKE_BLOCK_TOKENS, &mut c)
}

#[test]
#[ignore = "policy study: prints a table, takes tens of seconds"]
fn policy_study() {
    println!("| policy | trace | G1+G2+G3 | hit % | G1 / G2 / G3 % |");
    println!("|---|---|---|---|---|");
    for (name, f) in CONFIGS {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let total = capacity_for(f.iter().sum(), facts.unique_blocks);
        row(
            "single LRU (reference)",
            name,
            f,
            &single(&requests, LruSim::new(total)),
        );
        row(
            "single Belady (reference)",
            name,
            f,
            &single(&requests, BeladySim::new(&requests, total)),
        );
        for feed in [LruFeed::Victim, LruFeed::WriteThrough] {
            let s = tiered(&requests, caps.g1, LruTiers::new(caps.g2, caps.g3, feed));
            row(&format!("tiered LRU {feed:?}"), name, f, &s);
        }
        for (skip_partial, history_factor, weight_exponent) in [
            (false, 1.0, 1.0),
            (true, 1.0, 1.0),
            (true, 4.0, 1.0),
            (true, 16.0, 1.0),
            (true, 4.0, 2.0),
            (true, 4.0, 3.0),
            (true, 4.0, 0.5),
        ] {
            let cfg = ReuseScoreConfig {
                g1: caps.g1,
                g2: caps.g2,
                g3: caps.g3,
                history_factor,
                skip_partial,
                weight_exponent,
            };
            let s = tiered(&requests, caps.g1, ReuseScoreTiers::new(cfg));
            row(
                &format!(
                    "reuse-score skip_partial={skip_partial} history={history_factor}x w^{weight_exponent}"
                ),
                name,
                f,
                &s,
            );
        }
    }
}
