//! A wrapper that records every victim its policy picks, so the tier
//! engine can copy an evicted block to the next tier before its slot is
//! written again (victim caching: G2's evictions feed G3).

use std::sync::Arc;

use kvbm_block::SequenceHash;
use parking_lot::Mutex;

use super::{BlockRef, BlockView, EvictionPolicy, Victim};

/// A block a pool just evicted. Its bytes stay intact until whoever
/// allocates its slot writes into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Evicted {
    /// The evicted block's id (its slot in the tier's layout).
    pub id: u32,
    /// The hash it was registered under.
    pub hash: SequenceHash,
    /// Its parent's hash.
    pub parent: Option<SequenceHash>,
}

/// Victims recorded since the last drain.
pub(crate) type VictimLog = Arc<Mutex<Vec<Evicted>>>;

/// Records the victims of the policy it wraps into a [`VictimLog`].
pub(crate) struct SpillRecorder {
    inner: Box<dyn EvictionPolicy>,
    log: VictimLog,
    /// The block the last peek named, recorded when it is popped.
    peeked: Option<Evicted>,
}

impl SpillRecorder {
    /// Wraps `inner`, recording into `log`.
    pub fn new(inner: Box<dyn EvictionPolicy>, log: VictimLog) -> Self {
        Self {
            inner,
            log,
            peeked: None,
        }
    }
}

impl EvictionPolicy for SpillRecorder {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn on_release(&mut self, block: BlockRef<'_>) {
        self.inner.on_release(block);
    }

    fn on_became_leaf(&mut self, block: BlockRef<'_>) {
        self.inner.on_became_leaf(block);
    }

    fn peek_victim(&mut self, view: &BlockView<'_>) -> Option<Victim> {
        let v = self.inner.peek_victim(view)?;
        self.peeked = view.block(v.id).map(|b| Evicted {
            id: v.id,
            hash: b.hash(),
            parent: b.parent(),
        });
        Some(v)
    }

    fn pop_victim(&mut self) {
        self.inner.pop_victim();
        if let Some(e) = self.peeked.take() {
            self.log.lock().push(e);
        }
    }

    fn tracks_access(&self) -> bool {
        self.inner.tracks_access()
    }

    fn on_access(&mut self, hash: SequenceHash) {
        self.inner.on_access(hash);
    }

    fn admit(&mut self, candidate: SequenceHash, view: &BlockView<'_>) -> bool {
        self.inner.admit(candidate, view)
    }

    fn compact(&mut self, view: &BlockView<'_>) {
        self.inner.compact(view);
    }

    fn queued(&self) -> usize {
        self.inner.queued()
    }
}
