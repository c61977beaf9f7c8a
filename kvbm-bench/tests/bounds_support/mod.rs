//! Shared by the bound checks (`sim_bounds.rs`) and the bound studies
//! (the `studies` binary's `bounds.rs`): the three trace configurations,
//! tier replay and formatting helpers, and the oracle-admission scorer.
#![allow(dead_code)]

use kvbm_bench::sim::hindsight::Objective;
use kvbm_bench::sim::scored_tiers::{Admission, BlockMeta, BlockScorer, ScoredConfig, ScoredTiers};
use kvbm_bench::sim::trace_index::NO_REQUEST;
use kvbm_bench::sim::trace_index::TraceIndex;
use kvbm_bench::sim::{
    KvbmTiers, ReplayStats, Tier, TierCapacities, TieredSim, capacity_for, replay,
};
use kvbm_testkit::trace::{MOONCAKE_BLOCK_TOKENS, Request, TraceFacts};

pub const CONFIGS: [(&str, [f64; 3]); 3] = [
    ("conversation", [0.01, 0.04, 0.0]),
    ("conversation", [0.01, 0.04, 0.15]),
    ("synthetic", [0.01, 0.09, 0.0]),
];

/// One entry of [`CONFIGS`] with its trace loaded: what the bound checks
/// and studies start from.
pub struct Loaded {
    pub name: &'static str,
    /// G1, G2, G3 as fractions of the trace's unique blocks.
    pub fractions: [f64; 3],
    pub requests: Vec<Request>,
    pub facts: TraceFacts,
    pub caps: TierCapacities,
    /// The three tiers' blocks together (one cache of the same size).
    pub total: usize,
    pub ix: TraceIndex,
}

/// The configurations of [`CONFIGS`] in order, each loaded when reached;
/// ends at the first whose trace is missing (`sim_support::load` prints
/// the skip).
pub fn loaded_configs() -> impl Iterator<Item = Loaded> {
    CONFIGS.into_iter().map_while(|(name, fractions)| {
        let (requests, facts) = crate::sim_support::load(name)?;
        let [g1, g2, g3] = fractions;
        Some(Loaded {
            name,
            fractions,
            caps: TierCapacities::from_fractions(g1, g2, g3, facts.unique_blocks),
            total: capacity_for(fractions.iter().sum(), facts.unique_blocks),
            ix: TraceIndex::new(&requests),
            requests,
            facts,
        })
    })
}

pub fn scored(caps: TierCapacities, admission: Admission, cascade: bool) -> ScoredConfig {
    ScoredConfig {
        g2: caps.g2,
        g3: caps.g3,
        skip_partial: true,
        cascade,
        admission,
    }
}

pub fn run_tiers<K: KvbmTiers>(requests: &[Request], g1: usize, kvbm: K) -> ReplayStats {
    replay(
        requests,
        MOONCAKE_BLOCK_TOKENS,
        &mut TieredSim::new(g1, kvbm),
    )
}

/// Replays `requests` through the scored tiers of `caps` (partial blocks
/// skipped) ranked by `scorer`.
pub fn run_scored<S: BlockScorer>(
    requests: &[Request],
    ix: &TraceIndex,
    caps: TierCapacities,
    admission: Admission,
    cascade: bool,
    scorer: S,
) -> ReplayStats {
    run_tiers(
        requests,
        caps.g1,
        ScoredTiers::new(ix, scored(caps, admission, cascade), scorer),
    )
}

pub fn fmt(s: &ReplayStats) -> String {
    format!(
        "{:.2} ({:.2} / {:.2} / {:.2})",
        s.hit_rate_pct(),
        s.tier_rate_pct(Tier::G1),
        s.tier_rate_pct(Tier::G2),
        s.tier_rate_pct(Tier::G3)
    )
}

pub fn wanted(label: &str) -> bool {
    std::env::var("KVBM_BOUNDS_FILTER").map_or(true, |f| label.contains(&f))
}

/// Rank = "used again at all" (oracle admission), then recency.
#[derive(Debug, Clone, Copy)]
pub struct OracleAdmission;

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

/// The reuse objectives the hindsight fits are scored on.
pub fn objectives() -> [(&'static str, Objective); 3] {
    [
        ("within 250", Objective::Within { horizon: 250 }),
        ("within 1000", Objective::Within { horizon: 1000 }),
        ("density 1000", Objective::Density { horizon: 1000 }),
    ]
}
