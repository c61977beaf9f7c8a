//! Retention hints in G1: a wrapper around G1's own eviction policy.
//!
//! Blocks a hint marked done go first. A block the inner policy picks is
//! held back while a hint keeps it and the hint's time is short (at most
//! `g1_within`): the wrapper sets it aside and asks again. Set-aside blocks
//! come back first once their protection lapses, and when nothing else is
//! left the one that returns last goes. With no hint ever given the
//! wrapper only forwards.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvbm_block::SequenceHash;

use super::shared_history::SharedHistory;
use super::use_history::Retained;
use super::{BlockRef, BlockView, EvictionPolicy, Victim};

/// What the last peek named.
#[derive(Clone, Copy, Debug)]
enum Peeked {
    Done,
    Inner,
    /// A set-aside entry `(until, !key, id, stamp)`.
    Aside((u64, u128, u32, u64)),
}

/// G1's policy with retention hints (see the module docs).
pub struct RetainingPolicy {
    inner: Box<dyn EvictionPolicy>,
    history: SharedHistory,
    /// Set once any hint was given: until then every call forwards.
    hinted: Arc<AtomicBool>,
    /// Longest hinted time (ms) G1 holds blocks back for.
    g1_within: u64,
    /// Blocks marked done, `(id, stamp)`, oldest release first.
    done: VecDeque<(u32, u64)>,
    /// Blocks held back, ordered by lapse, then by the inner policy's
    /// order (its key, inverted): `(until, !key, id, stamp)`.
    aside: BTreeSet<(u64, u128, u32, u64)>,
    peeked: Option<Peeked>,
}

impl RetainingPolicy {
    /// Wraps `inner`; hints are read from `history` once `hinted` is set.
    pub fn new(
        inner: Box<dyn EvictionPolicy>,
        history: SharedHistory,
        hinted: Arc<AtomicBool>,
        g1_within: std::time::Duration,
    ) -> Self {
        Self {
            inner,
            history,
            hinted,
            g1_within: g1_within.as_millis().min(u128::from(u64::MAX)) as u64,
            done: VecDeque::new(),
            aside: BTreeSet::new(),
            peeked: None,
        }
    }

    fn active(&self) -> bool {
        self.hinted.load(Ordering::Relaxed)
    }

    fn peek_hinted(&mut self, view: &BlockView<'_>) -> Option<Victim> {
        let history = self.history.lock();
        let now = history.now_ms();
        // Done blocks first.
        while let Some(&(id, stamp)) = self.done.front() {
            match view.evictable(id, stamp) {
                Some(b) if history.retained(b.hash()) == Retained::Done => {
                    self.peeked = Some(Peeked::Done);
                    return Some(Victim { id, key: 0 });
                }
                _ => {
                    self.done.pop_front();
                }
            }
        }
        // Then held-back blocks whose protection lapsed.
        while let Some(&e) = self.aside.first() {
            let (until, key, id, stamp) = e;
            if view.evictable(id, stamp).is_none() {
                self.aside.remove(&e);
                continue;
            }
            if until > now {
                break;
            }
            self.peeked = Some(Peeked::Aside(e));
            return Some(Victim { id, key: !key });
        }
        while let Some(v) = self.inner.peek_victim(view) {
            let hold = view.block(v.id).and_then(|b| {
                let (until, within) = history.retentions().keep(b.hash(), now)?;
                (within <= self.g1_within).then(|| (until, b.stamp()))
            });
            match hold {
                Some((until, stamp)) => {
                    self.inner.pop_victim();
                    self.aside.insert((until, !v.key, v.id, stamp));
                }
                None => {
                    self.peeked = Some(Peeked::Inner);
                    return Some(v);
                }
            }
        }
        // Nothing else: the held-back block that returns last (of those,
        // the one the inner policy would have taken first).
        while let Some(&e) = self.aside.last() {
            let (_, key, id, stamp) = e;
            if view.evictable(id, stamp).is_none() {
                self.aside.remove(&e);
                continue;
            }
            self.peeked = Some(Peeked::Aside(e));
            return Some(Victim { id, key: !key });
        }
        None
    }
}

impl EvictionPolicy for RetainingPolicy {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn on_release(&mut self, block: BlockRef<'_>) {
        if self.active() && self.history.lock().retained(block.hash()) == Retained::Done {
            self.done.push_back((block.id(), block.stamp()));
        }
        self.inner.on_release(block);
    }

    fn on_became_leaf(&mut self, block: BlockRef<'_>) {
        self.inner.on_became_leaf(block);
    }

    fn peek_victim(&mut self, view: &BlockView<'_>) -> Option<Victim> {
        if !self.active() {
            self.peeked = Some(Peeked::Inner);
            return self.inner.peek_victim(view);
        }
        self.peek_hinted(view)
    }

    fn pop_victim(&mut self) {
        match self.peeked.take() {
            Some(Peeked::Done) => {
                self.done.pop_front();
            }
            Some(Peeked::Inner) => self.inner.pop_victim(),
            Some(Peeked::Aside(e)) => {
                self.aside.remove(&e);
            }
            None => {}
        }
    }

    fn warm(&self, view: &BlockView<'_>, n: usize) {
        self.inner.warm(view, n);
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
        self.done
            .retain(|&(id, stamp)| view.evictable(id, stamp).is_some());
        self.aside
            .retain(|&(_, _, id, stamp)| view.evictable(id, stamp).is_some());
    }

    fn queued(&self) -> usize {
        self.inner.queued() + self.done.len() + self.aside.len()
    }
}
