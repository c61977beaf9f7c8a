//! The bound study: how far can a policy that *knows* calibrated reuse
//! probabilities get, and what part of Belady's win is admission, eviction
//! order, which reuse gaps? These are studies, not checks: each replays
//! the full Mooncake traces many times (about 40 minutes together on the
//! 2-core box) and prints the tables of `docs/policy-study.md` §7:
//! `cargo run --release -p kvbm-bench --bin studies -- bounds_study`
//! (`KVBM_BOUNDS_FILTER=<text>` keeps only the rows whose label holds it).
//! The relations the conclusion rests on are checked by the always-run
//! tests of `sim_bounds.rs`.

use crate::bounds_support::*;
use crate::sim_support;

use kvbm_bench::sim::arc::ArcTiers;
use kvbm_bench::sim::gaps::{GAP_RANGES, GapSplit, range_label};
use kvbm_bench::sim::hindsight::{Feature, FeatureSet, Fit, HindsightScorer, Objective};
use kvbm_bench::sim::online::OnlineScorer;
use kvbm_bench::sim::reuse_score::{ReuseScoreConfig, ReuseScoreTiers};
use kvbm_bench::sim::scored_tiers::{Admission, BlockMeta, BlockScorer, OracleScorer, ScoredTiers};
use kvbm_bench::sim::trace_index::{NO_REQUEST, TraceIndex};
use kvbm_bench::sim::{
    BeladySim, CacheSim, LruFeed, LruSim, LruTiers, ReplayStats, TierCapacities, TieredSim, replay,
};
use kvbm_testkit::trace::MOONCAKE_BLOCK_TOKENS;

pub fn bounds_study() {
    for l in loaded_configs() {
        let Loaded {
            name,
            fractions: f,
            caps,
            ..
        } = &l;
        println!(
            "\n### {name} {f:?} (G1 {} G2 {} G3 {})",
            caps.g1, caps.g2, caps.g3
        );
        println!("| policy | cells | hit % (G1 / G2 / G3) |");
        println!("|---|---|---|");
        if wanted("reference") {
            reference_rows(&l);
        }
        if wanted("oracle") {
            oracle_rows(&l);
        }
        calibrated_rows(&l);
    }
}

/// One row of the study's table.
fn table_line(label: String, cells: String, s: ReplayStats) {
    println!("| {label} | {cells} | {} |", fmt(&s));
}

/// The references: single LRU and Belady, tiered LRU and the winner.
fn reference_rows(l: &Loaded) {
    let Loaded {
        ref requests,
        caps,
        total,
        ..
    } = *l;
    let single = |c: &mut dyn CacheSim| replay(requests, MOONCAKE_BLOCK_TOKENS, c);
    table_line(
        "reference: single LRU".into(),
        "".into(),
        single(&mut LruSim::new(total)),
    );
    table_line(
        "reference: single Belady".into(),
        "".into(),
        single(&mut BeladySim::new(requests, total)),
    );
    table_line(
        "single Belady without bypass".into(),
        "".into(),
        single(&mut BeladySim::without_bypass(requests, total)),
    );
    table_line(
        "tiered LRU victim".into(),
        "".into(),
        run_tiers(
            requests,
            caps.g1,
            LruTiers::new(caps.g2, caps.g3, LruFeed::Victim),
        ),
    );
    table_line(
        "winner (reuse-score within 250)".into(),
        "".into(),
        run_tiers(
            requests,
            caps.g1,
            ReuseScoreTiers::new(ReuseScoreConfig::for_tiers(caps)),
        ),
    );
}

/// The oracle's tiers, with and without bypass, and oracle admission.
fn oracle_rows(l: &Loaded) {
    let Loaded {
        ref requests,
        caps,
        ref ix,
        ..
    } = *l;
    for (label, adm) in [
        ("oracle tiers (Belady order, bypass)", Admission::Strict),
        ("oracle tiers, no bypass", Admission::Always),
    ] {
        table_line(
            label.into(),
            "".into(),
            run_scored(requests, ix, caps, adm, true, OracleScorer),
        );
    }
    table_line(
        "oracle admission (used again at all), recency order".into(),
        "".into(),
        run_scored(
            requests,
            ix,
            caps,
            Admission::TiesAdmit,
            true,
            OracleAdmission,
        ),
    );
}

/// Calibrated reuse probabilities: each feature set, fit and objective.
fn calibrated_rows(l: &Loaded) {
    let Loaded {
        ref requests,
        caps,
        ref ix,
        ..
    } = *l;
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
                let scorer = HindsightScorer::new(ix, set.clone(), objective, fit, support);
                let cells = scorer.cells().to_string();
                let s = run_scored(requests, ix, caps, Admission::TiesAdmit, true, scorer);
                table_line(label, cells, s);
            }
        }
    }
}

pub fn gap_study() {
    for Loaded {
        name,
        fractions: f,
        requests,
        caps,
        total,
        ix,
        ..
    } in loaded_configs()
    {
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

pub fn online_study() {
    use Feature::*;
    let sets = [
        FeatureSet::new("uses 1/2/3/4+", &[Count]),
        FeatureSet::new("uses fine + previous gap", &[CountFine, PrevGap]),
        FeatureSet::new("uses + previous gap", &[Count, PrevGap]),
        FeatureSet::new("uses + output length", &[Count, OutputLength]),
        FeatureSet::new("uses + depth + tail", &[Count, Depth, TailDistance]),
        FeatureSet::new("uses fine + gap + shape", &Feature::SHAPE),
    ];
    for Loaded {
        name,
        fractions: f,
        requests,
        caps,
        ix,
        ..
    } in loaded_configs()
    {
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
                    let s = run_scored(&requests, &ix, caps, Admission::TiesAdmit, true, scorer);
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

pub fn predictability_study() {
    for Loaded {
        name,
        fractions: f,
        requests,
        caps,
        ix,
        ..
    } in loaded_configs()
    {
        println!("\n### {name} {f:?}: oracle admission with labels flipped per request");
        for flip in [0.0, 0.05, 0.1, 0.2, 0.3, 0.4] {
            let s = run_scored(
                &requests,
                &ix,
                caps,
                Admission::TiesAdmit,
                true,
                NoisyOracle { flip },
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
                    let a = kvbm_bench::sim::hindsight::auc(&mut pairs).unwrap_or(f64::NAN);
                    row.push(format!("{a:.3}"));
                }
            }
            println!("| {} | {cells} | {} |", set.name, row.join(" | "));
        }
    }
}

pub fn support_sweep() {
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
                run_scored(&requests, &ix, caps, Admission::TiesAdmit, cascade, scorer)
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
                let s = run_scored(&requests, &ix, caps, Admission::TiesAdmit, cascade, scorer);
                println!("| {label} | {} |", fmt(&s));
            }
        }
    }
}

pub fn long_horizon_study() {
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
                let s = run_scored(&requests, &ix, caps, Admission::TiesAdmit, true, scorer);
                println!("| {label} | {} |", fmt(&s));
            }
        }
    }
}

pub fn g3_capacity_study() {
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

pub fn combo_study() {
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
                    let s = run_scored(&requests, &ix, caps, Admission::TiesAdmit, true, scorer);
                    println!("| {label} | {} |", fmt(&s));
                }
            }
        }
    }
}
