//! The references a replay sets itself against: the simulators at the
//! same capacities (tiered reuse score, tiered LRU, single LRU, Belady),
//! and their sweep over total capacity.

use kvbm_pool::tier::{DEFAULT_HISTORY_FACTOR, DEFAULT_REUSE_MODEL, ReuseModel};

use super::{ReplayConfig, ReplayReport, SweepPoint};
use crate::sim::reuse_score::{ReuseScoreConfig, ReuseScoreTiers, ScoreModel};
use crate::sim::{
    BeladySim, G1Keeps, LruFeed, LruSim, LruTiers, ReplayStats, TierCapacities, TieredSim,
    capacity_for, replay,
};
use kvbm_testkit::trace::Request;

/// Fills `report`'s simulator figures for `cfg`'s workload at `caps`
/// (its sweep too, when asked for).
pub(crate) fn fill(report: &mut ReplayReport, cfg: &ReplayConfig, caps: [usize; 3], unique: usize) {
    let requests = &cfg.requests;
    let total: usize = caps.iter().sum();
    report.sim_reuse_hit_rate_pct = reuse_stats(requests, cfg.block_tokens, caps).hit_rate_pct();
    report.sim_lru_tiers_hit_rate_pct =
        lru_tiers_stats(requests, cfg.block_tokens, caps).hit_rate_pct();
    report.lru_hit_rate_pct =
        replay(requests, cfg.block_tokens, &mut LruSim::new(total)).hit_rate_pct();
    report.belady_hit_rate_pct = replay(
        requests,
        cfg.block_tokens,
        &mut BeladySim::new(requests, total),
    )
    .hit_rate_pct();
    report.sweep = cfg
        .sweep
        .iter()
        .map(|&f| sweep_point(requests, cfg, unique, f))
        .collect();
}

/// Splits `total` blocks over the tiers in the proportions of `fractions`.
pub(crate) fn split(total: usize, fractions: [f64; 3]) -> [usize; 3] {
    let sum: f64 = fractions.iter().sum();
    if sum <= 0.0 {
        return [0; 3];
    }
    let g1 = (total as f64 * fractions[0] / sum).floor() as usize;
    let g2 = (total as f64 * fractions[1] / sum).floor() as usize;
    [g1, g2, total.saturating_sub(g1 + g2)]
}

fn lru_tiers_stats(requests: &[Request], block_tokens: u32, caps: [usize; 3]) -> ReplayStats {
    let mut sim = TieredSim::new(caps[0], LruTiers::new(caps[1], caps[2], LruFeed::Victim))
        .with_g1_keeping(G1Keeps::FullOnly);
    replay(requests, block_tokens, &mut sim)
}

/// The tiered simulator running the engine's default reuse-score policy
/// (its score model and history) at `caps`.
fn reuse_stats(requests: &[Request], block_tokens: u32, caps: [usize; 3]) -> ReplayStats {
    let tiers = TierCapacities {
        g1: caps[0],
        g2: caps[1],
        g3: caps[2],
    };
    let config = ReuseScoreConfig {
        model: match DEFAULT_REUSE_MODEL {
            ReuseModel::ReturnWithin { horizon } => ScoreModel::ReturnWithin { horizon },
            // The simulator's nearest model (its weights are learned
            // per age bucket, the engine's per use count only).
            ReuseModel::Hyperbolic => ScoreModel::Hyperbolic { exponent: 1.0 },
        },
        history_factor: DEFAULT_HISTORY_FACTOR,
        ..ReuseScoreConfig::for_tiers(tiers)
    };
    let mut sim =
        TieredSim::new(caps[0], ReuseScoreTiers::new(config)).with_g1_keeping(G1Keeps::FullOnly);
    replay(requests, block_tokens, &mut sim)
}

fn sweep_point(requests: &[Request], cfg: &ReplayConfig, unique: usize, f: f64) -> SweepPoint {
    let total = capacity_for(f, unique);
    let caps = split(total, cfg.fractions);
    SweepPoint {
        fraction: f,
        capacity_blocks: total,
        tiered_reuse_pct: reuse_stats(requests, cfg.block_tokens, caps).hit_rate_pct(),
        tiered_lru_pct: lru_tiers_stats(requests, cfg.block_tokens, caps).hit_rate_pct(),
        lru_pct: replay(requests, cfg.block_tokens, &mut LruSim::new(total)).hit_rate_pct(),
        belady_pct: replay(
            requests,
            cfg.block_tokens,
            &mut BeladySim::new(requests, total),
        )
        .hit_rate_pct(),
    }
}
