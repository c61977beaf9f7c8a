//! kvbm's G2 and G3 ranked by an arbitrary per-block score: the harness
//! of the bound studies.
//!
//! The flow is the study's winning one (exclusive victim caches: G1's
//! evictions are offered to G2, G2's victims to G3, what G3 pushes out is
//! dropped); only the ranking changes, supplied by a [`BlockScorer`]:
//! a calibrated hindsight predictor ([`super::hindsight`]), an online
//! learner ([`super::online`]), recency ([`RecencyScorer`], which reproduces
//! the LRU tiers) or the future itself ([`OracleScorer`], Belady on tiers).
//!
//! Scores may depend on a block's age; a scorer says when a block's rank
//! can change next and the tiers re-rank it then (event-driven, so a
//! score that changes at quarter-octave age edges costs a handful of
//! updates per block, not one per request).
//!
//! Arbitrary scores can rank a child above its parent; since hits are
//! prefix-contiguous, a child whose parent left every tier can never hit.
//! With [`ScoredConfig::cascade`] on, a block leaving every tier takes its
//! cached descendants with it (whole-tail eviction), so no space is spent
//! on orphans.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};

use super::replay::{RequestCtx, Tier};
use super::tiered::KvbmTiers;
use super::trace_index::{NO_REQUEST, TraceIndex};
use kvbm_testkit::trace::BlockId;

/// What the tiers remember about a block: its last use and the cell key a
/// scorer gave that use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMeta {
    /// Index of the request that used it last.
    pub request: u32,
    /// Its position in that request's prompt.
    pub position: u32,
    /// The scorer's key for that use.
    pub key: u64,
    /// Uses so far.
    pub count: u32,
    /// Index of the next request that will use it ([`NO_REQUEST`]: never);
    /// only oracle scorers may read it.
    pub next_request: u32,
    /// Whether it was the partially filled last block of its request.
    pub partial: bool,
}

/// Ranks blocks for [`ScoredTiers`]: higher ranks are kept.
pub trait BlockScorer {
    /// The cell key of the use at `position` of request `request`.
    fn key(&self, request: usize, position: usize) -> u64;

    /// The block's rank at request index `now`.
    fn rank(&self, meta: &BlockMeta, now: u64) -> u64;

    /// The earliest request index after `now` at which the rank may change
    /// (`None`: never, unless [`BlockScorer::epoch`] moves).
    fn next_change(&self, meta: &BlockMeta, now: u64) -> Option<u64>;

    /// Sees request `ctx` before the tiers do (online learners).
    fn observe(&mut self, _ctx: &RequestCtx<'_>) {}

    /// A counter that moves whenever every rank may have changed (an online
    /// learner refreshing its table); the tiers then re-rank everything.
    fn epoch(&self) -> u64 {
        0
    }
}

/// Rank = the last use: the tiers become the LRU victim tiers.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecencyScorer;

impl BlockScorer for RecencyScorer {
    fn key(&self, _request: usize, _position: usize) -> u64 {
        0
    }

    fn rank(&self, meta: &BlockMeta, _now: u64) -> u64 {
        meta.request as u64
    }

    fn next_change(&self, _meta: &BlockMeta, _now: u64) -> Option<u64> {
        None
    }
}

/// Rank = how soon the block is used next (never: lowest): Belady's rule.
#[derive(Debug, Clone, Copy, Default)]
pub struct OracleScorer;

impl BlockScorer for OracleScorer {
    fn key(&self, _request: usize, _position: usize) -> u64 {
        0
    }

    fn rank(&self, meta: &BlockMeta, _now: u64) -> u64 {
        if meta.next_request == NO_REQUEST {
            0
        } else {
            u64::MAX - meta.next_request as u64
        }
    }

    fn next_change(&self, _meta: &BlockMeta, _now: u64) -> Option<u64> {
        None
    }
}

/// When an offered block is admitted into a full tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Always: the lowest-ranked block makes room.
    Always,
    /// When its rank is at least the lowest cached rank.
    TiesAdmit,
    /// Only when its rank is strictly above the lowest cached rank
    /// (Belady's bypass).
    Strict,
}

