//! The tier engine: what an inference engine calls to keep its KV blocks
//! beyond GPU memory and get them back.
//!
//! Each tier is a [`BlockPool`] (the books: which prefix each block holds,
//! what may be evicted) and a [`PhysicalLayout`] (the bytes; pool block `i`
//! is memory block `i`). A [`TierMover`] owns the memory and moves the
//! bytes: [`LocalMover`] (the tiers' layouts and one
//! [`kvbm_transfer::Executor`]) in one process, a distributed mover when
//! each block is sliced across tensor-parallel workers.
//!
//! - **Offload.** By default (write-back) the blocks G1 evicts are copied
//!   to G2 before their slots are handed out again, through G2's admission;
//!   a block G2 refuses is offered to G3. G1, G2 and G3 then hold distinct
//!   blocks: a block loaded into G1 from G2 or G3 is evicted first there
//!   until G1 gives it back. In write-through mode, and for engines that
//!   keep their own G1, blocks registered in G1 are queued for G2. One
//!   worker thread takes batches off a bounded queue, holding only a
//!   [`WeakBlock`] to each source until its copy starts (a block freed
//!   before then is skipped: that is cancellation), asks G2's admission
//!   policy, allocates targets, copies (keeping up to `offload_in_flight`
//!   batches' copies in flight), and registers a target only after its
//!   bytes landed. G2 is a victim cache towards G3: when allocating in
//!   G2 evicts blocks, the worker copies those victims to G3 before their
//!   slots are written again (the policy study found exclusive victim
//!   caching beats writing every block through to disk, and it spares SSD
//!   wear) — into staging slots first, registering them in G3 at once and
//!   writing them to disk later (write-behind), so a G1 allocation does not
//!   wait for the disk. Offloads and those writes wait while any onboard
//!   runs: onboarding is latency-critical.
//! - **Match.** For a request's sequence hashes: the longest prefix in G1,
//!   continued in G2, then G3 — one contiguous prefix. When the three cover
//!   the whole prompt one block is given back so the engine recomputes the
//!   last token (it needs the logits). A cost model, when given the
//!   engine's prefill rate, leaves a tail whose load would be slower than
//!   recomputing it ([`LoadCost`]). Matched G2/G3 blocks are held until
//!   onboarded or released, and the G3 ones start moving at once: they are
//!   read into a staging area at the end of G2's memory (G3 prefetch,
//!   [`TierEngineBuilder::g3_staging_bytes`]) while the engine allocates
//!   G1.
//! - **Onboard.** Copies the held blocks into G1 blocks (allocated by kvbm
//!   from its G1 pool, or given by the engine as ids) and resolves one
//!   completion per request; staged G3 blocks are copied from their slots
//!   once their read landed. A failure reports nothing as loaded. Requests
//!   sharing a prefix onboard it once: the second waits for the first's
//!   blocks to land in G1.
//!
//! Reuse-score admission and eviction need to know how often each block
//! was requested; every first match of a request records its prompt in a
//! shared [`crate::policy::UseHistory`].
//!
//! An engine is made by [`TierEngine::builder`] (tiers kvbm allocates for
//! a [`KvShape`]) or [`TierEngine::builder_with_mover`] (the tiers a
//! [`TierMover`] owns); both take the same knobs, the one way to configure
//! it.
//!
//! # Who owns what
//!
//! `Shared` is only the wiring: each of its fields is a part that owns
//! its state privately and is used through its methods.
//!
//! - `tier/books.rs` — the books: each tier's [`BlockPool`], G2's victims
//!   not saved yet, and the use history the policies rank by. **What G2
//!   evicts** is decided by G2's eviction policy, chosen in
//!   `tier/assemble.rs`: by default the reuse score of
//!   `kvbm-pool/src/policy/reuse_score.rs` (LRU, `policy/lru.rs`, for
//!   the write-through and `min_uses` policies); where G2's victims then
//!   go (G3, through its admission) is decided in `tier/victims.rs`.
//! - `tier/g1_saves.rs` — write-back: which G1 blocks are saved when
//!   evicted, the serialised G1 allocations that save them and G1's free
//!   reserve.
//! - `tier/requests.rs` — the request table: each live request's match,
//!   holds and prefetch, and the guards of its engine-owned offloads.
//! - `tier/matching.rs` — the hierarchical match and its rules (full
//!   prompt, cost model).
//! - `tier/onboard/` — onboarding: `mod.rs` starts and releases,
//!   `copy.rs` **moves the bytes of an onboard** (G2 → G1, G3 → G1 and
//!   staged copies), `job.rs` counts its copies down, `inflight.rs`
//!   shares blocks between requests, `finish.rs` registers the loaded
//!   blocks and resolves the completion.
//! - `tier/offload/` — the offload pipeline: `mod.rs` the bounded queue
//!   and what the worker does next, `worker.rs` the worker and its G1 →
//!   G2 batches, `source.rs` what a queued offload reads from.
//! - `tier/victims.rs` — write-back and victim caching: admitting and
//!   copying G1's victims to G2, and G2's (or refused) victims to G3.
//! - `tier/behind.rs` — G3 write-behind through staging slots, and which
//!   G3 blocks may be read; `tier/prefetch.rs` — the staging area and G3
//!   prefetch at match time.
//! - `tier/cost.rs` — the load-or-recompute cost model and measured
//!   rates; `tier/mover.rs` — [`TierMover`] and [`LocalMover`].

