//! The use history the reuse score reads: per block its use count and
//! last use, the learned weights of each use-count class, the demotions of
//! copies a faster tier holds, and the retention hints' marks.
//!
//! The engine records every request when it is matched; the policies of G2
//! and G3 read the history through a [`SharedHistory`]. It also remembers
//! blocks no tier holds any more (bounded, least recently used forgotten
//! first), which is what lets a block that returns be recognised as
//! popular.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use kvbm_block::{BuildSequenceHasher, SequenceHash};

use super::recency::BlockRecency;
use super::retention::{HintClock, RetentionHint, Retentions};
use super::return_within::ReturnTable;
use super::shared_history::SharedHistory;
use crate::config::Tier;

/// A map keyed by sequence hash (the history is updated for every block
/// of every matched request).
type SeqMap<V> = HashMap<SequenceHash, V, BuildSequenceHasher>;

/// The bit of `tier` in a demotion mask (G2 and G3 only).
fn tier_bit(tier: Tier) -> u8 {
    match tier {
        Tier::G2 => 1,
        Tier::G3 => 2,
        Tier::G1 | Tier::G4 => 0,
    }
}

/// How a block's use count and age make its reuse score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReuseModel {
    /// `w[min(k, 4)] / (age + 1)^exponent`: the learned probability that a
    /// block used `k` times is used again at all, spread hyperbolically
    /// over its age (the exponent is the history's age exponent).
    Hyperbolic,
    /// The learned probability that a block of its use-count class, unused
    /// for its age, is used within the next `horizon` requests (learned
    /// from the returns the history saw): it keeps serving the returns that come after a
    /// long gap, which a hyperbolic decay gives up on.
    ReturnWithin {
        /// Look-ahead window in requests.
        horizon: u64,
    },
}

/// Number of use-count classes: 1, 2, 3, and 4 or more.
pub(crate) const USE_CLASSES: usize = 4;

/// Requests between two refreshes of the learned weights.
const REFRESH_EVERY: u64 = 256;

pub(crate) fn class_of(count: u32) -> usize {
    (count.max(1) as usize - 1).min(USE_CLASSES - 1)
}

/// Learned probability that a block used `k` times is used again.
#[derive(Debug, Clone)]
pub struct ReuseWeights {
    /// `reached[k]`: blocks whose use count reached `k + 1`; the last slot
    /// pools every count beyond the classes.
    reached: [f64; USE_CLASSES + 1],
    /// Uses beyond the last class, pooled.
    repeats: f64,
    weights: [f64; USE_CLASSES],
}

impl Default for ReuseWeights {
    fn default() -> Self {
        // A weak prior: one block in four comes back, more if seen more.
        let mut w = Self {
            reached: [400.0, 100.0, 40.0, 20.0, 15.0],
            repeats: 60.0,
            weights: [0.0; USE_CLASSES],
        };
        w.refresh();
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
        if c <= USE_CLASSES + 1 {
            self.reached[c - 1] += 1.0;
        }
        if c > USE_CLASSES {
            self.repeats += 1.0;
        }
    }

    /// Recomputes the weights from the counters.
    pub fn refresh(&mut self) {
        let mut best = 0.0f64;
        for k in 0..USE_CLASSES {
            let w = if k + 1 < USE_CLASSES {
                self.reached[k + 1] / self.reached[k].max(1.0)
            } else {
                self.repeats / (self.repeats + self.reached[USE_CLASSES - 1]).max(1.0)
            };
            best = best.max(w);
            self.weights[k] = best.max(1e-6);
        }
    }

    /// Weight of a block used `count` times.
    pub fn weight(&self, count: u32) -> f64 {
        self.weights[class_of(count)]
    }

    /// The current weights, class by class.
    pub fn weights(&self) -> [f64; USE_CLASSES] {
        self.weights
    }

    /// The counters the weights are learned from: `reached` and the
    /// pooled repeats.
    pub fn counters(&self) -> ([f64; USE_CLASSES + 1], f64) {
        (self.reached, self.repeats)
    }

    /// Weights learned from `counters` (what [`ReuseWeights::counters`]
    /// gave); counters that are not finite and non-negative give the
    /// defaults.
    pub fn from_counters(reached: [f64; USE_CLASSES + 1], repeats: f64) -> Self {
        let sane = |v: f64| v.is_finite() && v >= 0.0;
        if !(reached.iter().all(|&v| sane(v)) && sane(repeats)) {
            return Self::default();
        }
        let mut w = Self {
            reached,
            repeats,
            weights: [0.0; USE_CLASSES],
        };
        w.refresh();
        w
    }
}

