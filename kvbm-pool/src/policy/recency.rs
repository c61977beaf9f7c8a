//! A recency list: entries from least to most recently used, as a doubly
//! linked list over a slab. Appending, moving an entry to the back,
//! removing one and popping the front are O(1) and allocate nothing once
//! the slab has grown; a removed entry's node is reused. The use history
//! orders its blocks with one (so it forgets blocks without a queue of
//! stale entries to sweep), and the simulators build their caches on it.

use kvbm_block::SequenceHash;

/// No node (the end of the list).
const NIL: u32 = u32::MAX;

/// One entry's place in the list.
#[derive(Debug, Clone, Copy)]
struct Node<T> {
    value: T,
    prev: u32,
    next: u32,
}

/// Entries from least to most recently used, each addressed by the node id
/// [`push_back`](Self::push_back) returned.
#[derive(Debug, Clone)]
pub struct Recency<T: Copy> {
    nodes: Vec<Node<T>>,
    /// Nodes of removed entries, for reuse.
    free: Vec<u32>,
    head: u32,
    tail: u32,
}

impl<T: Copy> Default for Recency<T> {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl<T: Copy> Recency<T> {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty list with room for `capacity` entries before its slab grows.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            nodes: Vec::with_capacity(capacity),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    /// Whether no node is left to hand out (the list holds `u32::MAX`
    /// entries).
    pub fn is_full(&self) -> bool {
        self.free.is_empty() && self.nodes.len() >= NIL as usize
    }

    /// Appends `value` as the most recently used entry; its node id, or
    /// `None` when the list [is full](Self::is_full).
    pub fn push_back(&mut self, value: T) -> Option<u32> {
        let node = Node {
            value,
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

    /// Moves node `id` (an entry in the list) to the back: it was used
    /// again.
    pub fn touch(&mut self, id: u32) {
        if self.tail == id {
            return;
        }
        self.unlink(id);
        self.link_back(id);
    }

    /// Removes node `id` (an entry in the list); its value.
    pub fn remove(&mut self, id: u32) -> T {
        self.unlink(id);
        self.free.push(id);
        self.nodes[id as usize].value
    }

    /// The least recently used entry's value.
    pub fn front(&self) -> Option<T> {
        (self.head != NIL).then(|| self.nodes[self.head as usize].value)
    }

    /// Removes the least recently used entry; its value.
    pub fn pop_front(&mut self) -> Option<T> {
        let id = self.head;
        (id != NIL).then(|| self.remove(id))
    }

    /// Values from least to most recently used.
    pub fn iter(&self) -> impl Iterator<Item = T> + '_ {
        self.walk(self.head, |n| n.next)
    }

    /// Values from most to least recently used.
    pub fn iter_rev(&self) -> impl Iterator<Item = T> + '_ {
        self.walk(self.tail, |n| n.prev)
    }

    /// Values from node `from` on, following `step` to the next node.
    fn walk(&self, from: u32, step: fn(&Node<T>) -> u32) -> impl Iterator<Item = T> + '_ {
        let mut i = from;
        std::iter::from_fn(move || {
            (i != NIL).then(|| {
                let n = &self.nodes[i as usize];
                i = step(n);
                n.value
            })
        })
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

/// The use history's list of remembered blocks.
pub(crate) type BlockRecency = Recency<SequenceHash>;

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
