//! The knobs both kinds of [`TierEngineBuilder`] take. Each has a default
//! that suits most engines; values are checked when the engine is built
//! (a bad one is a [`TierError::InvalidConfig`](crate::TierError)).

use std::time::Duration;

use super::TierEngineBuilder;
use crate::config::EvictionKind;
use crate::policy::ReuseModel;
use crate::tier::{G3Onboard, LoadCost, OffloadMode, TierPolicy};

impl<T> TierEngineBuilder<T> {
    /// Eviction of kvbm's G1 books (the engine's GPU prefix cache; default
    /// leaf-first). Leaf-first keeps cached prefixes whole, so a prefix
    /// match never stops at an evicted block in the middle; plain LRU
    /// follows release order only; frequency eviction keeps often-used
    /// blocks longer at the cost of a sketch to update on every use.
    pub fn g1_eviction(mut self, eviction: EvictionKind) -> Self {
        self.config.g1_eviction = eviction;
        self
    }

    /// Admission and eviction in G2 (default [`TierPolicy::ReuseScore`]).
    /// Admitting every block ([`TierPolicy::WriteThrough`]) keeps the most
    /// for later hits but spends host-link bandwidth and G2 slots on
    /// one-off prompts; a filter ([`TierPolicy::MinUses`],
    /// [`TierPolicy::ReuseScore`]) saves both for blocks likely to come
    /// back, at the price of missing some blocks' first reuse.
    pub fn g2_policy(mut self, policy: TierPolicy) -> Self {
        self.config.g2_policy = policy;
        self
    }

    /// Admission and eviction in G3 (default [`TierPolicy::ReuseScore`]).
    /// The same trade as [`g2_policy`](Self::g2_policy), where a filter
    /// also saves disk bandwidth and SSD wear.
    pub fn g3_policy(mut self, policy: TierPolicy) -> Self {
        self.config.g3_policy = policy;
        self
    }

    /// How the reuse score ([`TierPolicy::ReuseScore`]) ranks a block from
    /// its use count and age (default
    /// [`DEFAULT_REUSE_MODEL`](crate::tier::DEFAULT_REUSE_MODEL)).
    pub fn reuse_model(mut self, model: ReuseModel) -> Self {
        self.config.reuse_model = model;
        self
    }

    /// With [`ReuseModel::Hyperbolic`], ages decay as
    /// `(age + 1)^-exponent` (default 1; see
    /// [`UseHistory::with_age_exponent`](crate::policy::UseHistory::with_age_exponent)).
    /// A larger exponent favours recently used blocks; a smaller one lets
    /// blocks used often long ago keep their rank, the right choice when
    /// reuse gaps are long compared with the cache's turnover. Other
    /// models do not read it.
    pub fn reuse_age_exponent(mut self, exponent: f64) -> Self {
        self.config.reuse_age_exponent = exponent;
        self
    }

    /// The G3 → G1 path (default [`G3Onboard::Direct`], the lowest
    /// latency). [`G3Onboard::KeepG2Copy`] spends an extra offload (link
    /// bandwidth and a G2 slot) per loaded block so that a later request
    /// finds it in G2 instead of on disk.
    pub fn g3_onboard(mut self, path: G3Onboard) -> Self {
        self.config.g3_onboard = path;
        self
    }

    /// When G1 blocks go to G2 (default [`OffloadMode::WriteBack`]).
    /// Write-through copies off the allocation path, and G2 duplicates G1;
    /// write-back holds more distinct blocks in the same G2 memory, but an
    /// allocation that evicts from G1 waits for the copy (unless
    /// [`g1_free_reserve`](Self::g1_free_reserve) covers it).
    pub fn offload_mode(mut self, mode: OffloadMode) -> Self {
        self.config.offload_mode = mode;
        self
    }

    /// Write-back mode: keeps `blocks` G1 slots free ahead of need (at most
    /// half of G1; 0: off) instead of the automatic size. After each G1
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
    /// Without this call it is sized from G1: 256 blocks, at most a
    /// sixty-fourth of G1, so that it costs next to no hit rate. An engine
    /// whose G1 is small next to its onboards trades some hit rate for
    /// onboards that wait less by asking for more.
    pub fn g1_free_reserve(mut self, blocks: usize) -> Self {
        self.config.g1_free_reserve = Some(blocks);
        self
    }

