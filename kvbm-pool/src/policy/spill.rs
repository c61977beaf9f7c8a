//! A wrapper that records every victim its policy picks, so the tier
//! engine can copy an evicted block to the next tier before its slot is
//! written again (victim caching: G2's evictions feed G3).

use std::sync::Arc;

use kvbm_block::SequenceHash;
use parking_lot::Mutex;

use super::{BlockInfo, BlockView, EvictionPolicy};

/// A block a pool just evicted. Its bytes stay intact until whoever
/// allocates its slot writes into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Victim {
    /// The evicted block's id (its slot in the tier's layout).
    pub id: u32,
    /// The hash it was registered under.
    pub hash: SequenceHash,
    /// Its parent's hash.
    pub parent: Option<SequenceHash>,
}

/// Victims recorded since the last drain.
pub type VictimLog = Arc<Mutex<Vec<Victim>>>;

/// Records the victims of the policy it wraps into a [`VictimLog`].
pub struct SpillRecorder {
    inner: Box<dyn EvictionPolicy>,
    log: VictimLog,
}

impl SpillRecorder {
    /// Wraps `inner`, recording into `log`.
    pub fn new(inner: Box<dyn EvictionPolicy>, log: VictimLog) -> Self {
        Self { inner, log }
    }
}

impl EvictionPolicy for SpillRecorder {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn on_release(&mut self, block: &BlockInfo) {
        self.inner.on_release(block);
    }

    fn on_became_leaf(&mut self, block: &BlockInfo) {
        self.inner.on_became_leaf(block);
    }

    fn next_victim(&mut self, view: &BlockView<'_>) -> Option<u32> {
        let id = self.inner.next_victim(view)?;
        if let Some(info) = view.info(id) {
            self.log.lock().push(Victim {
                id,
                hash: info.hash,
                parent: info.parent,
            });
        }
        Some(id)
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