mod assemble;
mod behind;
mod books;
mod builder;
mod config;
mod cost;
mod error;
mod events;
mod g1_saves;
pub(crate) mod kept;
mod matching;
mod mover;
mod offload;
mod onboard;
mod prefetch;
mod request;
mod requests;
mod shape;
mod victims;

use std::sync::Arc;
use std::sync::mpsc::Receiver;
use std::thread::JoinHandle;

use kvbm_block::SequenceHash;
use kvbm_transfer::PhysicalLayout;

use books::Books;
pub(crate) use books::TierSlot;
use g1_saves::G1Saves;

pub use builder::{MoverTiers, ShapeTiers, TierEngineBuilder};
pub(crate) use config::TierEngineConfig;
pub use config::{
    DEFAULT_G3_STAGING_BYTES, DEFAULT_HISTORY_FACTOR, DEFAULT_REUSE_MODEL, G3Onboard, OffloadMode,
    TierPolicy, default_g3_staging_bytes,
};
pub use cost::LoadCost;
pub use error::TierError;
pub use matching::{G1Lookup, TierMatch};
pub use mover::{BlockLabel, LocalMover, TierMover};
pub use onboard::{OnboardHandle, OnboardTarget, Onboarded};
pub use request::RequestId;
pub use shape::{Dtype, KvShape};

use crate::config::Tier;
use crate::events::KvEventBatch;
use crate::metrics::{EngineMetrics, TierStats};
pub use crate::policy::{HintClock, RetentionHint, ReuseModel};
use crate::pool::{BlockPool, CompleteBlock, ImmutableBlocks, MutableBlock, WeakBlock};

/// The memory of each tier. G1 is required; without G2 nothing is
/// offloaded, and without G3 G2's victims are dropped.
#[derive(Debug, Clone)]
pub struct TierLayouts {
    /// The engine's KV memory (device memory, or host memory standing in).
    pub g1: PhysicalLayout,
    /// Host memory (pinned where CUDA is available).
    pub g2: Option<PhysicalLayout>,
    /// A disk layout.
    pub g3: Option<PhysicalLayout>,
}

/// The engine's parts, wired together: shared by the engine, its offload
/// worker and onboard callbacks. Each field is a part that keeps its
/// state private (or immutable configuration).
pub(crate) struct Shared {
    /// The engine's knobs, fixed at build time.
    pub(crate) config: TierEngineConfig,
    /// What each tier holds, and the use history they rank by.
    pub(crate) books: Books,
    /// G1's write-back saves and the G1 allocations that make them.
    pub(crate) g1_saves: G1Saves,
    /// What moves the bytes between the tiers' memories.
    pub(crate) mover: Arc<dyn TierMover>,
    /// The live requests and the guards of their engine-block offloads.
    pub(crate) requests: requests::Requests,
    /// Onboards in flight into the G1 pool, by block.
    pub(crate) inflight: onboard::Inflights,
    /// The offload queue: G1 → G2 batches, write-backs, background saves
    /// and G3 writes, taken by the offload worker.
    pub(crate) offload: offload::OffloadQueue,
    /// The engine's counters.
    pub(crate) metrics: EngineMetrics,
    /// The G3 staging area (G2 memory beyond G2's pool): prefetch reads
    /// land there, and write-behind keeps blocks there until written.
    pub(crate) staging: Option<Arc<prefetch::Staging>>,
    /// G2 → G1 and G3 read rates the engine measured (for the cost model).
    pub(crate) rates: cost::MeasuredRates,
}