/// Parameters of [`ScoredTiers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScoredConfig {
    /// G2 capacity in blocks.
    pub g2: usize,
    /// G3 capacity in blocks.
    pub g3: usize,
    /// Never admit a partially filled last block.
    pub skip_partial: bool,
    /// A block leaving every tier takes its cached descendants along.
    pub cascade: bool,
    /// Admission into a full tier.
    pub admission: Admission,
}

/// Position of a block in a tier's order: lowest rank first, then the
/// least recent use, then the deepest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Slot {
    rank: u64,
    last: u32,
    shallowness: u32,
    block: BlockId,
}

#[derive(Debug, Clone, Default)]
struct RankedTier {
    capacity: usize,
    order: BTreeSet<Slot>,
    /// Block -> its slot and the time its next re-rank is due.
    slots: HashMap<BlockId, (Slot, u64)>,
}

impl RankedTier {
    fn remove(&mut self, b: BlockId) -> bool {
        match self.slots.remove(&b) {
            Some((slot, _)) => {
                self.order.remove(&slot);
                true
            }
            None => false,
        }
    }

    fn insert(&mut self, slot: Slot, due: u64) {
        self.order.insert(slot);
        self.slots.insert(slot.block, (slot, due));
    }
}

/// Counters of what the tiers did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScoredCounters {
    /// Offers turned away (bypass).
    pub bypassed: u64,
    /// Blocks dropped because their parent left every tier.
    pub cascaded: u64,
    /// Re-ranks triggered by age.
    pub reranks: u64,
}

/// kvbm's G2 and G3 ranked by a [`BlockScorer`].
#[derive(Debug, Clone)]
pub struct ScoredTiers<'a, S> {
    ix: &'a TraceIndex,
    config: ScoredConfig,
    scorer: S,
    tiers: [RankedTier; 2],
    meta: HashMap<BlockId, BlockMeta>,
    in_g1: HashSet<BlockId>,
    due: BinaryHeap<Reverse<(u64, BlockId)>>,
    epoch: u64,
    counters: ScoredCounters,
}

impl<'a, S: BlockScorer> ScoredTiers<'a, S> {
    /// Tiers of `config` over the trace indexed by `ix`, ranked by `scorer`.
    pub fn new(ix: &'a TraceIndex, config: ScoredConfig, scorer: S) -> Self {
        let epoch = scorer.epoch();
        Self {
            ix,
            config,
            scorer,
            tiers: [
                RankedTier {
                    capacity: config.g2,
                    ..RankedTier::default()
                },
                RankedTier {
                    capacity: config.g3,
                    ..RankedTier::default()
                },
            ],
            meta: HashMap::new(),
            in_g1: HashSet::new(),
            due: BinaryHeap::new(),
            epoch,
            counters: ScoredCounters::default(),
        }
    }

    /// The scorer.
    pub fn scorer(&self) -> &S {
        &self.scorer
    }

    /// What the tiers did so far.
    pub fn counters(&self) -> ScoredCounters {
        self.counters
    }

    fn slot(&self, b: BlockId, meta: &BlockMeta, now: u64) -> (Slot, u64) {
        let slot = Slot {
            rank: self.scorer.rank(meta, now),
            last: meta.request,
            shallowness: u32::MAX - meta.position,
            block: b,
        };
        let due = self.scorer.next_change(meta, now).unwrap_or(u64::MAX);
        (slot, due)
    }

    fn tier_of(&self, b: BlockId) -> Option<usize> {
        (0..2).find(|&t| self.tiers[t].slots.contains_key(&b))
    }

    fn rerank(&mut self, b: BlockId, now: u64) {
        let Some(t) = self.tier_of(b) else { return };
        let Some(meta) = self.meta.get(&b).copied() else {
            return;
        };
        let (slot, due) = self.slot(b, &meta, now);
        self.tiers[t].remove(b);
        self.tiers[t].insert(slot, due);
        if due != u64::MAX {
            self.due.push(Reverse((due, b)));
        }
        self.counters.reranks += 1;
    }

