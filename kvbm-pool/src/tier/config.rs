//! How a tier engine is built: per-tier admission and eviction, the
//! offload queue's bounds, and the G3 onboarding path.

use super::cost::LoadCost;
use crate::config::EvictionKind;
use crate::policy::ReuseModel;

/// Host memory [`TierEngineBuilder`](super::TierEngineBuilder) adds beyond
/// the G2 budget as the G3 prefetch staging area, unless an eighth of the
/// G2 budget is less (whole blocks, at least one): room for the G3 part of
/// several long prompts in flight at once.
pub const DEFAULT_G3_STAGING_BYTES: u64 = 256 << 20;

/// The G3 staging area (see [`TierEngineConfig::g3_staging_blocks`]) a G2
/// of `g2_bytes` gets unless told otherwise: [`DEFAULT_G3_STAGING_BYTES`],
/// at most an eighth of G2, in whole blocks of `block_bytes`, at least one.
pub(crate) fn default_g3_staging_blocks(g2_bytes: u64, block_bytes: u64) -> usize {
    let bytes = DEFAULT_G3_STAGING_BYTES.min(g2_bytes / 8);
    usize::try_from(bytes / block_bytes.max(1))
        .unwrap_or(usize::MAX)
        .max(1)
}

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
    /// probability (the score is [`TierEngineConfig::reuse_model`]); admit a
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
    /// ([`g1_free_reserve`](TierEngineConfig::g1_free_reserve)) covers the
    /// allocation and the copy ran in the background. G2 then holds only
    /// what G1 lost (an exclusive victim cache: more distinct blocks for the
    /// same memory), at the price of copies on the allocation path. Only blocks that went through
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

