//! An O(1) recency list of block ids: the building block of every
//! simulator here.
//!
//! kvbm-pool's slab-backed [`Recency`] list orders the entries, and a hash
//! map finds a block's node, so touching, removing and popping the least
//! recent entry are all O(1) with no allocation once the slab has grown.
//! Memory per entry: one 24-byte node plus one map slot (~16 bytes +
//! overhead).

use std::collections::HashMap;

use kvbm_pool::policy::Recency;
use kvbm_testkit::trace::BlockId;

/// Blocks ordered from least to most recently touched.
#[derive(Debug, Clone, Default)]
pub struct RecencyList {
    list: Recency<BlockId>,
    index: HashMap<BlockId, u32>,
}

impl RecencyList {
    /// An empty list with room for `capacity` entries before reallocating.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            list: Recency::with_capacity(capacity),
            index: HashMap::with_capacity(capacity),
        }
    }

    /// Number of blocks in the list.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Whether `block` is in the list.
    pub fn contains(&self, block: BlockId) -> bool {
        self.index.contains_key(&block)
    }

    /// Makes `block` the most recent entry, inserting it if absent.
    /// Returns whether it was already present.
    pub fn touch(&mut self, block: BlockId) -> bool {
        if let Some(&i) = self.index.get(&block) {
            self.list.touch(i);
            return true;
        }
        // A full list holds u32::MAX nodes of 24 bytes (~100 GB): no
        // simulated cache comes near it.
        let i = self
            .list
            .push_back(block)
            .expect("a recency list of fewer than u32::MAX blocks");
        self.index.insert(block, i);
        false
    }

    /// Removes `block`; returns whether it was present.
    pub fn remove(&mut self, block: BlockId) -> bool {
        match self.index.remove(&block) {
            Some(i) => {
                self.list.remove(i);
                true
            }
            None => false,
        }
    }

    /// The least recent block, if any.
    pub fn peek_lru(&self) -> Option<BlockId> {
        self.list.front()
    }

    /// Removes and returns the least recent block.
    pub fn pop_lru(&mut self) -> Option<BlockId> {
        let block = self.list.pop_front()?;
        self.index.remove(&block);
        Some(block)
    }

    /// Blocks from least to most recent.
    pub fn iter_lru(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.list.iter()
    }
}
