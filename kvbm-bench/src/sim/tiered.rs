//! Multi-tier simulation: the engine's G1 in front of kvbm's G2 and G3.
//!
//! G1 is the engine's GPU prefix cache: the engine inserts every block of
//! every request it runs, and evicts by recency, deepest blocks first
//! (vLLM frees a finished request's blocks tail-first), never a block of
//! the request it is admitting unless that request alone overflows G1.
//! Whether a request's partial last block stays cached after it is the
//! engine's choice ([`G1Keeps`]). kvbm does not choose what G1 holds; it
//! sees every request and every block G1 evicts, and decides what G2 and
//! G3 admit and evict: that is a [`KvbmTiers`] policy.
//!
//! A lookup walks the prompt and, for each block, asks G1 first, then
//! kvbm; the first tier holding the block serves it, and the walk stops at
//! the first block no tier holds. The replay then reports hits per tier.

use super::lru::{LruSim, TouchOrder};
use super::replay::{CacheSim, RequestCtx, Tier, capacity_for};
use kvbm_testkit::trace::{BlockId, Request};

/// Capacities of the three tiers, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierCapacities {
    /// Engine GPU cache.
    pub g1: usize,
    /// kvbm host memory.
    pub g2: usize,
    /// kvbm disk.
    pub g3: usize,
}

impl TierCapacities {
    /// Each tier gets `floor(fraction × unique_blocks)` blocks.
    pub fn from_fractions(g1: f64, g2: f64, g3: f64, unique_blocks: usize) -> Self {
        Self {
            g1: capacity_for(g1, unique_blocks),
            g2: capacity_for(g2, unique_blocks),
            g3: capacity_for(g3, unique_blocks),
        }
    }

    /// Sum of all tiers.
    pub fn total(&self) -> usize {
        self.g1 + self.g2 + self.g3
    }
}

/// kvbm's admission and eviction policy over G2 and G3.
pub trait KvbmTiers {
    /// Which of kvbm's tiers holds `block` (G2 or G3), if any. Called only
    /// for blocks G1 does not hold, in prompt order, up to the first miss.
    fn lookup(&mut self, block: BlockId) -> Option<Tier>;

    /// Called after each request's lookup, once the engine has inserted the
    /// request's blocks into G1; `g1_evicted` are the blocks G1 evicted to
    /// make room, in eviction order (the moment kvbm can still copy them).
    fn record(&mut self, ctx: &RequestCtx<'_>, g1_evicted: &[BlockId]);

    /// Blocks held in (G2, G3), for checking capacity invariants.
    fn occupancy(&self) -> (usize, usize);

    /// Every block kvbm holds and its tier (for invariant checks and
    /// diagnostics; O(blocks held)).
    fn cached(&self) -> Vec<(BlockId, Tier)>;
}

/// Which of a request's blocks the engine's G1 keeps cached once the
/// request is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum G1Keeps {
    /// Every block, the partial last one included, as a prefix cache at
    /// token granularity would (the policy study's model).
    #[default]
    Every,
    /// Full blocks only, as in vLLM, whose prefix cache hashes full blocks
    /// only, and in kvbm-bench's replay: the partial last block takes a
    /// slot while its request runs, which is freed with the request, and
    /// kvbm never sees the block (the engine neither matches nor offers it).
    FullOnly,
}

/// The engine's G1 followed by kvbm's tiers under policy `K`.
#[derive(Debug, Clone)]
pub struct TieredSim<K> {
    g1: LruSim,
    keeps: G1Keeps,
    kvbm: K,
    /// With [`G1Keeps::FullOnly`], the request kvbm is shown: its full
    /// blocks (reused between requests).
    full: Request,
}

impl<K: KvbmTiers> TieredSim<K> {
    /// An engine G1 of `g1_capacity` blocks in front of `kvbm`, keeping
    /// every block ([`G1Keeps::Every`]).
    pub fn new(g1_capacity: usize, kvbm: K) -> Self {
        Self {
            g1: LruSim::with_order(g1_capacity, TouchOrder::LeafFirst),
            keeps: G1Keeps::Every,
            kvbm,
            full: Request {
                timestamp_ms: 0,
                input_length: 0,
                output_length: 0,
                hash_ids: Vec::new(),
            },
        }
    }

    /// The same with G1 keeping `keeps`.
    pub fn with_g1_keeping(mut self, keeps: G1Keeps) -> Self {
        self.keeps = keeps;
        self
    }

    /// The kvbm policy (for inspection).
    pub fn kvbm(&self) -> &K {
        &self.kvbm
    }

    /// Blocks held in G1.
    pub fn g1_len(&self) -> usize {
        self.g1.len()
    }

