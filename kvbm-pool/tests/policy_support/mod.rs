//! Shared fixtures of the reuse-score policy tests: a G2 pool ranked by a
//! use history, and storing a block in it the way the tier engine does
//! (asking the policy only when the pool is full).
#![allow(dead_code)] // Each test binary uses its own part.

use kvbm_block::SequenceHash;
use kvbm_pool::policy::{ReuseScorePolicy, SharedHistory};
use kvbm_pool::{BlockPool, PoolConfig, Tier};

/// The block hash of `x`.
pub fn h(x: u64) -> SequenceHash {
    SequenceHash(x)
}

/// A G2 pool of `capacity` blocks ranked by `history`.
pub fn pool(history: &SharedHistory, capacity: usize) -> BlockPool {
    let policy = Box::new(ReuseScorePolicy::for_tier(history.clone(), Tier::G2));
    BlockPool::with_policy(PoolConfig::new(capacity, 4, Tier::G2), policy).unwrap()
}

/// Stores `x` (as one inactive block) if the pool admits it; true when
/// stored.
pub fn store(pool: &BlockPool, x: u64) -> bool {
    if pool.contains(h(x)) {
        return false;
    }
    if pool.counts().free == 0 && !pool.admit(h(x)) {
        return false;
    }
    let Ok(mut blocks) = pool.allocate(1) else {
        return false;
    };
    let b = blocks.pop().unwrap().complete(h(x), None).unwrap();
    drop(pool.register(vec![b]).unwrap());
    true
}
