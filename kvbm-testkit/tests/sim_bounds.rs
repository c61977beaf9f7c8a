//! The bound study: how far can a policy that *knows* calibrated reuse
//! probabilities get, and what part of Belady's win is admission, eviction
//! order, which reuse gaps? Cheap checks run always (they pin the recency,
//! oracle-tier and calibrated figures the study rests on). The study tables
//! are `#[ignore]`d because they are studies, not checks: each replays the
//! full Mooncake traces many times (about 40 minutes together on the 2-core
//! box) and prints the tables of `docs/policy-study.md` §7:
//! `cargo test -p kvbm-testkit --test sim_bounds -- --ignored --nocapture`
//! (`KVBM_BOUNDS_FILTER=<text>` keeps only the rows whose label holds it).

mod sim_support;

use std::collections::HashSet;

use kvbm_testkit::sim::arc::ArcTiers;
use kvbm_testkit::sim::gaps::{GAP_RANGES, GapSplit, range_label};
use kvbm_testkit::sim::hindsight::{Feature, FeatureSet, Fit, HindsightScorer, Objective};
use kvbm_testkit::sim::online::OnlineScorer;
use kvbm_testkit::sim::reuse_score::{ReuseScoreConfig, ReuseScoreTiers};
use kvbm_testkit::sim::scored_tiers::{
    Admission, BlockMeta, BlockScorer, OracleScorer, RecencyScorer, ScoredConfig, ScoredTiers,
};
use kvbm_testkit::sim::trace_index::{NO_REQUEST, TraceIndex};
use kvbm_testkit::sim::{
    BeladySim, CacheSim, KvbmTiers, LruFeed, LruSim, LruTiers, ReplayStats, Tier, TierCapacities,
    TieredSim, capacity_for, replay,
};
use kvbm_testkit::trace::{BlockId, MOONCAKE_BLOCK_TOKENS, Request};
use proptest::prelude::*;

const CONFIGS: [(&str, [f64; 3]); 3] = [
    ("conversation", [0.01, 0.04, 0.0]),
    ("conversation", [0.01, 0.04, 0.15]),
    ("synthetic", [0.01, 0.09, 0.0]),
];

fn scored(caps: TierCapacities, admission: Admission, cascade: bool) -> ScoredConfig {
    ScoredConfig {
        g2: caps.g2,
        g3: caps.g3,
        skip_partial: true,
        cascade,
        admission,
    }
}

fn run_tiers<K: KvbmTiers>(requests: &[Request], g1: usize, kvbm: K) -> ReplayStats {
    replay(
        requests,
        MOONCAKE_BLOCK_TOKENS,
        &mut TieredSim::new(g1, kvbm),
    )
}

fn fmt(s: &ReplayStats) -> String {
    format!(
        "{:.2} ({:.2} / {:.2} / {:.2})",
        s.hit_rate_pct(),
        s.tier_rate_pct(Tier::G1),
        s.tier_rate_pct(Tier::G2),
        s.tier_rate_pct(Tier::G3)
    )
}

fn wanted(label: &str) -> bool {
    std::env::var("KVBM_BOUNDS_FILTER").map_or(true, |f| label.contains(&f))
}

/// Rank = "used again at all" (oracle admission), then recency.
#[derive(Debug, Clone, Copy)]
struct OracleAdmission;

impl BlockScorer for OracleAdmission {
    fn key(&self, _: usize, _: usize) -> u64 {
        0
    }
    fn rank(&self, meta: &BlockMeta, _: u64) -> u64 {
        if meta.next_request == NO_REQUEST {
            0
        } else {
            1 + meta.request as u64
        }
    }
    fn next_change(&self, _: &BlockMeta, _: u64) -> Option<u64> {
        None
    }
}

// ---------------------------------------------------------------- checks

