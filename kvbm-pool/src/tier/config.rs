//! What a tier engine runs with: per-tier admission and eviction, the
//! offload queue's bounds and the G3 onboarding path. Set through
//! [`TierEngineBuilder`](super::TierEngineBuilder)'s setters; the values
//! the builder does not take are fixed here.

use std::time::Duration;

use super::cost::LoadCost;
use crate::config::EvictionKind;
use crate::policy::ReuseModel;

/// Host memory [`TierEngine::builder`](super::TierEngine::builder) adds
/// beyond the G2 budget as the G3 prefetch staging area, unless an eighth
/// of the G2 budget is less: room for the G3 part of several long prompts
/// in flight at once.
pub const DEFAULT_G3_STAGING_BYTES: u64 = 256 << 20;

/// The G3 staging bytes a G2 of `g2_bytes` gets unless told otherwise:
/// [`DEFAULT_G3_STAGING_BYTES`], at most an eighth of G2. For a caller that
/// sizes a mover's G2 memory (the G2 budget plus these bytes) before
/// building an engine over it with
/// [`TierEngineBuilder::g3_staging_bytes`](super::TierEngineBuilder::g3_staging_bytes).
pub fn default_g3_staging_bytes(g2_bytes: u64) -> u64 {
    DEFAULT_G3_STAGING_BYTES.min(g2_bytes / 8)
}

/// The G3 staging area a G2 of `g2_bytes` gets unless told otherwise:
/// [`default_g3_staging_bytes`] in whole blocks of `block_bytes`, at least
/// one.
pub(crate) fn default_g3_staging_blocks(g2_bytes: u64, block_bytes: u64) -> usize {
    usize::try_from(default_g3_staging_bytes(g2_bytes) / block_bytes.max(1))
        .unwrap_or(usize::MAX)
        .max(1)
}

/// How the reuse score ranks blocks unless the builder is told otherwise
/// ([`TierEngineBuilder::reuse_model`](super::TierEngineBuilder::reuse_model)):
/// the probability of a use within the next 350 requests. Simulators that
/// mirror the engine's policy read it.
pub const DEFAULT_REUSE_MODEL: ReuseModel = ReuseModel::ReturnWithin { horizon: 350 };

/// Blocks whose use counts the engine remembers after every tier dropped
/// them, as a multiple of the tiers' total capacity (G1 + G2 + G3): a
/// longer history lets admission recognise blocks that come back long
/// after they were evicted, at the cost of memory per remembered block.
/// Fixed; simulators that mirror the engine's policy read it.
pub const DEFAULT_HISTORY_FACTOR: f64 = 4.0;

/// Admission and eviction of one kvbm tier (G2 or G3).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TierPolicy {
    /// Admit every block; evict the least recently released.
    WriteThrough,
    /// Admit only blocks requests have carried at least `n` times (a
    /// frequency filter: one-off prompts never cost PCIe bandwidth or SSD
    /// wear); evict the least recently released.
    MinUses(u32),
    /// The policy study's winner: rank blocks by their learned reuse
    /// probability (the score is the builder's
    /// [`reuse_model`](super::TierEngineBuilder::reuse_model)); admit a
    /// block unless it scores below the block it would evict. See
    /// [`crate::policy::ReuseScorePolicy`].
    ReuseScore,
}

/// How a block found in G3 reaches G1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum G3Onboard {
    /// Straight into G1 (through the executor's bounce pipeline when G1 is
    /// device memory): lowest latency, no G2 copy is kept.
    #[default]
    Direct,
    /// Straight into G1 as well, then queue a G1→G2 offload of the loaded
    /// blocks (off the latency path), so a later request finds them in G2.
    KeepG2Copy,
}

