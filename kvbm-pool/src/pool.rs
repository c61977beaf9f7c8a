//! The public face of a pool: [`BlockPool`] and its handle types.

use std::sync::Arc;
use std::sync::mpsc::Receiver;

use kvbm_block::SequenceHash;
use kvbm_block::lifecycle;

use crate::config::{EvictionKind, PoolConfig, Tier};
use crate::core::{PoolCore, PoolState, thread_shard};
use crate::error::{PoolError, RegisterError};
use crate::events::{KvEvent, KvEventBatch};
use crate::policy::{EvictionPolicy, FrequencyPolicy, LeafFirstPolicy, LruPolicy, Prioritized};

/// A block being filled (see [`lifecycle::MutableBlock`]).
pub type MutableBlock = lifecycle::MutableBlock<PoolCore>;
/// A full, hashed block ready to register (see [`lifecycle::CompleteBlock`]).
pub type CompleteBlock = lifecycle::CompleteBlock<PoolCore>;
/// A registered, shareable block (see [`lifecycle::ImmutableBlock`]).
pub type ImmutableBlock = lifecycle::ImmutableBlock<PoolCore>;
/// Registered blocks held together (see [`lifecycle::ImmutableBlocks`]).
pub type ImmutableBlocks = lifecycle::ImmutableBlocks<PoolCore>;
/// A weak reference to a registered block (see [`lifecycle::WeakBlock`]).
pub type WeakBlock = lifecycle::WeakBlock<PoolCore>;

/// Block counts of a pool. `free + active + inactive == capacity`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PoolCounts {
    /// Blocks in the pool.
    pub capacity: usize,
    /// Blocks on the free list.
    pub free: usize,
    /// Blocks in use: being filled, complete, or registered and held.
    pub active: usize,
    /// Registered blocks nobody holds: evictable, still matchable.
    pub inactive: usize,
}

/// The block pool of one tier: fixed capacity, `Send + Sync`, cheap to
/// clone (clones share the pool).
///
/// Block ids are `0..capacity` and are the blocks' indices in the tier's
/// memory layout.
#[derive(Clone, Debug)]
pub struct BlockPool {
    core: Arc<PoolState>,
    /// The stores handed to handles, one per thread shard (see
    /// [`PoolCore`]).
    stores: Arc<[Arc<PoolCore>]>,
}

/// Stores per pool: handles made on different threads count their
/// references on different cache lines.
const STORES: usize = 4;

/// Policy instances a built-in shardable policy runs as.
pub const POLICY_SHARDS: usize = 4;

/// Builds one shard of the policy a configuration names.
fn policy_for(config: &PoolConfig, shards: usize) -> Box<dyn EvictionPolicy> {
    let capacity = config.capacity.div_ceil(shards);
    let kind = config.eviction;
    let make = move |cap: usize| -> Box<dyn EvictionPolicy> {
        match kind {
            EvictionKind::Lru => Box::new(LruPolicy::with_capacity(cap)),
            EvictionKind::LeafFirst => Box::new(LeafFirstPolicy::with_capacity(cap)),
            EvictionKind::Frequency { sample } => Box::new(FrequencyPolicy::new(cap, sample)),
        }
    };
    if config.priorities {
        // Levels grow on demand instead of each reserving the whole pool.
        Box::new(Prioritized::new(Box::new(move || make(0))))
    } else {
        make(capacity)
    }
}

impl BlockPool {
    /// A pool with the policy `config` names. LRU and leaf-first (with or
    /// without priorities) run as [`POLICY_SHARDS`] instances so threads
    /// releasing blocks do not share one queue; the frequency policy keeps
    /// one shared sketch, so it runs as one.
    pub fn new(config: PoolConfig) -> Result<Self, PoolError> {
        let shards = match config.eviction {
            EvictionKind::Frequency { .. } => 1,
            EvictionKind::Lru | EvictionKind::LeafFirst => POLICY_SHARDS,
        };
        let policies = (0..shards).map(|_| policy_for(&config, shards)).collect();
        Self::from_state(PoolState::new(&config, policies)?)
    }

    /// A pool with a policy of your own (`config.eviction` and
    /// `config.priorities` are ignored).
    pub fn with_policy(
        config: PoolConfig,
        policy: Box<dyn EvictionPolicy>,
    ) -> Result<Self, PoolError> {
        Self::from_state(PoolState::new(&config, vec![policy])?)
    }

    fn from_state(state: PoolState) -> Result<Self, PoolError> {
        let core = Arc::new(state);
        let stores = (0..STORES)
            .map(|_| {
                Arc::new(PoolCore {
                    state: Arc::clone(&core),
                })
            })
            .collect();
        Ok(Self { core, stores })
    }

    /// The calling thread's store, for a new handle.
    fn store(&self) -> Arc<PoolCore> {
        Arc::clone(&self.stores[thread_shard(self.stores.len())])
    }

    /// Any store of this pool, to check which pool a block belongs to
    /// (stores of one pool compare equal).
    fn any_store(&self) -> &Arc<PoolCore> {
        &self.stores[0]
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.core.capacity()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.core.block_size
    }

    /// The tier named in this pool's events.
    pub fn tier(&self) -> Tier {
        self.core.tier
    }