/// What is remembered about one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// Requests that carried the block.
    pub count: u32,
    /// Index of the last such request.
    pub last: u64,
    /// Tie-breaker: a global sequence number of the last use (deeper
    /// blocks of one request get smaller numbers).
    pub seq: u64,
}

/// A remembered block: what is known and its node in the recency list.
#[derive(Debug, Clone, Copy)]
struct Slot {
    seen: Seen,
    node: u32,
}

/// The most blocks a history remembers.
const MAX_CAPACITY: usize = 1 << 31;

/// Use counts of recently seen blocks, shared by the engine and the
/// reuse-score policies of its tiers.
#[derive(Debug)]
pub struct UseHistory {
    seen: SeqMap<Slot>,
    /// The remembered blocks, least recently used first.
    recency: BlockRecency,
    capacity: usize,
    weights: ReuseWeights,
    now: u64,
    seq: u64,
    age_exponent: f64,
    /// Blocks to evict first (their bytes are in a faster tier now), with
    /// the tiers (bits of [`tier_bit`]) whose copies are concerned.
    demoted: SeqMap<u8>,
    /// The return-within model's table, when that is the score.
    returns: Option<ReturnTable>,
    /// Marks left by retention hints.
    retentions: Retentions,
    /// The hints' time base.
    clock: HintClock,
    /// `(request clock, hint clock)` at the first recorded request: the
    /// request rate that converts a hint's time into requests.
    first: Option<(u64, u64)>,
    /// Done hints given, and those proven wrong (a later request carried
    /// a block they marked).
    done_hints: (f64, f64),
}

/// The score of a block marked done.
pub(crate) const DONE_SCORE: f64 = -1.0;

/// Done hints are acted on while at least this share of them has proven
/// right (a prior of four right ones included): a wrong "done" loses the
/// conversation's next hit, so a source of hints that says it wrongly too often
/// is ignored.
const DONE_TRUST: f64 = 0.85;

/// Where retention hints put a block now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retained {
    /// No live hint: it ranks by its history.
    No,
    /// Kept by a hint (times in ms).
    Kept {
        /// When it is expected back.
        due: u64,
        /// When its protection lapses.
        until: u64,
    },
    /// First to evict.
    Done,
}