    /// Whether G1 holds `block`.
    pub fn g1_contains(&self, block: BlockId) -> bool {
        self.g1.contains(block)
    }
}

impl<K: KvbmTiers> CacheSim for TieredSim<K> {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        if self.g1.contains(block) {
            Some(Tier::G1)
        } else {
            self.kvbm.lookup(block)
        }
    }

    fn record(&mut self, ctx: &RequestCtx<'_>) {
        let partial = match (self.keeps, ctx.blocks().last()) {
            (G1Keeps::FullOnly, Some(&last)) if ctx.last_block_partial => Some(last),
            _ => None,
        };
        let Some(last) = partial else {
            let evicted = self.g1.touch_all(ctx.blocks());
            self.kvbm.record(ctx, evicted);
            return;
        };
        // The partial block takes a G1 slot while the request runs; kvbm
        // never sees it (the engine neither matches nor registers it), and
        // its slot is freed afterwards unless a full block of that id was
        // cached already.
        let cached = self.g1.contains(last);
        let evicted = self.g1.touch_all(ctx.blocks());
        let r = ctx.request;
        self.full.hash_ids.clear();
        self.full.hash_ids.extend_from_slice(ctx.full_blocks());
        self.full.timestamp_ms = r.timestamp_ms;
        // The prompt length stays the request's (no kvbm policy reads it).
        self.full.input_length = r.input_length;
        self.full.output_length = r.output_length;
        let full = RequestCtx {
            request: &self.full,
            last_block_partial: false,
            ..*ctx
        };
        self.kvbm.record(&full, evicted);
        if !cached {
            self.g1.remove(last);
        }
    }
}

/// How the LRU baseline feeds kvbm's tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LruFeed {
    /// Exclusive victim caches: G1's evictions enter G2, G2's enter G3; the
    /// blocks of each request are in G1 afterwards, so they leave kvbm.
    Victim,
    /// Write-through: every block of every request is refreshed in G2
    /// (inclusive of G1), G2's evictions enter G3, and a G3 hit moves the
    /// block back to G2.
    WriteThrough,
}

/// Baseline kvbm policy: plain LRU in G2 and G3, everything admitted.
#[derive(Debug, Clone)]
pub struct LruTiers {
    g2: LruSim,
    g3: LruSim,
    feed: LruFeed,
    hits: Vec<(BlockId, Tier)>,
    spill: Vec<BlockId>,
}

impl LruTiers {
    /// G2 and G3 of the given capacities, fed as `feed` says.
    pub fn new(g2: usize, g3: usize, feed: LruFeed) -> Self {
        Self {
            g2: LruSim::with_order(g2, TouchOrder::LeafFirst),
            g3: LruSim::with_order(g3, TouchOrder::LeafFirst),
            feed,
            hits: Vec::new(),
            spill: Vec::new(),
        }
    }

    fn admit_to_g2(&mut self, blocks: &[BlockId]) {
        self.spill.clear();
        self.spill.extend_from_slice(self.g2.touch_all(blocks));
        let spill = std::mem::take(&mut self.spill);
        self.g3.touch_all(&spill);
        self.spill = spill;
    }
}

impl KvbmTiers for LruTiers {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        let tier = if self.g2.contains(block) {
            Tier::G2
        } else if self.g3.contains(block) {
            Tier::G3
        } else {
            return None;
        };
        self.hits.push((block, tier));
        Some(tier)
    }

    fn record(&mut self, ctx: &RequestCtx<'_>, g1_evicted: &[BlockId]) {
        let hits = std::mem::take(&mut self.hits);
        match self.feed {
            LruFeed::Victim => {
                // The engine holds the request's blocks in G1 now.
                for &b in ctx.blocks() {
                    self.g2.remove(b);
                    self.g3.remove(b);
                }
                // G1 evicts its least recent first; G2 receives them in that
                // order so its own recency order stays consistent.
                for &b in g1_evicted {
                    self.admit_to_g2(&[b]);
                }
            }
            LruFeed::WriteThrough => {
                for &(b, tier) in &hits {
                    if tier == Tier::G3 {
                        self.g3.remove(b);
                    }
                }
                self.admit_to_g2(ctx.blocks());
            }
        }
        self.hits = hits;
        self.hits.clear();
    }

    fn occupancy(&self) -> (usize, usize) {
        (self.g2.len(), self.g3.len())
    }

    fn cached(&self) -> Vec<(BlockId, Tier)> {
        let g2 = self.g2.blocks().map(|b| (b, Tier::G2));
        g2.chain(self.g3.blocks().map(|b| (b, Tier::G3))).collect()
    }
}
