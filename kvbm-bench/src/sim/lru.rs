//! Least-recently-used reference simulator: one cache, every block admitted.

use super::recency::RecencyList;
use super::replay::{CacheSim, RequestCtx, Tier};
use kvbm_testkit::trace::BlockId;

/// In which order a request's blocks are refreshed after its lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TouchOrder {
    /// Prompt order: the first block is refreshed first, so it becomes the
    /// *older* of the request's blocks. This is the reference definition.
    #[default]
    Prompt,
    /// Reverse prompt order ("leaf first"): the last block is refreshed
    /// first, so a request's deepest blocks are evicted before its prefix.
    /// This is what vLLM's free-block queue does.
    LeafFirst,
}

/// An LRU cache of `capacity` blocks.
#[derive(Debug, Clone)]
pub struct LruSim {
    list: RecencyList,
    capacity: usize,
    order: TouchOrder,
    evicted: Vec<BlockId>,
}

impl LruSim {
    /// The reference LRU: prompt order, every block admitted.
    pub fn new(capacity: usize) -> Self {
        Self::with_order(capacity, TouchOrder::Prompt)
    }

    /// An LRU refreshing blocks in `order`.
    pub fn with_order(capacity: usize, order: TouchOrder) -> Self {
        Self {
            list: RecencyList::with_capacity(capacity + 1),
            capacity,
            order,
            evicted: Vec::new(),
        }
    }

    /// Whether `block` is cached (no side effect).
    pub fn contains(&self, block: BlockId) -> bool {
        self.list.contains(block)
    }

    /// Blocks cached.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Cached blocks from least to most recent.
    pub fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.list.iter_lru()
    }

    /// The block the next insertion into a full cache would evict.
    pub fn peek_lru(&self) -> Option<BlockId> {
        self.list.peek_lru()
    }

    /// Removes `block`; returns whether it was cached.
    pub fn remove(&mut self, block: BlockId) -> bool {
        self.list.remove(block)
    }

    /// Refreshes `blocks` in this cache's order, then evicts the least
    /// recent blocks until it fits. The request's blocks are all in use
    /// together, so a block is never evicted and re-admitted within one
    /// call: eviction only takes one of them when the request alone
    /// exceeds the capacity (its least recent ones). The evicted blocks, in
    /// eviction order, are returned and stay valid until the next call.
    pub fn touch_all(&mut self, blocks: &[BlockId]) -> &[BlockId] {
        self.evicted.clear();
        match self.order {
            TouchOrder::Prompt => {
                for &b in blocks {
                    self.list.touch(b);
                }
            }
            TouchOrder::LeafFirst => {
                for &b in blocks.iter().rev() {
                    self.list.touch(b);
                }
            }
        }
        while self.list.len() > self.capacity {
            match self.list.pop_lru() {
                Some(victim) => self.evicted.push(victim),
                None => break,
            }
        }
        &self.evicted
    }
}

impl CacheSim for LruSim {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        self.contains(block).then_some(Tier::G1)
    }

    fn record(&mut self, ctx: &RequestCtx<'_>) {
        self.touch_all(ctx.blocks());
    }
}