/// A tier engine's parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct TierEngineConfig {
    /// Tokens per block, the same in every tier. Not a tuning knob: it must
    /// equal the engine's own block (page) size, and building a tier engine
    /// over a KV shape of another block size is refused.
    pub block_size: usize,
    /// Eviction of kvbm's G1 books (the engine's GPU prefix cache).
    /// Leaf-first keeps cached prefixes whole, so a prefix match never stops
    /// at an evicted block in the middle; plain LRU follows release order
    /// only; frequency eviction keeps often-used blocks longer at the cost
    /// of a sketch to update on every use.
    pub g1_eviction: EvictionKind,
    /// Admission and eviction in G2. Admitting every block
    /// ([`TierPolicy::WriteThrough`]) keeps the most for later hits but
    /// spends host-link bandwidth and G2 slots on one-off prompts; a filter
    /// ([`TierPolicy::MinUses`], [`TierPolicy::ReuseScore`]) saves both for
    /// blocks likely to come back, at the price of missing some blocks'
    /// first reuse.
    pub g2_policy: TierPolicy,
    /// Admission and eviction in G3. The same trade as `g2_policy`, where a
    /// filter also saves disk bandwidth and SSD wear.
    pub g3_policy: TierPolicy,
    /// The G3 → G1 path. [`G3Onboard::Direct`] gives the lowest latency;
    /// [`G3Onboard::KeepG2Copy`] spends an extra offload (link bandwidth and
    /// a G2 slot) per loaded block so that a later request finds it in G2
    /// instead of on disk.
    pub g3_onboard: G3Onboard,
    /// When G1 blocks go to G2. Write-through copies off the allocation
    /// path, and G2 duplicates G1; write-back holds more distinct blocks in
    /// the same G2 memory, but an allocation that evicts from G1 waits for
    /// the copy.
    pub offload_mode: OffloadMode,
    /// Blocks one offload batch moves (see also `offload_batch_bytes`).
    /// Larger batches spread each batch's fixed cost (preparing, starting
    /// and registering a copy) over more blocks; smaller ones land each
    /// block in G2 sooner after it completes and hold less of G1 and G2
    /// while in flight.
    pub offload_batch: usize,
    /// Small blocks: a batch takes more than `offload_batch` blocks, until
    /// it moves this many bytes (0: off). Each batch pays fixed costs, and
    /// beside the model each batch's staging kernel waits for SMs, so it is
    /// bytes per batch and in flight that keep the link busy, not blocks.
    /// Raising it keeps the link busier with small blocks, most of all in
    /// short bursts from an empty queue, where nothing overlaps a batch's
    /// wait; the cost is blocks landing later and more memory held per
    /// batch (measured in `docs/benchmarks.md`, "Offload through the tier
    /// engine"). Batches in flight still hold at most a quarter of G1 and
    /// of G2.
    pub offload_batch_bytes: u64,
    /// Offload batches whose copies may be in flight at once. With one, the
    /// link idles while each batch is registered and the next prepared, and
    /// beside the model every batch waits alone for the SMs its staging
    /// kernel needs; with more, one batch's wait overlaps the others' DMA.
    /// More batches keep the link busy while each waits for the model's
    /// SMs, at the cost of memory held in flight (a batch's sources stay
    /// held and its targets unregistered until its copy ends). What counts
    /// is the bytes in flight: they must cover what the link could move
    /// while the model's kernels hold the SMs, so a model with longer
    /// kernels wants more (measured in `docs/benchmarks.md`, "Offload
    /// through the tier engine"). Batches in flight together hold at most a
    /// quarter of G1 and of G2 (smaller batches when the tiers are small).
    pub offload_in_flight: usize,
    /// Most blocks waiting in the offload queue; beyond it new offloads are
    /// skipped and counted (the engine is never blocked). A longer queue
    /// rides out longer bursts of completed blocks without skipping any, at
    /// the cost of offloading blocks later after they complete (and more of
    /// them freed, and so skipped, before their turn); a shorter one sheds
    /// load sooner.
    pub offload_queue: usize,
    /// Use counts are remembered for as many blocks as the tiers hold
    /// (G1 + G2 + G3) and this many more per block of that capacity, for
    /// blocks no tier holds any more. A longer history lets admission
    /// recognise blocks that come back long after they were evicted, at the
    /// cost of memory per remembered block.
    pub history_factor: f64,
    /// How the reuse score ranks a block from its use count and age.
    pub reuse_model: ReuseModel,
    /// Blocks of G2's memory set aside as the staging area of G3 prefetch
    /// (the last ones of G2's layout; G2's pool gets the rest). When a
    /// match finds blocks in G3, their reads into staging slots start at
    /// once, so the disk works while the engine allocates G1 and copies the
    /// G2 part; the onboard then copies staged blocks G2 → G1 and waits
    /// only for reads still in flight. Each block is one contiguous read in
    /// the file and in the slot, and blocks adjacent in the file land in
    /// adjacent slots, so reads are large where a G1 layout split per layer
    /// would cut them into one small read per layer and plane. G3 blocks
    /// beyond the free slots are read straight into G1 at onboard. 0 turns
    /// prefetch off. [`TierEngineConfig::new`] leaves it 0: it cannot know
    /// whether the G2 layout given has room beyond its pool;
    /// [`TierEngineBuilder`](super::TierEngineBuilder) adds up to
    /// [`DEFAULT_G3_STAGING_BYTES`] of G2 memory for it whenever it builds a
    /// G2 and a G3, since a read that starts earlier and in larger pieces
    /// lands sooner, and the staging slots cost G2's pool nothing (measured
    /// in `docs/benchmarks.md`, "Trace replay: hit rates"). The price is
    /// the staging memory, and a read wasted when a request goes away
    /// before its onboard. Up to half of the area also holds blocks on
    /// their way to G3 (write-behind: a G1 allocation that pushes blocks
    /// down to G3 waits for memory copies, not for the disk); with no
    /// staging area those writes are waited for.
    pub g3_staging_blocks: usize,
    /// Whether a match leaves blocks to recompute whose load would take
    /// longer than recomputing them (see [`LoadCost`]; off by default).
    pub load_cost: LoadCost,
    /// With [`ReuseModel::Hyperbolic`], ages decay as `(age + 1)^-exponent`
    /// (see
    /// [`UseHistory::with_age_exponent`](crate::policy::UseHistory::with_age_exponent)).
    /// A larger exponent favours recently used blocks; a smaller one lets
    /// blocks used often long ago keep their rank, the right choice when
    /// reuse gaps are long compared with the cache's turnover.
    pub reuse_age_exponent: f64,
    /// A [`RetentionHint::ReturnsWithin`](crate::policy::RetentionHint)
    /// keeps blocks for this many times the hinted time, then lets them
    /// rank by their history again. More slack forgives hints that come
    /// back late; less limits what a wrong hint costs (at most `slack × T`
    /// of a block's residence).
    pub hint_slack: f64,
    /// G1 (write-back mode) holds back the eviction of hinted blocks whose
    /// hinted time is at most this; longer hints are left to G2 and G3,
    /// whose scores rank them by how soon they return. Longer keeps more
    /// follow-ups' prefixes in GPU memory (no onboard), at the price of G1
    /// room for everything else.
    pub hint_g1_within: std::time::Duration,
    /// Write-back mode: G1 slots kept free ahead of need. After each G1
    /// allocation the engine evicts G1's next victims until this many slots
    /// are free and saves them to G2 in the background (off the caller's
    /// path, deferred while onboards run), so a later allocation of up to
    /// this many blocks takes free slots instead of waiting for a
    /// write-back; an allocation that needs more waits for the background
    /// saves, then evicts the rest itself. A request's onboard is the
    /// allocation this is for: the reserve should cover a typical matched
    /// prefix. The price is this many blocks of the total cache: their
    /// contents move to G2 early and G2 evicts as many sooner.
    ///
    /// `None` (the default) sizes it from G1: 256 blocks, at most a
    /// sixty-fourth of G1, so that it costs next to no hit rate.
    /// `Some(n)` keeps `n` slots free, at most half of G1: an engine whose
    /// G1 is small next to its onboards trades some hit rate for onboards
    /// that wait less. `Some(0)` turns it off.
    pub g1_free_reserve: Option<usize>,
}

/// The automatic G1 free reserve's size in blocks, before its cap of a
/// sixty-fourth of G1 ([`TierEngineConfig::g1_free_reserve`]).
const AUTO_G1_RESERVE: usize = 256;

