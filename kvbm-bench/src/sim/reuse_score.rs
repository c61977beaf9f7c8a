//! The policy study's winner: keep the blocks most likely to be used again
//! soon, with that likelihood learned online per *use-count class* and age.
//!
//! Every block kvbm has seen has a *use count* `k` (requests that carried
//! it) and a *last use* `t` (index of the last such request). Blocks that
//! came back before come back more often: in the Mooncake conversation
//! trace a block seen once returns 26% of the time, seen twice 42%, three
//! times 50%, four or more 78%. For each class `c = min(k, 4)` the policy
//! counts blocks that entered the class and, per quarter-octave age bucket,
//! those that returned at that age (the history of recently seen ids keeps
//! returns observable after a block left every tier). From these it derives
//! the winning score ([`ScoreModel::ReturnWithin`]):
//!
//! `score(c, a) = P(used within the next H requests | class c, unused for a)`
//!
//! (H = 250), and evicts the lowest. The alternative
//! [`ScoreModel::Hyperbolic`] uses `P(ever used again | c) / (a + 1)`.
//!
//! Two orderings make this cheap and safe, and [`ReuseWeights::refresh`]
//! enforces both on the learned table:
//! - the score never increases with age within a class, so each class's
//!   least recent block is its lowest-scored one: eviction compares the
//!   tails of `K` per-class recency lists, O(K); everything else is O(1);
//! - the score never decreases with the use count. A prompt's blocks form
//!   a chain and a parent is used at least as often and as recently as
//!   each child, so a parent never scores below its child: eviction takes
//!   leaves first and does not strand a child behind a missing parent
//!   (which could never hit, as hits are prefix-contiguous). Within a
//!   request, blocks are stamped deepest first so ties also go to the leaf.
//!
//! Optional [`ClassFeature`]s split the classes by a request feature; the
//! study found none that helps enough to keep.

use std::collections::HashMap;

use super::recency::RecencyList;
use super::replay::{RequestCtx, Tier};
use super::tiered::KvbmTiers;
use kvbm_testkit::trace::BlockId;

/// Number of use-count classes: 1, 2, 3, and 4 or more.
pub const COUNT_CLASSES: usize = 4;

/// Number of output-length groups when [`ClassFeature::OutputLength`] is on:
/// `floor(log2(output_length))`, capped.
pub const OUTPUT_GROUPS: usize = 12;

/// Extra request feature that splits the use-count classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClassFeature {
    /// Use count only.
    #[default]
    None,
    /// Use count × log2 of the output length of the block's last request
    /// (known when the request finishes, i.e. before any offload).
    OutputLength,
    /// Use count × log2 of the block's depth in its prompt (position + 1).
    /// Scores never increase with depth, so parents still outrank children.
    Depth,
    /// Use count × log2 of how many leading blocks of the block's last
    /// request kvbm had seen before (1 = only a shared system prompt).
    SeenPrefix,
}

/// Number of seen-prefix groups when [`ClassFeature::SeenPrefix`] is on.
pub const SEEN_PREFIX_GROUPS: usize = 6;

/// Number of depth groups when [`ClassFeature::Depth`] is on.
pub const DEPTH_GROUPS: usize = 8;

impl ClassFeature {
    fn groups(self) -> usize {
        match self {
            ClassFeature::None => 1,
            ClassFeature::OutputLength => OUTPUT_GROUPS,
            ClassFeature::Depth => DEPTH_GROUPS,
            ClassFeature::SeenPrefix => SEEN_PREFIX_GROUPS,
        }
    }

    fn group_of(self, output_length: u32, position: usize, seen_prefix: usize) -> usize {
        match self {
            ClassFeature::None => 0,
            ClassFeature::OutputLength => {
                (u32::BITS - output_length.leading_zeros()).min(OUTPUT_GROUPS as u32 - 1) as usize
            }
            ClassFeature::SeenPrefix => {
                ((usize::BITS - seen_prefix.leading_zeros()) as usize).min(SEEN_PREFIX_GROUPS - 1)
            }
            ClassFeature::Depth => {
                (usize::BITS - (position + 1).leading_zeros()).min(DEPTH_GROUPS as u32) as usize - 1
            }
        }
    }
}