/// When G1 blocks are copied to G2.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffloadMode {
    /// When the engine registers a complete block (asynchronously, by the
    /// offload worker). G2 then also holds what G1 holds.
    WriteThrough,
    /// When G1 evicts a block to reuse its slot: the copy runs before the
    /// slot is handed out, so allocation through
    /// [`TierEngine::allocate_g1`](super::TierEngine::allocate_g1) waits for
    /// it, unless G1's free reserve
    /// ([`g1_free_reserve`](super::TierEngineBuilder::g1_free_reserve))
    /// covers the allocation and the copy ran in the background. G2 then
    /// holds only what G1 lost (an exclusive victim cache: more distinct
    /// blocks for the same memory), at the price of copies on the
    /// allocation path. Only blocks that went through
    /// [`register_g1`](super::TierEngine::register_g1) or were onboarded by
    /// kvbm are saved (a partial block registered straight in the G1 pool
    /// stays in G1 only); blocks loaded from G2 or G3 into G1 leave those
    /// tiers' ranks (they are evicted first) until G1 gives them back.
    /// Engines that keep their own G1 offload with
    /// [`offload_engine_blocks`](super::TierEngine::offload_engine_blocks)
    /// instead, whatever the mode.
    #[default]
    WriteBack,
}

/// A tier engine's parameters. Each settable one is documented at its
/// [`TierEngineBuilder`](super::TierEngineBuilder) setter.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TierEngineConfig {
    /// Tokens per block, the same in every tier: the KV shape's, or the
    /// one given with the mover.
    pub(crate) block_size: usize,
    /// Eviction of kvbm's G1 books.
    pub(crate) g1_eviction: EvictionKind,
    /// Admission and eviction in G2.
    pub(crate) g2_policy: TierPolicy,
    /// Admission and eviction in G3.
    pub(crate) g3_policy: TierPolicy,
    /// The G3 → G1 path.
    pub(crate) g3_onboard: G3Onboard,
    /// When G1 blocks go to G2.
    pub(crate) offload_mode: OffloadMode,
    /// Blocks one offload batch moves.
    pub(crate) offload_batch: usize,
    /// Bytes a batch of small blocks reaches (0: off).
    pub(crate) offload_batch_bytes: u64,
    /// Offload batches whose copies may be in flight at once.
    pub(crate) offload_in_flight: usize,
    /// Most blocks waiting in the offload queue.
    pub(crate) offload_queue: usize,
    /// See [`DEFAULT_HISTORY_FACTOR`].
    pub(crate) history_factor: f64,
    /// How the reuse score ranks a block from its use count and age.
    pub(crate) reuse_model: ReuseModel,
    /// Blocks at the end of G2's memory set aside as the staging area of
    /// G3 prefetch and write-behind (0: none). Derived by the builder from
    /// the staging bytes and the block size, and 0 unless the engine has
    /// both a G2 and a G3.
    pub(crate) g3_staging_blocks: usize,
    /// Whether a match leaves blocks to recompute whose load would take
    /// longer than recomputing them.
    pub(crate) load_cost: LoadCost,
    /// With [`ReuseModel::Hyperbolic`], ages decay as `(age + 1)^-exponent`.
    pub(crate) reuse_age_exponent: f64,
    /// Retention hints keep blocks for this many times the hinted time.
    pub(crate) hint_slack: f64,
    /// G1 (write-back mode) holds back the eviction of hinted blocks whose
    /// hinted time is at most this.
    pub(crate) hint_g1_within: Duration,
    /// Write-back mode: G1 slots kept free ahead of need; `None`: sized
    /// from G1 (see [`TierEngineConfig::g1_reserve_for`]).
    pub(crate) g1_free_reserve: Option<usize>,
}

/// The automatic G1 free reserve's size in blocks, before its cap of a
/// sixty-fourth of G1.
const AUTO_G1_RESERVE: usize = 256;

impl TierEngineConfig {
    /// Blocks of `block_size` tokens; reuse-score admission and eviction in
    /// G2 and G3 scored by [`DEFAULT_REUSE_MODEL`], write-back from G1 (G2
    /// receives G1's victims), LRU leaf-first G1, direct G3 onboarding,
    /// batches of 64, batches of at least 64 MiB, four batches in flight, a
    /// queue of 4096 blocks, a history of the resident blocks and
    /// [`DEFAULT_HISTORY_FACTOR`]× the total capacity more; retention hints
    /// keep blocks for twice their hinted time, and G1 holds back hints of
    /// up to 30 s; up to 256 G1 slots (a sixty-fourth of G1 at most) kept
    /// free ahead of need; no G3 staging area.
    pub(crate) fn new(block_size: usize) -> Self {
        Self {
            block_size,
            g1_eviction: EvictionKind::LeafFirst,
            g2_policy: TierPolicy::ReuseScore,
            g3_policy: TierPolicy::ReuseScore,
            g3_onboard: G3Onboard::Direct,
            offload_mode: OffloadMode::WriteBack,
            offload_batch: 64,
            offload_batch_bytes: 64 << 20,
            offload_in_flight: 4,
            offload_queue: 4096,
            history_factor: DEFAULT_HISTORY_FACTOR,
            reuse_model: DEFAULT_REUSE_MODEL,
            reuse_age_exponent: 1.0,
            hint_slack: 2.0,
            hint_g1_within: Duration::from_secs(30),
            g3_staging_blocks: 0,
            load_cost: LoadCost::default(),
            g1_free_reserve: None,
        }
    }

