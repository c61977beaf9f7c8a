//! The bound checks: cheap tests that pin the figures the bound study of
//! `docs/policy-study.md` §7 rests on (the recency scorer equals LRU tiers,
//! the oracle-tier decomposition, the calibrated use-count figures) and
//! property tests of the scored tiers' invariants. The study tables
//! themselves are the `studies` binary's (`src/bin/studies/bounds.rs`).

mod bounds_support;
mod sim_support;

use std::collections::HashSet;

use kvbm_bench::sim::arc::ArcTiers;
use kvbm_bench::sim::hindsight::{Feature, FeatureSet, Fit, HindsightScorer, Objective};
use kvbm_bench::sim::online::OnlineScorer;
use kvbm_bench::sim::scored_tiers::{
    Admission, OracleScorer, RecencyScorer, ScoredConfig, ScoredTiers,
};
use kvbm_bench::sim::trace_index::{NO_REQUEST, TraceIndex};
use kvbm_bench::sim::{CacheSim, KvbmTiers, LruFeed, LruTiers, TierCapacities, TieredSim};
use kvbm_testkit::trace::{BlockId, Request};
use proptest::prelude::*;

use bounds_support::*;

#[test]
fn recency_scorer_reproduces_lru_victim_tiers() {
    for Loaded {
        name,
        fractions: f,
        requests,
        caps,
        ix,
        ..
    } in loaded_configs()
    {
        let lru = run_tiers(
            &requests,
            caps.g1,
            LruTiers::new(caps.g2, caps.g3, LruFeed::Victim),
        );
        let config = ScoredConfig {
            skip_partial: false,
            ..scored(caps, Admission::Always, false)
        };
        let mine = run_tiers(
            &requests,
            caps.g1,
            ScoredTiers::new(&ix, config, RecencyScorer),
        );
        assert_eq!(mine, lru, "{name} {f:?}");
    }
}

#[test]
fn oracle_tiers_and_decomposition_are_pinned() {
    // (config, oracle tiers with bypass, without bypass), measured once.
    let want = [(36.51, 36.51), (36.61, 36.61), (49.80, 49.80)];
    for ((name, f), (bypass, always)) in CONFIGS.into_iter().zip(want) {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let ix = TraceIndex::new(&requests);
        let with = run_scored(&requests, &ix, caps, Admission::Strict, true, OracleScorer);
        let without = run_scored(&requests, &ix, caps, Admission::Always, true, OracleScorer);
        println!(
            "{name} {f:?}: oracle tiers {} / no bypass {}",
            fmt(&with),
            fmt(&without)
        );
        assert!((with.hit_rate_pct() - bypass).abs() < 0.01, "{name} {f:?}");
        assert!(
            (without.hit_rate_pct() - always).abs() < 0.01,
            "{name} {f:?}"
        );
    }
}

#[test]
fn calibrated_use_count_figures_are_pinned() {
    // Synthetic 1%+9% (the small trace): the use-count cells fitted on the
    // whole trace, and each half ranked by the other half's table.
    let (name, f) = CONFIGS[2];
    let Some((requests, facts)) = sim_support::load(name) else {
        return;
    };
    let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
    let ix = TraceIndex::new(&requests);
    let uses = FeatureSet::ladder()[1].clone();
    for (fit, want) in [(Fit::InSample, 28.15), (Fit::CrossFit, 26.41)] {
        let scorer = HindsightScorer::new(
            &ix,
            uses.clone(),
            Objective::Within { horizon: 250 },
            fit,
            50,
        );
        let s = run_scored(&requests, &ix, caps, Admission::TiesAdmit, true, scorer);
        println!("{fit:?}: {}", fmt(&s));
        assert!((s.hit_rate_pct() - want).abs() < 0.01, "{fit:?}");
    }
}

/// Chained traces: ids are (family, branch, depth) so every block has one
/// parent.
fn chained_trace() -> impl Strategy<Value = Vec<Request>> {
    prop::collection::vec((0u64..5, 1usize..9, 0u64..3, 1u32..5, 0u32..500), 1..80).prop_map(
        |reqs| {
            reqs.into_iter()
                .enumerate()
                .map(|(i, (family, len, branch, tail, out))| Request {
                    timestamp_ms: i as u64 * 700,
                    input_length: (len as u32 - 1) * 4 + tail,
                    output_length: out,
                    hash_ids: (0..len as u64)
                        .map(|d| {
                            if d < 2 {
                                family * 1000 + d
                            } else {
                                family * 1000 + (branch + 1) * 100 + d
                            }
                        })
                        .collect(),
                })
                .collect()
        },
    )
}