fn count_class(count: u32) -> usize {
    (count.max(1) as usize - 1).min(COUNT_CLASSES - 1)
}

/// How a block's class and age turn into a score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScoreModel {
    /// `w[class]^exponent / (age + 1)`: the learned probability that the
    /// class returns at all, spread hyperbolically over age.
    Hyperbolic {
        /// Exponent applied to the weight.
        exponent: f64,
    },
    /// The learned probability that a block of this class, still unused at
    /// this age, is used within the next `horizon` requests.
    ReturnWithin {
        /// Look-ahead window in requests.
        horizon: u64,
    },
    /// Like `ReturnWithin`, divided by the expected cache time the block
    /// occupies until it returns or the horizon ends (hits per request of
    /// occupancy).
    DensityWithin {
        /// Look-ahead window in requests.
        horizon: u64,
    },
    /// Like `ReturnWithin`, with the returns of an age bucket spread evenly
    /// over the bucket's ages, so that a horizon shorter than a bucket
    /// still counts the part of the bucket it covers.
    ReturnWithinSpread {
        /// Look-ahead window in requests.
        horizon: u64,
    },
}

/// Age buckets: quarter octaves of the age in requests.
const AGE_BUCKETS: usize = 80;

fn age_bucket(age: u64) -> usize {
    (((age + 1) as f64).log2() * 4.0)
        .floor()
        .min((AGE_BUCKETS - 1) as f64) as usize
}

/// The lowest age of bucket `i`.
fn bucket_start(i: usize) -> f64 {
    2f64.powf(i as f64 / 4.0) - 1.0
}

/// Returns at ages in `[start of bucket i, that + horizon)`, each bucket's
/// returns spread evenly over its ages.
fn spread_within(returned: &[f64; AGE_BUCKETS], i: usize, horizon: u64) -> f64 {
    let lo = bucket_start(i);
    let hi = lo + horizon as f64;
    let mut sum = 0.0;
    for (j, &r) in returned.iter().enumerate().skip(i) {
        let (a, b) = (bucket_start(j), bucket_start(j + 1));
        if a >= hi {
            break;
        }
        let overlap = (b.min(hi) - a).max(0.0);
        sum += r * overlap / (b - a);
    }
    sum
}

/// Learned reuse statistics per class, and the scores derived from them.
///
/// Each class counts the blocks that *entered* it (a use left them there)
/// and, per age bucket, those that *returned* (were used again) at that age.
/// Scores are made non-increasing in age within a class and non-decreasing
/// along the use count within a feature group, so that (a) each class's
/// least recent block is its lowest-scored one and (b) a parent, used at
/// least as often and as recently as its child, never scores below it.
#[derive(Debug, Clone)]
pub struct ReuseWeights {
    model: ScoreModel,
    /// Groups are depths: scores must not increase from a group to the next.
    groups_are_depths: bool,
    entered: Vec<f64>,
    returned: Vec<[f64; AGE_BUCKETS]>,
    /// Per class, per age bucket.
    table: Vec<[f64; AGE_BUCKETS]>,
}

impl ReuseWeights {
    /// Statistics for `classes` classes (a multiple of [`COUNT_CLASSES`]),
    /// starting from a weak prior of 1 in 4 returning.
    pub fn new(classes: usize, model: ScoreModel, groups_are_depths: bool) -> Self {
        let mut returned = vec![[0.0; AGE_BUCKETS]; classes];
        for r in &mut returned {
            // Prior: two returns spread over ages 16..4096.
            for (i, slot) in r.iter_mut().enumerate().take(48).skip(16) {
                *slot = 2.0 / 32.0 * (i >= 16) as u8 as f64;
            }
        }
        let mut w = Self {
            model,
            groups_are_depths,
            entered: vec![8.0; classes],
            returned,
            table: vec![[0.0; AGE_BUCKETS]; classes],
        };
        w.refresh();
        w
    }

    /// Records a use that moved a block from `previous` (its class and age
    /// since its last use, if it had been seen) into class `now`.
    pub fn observe(&mut self, previous: Option<(usize, u64)>, now: usize) {
        if let Some((p, age)) = previous {
            self.returned[p][age_bucket(age)] += 1.0;
        }
        self.entered[now] += 1.0;
    }

