//! Eviction and admission policies behind one trait.
//!
//! A policy never sees a lock or a handle: the pool tells it when a block
//! becomes inactive ([`EvictionPolicy::on_release`]) and asks it for
//! victims ([`EvictionPolicy::next_victim`]). Reactivating an inactive
//! block (a prefix match) does *not* call the policy: that keeps the match
//! path free of the policy's lock, which is what lets several threads match
//! at once. Instead every release carries a fresh *stamp* from the pool's
//! clock, and a policy's queued `(stamp, id)` entries are checked against
//! the block's current state when they come up ([`BlockView::evictable`]):
//! an entry whose block was reactivated, re-released (newer stamp) or
//! evicted is stale and skipped. The pool asks for [`EvictionPolicy::compact`]
//! when stale entries pile up, so memory stays bounded.

mod frequency;
mod hinted;
mod lineage;
mod lru;
mod priority;
mod recency;
pub mod retention;
mod return_within;
mod reuse_score;
mod shared_history;
mod sketch;
mod snapshot;
mod spill;
mod use_history;

pub use frequency::FrequencyPolicy;
pub use hinted::RetainingPolicy;
pub use lineage::LeafFirstPolicy;
pub use lru::LruPolicy;
pub use priority::Prioritized;
pub use recency::Recency;
pub use retention::{HintClock, RetentionHint, Retentions};
pub use reuse_score::ReuseScorePolicy;
pub use shared_history::{MAX_PENDING_BLOCKS, SharedHistory};
pub(crate) use sketch::CountMinSketch;
pub use snapshot::{HistorySnapshot, HistorySource};
pub(crate) use spill::{Evicted, SpillRecorder, VictimLog};
pub use use_history::{Retained, ReuseModel, ReuseWeights, Seen, UseHistory};

use std::sync::atomic::Ordering::{Acquire, Relaxed};

use kvbm_block::SequenceHash;

use crate::registry::Registry;
use crate::slab::{Entry, Slab, State};

/// A snapshot of what a policy may know about a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// The block's id in its pool.
    pub id: u32,
    /// Its sequence hash.
    pub hash: SequenceHash,
    /// Its parent's sequence hash.
    pub parent: Option<SequenceHash>,
    /// Engine-given priority, 0–100 (higher is kept longer).
    pub priority: u8,
    /// The stamp of its latest release: stamps order releases across the
    /// whole pool (the release time in 1/16 ticks of the CPU's counter
    /// since the pool was made, strictly increasing per policy shard).
    pub stamp: u64,
    /// Registered blocks built directly on this one.
    pub children: u32,
}

/// A block as a policy sees it during a call: each accessor reads the
/// pool's entry when asked, so a policy pays only for what it uses (LRU
/// reads the stamp and nothing else).
#[derive(Clone, Copy)]
pub struct BlockRef<'a> {
    id: u32,
    entry: Entry<'a>,
}

impl BlockRef<'_> {
    /// The block's id in its pool.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Its sequence hash.
    pub fn hash(&self) -> SequenceHash {
        self.entry.hash()
    }

    /// Its parent's sequence hash.
    pub fn parent(&self) -> Option<SequenceHash> {
        self.entry.parent()
    }

    /// Engine-given priority, 0–100 (higher is kept longer).
    pub fn priority(&self) -> u8 {
        self.entry.hot.priority.load(Relaxed)
    }

    /// The stamp of its latest release: stamps order releases across the
    /// whole pool (the release time in 1/16 ticks of the CPU's counter
    /// since the pool was made, strictly increasing per policy shard).
    pub fn stamp(&self) -> u64 {
        self.entry.hot.stamp.load(Relaxed)
    }

    /// Registered blocks built directly on this one.
    pub fn children(&self) -> u32 {
        self.entry.cold.children.load(Relaxed)
    }

    /// Everything at once.
    pub fn info(&self) -> BlockInfo {
        BlockInfo {
            id: self.id,
            hash: self.hash(),
            parent: self.parent(),
            priority: self.priority(),
            stamp: self.stamp(),
            children: self.children(),
        }
    }
}

impl std::fmt::Debug for BlockRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.info().fmt(f)
    }
}

pub(crate) fn block_ref(id: u32, entry: Entry<'_>) -> BlockRef<'_> {
    BlockRef { id, entry }
}

/// A read-only view of the pool's blocks, for policies to check candidates.
pub struct BlockView<'a> {
    slab: &'a Slab,
    registry: Option<&'a Registry>,
}

impl<'a> BlockView<'a> {
    pub(crate) fn new(slab: &'a Slab) -> Self {
        Self {
            slab,
            registry: None,
        }
    }

    /// A view that can also warm the registry slots of blocks (eviction
    /// removes them from the registry next).
    pub(crate) fn with_registry(slab: &'a Slab, registry: &'a Registry) -> Self {
        Self {
            slab,
            registry: Some(registry),
        }
    }