    fn rerank_due(&mut self, now: u64) {
        let epoch = self.scorer.epoch();
        if epoch != self.epoch {
            self.epoch = epoch;
            self.due.clear();
            let all: Vec<BlockId> = self
                .tiers
                .iter()
                .flat_map(|t| t.slots.keys().copied())
                .collect();
            for b in all {
                self.rerank(b, now);
            }
            return;
        }
        while let Some(&Reverse((at, b))) = self.due.peek() {
            if at > now {
                break;
            }
            self.due.pop();
            // A stale entry (the block moved or was re-ranked since) is
            // skipped: only the due time stored with the slot counts.
            let current = self
                .tier_of(b)
                .and_then(|t| self.tiers[t].slots.get(&b).map(|s| s.1));
            if current == Some(at) {
                self.rerank(b, now);
            }
        }
    }

    /// Offers `b` to tier `t`; returns the block pushed out, if any.
    fn offer(&mut self, t: usize, b: BlockId, now: u64) -> Option<BlockId> {
        let meta = self.meta.get(&b).copied()?;
        let (slot, due) = self.slot(b, &meta, now);
        let tier = &mut self.tiers[t];
        if tier.capacity == 0 {
            return Some(b);
        }
        let mut out = None;
        if tier.slots.len() >= tier.capacity {
            let lowest = *tier.order.first()?;
            let admit = match self.config.admission {
                Admission::Always => true,
                Admission::TiesAdmit => slot.rank >= lowest.rank,
                Admission::Strict => slot.rank > lowest.rank,
            };
            if !admit {
                self.counters.bypassed += 1;
                return Some(b);
            }
            tier.remove(lowest.block);
            out = Some(lowest.block);
        }
        tier.insert(slot, due);
        if due != u64::MAX {
            self.due.push(Reverse((due, b)));
        }
        out
    }

    /// `b` left every tier (or was never admitted): drop its descendants.
    fn depart(&mut self, b: BlockId) {
        if !self.config.cascade {
            return;
        }
        let mut stack = vec![b];
        while let Some(p) = stack.pop() {
            let Some(kids) = self.ix.children.get(&p) else {
                continue;
            };
            for &c in kids {
                if !self.in_g1.contains(&c) && (self.tiers[0].remove(c) || self.tiers[1].remove(c))
                {
                    self.counters.cascaded += 1;
                    stack.push(c);
                }
            }
        }
    }
}

impl<S: BlockScorer> KvbmTiers for ScoredTiers<'_, S> {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        match self.tier_of(block) {
            Some(0) => Some(Tier::G2),
            Some(_) => Some(Tier::G3),
            None => None,
        }
    }

    fn record(&mut self, ctx: &RequestCtx<'_>, g1_evicted: &[BlockId]) {
        let now = ctx.index as u64;
        self.scorer.observe(ctx);
        let blocks = ctx.blocks();
        for (i, &b) in blocks.iter().enumerate().rev() {
            let facts = self.ix.use_at(ctx.index, i);
            let partial = ctx.last_block_partial && i + 1 == blocks.len();
            let meta = BlockMeta {
                request: ctx.index as u32,
                position: i as u32,
                key: self.scorer.key(ctx.index, i),
                count: facts.count,
                next_request: facts.next_request,
                partial: partial || self.meta.get(&b).is_some_and(|m| m.partial),
            };
            self.meta.insert(b, meta);
            self.tiers[0].remove(b);
            self.tiers[1].remove(b);
            self.in_g1.insert(b);
        }
        self.rerank_due(now);
        for &b in g1_evicted {
            self.in_g1.remove(&b);
            if self.config.skip_partial && self.meta.get(&b).is_some_and(|m| m.partial) {
                self.depart(b);
                continue;
            }
            if let Some(out) = self.offer(0, b, now)
                && let Some(gone) = self.offer(1, out, now)
            {
                self.depart(gone);
            }
        }
    }

    fn occupancy(&self) -> (usize, usize) {
        (self.tiers[0].slots.len(), self.tiers[1].slots.len())
    }

    fn cached(&self) -> Vec<(BlockId, Tier)> {
        let g2 = self.tiers[0].slots.keys().map(|&b| (b, Tier::G2));
        g2.chain(self.tiers[1].slots.keys().map(|&b| (b, Tier::G3)))
            .collect()
    }
}