impl TierEngineConfig {
    /// Blocks of `block_size` tokens; reuse-score admission and eviction in
    /// G2 and G3 scored by the probability of a use within the next 350
    /// requests, write-back from G1 (G2 receives G1's victims), LRU
    /// leaf-first G1, direct G3 onboarding, batches of 64, batches of at
    /// least 64 MiB, four batches in flight, a queue of 4096 blocks, a
    /// history of the resident blocks and 4× the total capacity more;
    /// retention hints keep blocks for twice their hinted time, and G1
    /// holds back hints of up to 30 s; up to 256 G1 slots (a sixty-fourth of
    /// G1 at most) kept free ahead of need.
    pub fn new(block_size: usize) -> Self {
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
            history_factor: 4.0,
            reuse_model: ReuseModel::ReturnWithin { horizon: 350 },
            reuse_age_exponent: 1.0,
            hint_slack: 2.0,
            hint_g1_within: std::time::Duration::from_secs(30),
            g3_staging_blocks: 0,
            load_cost: LoadCost::default(),
            g1_free_reserve: None,
        }
    }

    /// Keeps `blocks` G1 slots free ahead of need in write-back mode, at
    /// most half of G1, instead of the automatic size (0: off).
    pub fn g1_free_reserve(mut self, blocks: usize) -> Self {
        self.g1_free_reserve = Some(blocks);
        self
    }

    /// Sets how long hints keep blocks, in multiples of the hinted time.
    pub fn hint_slack(mut self, slack: f64) -> Self {
        self.hint_slack = slack;
        self
    }

    /// Sets the longest hinted time G1 holds blocks back for.
    pub fn hint_g1_within(mut self, within: std::time::Duration) -> Self {
        self.hint_g1_within = within;
        self
    }

    /// Sets the blocks of G2 memory set aside for G3 prefetch (0: off).
    pub fn g3_staging_blocks(mut self, blocks: usize) -> Self {
        self.g3_staging_blocks = blocks;
        self
    }

    /// Sets the load-or-recompute cost model.
    pub fn load_cost(mut self, cost: LoadCost) -> Self {
        self.load_cost = cost;
        self
    }

    /// Sets the G2 policy.
    pub fn g2_policy(mut self, policy: TierPolicy) -> Self {
        self.g2_policy = policy;
        self
    }

    /// Sets the G3 policy.
    pub fn g3_policy(mut self, policy: TierPolicy) -> Self {
        self.g3_policy = policy;
        self
    }

    /// Sets the G1 eviction policy.
    pub fn g1_eviction(mut self, eviction: EvictionKind) -> Self {
        self.g1_eviction = eviction;
        self
    }

    /// Sets the G3 onboarding path.
    pub fn g3_onboard(mut self, path: G3Onboard) -> Self {
        self.g3_onboard = path;
        self
    }

    /// Sets when G1 blocks go to G2.
    pub fn offload_mode(mut self, mode: OffloadMode) -> Self {
        self.offload_mode = mode;
        self
    }

    /// Sets how the reuse score ranks blocks.
    pub fn reuse_model(mut self, model: ReuseModel) -> Self {
        self.reuse_model = model;
        self
    }

    /// Sets the reuse-score age exponent (hyperbolic model).
    pub fn reuse_age_exponent(mut self, exponent: f64) -> Self {
        self.reuse_age_exponent = exponent;
        self
    }

    /// Sets how many offload batches may be in flight at once (at least 1).
    pub fn offload_in_flight(mut self, batches: usize) -> Self {
        self.offload_in_flight = batches;
        self
    }

    /// Sets the bytes an offload batch of small blocks reaches (0: batches
    /// of `offload_batch` blocks whatever their size).
    pub fn offload_batch_bytes(mut self, bytes: u64) -> Self {
        self.offload_batch_bytes = bytes;
        self
    }

    /// Sets the offload batch size and queue bound.
    pub fn offload_limits(mut self, batch: usize, queue: usize) -> Self {
        self.offload_batch = batch;
        self.offload_queue = queue;
        self
    }

    /// The G1 slots kept free ahead of need for a G1 of `g1_blocks` blocks
    /// (see [`g1_free_reserve`](Self::g1_free_reserve); 0 in write-through
    /// mode).
    pub fn g1_reserve_for(&self, g1_blocks: usize) -> usize {
        match (self.offload_mode, self.g1_free_reserve) {
            (OffloadMode::WriteThrough, _) => 0,
            (OffloadMode::WriteBack, None) => AUTO_G1_RESERVE.min(g1_blocks / 64),
            (OffloadMode::WriteBack, Some(n)) => n.min(g1_blocks / 2),
        }
    }

    /// Whether a tier's policy reads the use history (reuse-score ranking
    /// or `min_uses` admission), so matches must record it.
    pub fn uses_history(&self) -> bool {
        let reads = |p: TierPolicy| !matches!(p, TierPolicy::WriteThrough);
        reads(self.g2_policy) || reads(self.g3_policy)
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.block_size == 0 {
            return Err("block_size must be at least 1".into());
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