    /// `n` blocks to fill: free blocks first, then evicted inactive ones.
    /// All or nothing: on error no block is handed out.
    pub fn allocate(&self, n: usize) -> Result<Vec<MutableBlock>, PoolError> {
        if n > self.capacity() {
            return Err(PoolError::Exhausted {
                requested: n,
                free: self.counts().free,
                evictable: self.core.inactive_count(),
            });
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let ids = self.core.take(n)?;
        let store = self.store();
        Ok(ids
            .into_iter()
            .map(|id| MutableBlock::from_store(Arc::clone(&store), id))
            .collect())
    }

    /// Blocks `ids`, those of them that are free, in `ids`' order: for a
    /// tier whose memory kept its blocks across a restart, so each is
    /// registered again in the slot that holds its bytes.
    pub fn allocate_ids(&self, ids: &[u32]) -> Vec<MutableBlock> {
        let store = self.store();
        self.core
            .take_ids(ids)
            .into_iter()
            .map(|id| MutableBlock::from_store(Arc::clone(&store), id))
            .collect()
    }

    /// Registers complete blocks (in order: a parent before its children)
    /// and returns a held handle per block, in the same order. A hash that is
    /// already registered is deduplicated per the pool's
    /// [`DuplicatePolicy`](crate::DuplicatePolicy). Blocks of another pool
    /// refuse the whole call and come back in the error.
    pub fn register(&self, blocks: Vec<CompleteBlock>) -> Result<ImmutableBlocks, RegisterError> {
        if blocks.iter().any(|b| !b.belongs_to(self.any_store())) {
            return Err(RegisterError { blocks });
        }
        let parts: Vec<_> = blocks
            .into_iter()
            .filter_map(lifecycle::CompleteBlock::into_parts)
            .collect();
        let ids = self.core.register(&parts);
        drop(parts);
        Ok(ImmutableBlocks::from_store(self.store(), ids))
    }

    /// Registers one block (see [`register`](Self::register)).
    pub fn register_block(&self, block: CompleteBlock) -> Result<ImmutableBlock, RegisterError> {
        if !block.belongs_to(self.any_store()) {
            return Err(RegisterError {
                blocks: vec![block],
            });
        }
        let mut held = self.register(vec![block])?.into_blocks();
        held.pop().ok_or(RegisterError { blocks: Vec::new() })
    }

    /// The longest prefix of `hashes` whose blocks are all cached, held
    /// (inactive blocks become active). Contiguous only: it stops at the
    /// first hash that is not cached.
    pub fn match_prefix(&self, hashes: &[SequenceHash]) -> ImmutableBlocks {
        let ids = self.core.match_prefix(hashes);
        if ids.is_empty() {
            return ImmutableBlocks::empty();
        }
        ImmutableBlocks::from_store(self.store(), ids)
    }

    /// How many leading `hashes` are cached, without holding or reactivating
    /// anything.
    pub fn cached_prefix_len(&self, hashes: &[SequenceHash]) -> usize {
        self.core.cached_prefix_len(hashes)
    }

    /// Whether `hash` is cached.
    pub fn contains(&self, hash: SequenceHash) -> bool {
        self.core.cached_prefix_len(std::slice::from_ref(&hash)) == 1
    }

    /// Marks cached inactive blocks among `hashes` as just used (they move
    /// to the back of the eviction order); returns how many are cached.
    pub fn touch(&self, hashes: &[SequenceHash]) -> usize {
        self.core.touch(hashes)
    }

    /// Sets a cached block's priority (0–100, higher is kept longer; larger
    /// values clamp to 100). `false` when `hash` is not cached.
    pub fn set_priority(&self, hash: SequenceHash, priority: u8) -> bool {
        self.core.set_priority(hash, priority)
    }

    /// Evicts up to `n` inactive blocks to the free list now; returns how
    /// many were evicted.
    pub fn evict(&self, n: usize) -> usize {
        self.core.evict(n)
    }

    /// Evicts up to `n` inactive blocks and hands out their slots, to be
    /// reused by the caller only: the free list's other blocks stay free.
    /// For saving the victims' bytes before anyone overwrites them.
    pub fn evict_to_allocated(&self, n: usize) -> Vec<MutableBlock> {
        let ids = self.core.evict_taken(n);
        let store = self.store();
        ids.into_iter()
            .map(|id| MutableBlock::from_store(Arc::clone(&store), id))
            .collect()
    }

    /// Admission: whether a block named `hash` is worth caching now. Always
    /// yes while free blocks remain; otherwise the policy compares it with
    /// the block it would evict.
    pub fn admit(&self, hash: SequenceHash) -> bool {
        self.core.admit(hash)
    }

    /// Current counts. Exact when no other thread is mid-operation; under
    /// concurrency a snapshot that may lag by in-flight batches.
    pub fn counts(&self) -> PoolCounts {
        let capacity = self.capacity();
        let free = self.core.free.lock().len();
        let inactive = self.core.inactive_count().min(capacity - free);
        PoolCounts {
            capacity,
            free,
            active: capacity - free - inactive,
            inactive,
        }
    }

    /// Subscribes to this pool's KV events. The first batch is a snapshot of
    /// every cached block (as `Stored` events); later batches follow the
    /// pool's changes in order.
    pub fn subscribe(&self) -> Receiver<KvEventBatch> {
        let gate = self.core.gate.write();
        let snapshot = self
            .core
            .registry
            .ids()
            .map(|id| {
                let e = self.core.slab.entry(id);
                KvEvent::Stored {
                    hash: e.hash(),
                    parent: e.parent(),
                    tier: self.core.tier,
                }
            })
            .collect();
        let rx = self.core.events.subscribe(snapshot);
        drop(gate);
        rx
    }

    /// Checks every internal invariant (expensive: scans the whole pool
    /// under its locks; for tests and debugging) and returns exact counts.
    pub fn audit(&self) -> Result<PoolCounts, crate::audit::AuditError> {
        crate::audit::audit(&self.core)
    }
}