    /// Multiplies every learned count by `factor` (no-op at 1 or above).
    pub fn decay(&mut self, factor: f64) {
        if factor >= 1.0 {
            return;
        }
        for c in 0..self.entered.len() {
            self.entered[c] *= factor;
            for r in self.returned[c].iter_mut() {
                *r *= factor;
            }
        }
    }

    /// Recomputes the score table from the counters (cheap; call
    /// periodically).
    pub fn refresh(&mut self) {
        for c in 0..self.entered.len() {
            let r = &self.returned[c];
            let total: f64 = r.iter().sum();
            let n = self.entered[c].max(total).max(1.0);
            // suffix[i] = returns at ages in bucket i or later.
            let mut suffix = [0.0; AGE_BUCKETS + 1];
            for i in (0..AGE_BUCKETS).rev() {
                suffix[i] = suffix[i + 1] + r[i];
            }
            let row = &mut self.table[c];
            for i in 0..AGE_BUCKETS {
                let alive = (n - (total - suffix[i])).max(1e-9);
                row[i] = match self.model {
                    ScoreModel::Hyperbolic { .. } => suffix[0] / n,
                    ScoreModel::ReturnWithin { horizon } => {
                        let age = 2f64.powf(i as f64 / 4.0) - 1.0;
                        let end = age_bucket(age as u64 + horizon);
                        (suffix[i] - suffix[end]) / alive
                    }
                    ScoreModel::ReturnWithinSpread { horizon } => {
                        spread_within(r, i, horizon) / alive
                    }
                    ScoreModel::DensityWithin { horizon } => {
                        // Returns within the horizon per request of
                        // occupancy until the return or the horizon.
                        let age = 2f64.powf(i as f64 / 4.0) - 1.0;
                        let end = age_bucket(age as u64 + horizon);
                        let mut occupancy = 0.0;
                        for (j, &returns) in r.iter().enumerate().take(end).skip(i) {
                            let at = 2f64.powf(j as f64 / 4.0) - 1.0;
                            occupancy += returns * (at - age).max(1.0);
                        }
                        let within = suffix[i] - suffix[end];
                        occupancy += (alive - within).max(0.0) * horizon as f64;
                        within / occupancy.max(1e-9)
                    }
                };
            }
            for i in (0..AGE_BUCKETS - 1).rev() {
                row[i] = row[i].max(row[i + 1]);
            }
        }
        for g in 0..self.table.len() / COUNT_CLASSES {
            for k in 1..COUNT_CLASSES {
                let c = g * COUNT_CLASSES + k;
                for i in 0..AGE_BUCKETS {
                    self.table[c][i] = self.table[c][i].max(self.table[c - 1][i]);
                }
            }
        }
        if self.groups_are_depths {
            let groups = self.table.len() / COUNT_CLASSES;
            for g in (0..groups.saturating_sub(1)).rev() {
                for k in 0..COUNT_CLASSES {
                    let (shallow, deep) = (g * COUNT_CLASSES + k, (g + 1) * COUNT_CLASSES + k);
                    for i in 0..AGE_BUCKETS {
                        self.table[shallow][i] = self.table[shallow][i].max(self.table[deep][i]);
                    }
                }
            }
        }
        if let ScoreModel::Hyperbolic { exponent } = self.model {
            for row in &mut self.table {
                for v in row.iter_mut() {
                    *v = v.max(1e-9).powf(exponent);
                }
            }
        }
    }

    /// Score of a block of `class` last used `age` requests ago.
    pub fn score(&self, class: usize, age: u64) -> f64 {
        match self.model {
            ScoreModel::Hyperbolic { .. } => self.table[class][0] / (age + 1) as f64,
            ScoreModel::ReturnWithin { .. }
            | ScoreModel::DensityWithin { .. }
            | ScoreModel::ReturnWithinSpread { .. } => {
                // Ties (equal buckets) go to the younger block.
                self.table[class][age_bucket(age)] - age as f64 * 1e-15
            }
        }
    }

    /// Probability that a block of `class` returns at all, as learned.
    pub fn return_probability(&self, class: usize) -> f64 {
        let total: f64 = self.returned[class].iter().sum();
        total / self.entered[class].max(total).max(1.0)
    }
}

