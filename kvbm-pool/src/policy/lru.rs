//! Least recently released first.

use std::collections::VecDeque;

use super::{BlockInfo, BlockView, EvictionPolicy};

/// LRU: a FIFO of releases; the oldest still-valid release is the victim.
/// O(1) per release and per eviction, no allocation once warmed up.
#[derive(Debug, Default)]
pub struct LruPolicy {
    queue: VecDeque<(u64, u32)>,
}

impl LruPolicy {
    /// An empty policy with room for `capacity` entries.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            queue: VecDeque::with_capacity(capacity),
        }
    }

    pub(crate) fn pop_valid(&mut self, view: &BlockView<'_>) -> Option<BlockInfo> {
        while let Some((stamp, id)) = self.queue.pop_front() {
            if let Some(info) = view.evictable(id, stamp) {
                return Some(info);
            }
        }
        None
    }

    pub(crate) fn push_front(&mut self, block: &BlockInfo) {
        self.queue.push_front((block.stamp, block.id));
    }
}

impl EvictionPolicy for LruPolicy {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn on_release(&mut self, block: &BlockInfo) {
        self.queue.push_back((block.stamp, block.id));
    }

    fn next_victim(&mut self, view: &BlockView<'_>) -> Option<u32> {
        self.pop_valid(view).map(|b| b.id)
    }

    fn compact(&mut self, view: &BlockView<'_>) {
        self.queue
            .retain(|&(stamp, id)| view.evictable(id, stamp).is_some());
    }

    fn queued(&self) -> usize {
        self.queue.len()
    }
}
