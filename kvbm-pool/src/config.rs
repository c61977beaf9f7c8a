//! How a pool is built: capacity, tier, eviction policy, duplicate policy.

/// The memory tier a pool keeps the books for; carried by every KV event so
/// a router can tell what each tier holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// G1: GPU memory (the engine's KV tensors).
    G1,
    /// G2: pinned host memory.
    G2,
    /// G3: local disk.
    G3,
    /// G4: remote peers.
    G4,
}

/// What registering a hash that is already registered does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DuplicatePolicy {
    /// Hand out the block already registered and return the new one to the
    /// free list: one copy of each prefix per tier.
    #[default]
    ReuseExisting,
    /// Keep the new block as an unmatchable duplicate (its holder keeps its
    /// own copy, e.g. because the engine already points at it); it returns
    /// to the free list when its last handle drops. The registry still
    /// names one primary per hash.
    KeepDuplicate,
}

/// Which built-in eviction policy a pool uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictionKind {
    /// Least recently released first.
    #[default]
    Lru,
    /// Least recently released *leaf* first: a block is never evicted while
    /// a block built on it is still registered, so cached prefixes stay
    /// whole.
    LeafFirst,
    /// TinyLFU-style: among the `sample` least recently released blocks,
    /// the one seen least often (count-min sketch with aging) goes first;
    /// the sketch also answers admission questions.
    Frequency {
        /// How many LRU candidates each eviction compares (at least 1).
        sample: usize,
    },
}

/// A pool's construction parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Number of blocks; block ids are `0..capacity` (at most `u32::MAX`).
    pub capacity: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The tier named in KV events.
    pub tier: Tier,
    /// The eviction policy.
    pub eviction: EvictionKind,
    /// Whether engine-given per-block priorities (0–100, higher is kept
    /// longer) order eviction before the policy does.
    pub priorities: bool,
    /// What a second registration of a hash does.
    pub duplicates: DuplicatePolicy,
}

impl PoolConfig {
    /// A pool of `capacity` blocks of `block_size` tokens for `tier`, with
    /// LRU eviction, no priorities, duplicates reusing the existing block.
    pub fn new(capacity: usize, block_size: usize, tier: Tier) -> Self {
        Self {
            capacity,
            block_size,
            tier,
            eviction: EvictionKind::Lru,
            priorities: false,
            duplicates: DuplicatePolicy::ReuseExisting,
        }
    }

    /// Sets the eviction policy.
    pub fn eviction(mut self, eviction: EvictionKind) -> Self {
        self.eviction = eviction;
        self
    }

    /// Orders eviction by engine-given priority first.
    pub fn priorities(mut self, on: bool) -> Self {
        self.priorities = on;
        self
    }

    /// Sets the duplicate policy.
    pub fn duplicates(mut self, duplicates: DuplicatePolicy) -> Self {
        self.duplicates = duplicates;
        self
    }
}
