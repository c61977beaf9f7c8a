//! The order in which the use history's blocks were last used: a doubly
//! linked list over a slab. A use moves a block to the back in constant
//! time, and the least recently used block is at the front, so the history
//! forgets blocks without a queue of stale entries to sweep.

use kvbm_block::SequenceHash;

/// No node (the end of the list).
pub(crate) const NIL: u32 = u32::MAX;

/// One remembered block's place in the list.
#[derive(Debug, Clone, Copy)]
struct Node {
    hash: SequenceHash,
    prev: u32,
    next: u32,
}

/// Blocks from least to most recently used.
#[derive(Debug)]
pub(crate) struct Recency {
    nodes: Vec<Node>,
    /// Nodes of forgotten blocks, for reuse.
    free: Vec<u32>,
    head: u32,
    tail: u32,
}

impl Recency {
    pub(crate) fn new() -> Self {
        Self {
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    /// Whether no node is left to hand out (the list holds `u32::MAX`
    /// blocks).
    pub(crate) fn is_full(&self) -> bool {
        self.free.is_empty() && self.nodes.len() >= NIL as usize
    }

    /// Appends `hash` as the most recently used block; its node, or `None`
    /// when the list [is full](Self::is_full).
    pub(crate) fn push_back(&mut self, hash: SequenceHash) -> Option<u32> {
        let node = Node {
            hash,
            prev: self.tail,
            next: NIL,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None if self.nodes.len() < NIL as usize => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
            None => return None,
        };
        self.link_back(id);
        Some(id)
    }

    /// Moves node `id` to the back (its block was used again).
    pub(crate) fn touch(&mut self, id: u32) {
        if self.tail == id {
            return;
        }
        self.unlink(id);
        self.link_back(id);
    }

    /// Removes the least recently used block; its hash.
    pub(crate) fn pop_front(&mut self) -> Option<SequenceHash> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.unlink(id);
        self.free.push(id);
        Some(self.nodes[id as usize].hash)
    }

    fn link_back(&mut self, id: u32) {
        let tail = self.tail;
        {
            let n = &mut self.nodes[id as usize];
            n.prev = tail;
            n.next = NIL;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.nodes[tail as usize].next = id;
        }
        self.tail = id;
    }

    fn unlink(&mut self, id: u32) {
        let Node { prev, next, .. } = self.nodes[id as usize];
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
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// The list orders blocks as a queue that moves a used block to
        /// its back.
        #[test]
        fn orders_by_last_use(ops in prop::collection::vec((0u8..3, 0u64..12), 0..200)) {
            let mut list = Recency::new();
            let mut ids = std::collections::HashMap::new();
            let mut model: VecDeque<u64> = VecDeque::new();
            for (op, x) in ops {
                match op {
                    0 | 1 => match ids.get(&x) {
                        Some(&id) => {
                            list.touch(id);
                            model.retain(|&y| y != x);
                            model.push_back(x);
                        }
                        None => {
                            let id = list.push_back(SequenceHash(x)).unwrap();
                            ids.insert(x, id);
                            model.push_back(x);
                        }
                    },
                    _ => {
                        let got = list.pop_front().map(|h| h.0);
                        prop_assert_eq!(got, model.pop_front());
                        if let Some(y) = got {
                            ids.remove(&y);
                        }
                    }
                }
            }
            while let Some(x) = model.pop_front() {
                prop_assert_eq!(list.pop_front().map(|h| h.0), Some(x));
            }
            prop_assert_eq!(list.pop_front(), None);
        }
    }
}