    /// The block, if it is still inactive since the release that gave it
    /// `stamp` (registered, no holders, same stamp); `None` for stale
    /// entries.
    pub fn evictable(&self, id: u32, stamp: u64) -> Option<BlockRef<'a>> {
        let e = self.slab.get(id)?;
        if e.hot.stamp.load(Relaxed) != stamp
            || e.state() != State::Registered
            || e.hot.holders.load(Acquire) != 0
        {
            return None;
        }
        Some(BlockRef { id, entry: e })
    }

    /// Loads the entries (and, during eviction, the registry slots) of
    /// blocks `ids` into cache, in one tight loop so that their cache misses
    /// overlap: call it with the next few candidates before evicting them.
    pub fn touch_all(&self, ids: impl Iterator<Item = u32>) {
        let mut sink = 0u64;
        for id in ids {
            if let Some(e) = self.slab.get(id) {
                let hash = e.hash();
                sink ^= self.registry.map_or(0, |r| r.peek(hash));
                sink ^= e.hot.stamp.load(Relaxed);
            }
        }
        std::hint::black_box(sink);
    }

    /// [`evictable`](Self::evictable) for a stamp kept as its low 32 bits.
    pub fn evictable_low32(&self, id: u32, stamp: u32) -> Option<BlockRef<'a>> {
        let e = self.slab.get(id)?;
        if e.hot.stamp.load(Relaxed) as u32 != stamp
            || e.state() != State::Registered
            || e.hot.holders.load(Acquire) != 0
        {
            return None;
        }
        Some(BlockRef { id, entry: e })
    }

    /// The block, whatever its state.
    pub fn block(&self, id: u32) -> Option<BlockRef<'a>> {
        self.slab.get(id).map(|entry| BlockRef { id, entry })
    }
}

/// The latest stamp each block was queued with, truncated to 32 bits: a
/// policy-local array that tells most stale queue entries apart without
/// touching the pool's entries, so compaction streams through the queue.
/// (A truncated match keeps a stale entry until it is popped and checked in
/// full; it never drops a live one.)
#[derive(Debug, Default, Clone)]
pub(crate) struct LatestStamps(Vec<u32>);

impl LatestStamps {
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self(vec![0; capacity])
    }

    pub(crate) fn set(&mut self, id: u32, stamp: u64) {
        let i = id as usize;
        if i >= self.0.len() {
            self.0.resize(i + 1, 0);
        }
        self.0[i] = stamp as u32;
    }

    /// Whether `(stamp, id)` may still be live.
    pub(crate) fn may_be_live(&self, id: u32, stamp: u64) -> bool {
        self.0.get(id as usize) == Some(&(stamp as u32))
    }
}

/// A candidate for eviction. A pool may spread releases over several
/// instances of a policy (one per shard, so threads releasing blocks do not
/// share a queue); it then evicts the candidate with the smallest `key`
/// among the shards' candidates, so keys must order candidates globally
/// (the release stamp does: every shard stamps from the same CPU
/// counter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Victim {
    /// The block.
    pub id: u32,
    /// Smaller goes first.
    pub key: u128,
}

/// An eviction (and admission) policy.
///
/// All calls happen under the pool's policy lock, so implementations are
/// plain single-threaded data structures. They must not panic.
pub trait EvictionPolicy: Send + 'static {
    /// A short name, for logs and benchmark labels.
    fn name(&self) -> &'static str;

    /// `block` just became inactive (its last holder left), with a fresh
    /// stamp: it is now a candidate.
    fn on_release(&mut self, block: BlockRef<'_>);

    /// An inactive block just lost its last registered child. Policies that
    /// keep lineage (leaf first) queue it now; others ignore it.
    fn on_became_leaf(&mut self, block: BlockRef<'_>) {
        let _ = block;
    }

    /// The block this policy would evict next, without removing it, or
    /// `None` when no queued candidate is evictable. Must return only blocks
    /// [`BlockView::evictable`] accepts with the stamp they were queued with.
    /// May be called again without [`pop_victim`](Self::pop_victim) (the
    /// answer may then change only if the policy was told something new).
    fn peek_victim(&mut self, view: &BlockView<'_>) -> Option<Victim>;

    /// Removes the victim the last [`peek_victim`](Self::peek_victim)
    /// returned: the pool is evicting it.
    fn pop_victim(&mut self);

    /// Hint: the pool is about to evict up to `n` blocks; a policy that
    /// knows its next candidates passes them to [`BlockView::touch_all`].
    fn warm(&self, view: &BlockView<'_>, n: usize) {
        let _ = (view, n);
    }

    /// Peek and pop at once.
    fn next_victim(&mut self, view: &BlockView<'_>) -> Option<u32> {
        let v = self.peek_victim(view)?;
        self.pop_victim();
        Some(v.id)
    }

    /// Whether the policy wants [`on_access`](Self::on_access) calls
    /// (registrations and matches); they take the policy lock, so policies
    /// that do not count accesses say no.
    fn tracks_access(&self) -> bool {
        false
    }

    /// A block was registered or matched.
    fn on_access(&mut self, hash: SequenceHash) {
        let _ = hash;
    }

    /// Admission: should a block named `candidate` be cached when caching it
    /// means evicting the policy's next victim? Asked only when the pool has
    /// no free block. The default admits everything.
    fn admit(&mut self, candidate: SequenceHash, view: &BlockView<'_>) -> bool {
        let _ = (candidate, view);
        true
    }

    /// Drops queued entries that are stale (at least those whose block was
    /// released again since); runs while other threads may match and
    /// release (only this shard is locked), so it must not rely on holder
    /// counts staying put.
    fn compact(&mut self, view: &BlockView<'_>);

    /// Entries queued, stale ones included (the pool compacts when this
    /// grows well past its capacity).
    fn queued(&self) -> usize;
}