/// What kvbm remembers about a block it has seen.
#[derive(Debug, Clone, Copy)]
struct Seen {
    count: u32,
    last: u64,
    class: u16,
    /// Was the partially filled last block of a request.
    partial: bool,
}

/// One kvbm tier ranked by reuse score.
#[derive(Debug, Clone)]
struct ScoredTier {
    capacity: usize,
    classes: Vec<RecencyList>,
    meta: HashMap<BlockId, Seen>,
}

impl ScoredTier {
    fn new(capacity: usize, classes: usize) -> Self {
        Self {
            capacity,
            classes: (0..classes).map(|_| RecencyList::default()).collect(),
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
        self.classes[seen.class as usize].remove(b);
        Some(seen)
    }

    fn insert(&mut self, b: BlockId, seen: Seen) {
        self.remove(b);
        self.classes[seen.class as usize].touch(b);
        self.meta.insert(b, seen);
    }

    /// The lowest-scored block and its score.
    fn lowest(&self, weights: &ReuseWeights, now: u64) -> Option<(BlockId, f64)> {
        let mut best: Option<(BlockId, f64)> = None;
        for list in &self.classes {
            if let Some(b) = list.peek_lru()
                && let Some(&seen) = self.meta.get(&b)
            {
                let s = score(seen, weights, now);
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
        if score(seen, weights, now) < low {
            return Some((b, seen));
        }
        let out = self.remove(victim).map(|s| (victim, s));
        self.insert(b, seen);
        out
    }
}

fn score(seen: Seen, weights: &ReuseWeights, now: u64) -> f64 {
    weights.score(seen.class as usize, now.saturating_sub(seen.last))
}

/// Parameters of [`ReuseScoreTiers`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReuseScoreConfig {
    /// The G1 capacity (to size the history).
    pub g1: usize,
    /// G2 capacity in blocks.
    pub g2: usize,
    /// G3 capacity in blocks.
    pub g3: usize,
    /// Blocks whose statistics are remembered after they left every tier
    /// ("ghosts"), as a multiple of the total capacity (G1 + G2 + G3).
    /// Blocks in a tier are always remembered.
    pub history_factor: f64,
    /// Never admit a partially filled last block (engines never reuse one).
    pub skip_partial: bool,
    /// How class and age make a score.
    pub model: ScoreModel,
    /// How G3 scores, when it differs from G2 (`None`: `model`). G3's
    /// ranking alone decides which blocks leave every tier.
    pub g3_model: Option<ScoreModel>,
    /// Request feature splitting the classes.
    pub feature: ClassFeature,
    /// What the policy's clock counts (ages and the horizon are in its unit).
    pub clock: Clock,
    /// Factor applied to all learned counts at each refresh (1 = never
    /// forget; below 1 follows a changing workload).
    pub decay: f64,
}

/// The unit of the policy's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Clock {
    /// One tick per request.
    #[default]
    Requests,
    /// One tick per prompt block of each request (cache pressure).
    Blocks,
}

impl ReuseScoreConfig {
    /// The study's winning settings for tiers of `caps`: partial blocks
    /// skipped, history of 4× the total capacity, classes by use count
    /// only, score = probability of a use within the next 250 requests.
    pub fn for_tiers(caps: super::tiered::TierCapacities) -> Self {
        Self {
            g1: caps.g1,
            g2: caps.g2,
            g3: caps.g3,
            history_factor: 4.0,
            skip_partial: true,
            model: ScoreModel::ReturnWithin { horizon: 250 },
            g3_model: None,
            feature: ClassFeature::None,
            clock: Clock::Requests,
            decay: 1.0,
        }
    }
}

/// kvbm's G2 and G3 ranked by reuse score; G2 is a victim cache of G1 and
/// G3 a victim cache of G2, all three exclusive.
///
/// Per request: every block's use count, last use and class are updated
/// (deepest block first); the request's blocks leave G2/G3 (the engine holds
/// them in G1 now); each block G1 evicts is offered to G2, where it replaces
/// the lowest-scored block if it scores higher; whatever G2 pushes out is
/// offered to G3 the same way; what G3 pushes out is dropped (its history
/// remains).
#[derive(Debug, Clone)]
pub struct ReuseScoreTiers {
    config: ReuseScoreConfig,
    g2: ScoredTier,
    g3: ScoredTier,
    /// Every block in some tier (G1 included), plus ghosts.
    history: HashMap<BlockId, Seen>,
    /// Ghosts: blocks that left every tier, oldest departure first.
    ghosts: RecencyList,
    ghost_cap: usize,
    weights: ReuseWeights,
    /// G3's weights when it has a model of its own.
    g3_weights: Option<ReuseWeights>,
    now: u64,
}

impl ReuseScoreTiers {
    /// A policy with `config`.
    pub fn new(config: ReuseScoreConfig) -> Self {
        let total = config.g1 + config.g2 + config.g3;
        let ghost_cap = ((total as f64) * config.history_factor.max(0.0)).ceil() as usize;
        let classes = config.feature.groups() * COUNT_CLASSES;
        Self {
            config,
            g2: ScoredTier::new(config.g2, classes),
            g3: ScoredTier::new(config.g3, classes),
            history: HashMap::with_capacity(total + ghost_cap),
            ghosts: RecencyList::with_capacity(ghost_cap),
            ghost_cap,
            weights: ReuseWeights::new(
                classes,
                config.model,
                config.feature == ClassFeature::Depth,
            ),
            g3_weights: config
                .g3_model
                .map(|m| ReuseWeights::new(classes, m, config.feature == ClassFeature::Depth)),
            now: 0,
        }
    }

