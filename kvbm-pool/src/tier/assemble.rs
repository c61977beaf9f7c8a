//! Assembling a tier engine from its configuration and mover: the books of
//! every tier with their policies, the shared use history, the G3 staging
//! area, and the offload worker. Only the builder calls it.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::books::{Books, TierSlot};
use super::config::{OffloadMode, TierEngineConfig, TierPolicy};
use super::g1_saves::G1Saves;
use super::mover::TierMover;
use super::{Shared, TierEngine, TierError, cost, offload, prefetch};
use crate::config::{EvictionKind, PoolConfig, Tier};
use crate::metrics::EngineMetrics;
use crate::policy::{
    EvictionPolicy, FrequencyPolicy, LeafFirstPolicy, LruPolicy, RetainingPolicy, ReuseScorePolicy,
    SharedHistory, SpillRecorder, UseHistory, VictimLog,
};
use crate::pool::BlockPool;

/// Builds the engine over the memory `mover` owns (pool capacities are the
/// mover's) and starts its offload worker.
pub(crate) fn start(
    mut config: TierEngineConfig,
    mover: Arc<dyn TierMover>,
) -> Result<TierEngine, TierError> {
    config.validate().map_err(TierError::InvalidConfig)?;
    let cap = |t: Tier| mover.capacity(t);
    let g1_capacity =
        cap(Tier::G1).ok_or_else(|| TierError::InvalidConfig("the mover has no G1".into()))?;
    let history = use_history(&config, &*mover);
    let hinted = Arc::new(AtomicBool::new(false));
    let g1_victims = (config.offload_mode == OffloadMode::WriteBack).then(VictimLog::default);
    let g1 = g1_slot(
        &config,
        &*mover,
        g1_capacity,
        &history,
        &hinted,
        &g1_victims,
    )?;
    let staging_blocks = staging_blocks(&config, &*mover)?;
    config.g3_staging_blocks = staging_blocks;
    let staging = (staging_blocks > 0).then(|| {
        let g2 = cap(Tier::G2).unwrap_or(0);
        prefetch::Staging::new(g2 - staging_blocks, staging_blocks)
    });
    let g2_victims: VictimLog = Arc::default();
    let g2 = match cap(Tier::G2).map(|c| c - staging_blocks) {
        Some(cap) => {
            let policy = Box::new(SpillRecorder::new(
                tier_policy(config.g2_policy, Tier::G2, cap, &history),
                Arc::clone(&g2_victims),
            ));
            Some(slot(&*mover, cap, Tier::G2, config.block_size, policy)?)
        }
        None => None,
    };
    let g3 = match cap(Tier::G3) {
        Some(cap) => {
            let policy = tier_policy(config.g3_policy, Tier::G3, cap, &history);
            Some(slot(&*mover, cap, Tier::G3, config.block_size, policy)?)
        }
        None => None,
    };
    let shared = Arc::new(Shared {
        config,
        books: Books::new(g1, g2, g3, g2_victims, history, hinted),
        g1_saves: G1Saves::new(g1_victims),
        mover,
        requests: Default::default(),
        inflight: Default::default(),
        offload: offload::OffloadQueue::default(),
        metrics: EngineMetrics::default(),
        staging,
        rates: cost::MeasuredRates::default(),
    });
    let worker = {
        let shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("kvbm-offload".into())
            .spawn(move || offload::run_worker(&shared))
            .map_err(|e| TierError::InvalidConfig(format!("cannot start worker: {e}")))?
    };
    Ok(TierEngine {
        shared,
        worker: Some(worker),
    })
}

/// The use history shared by every tier's policy: the blocks the tiers
/// hold and `history_factor` times as many more.
fn use_history(config: &TierEngineConfig, mover: &dyn TierMover) -> SharedHistory {
    let total: usize = [Tier::G1, Tier::G2, Tier::G3]
        .into_iter()
        .filter_map(|t| mover.capacity(t))
        .sum();
    let ghosts = (total as f64 * config.history_factor).ceil() as usize;
    SharedHistory::new(
        UseHistory::new(total.saturating_add(ghosts))
            .with_model(config.reuse_model)
            .with_age_exponent(config.reuse_age_exponent)
            .with_hint_slack(config.hint_slack),
    )
}

/// G1's books: its eviction policy, in write-back mode wrapped to hold
/// back hinted blocks and to log its victims for saving to G2.
fn g1_slot(
    config: &TierEngineConfig,
    mover: &dyn TierMover,
    capacity: usize,
    history: &SharedHistory,
    hinted: &Arc<AtomicBool>,
    victims: &Option<VictimLog>,
) -> Result<TierSlot, TierError> {
    let pool_config =
        PoolConfig::new(capacity, config.block_size, Tier::G1).eviction(config.g1_eviction);
    let pool = match victims {
        None => BlockPool::new(pool_config)?,
        Some(log) => {
            let inner: Box<dyn EvictionPolicy> = match config.g1_eviction {
                EvictionKind::Lru => Box::new(LruPolicy::with_capacity(capacity)),
                EvictionKind::LeafFirst => Box::new(LeafFirstPolicy::with_capacity(capacity)),
                EvictionKind::Frequency { sample } => {
                    Box::new(FrequencyPolicy::new(capacity, sample))
                }
            };
            let inner = Box::new(RetainingPolicy::new(
                inner,
                history.clone(),
                Arc::clone(hinted),
                config.hint_g1_within,
            ));
            let policy = Box::new(SpillRecorder::new(inner, Arc::clone(log)));
            BlockPool::with_policy(pool_config, policy)?
        }
    };
    Ok(TierSlot {
        pool,
        tier: Tier::G1,
        block_bytes: mover.block_bytes(Tier::G1),
    })
}

/// The staging area of G3 prefetch: the last `g3_staging_blocks` blocks of
/// G2's memory, when the engine has a G2 and a G3; G2's pool must keep at
/// least one block.
fn staging_blocks(config: &TierEngineConfig, mover: &dyn TierMover) -> Result<usize, TierError> {
    match (mover.capacity(Tier::G2), mover.capacity(Tier::G3)) {
        (Some(g2), Some(_)) if config.g3_staging_blocks > 0 => {
            if config.g3_staging_blocks >= g2 {
                return Err(TierError::InvalidConfig(format!(
                    "the G3 staging area ({} blocks) must leave G2's pool at least one of its {g2} blocks",
                    config.g3_staging_blocks
                )));
            }
            Ok(config.g3_staging_blocks)
        }
        _ => Ok(0),
    }
}

fn tier_policy(
    policy: TierPolicy,
    tier: Tier,
    capacity: usize,
    history: &SharedHistory,
) -> Box<dyn EvictionPolicy> {
    match policy {
        TierPolicy::ReuseScore => Box::new(ReuseScorePolicy::for_tier(history.clone(), tier)),
        TierPolicy::WriteThrough | TierPolicy::MinUses(_) => {
            Box::new(LruPolicy::with_capacity(capacity))
        }
    }
}

fn slot(
    mover: &dyn TierMover,
    capacity: usize,
    tier: Tier,
    block_size: usize,
    policy: Box<dyn EvictionPolicy>,
) -> Result<TierSlot, TierError> {
    let pool = BlockPool::with_policy(PoolConfig::new(capacity, block_size, tier), policy)?;
    Ok(TierSlot {
        pool,
        tier,
        block_bytes: mover.block_bytes(tier),
    })
}
