//! Block lifecycle as typestate RAII handles.
//!
//! A block of a pool is always in exactly one place: the free list, in the
//! hands of the engine while it fills it, or registered under its sequence
//! hash (held by someone, or cached and evictable). The handles here make
//! that bookkeeping impossible to get wrong from the outside:
//!
//! ```text
//!  allocate ──► MutableBlock ──complete(hash, parent)──► CompleteBlock
//!                   │   ▲ push/pop tokens                    │
//!                   │   └── reset                      register (pool)
//!                   ▼ drop: back to the free list            ▼
//!                                                 ImmutableBlock ◄─► WeakBlock
//!                                                  clone: shared     upgrade while cached
//!                                                  last drop: inactive (evictable, matchable)
//! ```
//!
//! Each transition consumes the previous handle, and a failed transition
//! hands the block back inside its error, so no block is ever lost or held
//! twice. Dropping a handle returns the block to the right place of its
//! pool through the [`BlockStore`] trait, which the pool implements; the
//! handles are generic over it, so the calls are static and inlined (no
//! virtual dispatch on the hot path).
//!
//! A block's id is its physical index in the tier's memory layout (block
//! `i` of the pool is block `i` of the layout), so every handle exposes
//! [`block_id`](MutableBlock::block_id).
//!
//! Matching returns many blocks at once; [`ImmutableBlocks`] holds them
//! behind one reference to the pool so that taking and dropping `L` blocks
//! costs one pool call each way, not `L`.

mod error;
mod immutable;
mod mutable;

pub use error::{CompleteError, CompleteErrorKind};
pub use immutable::{ImmutableBlock, ImmutableBlocks, WeakBlock};
pub use mutable::{CompleteBlock, CompleteParts, MutableBlock};

use crate::SequenceHash;

/// Default eviction priority of a block (TensorRT-LLM's default on its 0–100
/// scale). Higher priorities are kept longer.
pub const DEFAULT_PRIORITY: u8 = 35;

/// The pool side of the lifecycle: where handles go when they are dropped.
///
/// A pool implements it once; the handles call it. Ids are the indices of
/// the pool's blocks. Implementations must accept every id they handed out
/// exactly once per handle (the handles guarantee they never release a
/// block twice) and must not panic.
pub trait BlockStore: Send + Sync + 'static {
    /// Tokens per block: a mutable block accepts at most this many.
    fn block_size(&self) -> usize;

    /// Blocks that were allocated but never registered (mutable or complete
    /// handles dropped): they go back to the free list.
    fn release_unregistered(&self, ids: &[u32]);

    /// One more holder of a block that is already held by an immutable
    /// handle (a clone): the block stays active.
    fn retain(&self, id: u32);

    /// Immutable handles dropped: one holder fewer for each id (an id may
    /// repeat). A registered block whose last holder leaves becomes
    /// inactive: evictable, still matchable.
    fn release(&self, ids: &[u32]);

    /// A weak handle asks for its block back: succeeds (and counts one more
    /// holder) only while the block is still registered under `hash`.
    fn try_upgrade(&self, id: u32, hash: SequenceHash) -> bool;

    /// The sequence hash of a block currently held by an immutable handle.
    fn sequence_hash(&self, id: u32) -> SequenceHash;

    /// Whether `self` and `other` are the same pool. A pool may hand out
    /// several store objects (e.g. one per thread, so that threads do not
    /// share one reference count); handles compare stores with this.
    fn same_store(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

#[cfg(test)]
mod tests;