    /// The G1 slots kept free ahead of need for a G1 of `g1_blocks` blocks:
    /// none in write-through mode; otherwise the reserve asked for, at most
    /// half of G1, or without one 256 blocks, at most a sixty-fourth of G1.
    pub(crate) fn g1_reserve_for(&self, g1_blocks: usize) -> usize {
        match (self.offload_mode, self.g1_free_reserve) {
            (OffloadMode::WriteThrough, _) => 0,
            (OffloadMode::WriteBack, None) => AUTO_G1_RESERVE.min(g1_blocks / 64),
            (OffloadMode::WriteBack, Some(n)) => n.min(g1_blocks / 2),
        }
    }

    /// Whether a tier's policy reads the use history (reuse-score ranking
    /// or `min_uses` admission), so matches must record it.
    pub(crate) fn uses_history(&self) -> bool {
        let reads = |p: TierPolicy| !matches!(p, TierPolicy::WriteThrough);
        reads(self.g2_policy) || reads(self.g3_policy)
    }

    /// Checks the knobs; the error says which one is wrong and why.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.block_size == 0 {
            return Err("tokens per block must be at least 1".into());
        }
        if self.offload_batch == 0 || self.offload_queue == 0 {
            return Err("offload batch and queue must be at least 1".into());
        }
        if self.offload_in_flight == 0 {
            return Err("offload_in_flight must be at least 1".into());
        }
        if let TierPolicy::MinUses(0) = self.g2_policy {
            return Err("MinUses needs at least 1".into());
        }
        if let TierPolicy::MinUses(0) = self.g3_policy {
            return Err("MinUses needs at least 1".into());
        }
        if !(self.reuse_age_exponent.is_finite() && self.reuse_age_exponent > 0.0) {
            return Err("reuse_age_exponent must be positive".into());
        }
        if !(self.history_factor.is_finite() && self.history_factor >= 0.0) {
            return Err("history_factor must be finite and non-negative".into());
        }
        if !(self.hint_slack.is_finite() && self.hint_slack >= 1.0) {
            return Err("hint_slack must be at least 1".into());
        }
        self.load_cost.validate()?;
        if let ReuseModel::ReturnWithin { horizon: 0 } = self.reuse_model {
            return Err("the return-within horizon must be at least 1 request".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_sized_from_g1_and_capped_at_half_of_it() {
        let auto = TierEngineConfig::new(16);
        assert_eq!(auto.g1_reserve_for(81), 1);
        assert_eq!(auto.g1_reserve_for(3_655), 57);
        assert_eq!(auto.g1_reserve_for(1 << 20), 256);
        let asked = |blocks| TierEngineConfig {
            g1_free_reserve: Some(blocks),
            ..auto.clone()
        };
        assert_eq!(asked(12).g1_reserve_for(81), 12);
        assert_eq!(asked(1_000).g1_reserve_for(81), 40);
        let through = TierEngineConfig {
            offload_mode: OffloadMode::WriteThrough,
            ..asked(12)
        };
        assert_eq!(through.g1_reserve_for(81), 0);
    }

    #[test]
    fn the_default_staging_area_is_at_most_an_eighth_of_g2() {
        assert_eq!(default_g3_staging_bytes(1 << 40), DEFAULT_G3_STAGING_BYTES);
        assert_eq!(default_g3_staging_bytes(80 << 20), 10 << 20);
        assert_eq!(default_g3_staging_blocks(80 << 20, 1 << 20), 10);
        assert_eq!(default_g3_staging_blocks(8, 1 << 20), 1);
    }
}