/// The tier engine. `Send + Sync`; share it behind an `Arc`. Dropping it
/// stops the offload worker (queued offloads are skipped; blocks already
/// registered in G3 are written first).
pub struct TierEngine {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TierEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierEngine")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl TierEngine {
    /// When G1 blocks are copied to G2 (see
    /// [`TierEngineBuilder::offload_mode`]).
    pub fn offload_mode(&self) -> OffloadMode {
        self.shared.config.offload_mode
    }

    /// The G1 slots kept free ahead of need: the reserve asked for or the
    /// automatic one, capped for this engine's G1, and 0 in write-through
    /// mode (see [`TierEngineBuilder::g1_free_reserve`]).
    pub fn g1_free_reserve(&self) -> usize {
        self.shared
            .config
            .g1_reserve_for(self.shared.books.g1().pool.capacity())
    }

    /// Blocks of G2's memory set aside as the G3 staging area (0: none; see
    /// [`TierEngineBuilder::g3_staging_bytes`]).
    pub fn g3_staging_blocks(&self) -> usize {
        self.shared.config.g3_staging_blocks
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.shared.config.block_size
    }

    /// kvbm's books of G1. Allocate blocks for the engine to fill from it,
    /// then hand them back completed through
    /// [`register_g1`](Self::register_g1).
    pub fn g1(&self) -> &BlockPool {
        &self.shared.books.g1().pool
    }

    /// The pool of `tier`, if the engine has it.
    pub fn pool(&self, tier: Tier) -> Option<&BlockPool> {
        self.shared.books.slot(tier).map(|t| &t.pool)
    }

    /// The memory of `tier`, if it lives in this process.
    pub fn layout(&self, tier: Tier) -> Option<&PhysicalLayout> {
        self.shared.mover.local_layout(tier)
    }

    /// What moves the engine's bytes.
    pub fn mover(&self) -> &Arc<dyn TierMover> {
        &self.shared.mover
    }

    /// `n` G1 blocks for the engine to fill. In write-back mode the blocks
    /// G1 evicts to make room are copied to G2 before this returns (so the
    /// engine may overwrite them; the G3 writes this causes go through the
    /// staging area and land later), unless G1's free reserve covers `n`:
    /// then this takes free slots, and the victims evicted to refill the
    /// reserve are saved in the background (their slots are handed out only
    /// once saved). In write-through mode this is `g1().allocate(n)`. All or
    /// nothing.
    pub fn allocate_g1(&self, n: usize) -> Result<Vec<MutableBlock>, TierError> {
        self.shared.g1_saves.allocate(&self.shared, n, true)
    }

    /// Registers blocks the engine completed in G1 (a parent before its
    /// children) and, in write-through mode, queues them for offload to G2
    /// (in write-back mode they go to G2 when G1 evicts them). Waits for
    /// background saves of G1's reserve still running (they have ended
    /// by the time a forward pass completes).
    /// Returns the held G1 blocks in the same order.
    pub fn register_g1(&self, blocks: Vec<CompleteBlock>) -> Result<ImmutableBlocks, TierError> {
        // What the background saves of G1's reserve spill to G3 depends on
        // what G1 holds: they end first, so the books do not depend on how
        // far the worker got (an engine registers a forward pass after its
        // allocation; the saves have ended by then). Write-through has none.
        if self.shared.g1_saves.writes_back() {
            self.shared.offload.wait_cleaned();
        }
        let parents: Vec<Option<SequenceHash>> = blocks.iter().map(|b| b.parent()).collect();
        let held = self.shared.books.g1().pool.register(blocks).map_err(|e| {
            TierError::InvalidConfig(format!(
                "{} blocks do not belong to the engine's G1 pool",
                e.blocks.len()
            ))
        })?;
        match self.shared.config.offload_mode {
            OffloadMode::WriteThrough => {
                let items = (0..held.len())
                    .filter_map(|i| held.get(i).map(|b| (b.downgrade(), parents[i])));
                self.offload(items);
            }
            OffloadMode::WriteBack => {
                self.shared.g1_saves.save_when_evicted(
                    (0..held.len()).filter_map(|i| held.get(i).map(|b| b.sequence_hash())),
                );
            }
        }
        Ok(held)
    }