fn check_invariants<K: KvbmTiers>(requests: &[Request], caps: TierCapacities, kvbm: K) {
    let parent_of: std::collections::HashMap<BlockId, BlockId> = requests
        .iter()
        .flat_map(|r| r.hash_ids.windows(2).map(|w| (w[1], w[0])))
        .collect();
    let mut sim = TieredSim::new(caps.g1, kvbm);
    let mut pos = 0;
    for (index, request) in requests.iter().enumerate() {
        let mut hit_blocks = 0;
        for &b in &request.hash_ids {
            if sim.lookup(b).is_none() {
                break;
            }
            hit_blocks += 1;
        }
        let ctx = kvbm_bench::sim::RequestCtx {
            index,
            first_position: pos,
            request,
            hit_blocks,
            last_block_partial: request.last_block_partial(4),
        };
        sim.record(&ctx);
        pos += request.hash_ids.len();
        let (g2, g3) = sim.kvbm().occupancy();
        assert!(g2 <= caps.g2 && g3 <= caps.g3);
        let cached: HashSet<BlockId> = sim.kvbm().cached().into_iter().map(|(b, _)| b).collect();
        for &b in &cached {
            assert!(!sim.g1_contains(b), "block {b} in G1 and in kvbm");
            if let Some(p) = parent_of.get(&b) {
                assert!(
                    cached.contains(p) || sim.g1_contains(*p),
                    "block {b} cached without its parent {p}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any ranking, with cascade on: capacities hold, tiers stay exclusive
    /// of G1 and never hold a block whose parent no tier holds.
    #[test]
    fn scored_tiers_hold_no_orphans(
        requests in chained_trace(),
        g1 in 1usize..6, g2 in 0usize..8, g3 in 0usize..8,
        which in 0usize..5,
    ) {
        let caps = TierCapacities { g1, g2, g3 };
        let ix = TraceIndex::new(&requests);
        let config = scored(caps, Admission::TiesAdmit, true);
        let set = FeatureSet::new("depth", &[Feature::DepthFine, Feature::OutputLengthFine]);
        match which {
            0 => check_invariants(&requests, caps, ScoredTiers::new(&ix, config, OracleScorer)),
            1 => check_invariants(&requests, caps, ScoredTiers::new(&ix, config, RecencyScorer)),
            2 => check_invariants(&requests, caps, ScoredTiers::new(
                &ix, config,
                HindsightScorer::new(&ix, set, Objective::Within { horizon: 5 }, Fit::InSample, 1),
            )),
            3 => check_invariants(&requests, caps, ScoredTiers::new(
                &ix, config,
                OnlineScorer::new(&ix, set, Objective::Within { horizon: 5 }, 1, 3),
            )),
            _ => check_invariants(&requests, caps, ArcTiers::new(&ix, caps.g2, caps.g3)),
        }
    }

    /// The trace index agrees with a direct scan.
    #[test]
    fn trace_index_matches_scan(requests in chained_trace()) {
        let ix = TraceIndex::new(&requests);
        for (r, req) in requests.iter().enumerate() {
            for (i, &b) in req.hash_ids.iter().enumerate() {
                let u = ix.use_at(r, i);
                let next = requests.iter().enumerate().skip(r + 1)
                    .find(|(_, q)| q.hash_ids.contains(&b)).map(|(n, _)| n as u32);
                let prev = requests[..r].iter().rposition(|q| q.hash_ids.contains(&b));
                let count = requests[..=r].iter().filter(|q| q.hash_ids.contains(&b)).count();
                prop_assert_eq!(u.next_request, next.unwrap_or(NO_REQUEST));
                prop_assert_eq!(u.prev_request, prev.map_or(NO_REQUEST, |p| p as u32));
                prop_assert_eq!(u.count as usize, count);
            }
        }
    }
}
