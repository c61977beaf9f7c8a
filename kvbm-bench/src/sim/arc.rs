//! ARC (adaptive replacement) as kvbm's G2: an adaptive split between
//! blocks seen once and blocks seen more often, steered by which ghost list
//! the returning blocks come from. G3 (if any) is an LRU victim cache of
//! G2.
//!
//! In a victim cache, ARC's "hit" is a block coming back to G1: kvbm sees
//! it as a use of a block it holds or remembers. Offers come from G1's
//! evictions: a block used once goes to `T1`, one used twice or more to
//! `T2`. When G2 is full, `T1`'s least recent block is evicted while `T1`
//! holds more than the target `p` blocks, else `T2`'s; evicted blocks are
//! remembered in the ghost lists `B1` / `B2`. A use of a block remembered
//! in `B1` (a one-timer evicted too soon) grows `p`; one from `B2` shrinks
//! it. Partial last blocks are never offered; a block leaving every tier
//! takes its cached descendants with it (as in [`super::scored_tiers`]).

use std::collections::HashMap;

use super::lru::{LruSim, TouchOrder};
use super::recency::RecencyList;
use super::replay::{RequestCtx, Tier};
use super::tiered::KvbmTiers;
use super::trace_index::TraceIndex;
use kvbm_testkit::trace::BlockId;

/// ARC over G2, LRU over G3.
#[derive(Debug, Clone)]
pub struct ArcTiers<'a> {
    ix: &'a TraceIndex,
    capacity: usize,
    t1: RecencyList,
    t2: RecencyList,
    b1: RecencyList,
    b2: RecencyList,
    /// Target size of `T1`.
    p: f64,
    g3: LruSim,
    uses: HashMap<BlockId, u32>,
    partial: HashMap<BlockId, bool>,
    in_g1: std::collections::HashSet<BlockId>,
}

impl<'a> ArcTiers<'a> {
    /// G2 of `g2` blocks under ARC, G3 of `g3` blocks under LRU.
    pub fn new(ix: &'a TraceIndex, g2: usize, g3: usize) -> Self {
        Self {
            ix,
            capacity: g2,
            t1: RecencyList::default(),
            t2: RecencyList::default(),
            b1: RecencyList::default(),
            b2: RecencyList::default(),
            p: 0.0,
            g3: LruSim::with_order(g3, TouchOrder::LeafFirst),
            uses: HashMap::new(),
            partial: HashMap::new(),
            in_g1: Default::default(),
        }
    }

    /// The current target size of the seen-once list.
    pub fn target(&self) -> f64 {
        self.p
    }

    fn in_kvbm(&self, b: BlockId) -> bool {
        self.t1.contains(b) || self.t2.contains(b) || self.g3.contains(b)
    }

    fn drop_from_kvbm(&mut self, b: BlockId) -> bool {
        self.t1.remove(b) | self.t2.remove(b) | self.g3.remove(b)
    }

    fn depart(&mut self, b: BlockId) {
        let mut stack = vec![b];
        while let Some(p) = stack.pop() {
            let Some(kids) = self.ix.children.get(&p) else {
                continue;
            };
            for &c in kids {
                if !self.in_g1.contains(&c) && self.drop_from_kvbm(c) {
                    stack.push(c);
                }
            }
        }
    }

    /// Makes room in G2 (ARC's REPLACE); returns the evicted block.
    fn replace(&mut self, from_b2: bool) -> Option<BlockId> {
        let t1 = self.t1.len() as f64;
        let take_t1 =
            !self.t1.is_empty() && (t1 > self.p || (from_b2 && t1 >= self.p) || self.t2.is_empty());
        let (victim, ghosts) = if take_t1 {
            (self.t1.pop_lru()?, &mut self.b1)
        } else {
            (self.t2.pop_lru()?, &mut self.b2)
        };
        ghosts.touch(victim);
        while self.b1.len() + self.b2.len() > self.capacity.max(1) * 2 {
            let longer = if self.b1.len() >= self.b2.len() {
                &mut self.b1
            } else {
                &mut self.b2
            };
            longer.pop_lru();
        }
        Some(victim)
    }

    fn offer(&mut self, b: BlockId) {
        if self.capacity == 0 {
            self.demote(b);
            return;
        }
        let seen_more = self.uses.get(&b).copied().unwrap_or(1) >= 2;
        let from_b2 = self.b2.contains(b);
        if self.t1.len() + self.t2.len() >= self.capacity
            && let Some(v) = self.replace(from_b2)
        {
            self.demote(v);
        }
        if seen_more {
            self.t2.touch(b);
        } else {
            self.t1.touch(b);
        }
    }

    fn demote(&mut self, b: BlockId) {
        let evicted: Vec<BlockId> = self.g3.touch_all(&[b]).to_vec();
        for gone in evicted {
            if !self.in_kvbm(gone) {
                self.depart(gone);
            }
        }
        if !self.in_kvbm(b) {
            self.depart(b);
        }
    }
}

impl KvbmTiers for ArcTiers<'_> {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        if self.t1.contains(block) || self.t2.contains(block) {
            Some(Tier::G2)
        } else if self.g3.contains(block) {
            Some(Tier::G3)
        } else {
            None
        }
    }

    fn record(&mut self, ctx: &RequestCtx<'_>, g1_evicted: &[BlockId]) {
        let blocks = ctx.blocks();
        for (i, &b) in blocks.iter().enumerate().rev() {
            // Ghost hits steer the target, as in ARC.
            let (l1, l2) = (self.b1.len().max(1) as f64, self.b2.len().max(1) as f64);
            if self.b1.remove(b) {
                self.p = (self.p + (l2 / l1).max(1.0)).min(self.capacity as f64);
            } else if self.b2.remove(b) {
                self.p = (self.p - (l1 / l2).max(1.0)).max(0.0);
            }
            *self.uses.entry(b).or_insert(0) += 1;
            let partial = ctx.last_block_partial && i + 1 == blocks.len();
            *self.partial.entry(b).or_insert(false) |= partial;
            self.drop_from_kvbm(b);
            self.in_g1.insert(b);
        }
        for &b in g1_evicted {
            self.in_g1.remove(&b);
            if self.partial.get(&b).copied().unwrap_or(false) {
                self.depart(b);
                continue;
            }
            self.offer(b);
        }
    }

    fn occupancy(&self) -> (usize, usize) {
        (self.t1.len() + self.t2.len(), self.g3.len())
    }

    fn cached(&self) -> Vec<(BlockId, Tier)> {
        let g2 = self
            .t1
            .iter_lru()
            .chain(self.t2.iter_lru())
            .map(|b| (b, Tier::G2));
        g2.chain(self.g3.blocks().map(|b| (b, Tier::G3))).collect()
    }
}