    /// The learned weights.
    pub fn weights(&self) -> &ReuseWeights {
        &self.weights
    }

    fn see(&mut self, b: BlockId, partial: bool, group: usize) {
        let now = self.now;
        let previous = self.history.get(&b).copied();
        let count = previous.map_or(0, |s| s.count) + 1;
        let class = group * COUNT_CLASSES + count_class(count);
        let previous_use = previous.map(|s| (s.class as usize, now.saturating_sub(s.last)));
        self.weights.observe(previous_use, class);
        if let Some(w) = &mut self.g3_weights {
            w.observe(previous_use, class);
        }
        self.history.insert(
            b,
            Seen {
                count,
                last: now,
                class: class as u16,
                partial: partial || previous.is_some_and(|s| s.partial),
            },
        );
        // Resident again (the engine holds it in G1): not a ghost.
        self.ghosts.remove(b);
    }

    /// `b` left every tier: remember it as a ghost, forgetting the oldest.
    fn depart(&mut self, b: BlockId) {
        self.ghosts.touch(b);
        while self.ghosts.len() > self.ghost_cap {
            if let Some(old) = self.ghosts.pop_lru() {
                self.history.remove(&old);
            }
        }
    }
}

impl KvbmTiers for ReuseScoreTiers {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        if self.g2.contains(block) {
            Some(Tier::G2)
        } else if self.g3.contains(block) {
            Some(Tier::G3)
        } else {
            None
        }
    }

    fn record(&mut self, ctx: &RequestCtx<'_>, g1_evicted: &[BlockId]) {
        self.now = match self.config.clock {
            Clock::Requests => ctx.index as u64 + 1,
            Clock::Blocks => (ctx.first_position + ctx.blocks().len()) as u64,
        };
        let feature = self.config.feature;
        let output_length = ctx.request.output_length;
        let blocks = ctx.blocks();
        let seen_prefix = blocks
            .iter()
            .take_while(|b| self.history.contains_key(b))
            .count();
        for (i, &b) in blocks.iter().enumerate().rev() {
            let group = feature.group_of(output_length, i, seen_prefix);
            self.see(b, ctx.last_block_partial && i + 1 == blocks.len(), group);
            self.g2.remove(b);
            self.g3.remove(b);
        }
        if ctx.index.is_multiple_of(256) {
            for w in std::iter::once(&mut self.weights).chain(self.g3_weights.as_mut()) {
                w.decay(self.config.decay);
                w.refresh();
            }
        }
        let now = self.now;
        for &b in g1_evicted {
            // Blocks in G1 are never forgotten, so this fallback only
            // serves a caller reporting evictions of blocks it never showed:
            // seen once, in the least favoured group.
            let seen = self.history.get(&b).copied().unwrap_or(Seen {
                count: 1,
                last: now,
                class: ((feature.groups() - 1) * COUNT_CLASSES) as u16,
                partial: false,
            });
            if self.config.skip_partial && seen.partial {
                self.depart(b);
                continue;
            }
            if let Some((out, s)) = self.g2.offer(b, seen, &self.weights, now)
                && let Some((gone, _)) = self.g3.offer(
                    out,
                    s,
                    self.g3_weights.as_ref().unwrap_or(&self.weights),
                    now,
                )
            {
                self.depart(gone);
            }
        }
    }

