//! Registered blocks: shared immutable handles, batches of them, and weak
//! handles that can be upgraded while the block stays cached.

use std::fmt;
use std::sync::{Arc, Weak};

use super::BlockStore;
use crate::SequenceHash;

/// A registered block: its contents are published under its sequence hash
/// and may be shared. Cloning adds a holder; dropping the last holder makes
/// the block inactive (evictable, still matchable).
pub struct ImmutableBlock<S: BlockStore> {
    store: Arc<S>,
    id: u32,
    hash: SequenceHash,
}

impl<S: BlockStore> ImmutableBlock<S> {
    /// Wraps block `id` of `store`, which already counted this holder.
    ///
    /// For pool implementations: the handle releases `id` through
    /// [`BlockStore::release`] when dropped.
    pub fn from_store(store: Arc<S>, id: u32, hash: SequenceHash) -> Self {
        Self { store, id, hash }
    }

    /// The block's index in its pool, which is its index in the tier's
    /// memory layout.
    pub fn block_id(&self) -> u32 {
        self.id
    }

    /// The sequence hash naming the block.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.hash
    }

    /// A weak handle: does not keep the block active, and can be upgraded
    /// while the block is still registered.
    pub fn downgrade(&self) -> WeakBlock<S> {
        WeakBlock {
            store: Arc::downgrade(&self.store),
            id: self.id,
            hash: self.hash,
        }
    }

    /// Whether the block belongs to `store`.
    pub fn belongs_to(&self, store: &Arc<S>) -> bool {
        Arc::ptr_eq(&self.store, store) || self.store.same_store(store)
    }
}

impl<S: BlockStore> Clone for ImmutableBlock<S> {
    fn clone(&self) -> Self {
        self.store.retain(self.id);
        Self {
            store: Arc::clone(&self.store),
            id: self.id,
            hash: self.hash,
        }
    }
}

impl<S: BlockStore> Drop for ImmutableBlock<S> {
    fn drop(&mut self) {
        self.store.release(&[self.id]);
    }
}

impl<S: BlockStore> fmt::Debug for ImmutableBlock<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImmutableBlock")
            .field("id", &self.id)
            .field("hash", &self.hash)
            .finish()
    }
}

/// A weak reference to a registered block.
pub struct WeakBlock<S: BlockStore> {
    store: Weak<S>,
    id: u32,
    hash: SequenceHash,
}

impl<S: BlockStore> WeakBlock<S> {
    /// The block's index in its pool.
    pub fn block_id(&self) -> u32 {
        self.id
    }

    /// The sequence hash of the block it refers to.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.hash
    }

    /// A strong handle again, if the pool still exists and the block is
    /// still registered under the same hash (active or inactive; an inactive
    /// block becomes active).
    pub fn upgrade(&self) -> Option<ImmutableBlock<S>> {
        let store = self.store.upgrade()?;
        if store.try_upgrade(self.id, self.hash) {
            Some(ImmutableBlock {
                store,
                id: self.id,
                hash: self.hash,
            })
        } else {
            None
        }
    }
}

impl<S: BlockStore> Clone for WeakBlock<S> {
    fn clone(&self) -> Self {
        Self {
            store: Weak::clone(&self.store),
            id: self.id,
            hash: self.hash,
        }
    }
}

impl<S: BlockStore> fmt::Debug for WeakBlock<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeakBlock")
            .field("id", &self.id)
            .field("hash", &self.hash)
            .finish()
    }
}

/// Many registered blocks of one pool held together, in order (a matched
/// prefix, a registered sequence): one reference to the pool for all of
/// them, and one pool call to release them all.
pub struct ImmutableBlocks<S: BlockStore> {
    store: Option<Arc<S>>,
    ids: Vec<u32>,
}

impl<S: BlockStore> ImmutableBlocks<S> {
    /// No blocks.
    pub fn empty() -> Self {
        Self {
            store: None,
            ids: Vec::new(),
        }
    }

    /// Wraps blocks `ids` of `store`, which already counted one holder per
    /// entry.
    ///
    /// For pool implementations: the batch releases `ids` through
    /// [`BlockStore::release`] when dropped.
    pub fn from_store(store: Arc<S>, ids: Vec<u32>) -> Self {
        if ids.is_empty() {
            return Self::empty();
        }
        Self {
            store: Some(store),
            ids,
        }
    }

    /// How many blocks it holds.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The blocks' indices in their pool, in order.
    pub fn block_ids(&self) -> &[u32] {
        &self.ids
    }

    /// The sequence hash of the `index`-th block.
    pub fn sequence_hash(&self, index: usize) -> Option<SequenceHash> {
        let id = *self.ids.get(index)?;
        self.store.as_ref().map(|s| s.sequence_hash(id))
    }

    /// A separate handle on the `index`-th block (one more holder).
    pub fn get(&self, index: usize) -> Option<ImmutableBlock<S>> {
        let id = *self.ids.get(index)?;
        let store = self.store.as_ref()?;
        store.retain(id);
        Some(ImmutableBlock {
            store: Arc::clone(store),
            id,
            hash: store.sequence_hash(id),
        })
    }

    /// Releases every block from `len` on (e.g. the last block of a fully
    /// matched prompt, which the engine must recompute).
    pub fn truncate(&mut self, len: usize) {
        if len >= self.ids.len() {
            return;
        }
        if let Some(store) = &self.store {
            store.release(&self.ids[len..]);
        }
        self.ids.truncate(len);
    }

    /// Splits into one handle per block, in order.
    pub fn into_blocks(mut self) -> Vec<ImmutableBlock<S>> {
        let Some(store) = self.store.take() else {
            return Vec::new();
        };
        std::mem::take(&mut self.ids)
            .into_iter()
            .map(|id| ImmutableBlock {
                store: Arc::clone(&store),
                id,
                hash: store.sequence_hash(id),
            })
            .collect()
    }

    /// Appends a block of the same pool; hands it back if it belongs to
    /// another pool.
    pub fn push(&mut self, block: ImmutableBlock<S>) -> Result<(), ImmutableBlock<S>> {
        match &self.store {
            Some(store) if !store.same_store(&block.store) => return Err(block),
            Some(_) => {}
            None => self.store = Some(Arc::clone(&block.store)),
        }
        // The batch takes its own holder count; the handle then releases
        // its one as it drops.
        block.store.retain(block.id);
        self.ids.push(block.id);
        drop(block);
        Ok(())
    }
}

impl<S: BlockStore> Default for ImmutableBlocks<S> {
    fn default() -> Self {
        Self::empty()
    }
}

impl<S: BlockStore> Drop for ImmutableBlocks<S> {
    fn drop(&mut self) {
        if let Some(store) = self.store.take() {
            store.release(&self.ids);
        }
    }
}

impl<S: BlockStore> fmt::Debug for ImmutableBlocks<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImmutableBlocks")
            .field("ids", &self.ids)
            .finish()
    }
}