    /// Queues registered G1 blocks (with their parents' hashes) for offload
    /// to G2. Never blocks and never fails: a full queue skips and counts.
    pub fn offload(&self, blocks: impl IntoIterator<Item = (WeakBlock, Option<SequenceHash>)>) {
        offload::enqueue(&self.shared, blocks);
    }

    /// Queues blocks the engine owns in G1 — `(block id, hash, parent)`,
    /// e.g. vLLM's newly computed blocks of `request` — for offload to G2.
    /// The engine must leave their bytes unchanged until
    /// [`release`](Self::release) of the request returns: release cancels
    /// copies not yet started and waits for those running.
    pub fn offload_engine_blocks(
        &self,
        request: impl Into<RequestId>,
        blocks: &[(u32, SequenceHash, Option<SequenceHash>)],
    ) {
        let guard = self.shared.requests.engine_guard(request.into());
        offload::enqueue_engine(&self.shared, &guard, blocks);
    }

    /// Waits until every offload queued for `request` through
    /// [`offload_engine_blocks`](Self::offload_engine_blocks) has run (or
    /// was skipped), then releases the request (see
    /// [`release`](Self::release)). Offloads of other requests are not
    /// waited for. For an engine that keeps a finished request's blocks
    /// until kvbm has read them.
    pub fn release_after_offloads(&self, request: impl Into<RequestId>) -> bool {
        let request = request.into();
        let guard = self.shared.requests.find_engine_guard(&request);
        if let Some(g) = guard {
            // Checks now and then whether the engine is shutting down: its
            // queue then never drains.
            while !g.wait_idle(std::time::Duration::from_millis(100))
                && !self.shared.offload.is_shut_down()
            {}
        }
        self.release(request)
    }

    /// Blocks per offload batch as the worker takes them: `offload_batch`,
    /// raised for small blocks to `offload_batch_bytes`, capped so that the
    /// batches in flight together hold at most a quarter of G1 and of G2.
    pub fn offload_batch_limit(&self) -> usize {
        offload::batch_limit(&self.shared)
    }

    /// Blocks until every queued offload has been processed, every block
    /// left in the staging area for G3 has been written and every onboard
    /// in flight has ended, a released request's too: its G1 targets are
    /// held until its copies end (for tests, benchmarks and orderly
    /// shutdown).
    pub fn flush(&self) {
        self.shared.offload.flush();
    }

    /// Blocks until the offload worker has nothing it can do now: it has
    /// looked at its queue after this call and found no landed batch to
    /// register and nothing it may start (queued batches wait for a place
    /// among the batches in flight or for an onboard to end, or nothing is
    /// queued). Copies in flight may still be running. Returns at once
    /// when the engine shuts down. For tests that check what the worker
    /// leaves waiting, and that it has dealt with what they queued.
    pub fn wait_offload_idle(&self) {
        self.shared.offload.wait_idle();
    }

    /// Matches a request: the longest prefix of `hashes` in G1 (when
    /// `g1` is [`G1Lookup::Pool`]), continued in G2 then G3. The G2/G3
    /// blocks found are held for the request until
    /// [`onboard`](Self::onboard) or [`release`](Self::release).
    /// `prompt_tokens` applies the full-prompt rule. Matching the same id
    /// again replaces its earlier match (the first match alone counts as a
    /// use of its blocks).
    pub fn match_request(
        &self,
        request: impl Into<RequestId>,
        hashes: &[SequenceHash],
        prompt_tokens: usize,
        g1: G1Lookup,
    ) -> Result<TierMatch, TierError> {
        matching::match_request(&self.shared, request.into(), hashes, prompt_tokens, g1)
    }

    /// Starts copying the request's matched G2/G3 blocks into G1.
    pub fn onboard(
        &self,
        request: impl Into<RequestId>,
        target: OnboardTarget,
    ) -> Result<OnboardHandle, TierError> {
        onboard::start(&self.shared, request.into(), target)
    }