impl UseHistory {
    /// A history remembering at most `capacity` blocks (at least 1, at
    /// most 2^31).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.clamp(1, MAX_CAPACITY);
        Self {
            seen: SeqMap::with_capacity_and_hasher(capacity.min(1 << 20), Default::default()),
            recency: BlockRecency::new(),
            capacity,
            weights: ReuseWeights::default(),
            now: 0,
            seq: 0,
            age_exponent: 1.0,
            demoted: SeqMap::default(),
            returns: None,
            retentions: Retentions::new(2.0),
            clock: HintClock::Wall(std::time::Instant::now()),
            first: None,
            done_hints: (0.0, 0.0),
        }
    }

    /// Protections of [`RetentionHint::ReturnsWithin`] last `slack` times
    /// the hinted time (default 2, at least 1).
    pub fn with_hint_slack(mut self, slack: f64) -> Self {
        self.retentions = Retentions::new(slack);
        self
    }

    /// Sets the hints' time base (default: the wall clock since the
    /// history was made).
    pub fn set_clock(&mut self, clock: HintClock) {
        self.clock = clock;
    }

    /// The hints' clock, milliseconds.
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Applies a retention hint to a request's blocks (in prompt order),
    /// given now.
    pub fn retain(&mut self, hashes: &[SequenceHash], hint: RetentionHint) {
        if hint == RetentionHint::Done {
            self.done_hints.0 += 1.0;
        }
        let now = self.now_ms();
        let trusted = self.done_trusted();
        let seen = &self.seen;
        self.retentions.apply(hashes, hint, now, trusted, |h| {
            seen.get(&h).map_or(0, |s| s.seen.count)
        });
    }

    /// Whether any block carries a hint's mark.
    pub fn has_retentions(&self) -> bool {
        !self.retentions.is_empty()
    }

    /// The hints' marks.
    pub fn retentions(&self) -> &Retentions {
        &self.retentions
    }

    /// Whether a done hint given now is acted on: at least 85% of those
    /// given so far (with a prior of four right ones) have not been
    /// proven wrong.
    pub fn done_trusted(&self) -> bool {
        let (given, wrong) = self.done_hints;
        (given - wrong + 4.0) / (given + 4.0) >= DONE_TRUST
    }

    /// Where retention hints put `hash` now.
    pub fn retained(&self, hash: SequenceHash) -> Retained {
        if self.retentions.is_empty() {
            return Retained::No;
        }
        if self.retentions.is_done(hash) {
            return Retained::Done;
        }
        match self.retentions.keep_until(hash, self.now_ms()) {
            Some((due, until)) => Retained::Kept { due, until },
            None => Retained::No,
        }
    }

    /// The score of a kept block due back at `due`, from the requests `r`
    /// expected before it returns (the time until `due`, at the request
    /// rate seen so far; none once due) and the horizon `h`:
    /// `2 - r / h` within the horizon, `h / r` beyond it. A block expected
    /// back within the horizon outranks every block scored by its history
    /// (scores at most 1), and a sooner one a later one.
    pub fn kept_score(&self, due: u64) -> f64 {
        let now = self.now_ms();
        let horizon = match &self.returns {
            Some(t) => t.horizon() as f64,
            None => REFRESH_EVERY as f64,
        };
        let remaining = due.saturating_sub(now) as f64;
        let rate = match self.first {
            Some((r0, t0)) if now > t0 => (self.now - r0) as f64 / (now - t0) as f64,
            _ => 0.0,
        };
        let requests = remaining * rate;
        if requests <= horizon {
            2.0 - requests / horizon
        } else {
            horizon / requests
        }
    }

    /// Scores by `model` (default [`ReuseModel::Hyperbolic`]).
    pub fn with_model(mut self, model: ReuseModel) -> Self {
        self.returns = match model {
            ReuseModel::Hyperbolic => None,
            ReuseModel::ReturnWithin { horizon } => Some(ReturnTable::new(horizon)),
        };
        self
    }

    /// The score model in use.
    pub fn model(&self) -> ReuseModel {
        match &self.returns {
            None => ReuseModel::Hyperbolic,
            Some(t) => ReuseModel::ReturnWithin {
                horizon: t.horizon(),
            },
        }
    }

    /// Marks `tier`'s copies of blocks as first to evict: they were just
    /// loaded into G1, which gives them back to G2 when it evicts them
    /// (write-back), so the copy is redundant meanwhile.
    pub fn demote(&mut self, tier: Tier, hashes: impl IntoIterator<Item = SequenceHash>) {
        let bit = tier_bit(tier);
        for h in hashes {
            *self.demoted.entry(h).or_default() |= bit;
        }
    }

    /// G1 gave `hash` back to G2: a G2 copy still held ranks by its score
    /// again (a G3 copy stays first to evict: G2 holds the block now).
    pub fn undemote(&mut self, hash: SequenceHash) {
        self.clear_demoted(Tier::G2, hash);
    }

    /// `tier` receives `hash` again (from the tier above it): a copy it
    /// still holds ranks by its score again.
    pub fn clear_demoted(&mut self, tier: Tier, hash: SequenceHash) {
        if let Some(bits) = self.demoted.get_mut(&hash) {
            *bits &= !tier_bit(tier);
            if *bits == 0 {
                self.demoted.remove(&hash);
            }
        }
    }

    /// Whether `tier`'s copy of `hash` is marked as first to evict.
    pub fn is_demoted(&self, tier: Tier, hash: SequenceHash) -> bool {
        self.demoted
            .get(&hash)
            .is_some_and(|b| b & tier_bit(tier) != 0)
    }

    /// Scores divide by `(age + 1)^exponent` (default 1). Below 1, blocks
    /// that were used often keep their rank for longer: the right choice
    /// when reuse gaps are long compared with the cache's turnover.
    pub fn with_age_exponent(mut self, exponent: f64) -> Self {
        if exponent.is_finite() && exponent > 0.0 {
            self.age_exponent = exponent;
        }
        self
    }

    /// A shared history of `capacity` blocks.
    pub fn shared(capacity: usize) -> SharedHistory {
        SharedHistory::new(Self::new(capacity))
    }

    /// Records one request carrying `hashes` (its prompt's blocks, in
    /// order): the clock advances and every block's use count grows by one.
    pub fn record_request(&mut self, hashes: &[SequenceHash]) {
        if self.first.is_none() {
            self.first = Some((self.now, self.now_ms()));
        }
        self.now += 1;
        let now = self.now;
        if !self.retentions.is_empty() {
            let mut wrong = false;
            for &h in hashes {
                wrong |= self.retentions.said_done(h);
                self.retentions.used(h);
            }
            if wrong {
                self.done_hints.1 += 1.0;
            }
        }
        for &h in hashes.iter().rev() {
            if self.recency.is_full() {
                // Only a request of billions of blocks gets here.
                self.forget_one();
            }
            self.seq += 1;
            let seq = self.seq;
            let (previous, count) = match self.seen.entry(h) {
                Entry::Occupied(mut e) => {
                    let slot = e.get_mut();
                    let s = &mut slot.seen;
                    let previous = (s.count > 0).then(|| (class_of(s.count), now - s.last));
                    s.count = s.count.saturating_add(1);
                    s.last = now;
                    s.seq = seq;
                    self.recency.touch(slot.node);
                    (previous, s.count)
                }
                Entry::Vacant(v) => {
                    let Some(node) = self.recency.push_back(h) else {
                        continue;
                    };
                    let seen = Seen {
                        count: 1,
                        last: now,
                        seq,
                    };
                    v.insert(Slot { seen, node });
                    (None, 1)
                }
            };
            self.weights.observe(count);
            if let Some(t) = &mut self.returns {
                t.observe(previous, class_of(count));
            }
        }
        self.forget_excess();
        if now.is_multiple_of(REFRESH_EVERY) {
            self.weights.refresh();
        }
        // The first request's statistics count from the start.
        if (now - 1).is_multiple_of(REFRESH_EVERY)
            && let Some(t) = &mut self.returns
        {
            t.refresh();
        }
    }

    /// The blocks used after use stamp `seq`, most recently used first:
    /// the back of the recency list, which is in stamp order.
    pub(crate) fn used_after(&self, seq: u64) -> impl Iterator<Item = (SequenceHash, Seen)> + '_ {
        self.recency
            .iter_rev()
            .map_while(move |h| Some((h, self.seen.get(&h)?.seen)).filter(|(_, s)| s.seq > seq))
    }

    /// Moves the clock and the use stamps forward to at least `now` and
    /// `seq`.
    pub(crate) fn advance_to(&mut self, now: u64, seq: u64) {
        self.now = self.now.max(now);
        self.seq = self.seq.max(seq);
    }

    /// Replaces the learned weights.
    pub(crate) fn set_weights(&mut self, weights: ReuseWeights) {
        self.weights = weights;
    }

    /// Remembers `hash` as `seen` unless it is remembered already, as the
    /// most recently used block (within the capacity: the least recently
    /// used are forgotten).
    pub(crate) fn remember(&mut self, hash: SequenceHash, seen: Seen) {
        if self.seen.contains_key(&hash) || self.recency.is_full() {
            return;
        }
        let Some(node) = self.recency.push_back(hash) else {
            return;
        };
        self.seen.insert(hash, Slot { seen, node });
        self.forget_excess();
    }

    /// Forgets the least recently used block; `false` when none is left.
    fn forget_one(&mut self) -> bool {
        match self.recency.pop_front() {
            Some(h) => {
                self.seen.remove(&h);
                true
            }
            None => false,
        }
    }

    fn forget_excess(&mut self) {
        while self.seen.len() > self.capacity {
            if !self.forget_one() {
                break;
            }
        }
        if self.retentions.len() > self.capacity {
            let seen = &self.seen;
            self.retentions.forget_done(|h| seen.contains_key(&h));
        }
    }

    /// Stamps handed out so far (every recorded block takes the next).
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// The clock: requests recorded so far.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// What is remembered about `hash`.
    pub fn get(&self, hash: SequenceHash) -> Option<Seen> {
        self.seen.get(&hash).map(|s| s.seen)
    }

    /// Requests that carried `hash` (0 when unknown or forgotten).
    pub fn uses(&self, hash: SequenceHash) -> u32 {
        self.seen.get(&hash).map_or(0, |s| s.seen.count)
    }

    /// The score of a block with this history entry.
    pub fn score_of(&self, seen: Seen) -> f64 {
        if let Some(t) = &self.returns {
            return t.score(class_of(seen.count), self.now.saturating_sub(seen.last));
        }
        let age = (self.now.saturating_sub(seen.last) + 1) as f64;
        let decay = if self.age_exponent == 1.0 {
            age
        } else {
            age.powf(self.age_exponent)
        };
        self.weights.weight(seen.count) / decay
    }

    /// The score of `hash` (an unknown block counts as used once, now);
    /// a block a hint keeps scores by [`kept_score`](Self::kept_score),
    /// one marked done -1.
    pub fn score(&self, hash: SequenceHash) -> f64 {
        match self.retained(hash) {
            Retained::No => {}
            Retained::Kept { due, .. } => return self.kept_score(due),
            Retained::Done => return DONE_SCORE,
        }
        let seen = self.get(hash).unwrap_or(Seen {
            count: 1,
            last: self.now,
            seq: u64::MAX,
        });
        self.score_of(seen)
    }

    /// The learned weights.
    pub fn weights(&self) -> &ReuseWeights {
        &self.weights
    }
}
