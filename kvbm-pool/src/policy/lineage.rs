//! Leaf first: prefixes stay whole.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use super::{BlockRef, BlockView, EvictionPolicy, LatestStamps, Victim};

/// LRU among leaves: a block is evicted only when no registered block is
/// built on it, so a cached prefix never loses an inner block (a match can
/// use every block up to the cached leaf).
///
/// Releases arrive in clock order and go to a FIFO; a block that becomes a
/// leaf later (its last child was evicted) carries an older stamp and goes
/// to a small min-heap. The victim is the older of the two fronts.
#[derive(Debug, Default)]
// Aligned to its own cache lines: the shards of a sharded policy are
// written by different threads and must not share a line.
#[repr(align(128))]
pub struct LeafFirstPolicy {
    released: VecDeque<(u64, u32)>,
    late_leaves: BinaryHeap<Reverse<(u64, u32)>>,
    latest: LatestStamps,
    /// Where the last peeked victim sits.
    peeked_heap: bool,
}

impl LeafFirstPolicy {
    /// An empty policy with room for `capacity` entries.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            released: VecDeque::with_capacity(capacity),
            late_leaves: BinaryHeap::new(),
            latest: LatestStamps::with_capacity(capacity),
            peeked_heap: false,
        }
    }
}

fn is_leaf_victim(view: &BlockView<'_>, stamp: u64, id: u32) -> bool {
    view.evictable(id, stamp).is_some_and(|b| b.children() == 0)
}

impl EvictionPolicy for LeafFirstPolicy {
    fn name(&self) -> &'static str {
        "leaf-first"
    }

    fn on_release(&mut self, block: BlockRef<'_>) {
        let (stamp, id) = (block.stamp(), block.id());
        self.latest.set(id, stamp);
        if block.children() == 0 {
            self.released.push_back((stamp, id));
        }
    }

    fn on_became_leaf(&mut self, block: BlockRef<'_>) {
        let (stamp, id) = (block.stamp(), block.id());
        self.latest.set(id, stamp);
        self.late_leaves.push(Reverse((stamp, id)));
    }

    fn peek_victim(&mut self, view: &BlockView<'_>) -> Option<Victim> {
        loop {
            let fifo = self.released.front().copied();
            let heap = self.late_leaves.peek().map(|r| r.0);
            let (from_heap, (stamp, id)) = match (fifo, heap) {
                (None, None) => return None,
                (Some(f), Some(h)) if h < f => (true, h),
                (Some(f), _) => (false, f),
                (None, Some(h)) => (true, h),
            };
            if is_leaf_victim(view, stamp, id) {
                self.peeked_heap = from_heap;
                return Some(Victim {
                    id,
                    key: u128::from(stamp),
                });
            }
            if from_heap {
                self.late_leaves.pop();
            } else {
                self.released.pop_front();
            }
        }
    }

    fn warm(&self, view: &BlockView<'_>, n: usize) {
        view.touch_all(self.released.iter().take(n).map(|&(_, id)| id));
    }

    fn pop_victim(&mut self) {
        if self.peeked_heap {
            self.late_leaves.pop();
        } else {
            self.released.pop_front();
        }
    }

    fn compact(&mut self, _view: &BlockView<'_>) {
        let latest = &self.latest;
        self.released
            .retain(|&(stamp, id)| latest.may_be_live(id, stamp));
        self.late_leaves
            .retain(|Reverse((stamp, id))| latest.may_be_live(*id, *stamp));
    }

    fn queued(&self) -> usize {
        self.released.len() + self.late_leaves.len()
    }
}