    /// `bytes` of G2 memory (whole blocks of it; 0: none) set aside as the
    /// staging area of G3 prefetch. When a match finds blocks in G3, their
    /// reads into staging slots start at once, so the disk works while the
    /// engine allocates G1 and copies the G2 part; the onboard then copies
    /// staged blocks G2 → G1 and waits only for reads still in flight. Each
    /// block is one contiguous read in the file and in the slot, and blocks
    /// adjacent in the file land in adjacent slots, so reads are large
    /// where a G1 layout split per layer would cut them into one small read
    /// per layer and plane. G3 blocks beyond the free slots are read
    /// straight into G1 at onboard. Up to half of the area also holds
    /// blocks on their way to G3 (write-behind: a G1 allocation that pushes
    /// blocks down to G3 waits for memory copies, not for the disk); with
    /// no staging area those writes are waited for. The price is the
    /// staging memory, and a read wasted when a request goes away before
    /// its onboard. Only an engine with both a G2 and a G3 has one.
    ///
    /// [`TierEngine::builder`](crate::TierEngine::builder) allocates the
    /// area beyond the G2 budget; without this call it allocates
    /// [`default_g3_staging_bytes`](crate::tier::default_g3_staging_bytes)
    /// of the budget (at least one block), since a read that starts
    /// earlier and in larger pieces lands sooner, and the staging slots
    /// cost G2's pool nothing (measured in `docs/benchmarks.md`, "Trace
    /// replay: hit rates"). Over a mover
    /// ([`TierEngine::builder_with_mover`](crate::TierEngine::builder_with_mover))
    /// the area is the last blocks of the mover's G2, which must keep at
    /// least one block for its pool; without this call there is none.
    pub fn g3_staging_bytes(mut self, bytes: u64) -> Self {
        self.g3_staging_bytes = Some(bytes);
        self
    }

    /// Offload batches whose copies may be in flight at once (default 4;
    /// at least 1). With one, the link idles while each batch is registered
    /// and the next prepared, and beside the model every batch waits alone
    /// for the SMs its staging kernel needs; with more, one batch's wait
    /// overlaps the others' DMA, at the cost of memory held in flight (a
    /// batch's sources stay held and its targets unregistered until its
    /// copy ends). What counts is the bytes in flight: they must cover what
    /// the link could move while the model's kernels hold the SMs, so a
    /// model with longer kernels wants more (measured in
    /// `docs/benchmarks.md`, "Offload through the tier engine"). Batches in
    /// flight together hold at most a quarter of G1 and of G2 (smaller
    /// batches when the tiers are small).
    pub fn offload_in_flight(mut self, batches: usize) -> Self {
        self.config.offload_in_flight = batches;
        self
    }

    /// Small blocks: a batch takes more than the batch's block count
    /// ([`offload_limits`](Self::offload_limits)) until it moves this many
    /// bytes (default 64 MiB; 0: off). Each batch pays fixed costs, and
    /// beside the model each batch's staging kernel waits for SMs, so it is
    /// bytes per batch and in flight that keep the link busy, not blocks.
    /// Raising it keeps the link busier with small blocks, most of all in
    /// short bursts from an empty queue, where nothing overlaps a batch's
    /// wait; the cost is blocks landing later and more memory held per
    /// batch (measured in `docs/benchmarks.md`, "Offload through the tier
    /// engine").
    pub fn offload_batch_bytes(mut self, bytes: u64) -> Self {
        self.config.offload_batch_bytes = bytes;
        self
    }

    /// Blocks one offload batch moves (default 64) and the most blocks
    /// waiting in the offload queue (default 4096; both at least 1).
    /// Larger batches spread each batch's fixed cost (preparing, starting
    /// and registering a copy) over more blocks; smaller ones land each
    /// block in G2 sooner after it completes and hold less of G1 and G2
    /// while in flight. Beyond the queue's bound new offloads are skipped
    /// and counted (the engine is never blocked): a longer queue rides out
    /// longer bursts of completed blocks without skipping any, at the cost
    /// of offloading blocks later after they complete; a shorter one sheds
    /// load sooner.
    pub fn offload_limits(mut self, batch: usize, queue: usize) -> Self {
        self.config.offload_batch = batch;
        self.config.offload_queue = queue;
        self
    }

    /// Whether a match leaves blocks to recompute whose load would take
    /// longer than recomputing them (see [`LoadCost`]; off by default).
    pub fn load_cost(mut self, cost: LoadCost) -> Self {
        self.config.load_cost = cost;
        self
    }

    /// A [`RetentionHint::ReturnsWithin`](crate::policy::RetentionHint)
    /// keeps blocks for this many times the hinted time (default 2; at
    /// least 1), then lets them rank by their history again. More slack
    /// forgives hints that come back late; less limits what a wrong hint
    /// costs (at most `slack × T` of a block's residence).
    pub fn hint_slack(mut self, slack: f64) -> Self {
        self.config.hint_slack = slack;
        self
    }

    /// G1 (write-back mode) holds back the eviction of hinted blocks whose
    /// hinted time is at most `within` (default 30 s); longer hints are
    /// left to G2 and G3, whose scores rank them by how soon they return.
    /// Longer keeps more follow-ups' prefixes in GPU memory (no onboard),
    /// at the price of G1 room for everything else.
    pub fn hint_g1_within(mut self, within: Duration) -> Self {
        self.config.hint_g1_within = within;
        self
    }
}
