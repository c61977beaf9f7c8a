//! The per-block state: one compact entry per block, indexed by block id.
//!
//! Every field is an atomic so that the entries can live outside the locks:
//! holder counts change with a single atomic operation under the shared
//! registry lock (or none at all for a clone), which is what lets several
//! threads match and release at once. Fields other than the holder count
//! and the stamp only change under the exclusive registry lock, so relaxed
//! loads and stores suffice for them (the lock orders them).

use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering::Relaxed};

use kvbm_block::SequenceHash;

/// No parent link.
pub(crate) const NO_PARENT: u32 = u32::MAX;

/// Where a block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum State {
    /// On the free list.
    Free = 0,
    /// Held by a mutable or complete handle.
    Allocated = 1,
    /// In the registry: active while held, inactive (evictable) otherwise.
    Registered = 2,
    /// Held by immutable handles but not in the registry (a kept duplicate).
    Duplicate = 3,
}

impl State {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Allocated,
            2 => Self::Registered,
            3 => Self::Duplicate,
            _ => Self::Free,
        }
    }
}

/// One block's bookkeeping (48 bytes).
#[derive(Default)]
pub(crate) struct Entry {
    pub(crate) hash: AtomicU64,
    pub(crate) parent: AtomicU64,
    /// When the block last became inactive (the policy's clock).
    pub(crate) stamp: AtomicU64,
    /// Holders (immutable handles) of a registered or duplicate block.
    pub(crate) holders: AtomicU32,
    /// Registered blocks whose parent link points here.
    pub(crate) children: AtomicU32,
    pub(crate) parent_id: AtomicU32,
    /// The parent's generation when the link was made: a stale link (the
    /// parent was evicted and its slot reused) is recognised and ignored.
    pub(crate) parent_gen: AtomicU32,
    /// Bumped each time the block leaves the registry.
    pub(crate) generation: AtomicU32,
    state: AtomicU8,
    pub(crate) priority: AtomicU8,
    has_parent: AtomicU8,
}

impl Entry {
    pub(crate) fn state(&self) -> State {
        State::from_u8(self.state.load(Relaxed))
    }

    pub(crate) fn set_state(&self, state: State) {
        self.state.store(state as u8, Relaxed);
    }

    pub(crate) fn hash(&self) -> SequenceHash {
        SequenceHash(self.hash.load(Relaxed))
    }

    pub(crate) fn parent(&self) -> Option<SequenceHash> {
        (self.has_parent.load(Relaxed) != 0).then(|| SequenceHash(self.parent.load(Relaxed)))
    }

    pub(crate) fn set_names(&self, hash: SequenceHash, parent: Option<SequenceHash>) {
        self.hash.store(hash.0, Relaxed);
        self.parent.store(parent.map_or(0, |p| p.0), Relaxed);
        self.has_parent.store(u8::from(parent.is_some()), Relaxed);
    }
}

/// A fixed array of entries.
pub(crate) fn new_slab(capacity: usize) -> Box<[Entry]> {
    (0..capacity).map(|_| Entry::default()).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn entry_is_compact() {
        assert_eq!(std::mem::size_of::<super::Entry>(), 48);
    }
}
