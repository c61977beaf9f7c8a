//! Pins the policy study's winner (reuse score) on the tiered
//! configurations of the policy study (docs/policy-study.md).

mod sim_support;

use kvbm_bench::sim::reuse_score::{ReuseScoreConfig, ReuseScoreTiers};
use kvbm_bench::sim::{Tier, TierCapacities, TieredSim, replay};
use kvbm_testkit::trace::MOONCAKE_BLOCK_TOKENS;

#[test]
fn reuse_score_tiered_figures() {
    // (trace, G1/G2/G3 fractions, total %, G1 %, G2 %, G3 %)
    for (name, f, want) in [
        ("conversation", [0.01, 0.04, 0.0], [22.33, 5.25, 17.09, 0.0]),
        (
            "conversation",
            [0.01, 0.04, 0.15],
            [35.01, 5.25, 16.92, 12.84],
        ),
        ("synthetic", [0.01, 0.09, 0.0], [26.93, 3.81, 23.12, 0.0]),
    ] {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let kvbm = ReuseScoreTiers::new(ReuseScoreConfig::for_tiers(caps));
        let s = replay(
            &requests,
            MOONCAKE_BLOCK_TOKENS,
            &mut TieredSim::new(caps.g1, kvbm),
        );
        let got = [
            s.hit_rate_pct(),
            s.tier_rate_pct(Tier::G1),
            s.tier_rate_pct(Tier::G2),
            s.tier_rate_pct(Tier::G3),
        ];
        println!("{name} {f:?}: {got:.2?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 0.1, "{name} {f:?}: {got:.2?} vs {want:?}");
        }
    }
}
