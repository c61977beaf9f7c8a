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
mod lineage;
mod lru;
mod priority;
mod reuse_score;
mod sketch;
mod spill;

pub use frequency::FrequencyPolicy;
pub use lineage::LeafFirstPolicy;
pub use lru::LruPolicy;
pub use priority::{PolicyFactory, Prioritized};
pub use reuse_score::{
    ReuseScorePolicy, ReuseWeights, Seen, SharedHistory, USE_CLASSES, UseHistory,
};
pub use sketch::CountMinSketch;
pub use spill::{SpillRecorder, Victim, VictimLog};

use std::sync::atomic::Ordering::{Acquire, Relaxed};

use kvbm_block::SequenceHash;

use crate::slab::{Entry, State};

/// What a policy may know about a block.
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
    /// The pool clock when the block last became inactive.
    pub stamp: u64,
    /// Registered blocks built directly on this one.
    pub children: u32,
}

/// A read-only view of the pool's blocks, for policies to check candidates.
pub struct BlockView<'a> {
    slab: &'a [Entry],
}

impl<'a> BlockView<'a> {
    pub(crate) fn new(slab: &'a [Entry]) -> Self {
        Self { slab }
    }

    /// The block, if it is still inactive since the release that gave it
    /// `stamp` (registered, no holders, same stamp); `None` for stale
    /// entries.
    pub fn evictable(&self, id: u32, stamp: u64) -> Option<BlockInfo> {
        let e = self.slab.get(id as usize)?;
        if e.state() != State::Registered
            || e.holders.load(Acquire) != 0
            || e.stamp.load(Relaxed) != stamp
        {
            return None;
        }
        Some(info(id, e))
    }

    /// The block's current bookkeeping, whatever its state.
    pub fn info(&self, id: u32) -> Option<BlockInfo> {
        self.slab.get(id as usize).map(|e| info(id, e))
    }
}

pub(crate) fn info(id: u32, e: &Entry) -> BlockInfo {
    BlockInfo {
        id,
        hash: e.hash(),
        parent: e.parent(),
        priority: e.priority.load(Relaxed),
        stamp: e.stamp.load(Relaxed),
        children: e.children.load(Relaxed),
    }
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
    fn on_release(&mut self, block: &BlockInfo);

    /// An inactive block just lost its last registered child. Policies that
    /// keep lineage (leaf first) queue it now; others ignore it.
    fn on_became_leaf(&mut self, block: &BlockInfo) {
        let _ = block;
    }

    /// The next block to evict, or `None` when no queued candidate is
    /// evictable. Must return only blocks [`BlockView::evictable`] accepts
    /// with the stamp they were queued with.
    fn next_victim(&mut self, view: &BlockView<'_>) -> Option<u32>;

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

    /// Drops queued entries that are no longer evictable.
    fn compact(&mut self, view: &BlockView<'_>);

    /// Entries queued, stale ones included (the pool compacts when this
    /// grows well past its capacity).
    fn queued(&self) -> usize;
}
