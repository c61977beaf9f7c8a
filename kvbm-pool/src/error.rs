//! The pool's error type.

use kvbm_block::lifecycle::CompleteBlock;

use crate::core::PoolCore;

/// What a pool operation can fail with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    /// The configuration cannot build a pool.
    #[error("invalid pool configuration: {0}")]
    InvalidConfig(&'static str),
    /// Not enough free or evictable blocks; nothing was handed out.
    #[error("cannot allocate {requested} blocks: {free} free, {evictable} evictable")]
    Exhausted {
        /// Blocks asked for.
        requested: usize,
        /// Free blocks at the time (after any eviction the call did).
        free: usize,
        /// Inactive blocks the policy could not or did not evict.
        evictable: usize,
    },
}

/// A registration that was refused: every block comes back unregistered.
#[derive(Debug, thiserror::Error)]
#[error("{} blocks belong to another pool: nothing was registered", .blocks.len())]
pub struct RegisterError {
    /// The blocks handed to the call, unchanged.
    pub blocks: Vec<CompleteBlock<PoolCore>>,
}
