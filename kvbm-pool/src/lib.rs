//! # kvbm-pool
//!
//! Where logical blocks meet physical memory: per-tier block pools with a
//! registry by sequence hash, eviction policies behind one trait, prefix
//! matching, KV events, and the tier engine that offloads blocks G1→G2→G3,
//! matches a request's prefix across tiers and onboards it back, exposed to
//! an engine's scheduler through the slot API. It builds on kvbm-block for
//! the logical state and kvbm-transfer for moving bytes, and never talks to
//! the network; kvbm-dist spreads it over processes.
//!
//! ## The block pool
//!
//! [`BlockPool`] keeps the books of one tier: which of its `capacity`
//! blocks are free, which are in use, and which are cached (registered
//! under their sequence hash, evictable when nobody holds them). It owns
//! no memory: block `i` of the pool is block `i` of the tier's layout.
//! Blocks move through the typestate handles of
//! [`kvbm_block::lifecycle`]:
//!
//! ```
//! use kvbm_block::SequenceHash;
//! use kvbm_pool::{BlockPool, PoolConfig, Tier};
//!
//! let pool = BlockPool::new(PoolConfig::new(64, 16, Tier::G2)).unwrap();
//! let blocks = pool.allocate(2).unwrap();
//! let (h0, h1) = (SequenceHash(0xa), SequenceHash(0xb));
//! let complete = blocks
//!     .into_iter()
//!     .zip([(h0, None), (h1, Some(h0))])
//!     .map(|(b, (h, p))| b.complete(h, p).unwrap())
//!     .collect();
//! let held = pool.register(complete).unwrap();
//! drop(held); // now inactive: cached, evictable
//! let hit = pool.match_prefix(&[h0, h1, SequenceHash(0xc)]);
//! assert_eq!(hit.len(), 2);
//! ```
//!
//! Everything a hot path does takes each lock at most once per call, not
//! once per block; see the `core` module docs for the locking scheme.

mod audit;
mod clock;
mod config;
mod core;
mod error;
mod events;
mod gate;
pub mod ledger;
pub mod metrics;
pub mod policy;
mod pool;
pub mod rate_limit;
mod registry;
mod slab;
pub mod slot;
pub mod tier;

pub use audit::AuditError;
pub use config::{DuplicatePolicy, EvictionKind, PoolConfig, Tier};
pub use core::PoolCore;
pub use error::{PoolError, RegisterError};
pub use events::{KvEvent, KvEventBatch};
pub use policy::{BlockInfo, BlockRef, BlockView, EvictionPolicy, Victim};
pub use pool::{
    BlockPool, CompleteBlock, ImmutableBlock, ImmutableBlocks, MutableBlock, POLICY_SHARDS,
    PoolCounts, WeakBlock,
};
pub use slot::SlotManager;
pub use tier::{Dtype, KvShape, TierEngine, TierEngineBuilder, TierError, TierLayouts};
