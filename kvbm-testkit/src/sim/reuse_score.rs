//! The policy study's winner: rank cached blocks by estimated reuse per
//! unit of age, with the reuse probability learned online from how often
//! blocks seen `k` times came back a `k+1`-th time.
//!
//! Every block kvbm has seen has a *use count* `k` (requests that carried
//! it) and a *last use* time `t` (index of the last such request). A block
//! that has come back often is far more likely to come back again: in the
//! Mooncake conversation trace a block seen once returns 26% of the time,
//! seen twice 42%, three times 50%, four or more 78%. Its score is
//!
//! `score = w[min(k, K)] / (now - t + 1)`
//!
//! where `w[k]` is the learned probability that a block used `k` times is
//! used again (monotone non-decreasing in `k`, see [`ReuseWeights`]). The
//! lowest score is evicted. Because a prompt's blocks form a chain, a parent
//! is used at least as often and at least as recently as each child, so its
//! score is never lower: eviction always takes leaves first and never leaves
//! a cached block behind a missing parent (which could never hit). Within a
//! request, blocks are stamped deepest first, so equal scores also break
//! toward the leaf.
//!
//! Because the score's order among blocks of the same class never changes
//! as time passes, each class keeps a recency list and the eviction victim
//! is the least recent entry of one of the `K` lists: eviction is O(K),
//! everything else O(1).

use std::collections::HashMap;

use super::recency::RecencyList;
use super::replay::{RequestCtx, Tier};
use super::tiered::KvbmTiers;
use crate::trace::BlockId;

/// Number of use-count classes: 1, 2, 3, and 4 or more.
pub const CLASSES: usize = 4;

/// Learned probability that a block used `k` times is used again.
#[derive(Debug, Clone)]
pub struct ReuseWeights {
    /// `reached[k]` = blocks whose use count reached `k + 1` (k < CLASSES),
    /// the last class pooling every count ≥ CLASSES.
    reached: [f64; CLASSES + 1],
    /// Uses beyond the CLASSES-th, pooled.
    repeats: f64,
    weights: [f64; CLASSES],
}

impl Default for ReuseWeights {
    fn default() -> Self {
        // A weak prior: "one in four blocks comes back, more if seen more".
        let mut w = Self {
            reached: [400.0, 100.0, 40.0, 20.0, 15.0],
            repeats: 0.0,
            weights: [0.0; CLASSES],
        };
        w.repeats = w.reached[CLASSES] * 3.0;
        w.refresh(1.0);
        w
    }
}

impl ReuseWeights {
    /// Records that a block's use count went from `count - 1` to `count`.
    pub fn observe(&mut self, count: u32) {
        let c = count as usize;
        if c == 0 {
            return;
        }
        if c <= CLASSES + 1 {
            self.reached[c - 1] += 1.0;
        }
        if c > CLASSES {
            self.repeats += 1.0;
        }
    }

    /// Recomputes the weights from the counters (cheap; call periodically),
    /// raised to `exponent`.
    pub fn refresh(&mut self, exponent: f64) {
        let mut best = 0.0f64;
        for k in 0..CLASSES {
            let w = if k + 1 < CLASSES {
                self.reached[k + 1] / self.reached[k].max(1.0)
            } else {
                // Of the uses a class-K block had, the share that were repeats.
                self.repeats / (self.repeats + self.reached[CLASSES - 1]).max(1.0)
            };
            best = best.max(w);
            self.weights[k] = best.max(1e-6).powf(exponent);
        }
    }

    /// Weight of a block used `count` times (count ≥ 1).
    pub fn weight(&self, count: u32) -> f64 {
        self.weights[class_of(count)]
    }

    /// Current weights, class by class.
    pub fn weights(&self) -> [f64; CLASSES] {
        self.weights
    }
}

fn class_of(count: u32) -> usize {
    (count.max(1) as usize - 1).min(CLASSES - 1)
}

/// What kvbm remembers about a block it has seen.
#[derive(Debug, Clone, Copy)]
struct Seen {
    count: u32,
    last: u64,
    /// Was the partially filled last block of a request.
    partial: bool,
}

/// One kvbm tier ranked by reuse score.
#[derive(Debug, Clone)]
struct ScoredTier {
    capacity: usize,
    classes: [RecencyList; CLASSES],
    meta: HashMap<BlockId, Seen>,
}

impl ScoredTier {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            classes: std::array::from_fn(|_| RecencyList::default()),
            meta: HashMap::with_capacity(capacity),
        }
    }

    fn len(&self) -> usize {
        self.meta.len()
    }

    fn contains(&self, b: BlockId) -> bool {
        self.meta.contains_key(&b)
    }

    fn remove(&mut self, b: BlockId) -> Option<Seen> {
        let seen = self.meta.remove(&b)?;
        self.classes[class_of(seen.count)].remove(b);
        Some(seen)
    }

    fn insert(&mut self, b: BlockId, seen: Seen) {
        self.remove(b);
        self.classes[class_of(seen.count)].touch(b);
        self.meta.insert(b, seen);
    }

    /// The lowest-scored block and its score.
    fn lowest(&self, weights: &ReuseWeights, now: u64) -> Option<(BlockId, f64)> {
        let mut best: Option<(BlockId, f64)> = None;
        for list in &self.classes {
            if let Some(b) = list.peek_lru() {
                let s = score(self.meta[&b], weights, now);
                if best.is_none_or(|(_, bs)| s < bs) {
                    best = Some((b, s));
                }
            }
        }
        best
    }

    /// Offers `b`; returns the block pushed out (the victim, or `b` itself
    /// when it scores no better than every cached block).
    fn offer(
        &mut self,
        b: BlockId,
        seen: Seen,
        weights: &ReuseWeights,
        now: u64,
    ) -> Option<(BlockId, Seen)> {
        if self.capacity == 0 {
            return Some((b, seen));
        }
        if self.len() < self.capacity {
            self.insert(b, seen);
            return None;
        }
        let (victim, low) = self.lowest(weights, now)?;
        if score(seen, weights, now) <= low {
            return Some((b, seen));
        }
        let out = self.remove(victim).map(|s| (victim, s));
        self.insert(b, seen);
        out
    }
}