    fn occupancy(&self) -> (usize, usize) {
        (self.g2.len(), self.g3.len())
    }

    fn cached(&self) -> Vec<(BlockId, Tier)> {
        let g2 = self.g2.meta.keys().map(|&b| (b, Tier::G2));
        g2.chain(self.g3.meta.keys().map(|&b| (b, Tier::G3)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tiered::{TierCapacities, TieredSim};
    use super::super::{ReplayStats, replay};
    use super::*;
    use kvbm_testkit::trace::{SyntheticConfig, generate_synthetic};

    fn run(caps: TierCapacities, g3_model: Option<ScoreModel>) -> ReplayStats {
        let synth = SyntheticConfig {
            conversations: 60,
            ..SyntheticConfig::default()
        };
        let requests = generate_synthetic(&synth);
        let config = ReuseScoreConfig {
            g3_model,
            ..ReuseScoreConfig::for_tiers(caps)
        };
        let mut sim = TieredSim::new(caps.g1, ReuseScoreTiers::new(config));
        replay(&requests, synth.block_tokens, &mut sim)
    }

    #[test]
    fn a_g3_model_ranks_g3_only() {
        let caps = TierCapacities {
            g1: 40,
            g2: 60,
            g3: 120,
        };
        let base = run(caps, None);
        // G3's own copy of the shared model changes nothing.
        let same = ScoreModel::ReturnWithin { horizon: 250 };
        assert_eq!(run(caps, Some(same)), base);
        // Another G3 model leaves a tiering without G3 as it was.
        let other = Some(ScoreModel::ReturnWithin { horizon: 20 });
        let no_g3 = TierCapacities { g3: 0, ..caps };
        assert_eq!(run(no_g3, other), run(no_g3, None));
        assert_ne!(run(caps, other), base, "G3 ranks by its own model");
    }

    #[test]
    fn spread_counts_the_covered_share_of_each_bucket() {
        let mut r = [0.0; AGE_BUCKETS];
        r[40] = 8.0;
        let width = bucket_start(41) - bucket_start(40);
        // Half of bucket 40's ages: half of its returns.
        let half = spread_within(&r, 40, (width / 2.0) as u64);
        assert!((half - 4.0).abs() < 0.05, "{half}");
        // A horizon past the bucket takes all of it, and nothing before i.
        assert_eq!(spread_within(&r, 40, 1 << 20), 8.0);
        assert_eq!(spread_within(&r, 41, 1 << 20), 0.0);
    }

    #[test]
    fn spread_keeps_old_ages_apart_where_whole_buckets_score_nothing() {
        // Returns only at ages around 3000, where a bucket spans ~550
        // requests: a horizon of 350 never reaches the next bucket.
        let (model, spread) = (
            ScoreModel::ReturnWithin { horizon: 350 },
            ScoreModel::ReturnWithinSpread { horizon: 350 },
        );
        let mut a = ReuseWeights::new(COUNT_CLASSES, model, false);
        let mut b = ReuseWeights::new(COUNT_CLASSES, spread, false);
        for w in [&mut a, &mut b] {
            for _ in 0..1000 {
                w.observe(None, 0);
            }
            for _ in 0..100 {
                w.observe(Some((0, 3000)), 1);
                w.observe(Some((3, 3000)), 3);
                w.observe(Some((3, 3000)), 3);
            }
            w.refresh();
        }
        assert!(a.score(0, 3000).abs() < 1e-9 && a.score(3, 3000).abs() < 1e-9);
        assert!(b.score(3, 3000) > b.score(0, 3000));
        assert!(b.score(0, 3000) > 0.0);
    }
}
