//! Least recently released first.

use std::collections::VecDeque;

use super::{BlockRef, BlockView, EvictionPolicy, LatestStamps, Victim};

/// LRU: a FIFO of releases; the oldest still-valid release is the victim.
/// O(1) per release and per eviction, no allocation once warmed up.
///
/// An entry is 8 bytes: the block id and the low 32 bits of its release
/// stamp. The FIFO's order carries the recency, so the stamp only has to
/// tell a stale entry from the block's latest release; a truncated match
/// (the same block released again exactly 2^32 releases later) can only
/// make an inactive block leave a little early, never an active one.
#[derive(Debug)]
// Aligned to its own cache lines: the shards of a sharded policy are
// written by different threads and must not share a line.
#[repr(align(128))]
pub struct LruPolicy {
    queue: VecDeque<u64>,
    latest: LatestStamps,
    /// The queue compacts itself at this length (its reserved size), so it
    /// never reallocates: compaction leaves at most one entry per block.
    limit: usize,
}

fn pack(stamp: u64, id: u32) -> u64 {
    (stamp << 32) | u64::from(id)
}

fn unpack(entry: u64) -> (u32, u32) {
    ((entry >> 32) as u32, entry as u32)
}

impl LruPolicy {
    /// An empty policy for a pool of `capacity` blocks.
    pub fn with_capacity(capacity: usize) -> Self {
        let limit = capacity.saturating_mul(2).saturating_add(64);
        Self {
            queue: VecDeque::with_capacity(limit),
            latest: LatestStamps::with_capacity(capacity),
            limit,
        }
    }

    fn compact_stale(&mut self) {
        let latest = &self.latest;
        self.queue.retain(|&entry| {
            let (stamp, id) = unpack(entry);
            latest.may_be_live(id, u64::from(stamp))
        });
    }

    /// The oldest evictable entry, left at the front (stale entries before
    /// it are dropped).
    pub(crate) fn peek_valid<'a>(&mut self, view: &BlockView<'a>) -> Option<BlockRef<'a>> {
        while let Some(&entry) = self.queue.front() {
            let (stamp, id) = unpack(entry);
            if let Some(b) = view.evictable_low32(id, stamp) {
                return Some(b);
            }
            self.queue.pop_front();
        }
        None
    }

    /// The oldest evictable entry, taken off the queue.
    pub(crate) fn pop_valid<'a>(&mut self, view: &BlockView<'a>) -> Option<BlockRef<'a>> {
        let b = self.peek_valid(view)?;
        self.queue.pop_front();
        Some(b)
    }

    /// Puts an entry taken with [`pop_valid`](Self::pop_valid) back in
    /// front.
    pub(crate) fn push_front(&mut self, stamp: u64, id: u32) {
        self.queue.push_front(pack(stamp, id));
    }
}

impl Default for LruPolicy {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl EvictionPolicy for LruPolicy {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn on_release(&mut self, block: BlockRef<'_>) {
        let (stamp, id) = (block.stamp(), block.id());
        self.latest.set(id, stamp);
        if self.queue.len() >= self.limit {
            self.compact_stale();
            // More than a third still live (most of the pool inactive, or
            // a pool bigger than announced): grow, so each compaction frees
            // at least two thirds of what it walks — amortised 1.5 entries
            // walked per release at most.
            if self.queue.len().saturating_mul(3) > self.limit {
                self.limit = self.limit.saturating_mul(2);
            }
        }
        self.queue.push_back(pack(stamp, id));
    }

    fn peek_victim(&mut self, view: &BlockView<'_>) -> Option<Victim> {
        self.peek_valid(view).map(|b| Victim {
            id: b.id(),
            key: u128::from(b.stamp()),
        })
    }

    fn pop_victim(&mut self) {
        self.queue.pop_front();
    }

    fn warm(&self, view: &BlockView<'_>, n: usize) {
        view.touch_all(self.queue.iter().take(n).map(|&e| unpack(e).1));
    }

    fn compact(&mut self, _view: &BlockView<'_>) {
        self.compact_stale();
    }

    fn queued(&self) -> usize {
        self.queue.len()
    }
}
