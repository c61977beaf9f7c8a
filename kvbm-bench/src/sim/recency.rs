//! An O(1) recency list of block ids: the building block of every
//! simulator here.
//!
//! Entries live in a slab (a `Vec` of nodes linked by index) and a hash map
//! finds a block's node, so touching, removing and popping the least recent
//! entry are all O(1) with no allocation once the slab has grown. Memory per
//! entry: one 24-byte node plus one map slot (~16 bytes + overhead).

use std::collections::HashMap;

use kvbm_testkit::trace::BlockId;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    block: BlockId,
    prev: u32,
    next: u32,
}

/// Blocks ordered from least to most recently touched.
#[derive(Debug, Clone)]
pub struct RecencyList {
    nodes: Vec<Node>,
    free: Vec<u32>,
    index: HashMap<BlockId, u32>,
    /// Least recent end.
    head: u32,
    /// Most recent end.
    tail: u32,
}

impl Default for RecencyList {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl RecencyList {
    /// An empty list with room for `capacity` entries before reallocating.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            nodes: Vec::with_capacity(capacity),
            free: Vec::new(),
            index: HashMap::with_capacity(capacity),
            head: NIL,
            tail: NIL,
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

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn link_tail(&mut self, i: u32) {
        self.nodes[i as usize].prev = self.tail;
        self.nodes[i as usize].next = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.nodes[self.tail as usize].next = i;
        }
        self.tail = i;
    }

    /// Makes `block` the most recent entry, inserting it if absent.
    /// Returns whether it was already present.
    pub fn touch(&mut self, block: BlockId) -> bool {
        if let Some(&i) = self.index.get(&block) {
            self.unlink(i);
            self.link_tail(i);
            return true;
        }
        let node = Node {
            block,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.index.insert(block, i);
        self.link_tail(i);
        false
    }

    /// Removes `block`; returns whether it was present.
    pub fn remove(&mut self, block: BlockId) -> bool {
        match self.index.remove(&block) {
            Some(i) => {
                self.unlink(i);
                self.free.push(i);
                true
            }
            None => false,
        }
    }

    /// The least recent block, if any.
    pub fn peek_lru(&self) -> Option<BlockId> {
        (self.head != NIL).then(|| self.nodes[self.head as usize].block)
    }

    /// Removes and returns the least recent block.
    pub fn pop_lru(&mut self) -> Option<BlockId> {
        let block = self.peek_lru()?;
        self.remove(block);
        Some(block)
    }

    /// Blocks from least to most recent.
    pub fn iter_lru(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut i = self.head;
        std::iter::from_fn(move || {
            (i != NIL).then(|| {
                let n = self.nodes[i as usize];
                i = n.next;
                n.block
            })
        })
    }
}
