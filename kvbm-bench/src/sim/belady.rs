//! Belady's offline optimum with bypass: the upper bound any admission and
//! eviction policy can reach at a given capacity.
//!
//! The simulator knows, for every position of the flattened block stream,
//! when the same block is referenced next (`u64::MAX` for never). Recording
//! a request walks its blocks in prompt order; for each block:
//! - cached: its next use is updated;
//! - not cached and the cache has room: admitted;
//! - not cached and full: if its next use is *not earlier* than the latest
//!   next use among cached blocks (ties and never-again blocks included),
//!   it is **bypassed** (not admitted); otherwise the cached block used
//!   farthest in the future is evicted and it is admitted.
//!
//! The hit accounting is the shared prefix-contiguous one; the optimum is
//! over block references, which is what the reference figures measure.

use std::collections::{BTreeSet, HashMap};

use super::replay::{CacheSim, RequestCtx, Tier};
use kvbm_testkit::trace::{BlockId, Request};

/// "Never referenced again".
pub const NEVER: u64 = u64::MAX;

/// For every position of the flattened block stream of `requests`, the
/// position of the next reference to the same block, or [`NEVER`].
pub fn next_uses(requests: &[Request]) -> Vec<u64> {
    let total: usize = requests.iter().map(|r| r.hash_ids.len()).sum();
    let mut next = vec![NEVER; total];
    let mut last_seen: HashMap<BlockId, u64> = HashMap::new();
    let mut pos = total;
    for r in requests.iter().rev() {
        for &b in r.hash_ids.iter().rev() {
            pos -= 1;
            if let Some(&n) = last_seen.get(&b) {
                next[pos] = n;
            }
            last_seen.insert(b, pos as u64);
        }
    }
    next
}

/// Belady's optimum with bypass over one cache.
#[derive(Debug, Clone)]
pub struct BeladySim {
    capacity: usize,
    next: Vec<u64>,
    /// Cached block → its next use.
    cached: HashMap<BlockId, u64>,
    /// (next use, block) of every cached block.
    by_next_use: BTreeSet<(u64, BlockId)>,
    /// Turn away blocks needed no sooner than every cached one (Belady's
    /// bypass); off, every block is admitted and only eviction is optimal.
    bypass: bool,
}

impl BeladySim {
    /// A cache of `capacity` blocks for replaying exactly `requests`.
    pub fn new(requests: &[Request], capacity: usize) -> Self {
        Self {
            capacity,
            next: next_uses(requests),
            cached: HashMap::with_capacity(capacity),
            by_next_use: BTreeSet::new(),
            bypass: true,
        }
    }

    /// The same cache without bypass: every block is admitted, the one used
    /// farthest in the future is evicted (the eviction half of the optimum).
    pub fn without_bypass(requests: &[Request], capacity: usize) -> Self {
        Self {
            bypass: false,
            ..Self::new(requests, capacity)
        }
    }

    fn record_one(&mut self, block: BlockId, next_use: u64) {
        if let Some(old) = self.cached.insert(block, next_use) {
            self.by_next_use.remove(&(old, block));
            self.by_next_use.insert((next_use, block));
            return;
        }
        if self.cached.len() > self.capacity {
            let farthest = self.by_next_use.last().copied();
            match farthest {
                Some((far, victim)) if next_use < far || !self.bypass => {
                    self.by_next_use.pop_last();
                    self.cached.remove(&victim);
                    self.by_next_use.insert((next_use, block));
                }
                _ => {
                    // Bypass: admitting it would evict a block needed sooner.
                    self.cached.remove(&block);
                }
            }
        } else {
            self.by_next_use.insert((next_use, block));
        }
    }
}

impl CacheSim for BeladySim {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        self.cached.contains_key(&block).then_some(Tier::G1)
    }

    fn record(&mut self, ctx: &RequestCtx<'_>) {
        for (i, &b) in ctx.blocks().iter().enumerate() {
            let next_use = self
                .next
                .get(ctx.first_position + i)
                .copied()
                .unwrap_or(NEVER);
            self.record_one(b, next_use);
        }
    }
}
