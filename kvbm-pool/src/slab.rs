//! The per-block state: compact entries indexed by block id.
//!
//! Each block has a *hot* part (hash, holder count, state, eviction stamp
//! and priority: 32 bytes, two to a cache line), which is all a prefix
//! match and a release read and write, and a *cold* part (lineage) that
//! only registration and eviction touch. Splitting them keeps the match path's
//! working set small.
//!
//! Every field is an atomic so that the entries can live outside the locks:
//! holder counts change with a single atomic operation under the shared
//! registry lock (or none at all for a clone), which is what lets several
//! threads match and release at once. The other fields only change under
//! the exclusive registry lock (or the policy lock, for stamps), so relaxed
//! loads and stores suffice for them: the locks order them.

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

/// What a match and a release touch (32 bytes, two to a cache line).
#[derive(Default)]
#[repr(align(32))]
pub(crate) struct Hot {
    pub(crate) hash: AtomicU64,
    /// The release stamp of the block's latest release (see the `clock`
    /// module).
    pub(crate) stamp: AtomicU64,
    /// Holders (immutable handles) of a registered or duplicate block.
    pub(crate) holders: AtomicU32,
    state: AtomicU8,
    pub(crate) priority: AtomicU8,
}

/// What registration and eviction touch (32 bytes).
#[derive(Default)]
pub(crate) struct Cold {
    pub(crate) parent: AtomicU64,
    /// Registered blocks whose parent link points here.
    pub(crate) children: AtomicU32,
    pub(crate) parent_id: AtomicU32,
    /// The parent's generation when the link was made: a stale link (the
    /// parent was evicted and its slot reused) is recognised and ignored.
    pub(crate) parent_gen: AtomicU32,
    /// Bumped each time the block leaves the registry.
    pub(crate) generation: AtomicU32,
    has_parent: AtomicU8,
}

/// One block's entry: both parts.
#[derive(Clone, Copy)]
pub(crate) struct Entry<'a> {
    pub(crate) hot: &'a Hot,
    pub(crate) cold: &'a Cold,
}

impl Entry<'_> {
    pub(crate) fn state(&self) -> State {
        State::from_u8(self.hot.state.load(Relaxed))
    }

    pub(crate) fn set_state(&self, state: State) {
        self.hot.state.store(state as u8, Relaxed);
    }

    pub(crate) fn hash(&self) -> SequenceHash {
        SequenceHash(self.hot.hash.load(Relaxed))
    }

    pub(crate) fn parent(&self) -> Option<SequenceHash> {
        (self.cold.has_parent.load(Relaxed) != 0)
            .then(|| SequenceHash(self.cold.parent.load(Relaxed)))
    }

    pub(crate) fn set_names(&self, hash: SequenceHash, parent: Option<SequenceHash>) {
        self.hot.hash.store(hash.0, Relaxed);
        self.cold.parent.store(parent.map_or(0, |p| p.0), Relaxed);
        self.cold
            .has_parent
            .store(u8::from(parent.is_some()), Relaxed);
    }
}

/// All entries of a pool.
pub(crate) struct Slab {
    hot: Box<[Hot]>,
    cold: Box<[Cold]>,
}

impl Slab {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            hot: (0..capacity).map(|_| Hot::default()).collect(),
            cold: (0..capacity).map(|_| Cold::default()).collect(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.hot.len()
    }

    /// The hot part of block `id` (which must be below the capacity).
    pub(crate) fn hot(&self, id: u32) -> &Hot {
        &self.hot[id as usize]
    }

    /// Whether block `id` exists and is registered under `hash` (which
    /// makes it the registry's primary for `hash`).
    pub(crate) fn is_registered_as(&self, id: u32, hash: SequenceHash) -> bool {
        self.hot.get(id as usize).is_some_and(|h| {
            h.hash.load(Relaxed) == hash.0 && h.state.load(Relaxed) == State::Registered as u8
        })
    }

    /// Block `id`'s entry (which must be below the capacity).
    pub(crate) fn entry(&self, id: u32) -> Entry<'_> {
        Entry {
            hot: &self.hot[id as usize],
            cold: &self.cold[id as usize],
        }
    }

    /// Block `id`'s entry, if `id` is in range.
    pub(crate) fn get(&self, id: u32) -> Option<Entry<'_>> {
        Some(Entry {
            hot: self.hot.get(id as usize)?,
            cold: self.cold.get(id as usize)?,
        })
    }

    /// Every entry, in id order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = Entry<'_>> {
        self.hot
            .iter()
            .zip(self.cold.iter())
            .map(|(hot, cold)| Entry { hot, cold })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn entries_are_compact() {
        assert_eq!(std::mem::size_of::<super::Hot>(), 32);
        assert_eq!(std::mem::size_of::<super::Cold>(), 32);
    }
}