#[test]
fn recency_scorer_reproduces_lru_victim_tiers() {
    for (name, f) in CONFIGS {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let ix = TraceIndex::new(&requests);
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
        let with = run_tiers(
            &requests,
            caps.g1,
            ScoredTiers::new(&ix, scored(caps, Admission::Strict, true), OracleScorer),
        );
        let without = run_tiers(
            &requests,
            caps.g1,
            ScoredTiers::new(&ix, scored(caps, Admission::Always, true), OracleScorer),
        );
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
        let s = run_tiers(
            &requests,
            caps.g1,
            ScoredTiers::new(&ix, scored(caps, Admission::TiesAdmit, true), scorer),
        );
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
        let ctx = kvbm_testkit::sim::RequestCtx {
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

// ---------------------------------------------------------------- study

fn objectives() -> [(&'static str, Objective); 3] {
    [
        ("within 250", Objective::Within { horizon: 250 }),
        ("within 1000", Objective::Within { horizon: 1000 }),
        ("density 1000", Objective::Density { horizon: 1000 }),
    ]
}

#[test]
#[ignore = "bound study: prints tables, takes minutes"]
fn bounds_study() {
    for (name, f) in CONFIGS {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let total = capacity_for(f.iter().sum(), facts.unique_blocks);
        let ix = TraceIndex::new(&requests);
        println!(
            "\n### {name} {f:?} (G1 {} G2 {} G3 {})",
            caps.g1, caps.g2, caps.g3
        );
        println!("| policy | cells | hit % (G1 / G2 / G3) |");
        println!("|---|---|---|");
        let line = |label: String, cells: String, s: ReplayStats| {
            println!("| {label} | {cells} | {} |", fmt(&s));
        };
        if wanted("reference") {
            let single = |c: &mut dyn CacheSim| replay(&requests, MOONCAKE_BLOCK_TOKENS, c);
            line(
                "reference: single LRU".into(),
                "".into(),
                single(&mut LruSim::new(total)),
            );
            line(
                "reference: single Belady".into(),
                "".into(),
                single(&mut BeladySim::new(&requests, total)),
            );
            line(
                "single Belady without bypass".into(),
                "".into(),
                single(&mut BeladySim::without_bypass(&requests, total)),
            );
            line(
                "tiered LRU victim".into(),
                "".into(),
                run_tiers(
                    &requests,
                    caps.g1,
                    LruTiers::new(caps.g2, caps.g3, LruFeed::Victim),
                ),
            );
            line(
                "winner (reuse-score within 250)".into(),
                "".into(),
                run_tiers(
                    &requests,
                    caps.g1,
                    ReuseScoreTiers::new(ReuseScoreConfig::for_tiers(caps)),
                ),
            );
        }
        if wanted("oracle") {
            for (label, adm) in [
                ("oracle tiers (Belady order, bypass)", Admission::Strict),
                ("oracle tiers, no bypass", Admission::Always),
            ] {
                line(
                    label.into(),
                    "".into(),
                    run_tiers(
                        &requests,
                        caps.g1,
                        ScoredTiers::new(&ix, scored(caps, adm, true), OracleScorer),
                    ),
                );
            }
            line(
                "oracle admission (used again at all), recency order".into(),
                "".into(),
                run_tiers(
                    &requests,
                    caps.g1,
                    ScoredTiers::new(
                        &ix,
                        scored(caps, Admission::TiesAdmit, true),
                        OracleAdmission,
                    ),
                ),
            );
        }
        for set in FeatureSet::ladder() {
            for (fit, support, fit_label) in [
                (Fit::InSample, 1, "in-sample"),
                (Fit::InSample, 50, "in-sample, cells >= 50"),
                (Fit::CrossFit, 50, "cross-fit, cells >= 50"),
            ] {
                for (oname, objective) in objectives() {
                    let label = format!("calibrated [{}] {fit_label}, {oname}", set.name);
                    if !wanted(&label) {
                        continue;
                    }
                    let scorer = HindsightScorer::new(&ix, set.clone(), objective, fit, support);
                    let cells = scorer.cells().to_string();
                    let s = run_tiers(
                        &requests,
                        caps.g1,
                        ScoredTiers::new(&ix, scored(caps, Admission::TiesAdmit, true), scorer),
                    );
                    line(label, cells, s);
                }
            }
        }
    }
}

#[test]
#[ignore = "bound study: hits by reuse gap"]
fn gap_study() {
    for (name, f) in CONFIGS {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let total = capacity_for(f.iter().sum(), facts.unique_blocks);
        let ix = TraceIndex::new(&requests);
        println!("\n### {name} {f:?}: hits by requests since the previous use");
        let header: Vec<String> = (0..GAP_RANGES).map(range_label).collect();
        println!("| policy | {} |", header.join(" | "));
        println!("|---|{}", "---|".repeat(GAP_RANGES));
        let mut refs_printed = false;
        let mut line = |label: &str, c: &mut dyn CacheSim| {
            let mut split = GapSplit::new(c);
            replay(&requests, MOONCAKE_BLOCK_TOKENS, &mut split);
            let counts = split.counts();
            if !refs_printed {
                let refs: Vec<String> = counts.references.iter().map(u64::to_string).collect();
                println!(
                    "| references (infinite cache hits all but first use) | {} |",
                    refs.join(" | ")
                );
                refs_printed = true;
            }
            let hits: Vec<String> = counts.hits.iter().map(u64::to_string).collect();
            println!("| {label} | {} |", hits.join(" | "));
        };
        line("single Belady", &mut BeladySim::new(&requests, total));
        line(
            "single Belady, no bypass",
            &mut BeladySim::without_bypass(&requests, total),
        );
        line(
            "tiered LRU victim",
            &mut TieredSim::new(caps.g1, LruTiers::new(caps.g2, caps.g3, LruFeed::Victim)),
        );
        line(
            "winner",
            &mut TieredSim::new(
                caps.g1,
                ReuseScoreTiers::new(ReuseScoreConfig::for_tiers(caps)),
            ),
        );
        line(
            "oracle tiers",
            &mut TieredSim::new(
                caps.g1,
                ScoredTiers::new(&ix, scored(caps, Admission::Strict, true), OracleScorer),
            ),
        );
        line(
            "oracle admission, recency order",
            &mut TieredSim::new(
                caps.g1,
                ScoredTiers::new(
                    &ix,
                    scored(caps, Admission::TiesAdmit, true),
                    OracleAdmission,
                ),
            ),
        );
    }
}

#[test]
#[ignore = "online study: learned predictors over feature cells"]
fn online_study() {
    use Feature::*;
    let sets = [
        FeatureSet::new("uses 1/2/3/4+", &[Count]),
        FeatureSet::new("uses fine + previous gap", &[CountFine, PrevGap]),
        FeatureSet::new("uses + previous gap", &[Count, PrevGap]),
        FeatureSet::new("uses + output length", &[Count, OutputLength]),
        FeatureSet::new("uses + depth + tail", &[Count, Depth, TailDistance]),
        FeatureSet::new("uses fine + gap + shape", &Feature::SHAPE),
    ];
    for (name, f) in CONFIGS {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let ix = TraceIndex::new(&requests);
        println!("\n### {name} {f:?}");
        if wanted("ARC") {
            let s = run_tiers(&requests, caps.g1, ArcTiers::new(&ix, caps.g2, caps.g3));
            println!("| ARC G2, LRU G3 | {} |", fmt(&s));
        }
        for set in &sets {
            for (oname, objective) in [objectives()[0], objectives()[2]] {
                for support in [50] {
                    let label = format!("online [{}] {oname}, cells >= {support}", set.name);
                    if !wanted(&label) {
                        continue;
                    }
                    let scorer = OnlineScorer::new(&ix, set.clone(), objective, support, 256);
                    let s = run_tiers(
                        &requests,
                        caps.g1,
                        ScoredTiers::new(&ix, scored(caps, Admission::TiesAdmit, true), scorer),
                    );
                    println!("| {label} | {} |", fmt(&s));
                }
            }
        }
    }
}

/// Oracle admission seen through noise: each request's "used again"
/// labels are inverted with probability `flip` (a fixed hash of the request
/// index), i.e. a predictor of balanced accuracy `1 - flip` (AUC `1 - flip`).
#[derive(Debug, Clone, Copy)]
struct NoisyOracle {
    flip: f64,
}

fn unit_hash(x: u64) -> f64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
}

impl BlockScorer for NoisyOracle {
    fn key(&self, _: usize, _: usize) -> u64 {
        0
    }
    fn rank(&self, meta: &BlockMeta, _: u64) -> u64 {
        let live = meta.next_request != NO_REQUEST;
        let flipped = unit_hash(meta.request as u64) < self.flip;
        if live != flipped {
            1 + meta.request as u64
        } else {
            0
        }
    }
    fn next_change(&self, _: &BlockMeta, _: u64) -> Option<u64> {
        None
    }
}

#[test]
#[ignore = "bound study: how good must a predictor be, how good can one be"]
fn predictability_study() {
    for (name, f) in CONFIGS {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let ix = TraceIndex::new(&requests);
        println!("\n### {name} {f:?}: oracle admission with labels flipped per request");
        for flip in [0.0, 0.05, 0.1, 0.2, 0.3, 0.4] {
            let s = run_tiers(
                &requests,
                caps.g1,
                ScoredTiers::new(
                    &ix,
                    scored(caps, Admission::TiesAdmit, true),
                    NoisyOracle { flip },
                ),
            );
            println!("| flip {flip} (AUC {:.2}) | {} |", 1.0 - flip, fmt(&s));
        }
    }
    for name in ["conversation", "synthetic"] {
        let Some((requests, _)) = sim_support::load(name) else {
            return;
        };
        let ix = TraceIndex::new(&requests);
        println!("\n### {name}: AUC of the calibrated P(used again | cell) at the block's use");
        println!(
            "| features | cells | AUC ever, in-sample | cross-fit >= 50 | AUC within 1000, in-sample | cross-fit >= 50 |"
        );
        println!("|---|---|---|---|---|---|");
        for set in FeatureSet::ladder() {
            let mut row = Vec::new();
            let mut cells = 0;
            for horizon in [u32::MAX as u64, 1000] {
                for (fit, support) in [(Fit::InSample, 1), (Fit::CrossFit, 50)] {
                    let scorer = HindsightScorer::new(
                        &ix,
                        set.clone(),
                        Objective::Within { horizon },
                        fit,
                        support,
                    );
                    if fit == Fit::InSample {
                        cells = scorer.cells();
                    }
                    let mut pairs = Vec::new();
                    for (r, req) in requests.iter().enumerate() {
                        let full = req.hash_ids.len()
                            - usize::from(req.last_block_partial(MOONCAKE_BLOCK_TOKENS));
                        for i in 0..full {
                            let gap = ix.gap(r, i).map(u64::from);
                            let label = gap.is_some_and(|g| g <= horizon);
                            pairs.push((scorer.probability(r, i, horizon), label));
                        }
                    }
                    let a = kvbm_testkit::sim::hindsight::auc(&mut pairs).unwrap_or(f64::NAN);
                    row.push(format!("{a:.3}"));
                }
            }
            println!("| {} | {cells} | {} |", set.name, row.join(" | "));
        }
    }
}

#[test]
#[ignore = "bound study: how much support a cell needs before it stops memorising"]
fn support_sweep() {
    let ladder = FeatureSet::ladder();
    for (name, f) in [CONFIGS[0], CONFIGS[2]] {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let ix = TraceIndex::new(&requests);
        let run =
            |set: &FeatureSet, fit: Fit, support: usize, objective: Objective, cascade: bool| {
                let scorer = HindsightScorer::new(&ix, set.clone(), objective, fit, support);
                run_tiers(
                    &requests,
                    caps.g1,
                    ScoredTiers::new(&ix, scored(caps, Admission::TiesAdmit, cascade), scorer),
                )
            };
        let within = |horizon| Objective::Within { horizon };
        println!("\n### {name} {f:?}: calibrated, by minimum episodes per cell");
        for set in &ladder[3..5] {
            for fit in [Fit::InSample, Fit::CrossFit] {
                for support in [3, 10, 20] {
                    for horizon in [250, 1000] {
                        let label = format!(
                            "[{}] {fit:?}, cells >= {support}, within {horizon}",
                            set.name
                        );
                        if wanted(&label) {
                            println!(
                                "| {label} | {} |",
                                fmt(&run(set, fit, support, within(horizon), true))
                            );
                        }
                    }
                }
            }
        }
        println!("\n### {name} {f:?}: use count plus one feature, cells >= 50");
        for extra in Feature::ALL {
            let set = FeatureSet::new(format!("uses + {extra:?}"), &[Feature::Count, extra]);
            for fit in [Fit::InSample, Fit::CrossFit] {
                for horizon in [250, 1000] {
                    let label = format!("[{}] {fit:?} within {horizon}", set.name);
                    if wanted(&label) {
                        println!(
                            "| {label} | {} |",
                            fmt(&run(&set, fit, 50, within(horizon), true))
                        );
                    }
                }
            }
        }
        println!("\n### {name} {f:?}: whole-tail eviction (cascade) on and off");
        let uses = &ladder[1];
        for cascade in [true, false] {
            let label = format!("[{}] in-sample, within 250, cascade {cascade}", uses.name);
            if wanted(&label) {
                println!(
                    "| {label} | {} |",
                    fmt(&run(uses, Fit::InSample, 1, within(250), cascade))
                );
            }
            let label = format!("online [{}] within 250, cascade {cascade}", uses.name);
            if wanted(&label) {
                let scorer = OnlineScorer::new(&ix, uses.clone(), within(250), 50, 256);
                let s = run_tiers(
                    &requests,
                    caps.g1,
                    ScoredTiers::new(&ix, scored(caps, Admission::TiesAdmit, cascade), scorer),
                );
                println!("| {label} | {} |", fmt(&s));
            }
        }
    }
}

#[test]
#[ignore = "bound study: long horizons for the 20% configuration"]
fn long_horizon_study() {
    let (name, f) = CONFIGS[1];
    let Some((requests, facts)) = sim_support::load(name) else {
        return;
    };
    let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
    let ix = TraceIndex::new(&requests);
    println!("\n### {name} {f:?}: calibrated, long horizons");
    for set in &FeatureSet::ladder()[1..4] {
        for (fit, support) in [(Fit::InSample, 50), (Fit::CrossFit, 50)] {
            for horizon in [4000, u32::MAX as u64] {
                let label = format!(
                    "[{}] {fit:?}, cells >= {support}, within {horizon}",
                    set.name
                );
                if !wanted(&label) {
                    continue;
                }
                let objective = Objective::Within { horizon };
                let scorer = HindsightScorer::new(&ix, set.clone(), objective, fit, support);
                let s = run_tiers(
                    &requests,
                    caps.g1,
                    ScoredTiers::new(&ix, scored(caps, Admission::TiesAdmit, true), scorer),
                );
                println!("| {label} | {} |", fmt(&s));
            }
        }
    }
}

#[test]
#[ignore = "bound study: how much G3 the winner needs for 36% on conversation"]
fn g3_capacity_study() {
    let Some((requests, facts)) = sim_support::load("conversation") else {
        return;
    };
    println!("\n### conversation, G1 1% + G2 4% + G3 x: winner and tiered LRU");
    for g3 in [0.15, 0.20, 0.25, 0.30] {
        let caps = TierCapacities::from_fractions(0.01, 0.04, g3, facts.unique_blocks);
        let winner = run_tiers(
            &requests,
            caps.g1,
            ReuseScoreTiers::new(ReuseScoreConfig::for_tiers(caps)),
        );
        let lru = run_tiers(
            &requests,
            caps.g1,
            LruTiers::new(caps.g2, caps.g3, LruFeed::Victim),
        );
        println!(
            "| G3 {:.0}% | winner {} | tiered LRU {} |",
            g3 * 100.0,
            fmt(&winner),
            fmt(&lru)
        );
    }
}

#[test]
#[ignore = "bound study: coarse feature combinations, in-sample and cross-fitted"]
fn combo_study() {
    use Feature::*;
    let combos = [
        FeatureSet::new(
            "uses + output + new blocks",
            &[Count, OutputLength, NewBlocks],
        ),
        FeatureSet::new(
            "uses + output + gap in ms",
            &[Count, OutputLength, PrevGapMs],
        ),
        FeatureSet::new(
            "uses + output + new + gap ms + prompt",
            &[Count, OutputLength, NewBlocks, PrevGapMs, PromptBlocks],
        ),
        FeatureSet::new("uses + exact prompt blocks", &[Count, PromptBlocksFine]),
        FeatureSet::new("uses + output in 8-token steps", &[Count, OutputLengthFine]),
    ];
    for (name, f) in [CONFIGS[0], CONFIGS[2]] {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let ix = TraceIndex::new(&requests);
        println!("\n### {name} {f:?}: feature combinations, cells >= 50");
        for set in &combos {
            for fit in [Fit::InSample, Fit::CrossFit] {
                for horizon in [250, 1000] {
                    let label = format!("[{}] {fit:?}, within {horizon}", set.name);
                    if !wanted(&label) {
                        continue;
                    }
                    let objective = Objective::Within { horizon };
                    let scorer = HindsightScorer::new(&ix, set.clone(), objective, fit, 50);
                    let s = run_tiers(
                        &requests,
                        caps.g1,
                        ScoredTiers::new(&ix, scored(caps, Admission::TiesAdmit, true), scorer),
                    );
                    println!("| {label} | {} |", fmt(&s));
                }
            }
        }
    }
}
