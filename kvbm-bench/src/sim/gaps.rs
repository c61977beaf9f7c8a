//! Hits split by reuse gap: which returns does a policy serve, and which
//! does it lose, by how long the block had been unused?
//!
//! [`GapSplit`] wraps any [`CacheSim`] and files every block reference
//! under the number of requests since the block's previous use ("first
//! use" when there is none), counting the references and the hits. An
//! infinite cache hits every reference with a previous use (chained hashes
//! make seen blocks a prefix), so per range, `references - hits` is what
//! the policy lost against it.

use std::collections::HashMap;

use super::replay::{CacheSim, RequestCtx, Tier};
use kvbm_testkit::trace::BlockId;

/// Upper bounds (exclusive) of the gap ranges, in requests; the last range
/// is open.
pub const GAP_EDGES: [u32; 8] = [10, 50, 100, 250, 500, 1000, 2000, 4000];

/// Number of ranges: first use, the bounded ranges, and the open one.
pub const GAP_RANGES: usize = GAP_EDGES.len() + 2;

/// Label of range `i` (0 = first use).
pub fn range_label(i: usize) -> String {
    match i {
        0 => "first use".to_string(),
        1 => format!("1-{}", GAP_EDGES[0] - 1),
        i if i <= GAP_EDGES.len() => format!("{}-{}", GAP_EDGES[i - 2], GAP_EDGES[i - 1] - 1),
        _ => format!(">= {}", GAP_EDGES[GAP_EDGES.len() - 1]),
    }
}

fn range_of(gap: Option<u32>) -> usize {
    match gap {
        None => 0,
        Some(g) => 1 + GAP_EDGES.iter().take_while(|&&e| g >= e).count(),
    }
}

/// Block references and hits per gap range.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GapCounts {
    /// References per range.
    pub references: [u64; GAP_RANGES],
    /// Hits per range.
    pub hits: [u64; GAP_RANGES],
}

/// A cache whose hits are filed by reuse gap.
#[derive(Debug, Clone)]
pub struct GapSplit<C> {
    inner: C,
    last_use: HashMap<BlockId, u32>,
    /// Index of the request being looked up.
    current: u32,
    counts: GapCounts,
}

impl<C> GapSplit<C> {
    /// Wraps `inner`.
    pub fn new(inner: C) -> Self {
        Self {
            inner,
            last_use: HashMap::new(),
            current: 0,
            counts: GapCounts::default(),
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> GapCounts {
        self.counts
    }

    /// The wrapped cache.
    pub fn inner(&self) -> &C {
        &self.inner
    }
}

impl<C: CacheSim> CacheSim for GapSplit<C> {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        let hit = self.inner.lookup(block);
        if hit.is_some() {
            let gap = self.last_use.get(&block).map(|&r| self.current - r);
            self.counts.hits[range_of(gap)] += 1;
        }
        hit
    }

    fn record(&mut self, ctx: &RequestCtx<'_>) {
        let now = ctx.index as u32;
        for &b in ctx.blocks() {
            let gap = self.last_use.get(&b).map(|&r| now - r);
            self.counts.references[range_of(gap)] += 1;
            self.last_use.insert(b, now);
        }
        self.inner.record(ctx);
        self.current = now + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(range_of(None), 0);
        assert_eq!(range_of(Some(1)), 1);
        assert_eq!(range_of(Some(9)), 1);
        assert_eq!(range_of(Some(10)), 2);
        assert_eq!(range_of(Some(3999)), 8);
        assert_eq!(range_of(Some(4000)), 9);
        assert_eq!(range_label(0), "first use");
        assert_eq!(range_label(1), "1-9");
        assert_eq!(range_label(2), "10-49");
        assert_eq!(range_label(9), ">= 4000");
    }
}