    /// Drops every cached block of every tier from kvbm's books without
    /// saving any of them to another tier, and returns how many: for when
    /// their bytes are gone (a worker holding a slice of each died with its
    /// memory), where a write-back save would copy garbage. Blocks held by
    /// live requests stay. Call it while no offload is queued (after
    /// [`flush`](Self::flush)).
    pub fn drop_cached(&self) -> usize {
        self.shared.g1_saves.drop_cached(&self.shared)
    }

    /// Gives a retention hint for `hashes` (a request's blocks, in prompt
    /// order), as of now on the hint clock. Every tier's admission and
    /// eviction use it (see [`crate::policy::retention`]): G2 and G3 with
    /// the reuse-score policy, G1 in write-back mode. Any later request
    /// carrying a block spends its hint.
    pub fn retain(&self, hashes: &[SequenceHash], hint: RetentionHint) {
        self.shared.books.retain(&self.shared.config, hashes, hint);
    }

    /// Gives a retention hint for the blocks of a matched request (its
    /// prompt's hashes as matched). Give it before the request's blocks
    /// are released, so that each tier ranks them by it as they become
    /// evictable. `false` if the request is unknown.
    pub fn hint_request(&self, request: impl Into<RequestId>, hint: RetentionHint) -> bool {
        let request = request.into();
        let Some(hashes) = self.shared.requests.hashes(&request) else {
            return false;
        };
        self.retain(&hashes, hint);
        true
    }

    /// Where retention hints put `hash` now.
    pub fn retained(&self, hash: SequenceHash) -> crate::policy::Retained {
        self.shared.books.retained(hash)
    }

    /// Sets the hint clock to `now` (e.g. a replay's trace timestamp, from
    /// its start). From the first call on, hints count time by these calls
    /// instead of the wall clock; times should not go backwards (an
    /// earlier time only makes protections last longer).
    pub fn set_time(&self, now: std::time::Duration) {
        let ms = now.as_millis().min(u128::from(u64::MAX)) as u64;
        self.shared.books.set_clock(HintClock::Manual(ms));
    }

    /// Forgets a request and drops everything it holds. When its onboard
    /// writes into engine-given G1 block ids, this waits until no more
    /// bytes can land there. `false` if the request was unknown.
    pub fn release(&self, request: impl Into<RequestId>) -> bool {
        let released = onboard::release(&self.shared, &request.into());
        // A request ended: the worker catches up with the uses recorded
        // since the history was last read.
        if self.shared.books.pending_uses() > 0 {
            self.shared.offload.apply_history();
        }
        released
    }

    /// Free slots of the G3 staging area (0 without one). Slots return
    /// when a staged block has been copied into G1, when the read of a
    /// request released before its onboard has stopped, or when a block's
    /// write to G3 has ended.
    pub fn staging_free_blocks(&self) -> usize {
        self.shared.staging.as_ref().map_or(0, |s| s.free_slots())
    }

    /// Requests currently known (matched and not released).
    pub fn live_requests(&self) -> usize {
        self.shared.requests.len()
    }

    /// Subscribes to the KV events of every tier, merged into one stream;
    /// each event names its tier. The first batches are snapshots.
    pub fn subscribe(&self) -> Receiver<KvEventBatch> {
        let pools = self.shared.books.slots().map(|t| t.pool.clone()).collect();
        events::merged(pools)
    }

    /// The engine's counters.
    pub fn stats(&self) -> TierStats {
        self.shared.metrics.snapshot()
    }

    /// A number that grows whenever blocks are stored into G2 or G3 (and
    /// only then). Matches only find more when it changed: an engine that
    /// matches a waiting request again and again may reuse the earlier
    /// answer while it stands still (the earlier match still holds its
    /// blocks, so nothing it found can have gone).
    pub fn stored_generation(&self) -> u64 {
        self.shared.metrics.stored()
    }

    /// How many requests used `hash` (as the reuse-score policy sees it).
    /// Uses are recorded only when G2 or G3 ranks or admits by them
    /// ([`TierPolicy::ReuseScore`] or [`TierPolicy::MinUses`]): with
    /// write-through tiers this stays 0.
    pub fn uses(&self, hash: SequenceHash) -> u32 {
        self.shared.books.uses(hash)
    }
}

impl Drop for TierEngine {
    fn drop(&mut self) {
        self.shared.offload.shutdown();
        if let Some(w) = self.worker.take() {
            // A panicked worker has nothing left to clean up.
            let _ = w.join();
        }
    }
}
