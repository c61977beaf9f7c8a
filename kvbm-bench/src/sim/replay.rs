//! The replay loop: the one definition of "hit rate" every simulator and
//! kvbm's own replay benchmark share.
//!
//! For each request, in trace order:
//! 1. **lookup**: walk the prompt blocks in order and ask the cache which
//!    tier holds each one; stop at the first miss. Hits are *prefix
//!    contiguous*: after a request's first miss, its later blocks count as
//!    misses even if cached, because an engine can only reuse KV for a
//!    prefix of the prompt.
//! 2. **record**: hand the whole request to the cache, which inserts (or
//!    refreshes) every block of it; admission is the cache's choice.
//!
//! Hit rate = prompt blocks hit ÷ prompt blocks. Capacities are
//! `floor(fraction × unique blocks of the trace)`.

use kvbm_testkit::trace::{BlockId, Request};

/// A memory tier that served a hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// GPU memory, owned by the engine (also the one cache of a single-tier
    /// simulator).
    G1 = 0,
    /// Pinned host memory.
    G2 = 1,
    /// Local disk.
    G3 = 2,
}

impl Tier {
    /// All tiers, fastest first.
    pub const ALL: [Tier; 3] = [Tier::G1, Tier::G2, Tier::G3];
}

/// A request as a simulator sees it while recording.
#[derive(Debug, Clone, Copy)]
pub struct RequestCtx<'a> {
    /// Position of the request in the trace.
    pub index: usize,
    /// Position of its first block in the trace's flattened block stream
    /// (the sum of the lengths of all earlier requests).
    pub first_position: usize,
    /// The request itself.
    pub request: &'a Request,
    /// Blocks of its prompt that hit (the contiguous prefix).
    pub hit_blocks: usize,
    /// Whether its last block is only partly filled (for the trace's block
    /// size); engines never reuse a partial block.
    pub last_block_partial: bool,
}

impl RequestCtx<'_> {
    /// The prompt's block ids.
    pub fn blocks(&self) -> &[BlockId] {
        &self.request.hash_ids
    }

    /// The blocks an engine would register: all but a partial last block.
    pub fn full_blocks(&self) -> &[BlockId] {
        let b = self.blocks();
        if self.last_block_partial && !b.is_empty() {
            &b[..b.len() - 1]
        } else {
            b
        }
    }
}

/// A cache under simulation.
pub trait CacheSim {
    /// Which tier holds `block`, or `None` on a miss. Called in prompt
    /// order for the contiguous prefix and the first miss only.
    fn lookup(&mut self, block: BlockId) -> Option<Tier>;

    /// Inserts or refreshes the request's blocks after its lookup.
    fn record(&mut self, ctx: &RequestCtx<'_>);
}

/// Outcome of one replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Requests replayed.
    pub requests: u64,
    /// Prompt blocks looked up.
    pub block_references: u64,
    /// Hits served by each tier, indexed by `Tier as usize`.
    pub hits: [u64; 3],
}

impl ReplayStats {
    /// All hits.
    pub fn total_hits(&self) -> u64 {
        self.hits.iter().sum()
    }

    /// Hits ÷ block references, in percent.
    pub fn hit_rate_pct(&self) -> f64 {
        self.pct(self.total_hits())
    }

    /// Hits served by `tier` ÷ block references, in percent.
    pub fn tier_rate_pct(&self, tier: Tier) -> f64 {
        self.pct(self.hits[tier as usize])
    }

    fn pct(&self, n: u64) -> f64 {
        if self.block_references == 0 {
            0.0
        } else {
            100.0 * n as f64 / self.block_references as f64
        }
    }
}

/// `floor(fraction × unique_blocks)`, the capacity convention of the
/// replay benchmark.
pub fn capacity_for(fraction: f64, unique_blocks: usize) -> usize {
    (fraction * unique_blocks as f64).floor().max(0.0) as usize
}

/// Replays `requests` against `cache` with blocks of `block_tokens` tokens.
pub fn replay<C: CacheSim + ?Sized>(
    requests: &[Request],
    block_tokens: u32,
    cache: &mut C,
) -> ReplayStats {
    let mut stats = ReplayStats::default();
    let mut position = 0;
    for (index, request) in requests.iter().enumerate() {
        let blocks = &request.hash_ids;
        let mut hit_blocks = 0;
        for &b in blocks {
            match cache.lookup(b) {
                Some(tier) => {
                    stats.hits[tier as usize] += 1;
                    hit_blocks += 1;
                }
                None => break,
            }
        }
        stats.requests += 1;
        stats.block_references += blocks.len() as u64;
        let ctx = RequestCtx {
            index,
            first_position: position,
            request,
            hit_blocks,
            last_block_partial: request.last_block_partial(block_tokens),
        };
        cache.record(&ctx);
        position += blocks.len();
    }
    stats
}

impl<C: CacheSim + ?Sized> CacheSim for &mut C {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        (**self).lookup(block)
    }

    fn record(&mut self, ctx: &RequestCtx<'_>) {
        (**self).record(ctx)
    }
}
