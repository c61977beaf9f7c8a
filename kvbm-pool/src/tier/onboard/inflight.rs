//! Onboards in flight into the G1 pool, by block: a request that needs a
//! block another request is loading waits for it instead of copying it
//! again.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvbm_block::SequenceHash;
use parking_lot::Mutex;

/// A callback of a request waiting on another's onboard.
pub(super) type Waiter = Box<dyn FnOnce() + Send>;

/// A block some request is onboarding into the G1 pool; others wait on it.
pub(crate) struct Inflight {
    /// Callbacks of waiting requests; `None` once the owner finished.
    waiters: Mutex<Option<Vec<Waiter>>>,
}

impl Inflight {
    fn new() -> Self {
        Self {
            waiters: Mutex::new(Some(Vec::new())),
        }
    }

    /// The owner finished: runs the waiting requests' callbacks.
    pub(super) fn finish(&self) {
        let waiters = self.waiters.lock().take().unwrap_or_default();
        for w in waiters {
            w();
        }
    }

    /// Runs `f` when the owner finishes (now, if it has).
    pub(super) fn wait(&self, f: Waiter) {
        let mut w = self.waiters.lock();
        match w.as_mut() {
            Some(list) => list.push(f),
            None => {
                drop(w);
                f();
            }
        }
    }
}

/// How one onboard shares its blocks with onboards in flight.
pub(super) struct Sharing {
    /// Indices of the blocks this onboard copies.
    pub(super) own: Vec<usize>,
    /// Indices of the blocks another onboard is loading.
    pub(super) waited: Vec<usize>,
    /// The onboards waited on, each once.
    pub(super) deps: Vec<Arc<Inflight>>,
    /// The in-flight entries this onboard claimed, for the blocks it
    /// copies.
    pub(super) owned: Vec<(SequenceHash, Arc<Inflight>)>,
}

impl Sharing {
    /// An onboard of `n` blocks that shares none (it writes into
    /// engine-given blocks).
    pub(super) fn alone(n: usize) -> Self {
        Self {
            own: (0..n).collect(),
            waited: Vec::new(),
            deps: Vec::new(),
            owned: Vec::new(),
        }
    }
}

/// The blocks being onboarded into the G1 pool, by hash.
#[derive(Default)]
pub(crate) struct Inflights {
    map: Mutex<HashMap<SequenceHash, Arc<Inflight>>>,
}

impl Inflights {
    /// Splits `hashes` into the blocks another onboard is loading (waited
    /// for) and the others, which the caller now owns: their entries are
    /// made here, and others wait on them until [`Self::end`].
    pub(super) fn claim(&self, hashes: &[SequenceHash]) -> Sharing {
        let mut sharing = Sharing {
            own: Vec::with_capacity(hashes.len()),
            waited: Vec::new(),
            deps: Vec::new(),
            owned: Vec::new(),
        };
        let mut map = self.map.lock();
        let mut seen_deps = HashSet::new();
        for (i, h) in hashes.iter().enumerate() {
            match map.get(h) {
                Some(entry) => {
                    sharing.waited.push(i);
                    if seen_deps.insert(Arc::as_ptr(entry) as usize) {
                        sharing.deps.push(Arc::clone(entry));
                    }
                }
                None => {
                    sharing.own.push(i);
                    let entry = Arc::new(Inflight::new());
                    map.insert(*h, Arc::clone(&entry));
                    sharing.owned.push((*h, entry));
                }
            }
        }
        sharing
    }

    /// Removes the entries of `owned` that are still these: the owner's
    /// blocks are in G1 (or failed), and new requests look there.
    pub(super) fn end(&self, owned: &[(SequenceHash, Arc<Inflight>)]) {
        let mut map = self.map.lock();
        for (h, entry) in owned {
            if map.get(h).is_some_and(|e| Arc::ptr_eq(e, entry)) {
                map.remove(h);
            }
        }
    }
}