fn score(seen: Seen, weights: &ReuseWeights, now: u64) -> f64 {
    weights.weight(seen.count) / (now.saturating_sub(seen.last) + 1) as f64
}

/// Parameters of [`ReuseScoreTiers`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReuseScoreConfig {
    /// G2 capacity in blocks.
    pub g2: usize,
    /// G3 capacity in blocks.
    pub g3: usize,
    /// Blocks whose use count is remembered after they left every tier,
    /// as a multiple of the total capacity (G1 + G2 + G3).
    pub history_factor: f64,
    /// The G1 capacity (to size the history).
    pub g1: usize,
    /// Never admit a partially filled last block (engines never reuse one).
    pub skip_partial: bool,
    /// Scores use `w^exponent`: above 1 favours frequently used blocks
    /// more strongly over recent ones.
    pub weight_exponent: f64,
}

impl ReuseScoreConfig {
    /// The study's winning settings for tiers of `caps`: partial blocks
    /// skipped, history of 4× the total capacity, weights used as learned.
    pub fn for_tiers(caps: super::tiered::TierCapacities) -> Self {
        Self {
            g1: caps.g1,
            g2: caps.g2,
            g3: caps.g3,
            history_factor: 4.0,
            skip_partial: true,
            weight_exponent: 1.0,
        }
    }
}

/// kvbm's G2 and G3 ranked by reuse score; G2 is a victim cache of G1 and
/// G3 a victim cache of G2, both exclusive.
///
/// Per request: every block's use count and last use are updated (deepest
/// block first); blocks served from G2/G3 leave kvbm (they are back in G1);
/// each block G1 evicts is offered to G2, where it replaces the lowest-
/// scored block if it scores higher; whatever G2 pushes out is offered to
/// G3 the same way; what G3 pushes out is dropped (its history remains).
#[derive(Debug, Clone)]
pub struct ReuseScoreTiers {
    config: ReuseScoreConfig,
    g2: ScoredTier,
    g3: ScoredTier,
    history: HashMap<BlockId, Seen>,
    history_order: RecencyList,
    history_cap: usize,
    weights: ReuseWeights,
    served: Vec<BlockId>,
    now: u64,
}

impl ReuseScoreTiers {
    /// A policy with `config`.
    pub fn new(config: ReuseScoreConfig) -> Self {
        let total = config.g1 + config.g2 + config.g3;
        let history_cap = ((total as f64) * config.history_factor.max(1.0)).ceil() as usize;
        Self {
            config,
            g2: ScoredTier::new(config.g2),
            g3: ScoredTier::new(config.g3),
            history: HashMap::with_capacity(history_cap),
            history_order: RecencyList::with_capacity(history_cap),
            history_cap,
            weights: ReuseWeights::default(),
            served: Vec::new(),
            now: 0,
        }
    }

    /// The learned weights.
    pub fn weights(&self) -> &ReuseWeights {
        &self.weights
    }

    fn see(&mut self, b: BlockId, partial: bool) {
        let now = self.now;
        let seen = self.history.entry(b).or_insert(Seen {
            count: 0,
            last: 0,
            partial,
        });
        seen.count += 1;
        seen.last = now;
        seen.partial |= partial;
        self.weights.observe(seen.count);
        self.history_order.touch(b);
        while self.history_order.len() > self.history_cap {
            if let Some(old) = self.history_order.pop_lru() {
                self.history.remove(&old);
            }
        }
    }
}

impl KvbmTiers for ReuseScoreTiers {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        let tier = if self.g2.contains(block) {
            Tier::G2
        } else if self.g3.contains(block) {
            Tier::G3
        } else {
            return None;
        };
        self.served.push(block);
        Some(tier)
    }

    fn record(&mut self, ctx: &RequestCtx<'_>, g1_evicted: &[BlockId]) {
        self.now = ctx.index as u64 + 1;
        let blocks = ctx.blocks();
        for (i, &b) in blocks.iter().enumerate().rev() {
            self.see(b, ctx.last_block_partial && i + 1 == blocks.len());
        }
        if ctx.index.is_multiple_of(256) {
            self.weights.refresh(self.config.weight_exponent);
        }
        for b in std::mem::take(&mut self.served) {
            self.g2.remove(b);
            self.g3.remove(b);
        }
        let now = self.now;
        for &b in g1_evicted {
            // The history may have forgotten a block G1 held for long.
            let seen = self.history.get(&b).copied().unwrap_or(Seen {
                count: 1,
                last: now,
                partial: false,
            });
            if self.config.skip_partial && seen.partial {
                continue;
            }
            if let Some((out, s)) = self.g2.offer(b, seen, &self.weights, now) {
                self.g3.offer(out, s, &self.weights, now);
            }
        }
    }

    fn occupancy(&self) -> (usize, usize) {
        (self.g2.len(), self.g3.len())
    }
}
