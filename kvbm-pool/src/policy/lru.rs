//! Least recently released first.

use std::collections::VecDeque;

use super::{BlockRef, BlockView, EvictionPolicy, LatestStamps};

/// How far ahead of the queue's front eviction loads entries.
const TOUCH_AHEAD: usize = 8;

/// LRU: a FIFO of releases; the oldest still-valid release is the victim.
/// O(1) per release and per eviction, no allocation once warmed up.
#[derive(Debug, Default)]
pub struct LruPolicy {
    queue: VecDeque<(u64, u32)>,
    latest: LatestStamps,
}

impl LruPolicy {
    /// An empty policy for a pool of `capacity` blocks.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            queue: VecDeque::with_capacity(capacity),
            latest: LatestStamps::with_capacity(capacity),
        }
    }

    /// The oldest evictable entry, taken off the queue.
    pub(crate) fn pop_valid<'a>(&mut self, view: &BlockView<'a>) -> Option<BlockRef<'a>> {
        while let Some((stamp, id)) = self.queue.pop_front() {
            if let Some(&(_, ahead)) = self.queue.get(TOUCH_AHEAD) {
                view.touch(ahead);
            }
            if let Some(b) = view.evictable(id, stamp) {
                return Some(b);
            }
        }
        None
    }

    /// Puts an entry taken with [`pop_valid`](Self::pop_valid) back in
    /// front.
    pub(crate) fn push_front(&mut self, stamp: u64, id: u32) {
        self.queue.push_front((stamp, id));
    }
}

impl EvictionPolicy for LruPolicy {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn on_release(&mut self, block: BlockRef<'_>) {
        let (stamp, id) = (block.stamp(), block.id());
        self.latest.set(id, stamp);
        self.queue.push_back((stamp, id));
    }

    fn next_victim(&mut self, view: &BlockView<'_>) -> Option<u32> {
        self.pop_valid(view).map(|b| b.id())
    }

    fn compact(&mut self, _view: &BlockView<'_>) {
        let latest = &self.latest;
        self.queue
            .retain(|&(stamp, id)| latest.may_be_live(id, stamp));
    }

    fn queued(&self) -> usize {
        self.queue.len()
    }
}
