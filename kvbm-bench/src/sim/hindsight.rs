//! Calibrated predictors: how well could a policy do if it knew, for every
//! block, the true probability that it is used again soon *given what an
//! online policy can observe about it*?
//!
//! Each use of a block starts an *episode* that ends at its next use (its
//! *gap*, in requests) or never. A [`FeatureSet`] maps the use to a cell
//! key (use count, depth, prompt and output lengths, timing, …). A
//! [`GapTable`] holds, per cell, the gaps of all episodes of the trace: it is
//! fitted in hindsight on the very trace the policy then runs on (the
//! generous bound), or, as a check on memorisation, *cross-fitted*: the
//! first half of the trace is scored with the table of the second half and
//! vice versa. [`HindsightScorer`] turns a cell and the block's current age
//! into a rank for [`super::scored_tiers::ScoredTiers`]:
//! - [`Objective::Within`]: `P(used within the next H requests | cell,
//!   unused for a requests)`;
//! - [`Objective::Density`]: that probability per request of cache time the
//!   block occupies until its use or the horizon (expected hits per unit of
//!   occupancy).
//!
//! With fine enough cells every episode gets its own cell and the in-sample
//! table *is* the future (memorisation); the cross-fitted figure and the
//! cell counts printed next to it tell a real signal from that.

use std::collections::HashMap;

use super::scored_tiers::{BlockMeta, BlockScorer};
use super::trace_index::{NO_REQUEST, TraceIndex};

/// One observable feature of a block use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feature {
    /// Uses so far: 1, 2, 3, 4 or more.
    Count,
    /// Uses so far, capped at 32.
    CountFine,
    /// log2 of the requests since the block's previous use (0: first use).
    PrevGap,
    /// log2 of the milliseconds since the block's previous use.
    PrevGapMs,
    /// log2 of the block's depth in its prompt (position + 1).
    Depth,
    /// The block's position in its prompt, capped at 255.
    DepthFine,
    /// log2 of the prompt's blocks.
    PromptBlocks,
    /// The prompt's blocks, exactly.
    PromptBlocksFine,
    /// log2 of the output length.
    OutputLength,
    /// Output length in steps of 8 tokens.
    OutputLengthFine,
    /// log2 of the prompt's never-seen blocks.
    NewBlocks,
    /// log2 of the prompt's already-seen leading blocks.
    SeenPrefix,
    /// log2 of (blocks after this one in the prompt + 1).
    TailDistance,
    /// Turn number (see [`super::trace_index::RequestFacts::turn`]), capped
    /// at 32.
    Turn,
    /// Minute of the trace at arrival.
    Minute,
    /// Ten-second slot of the trace at arrival.
    TenSeconds,
    /// log2 of the requests that arrived in the 10 s before.
    Arrivals,
    /// Tokens in the prompt's last block, in steps of 64.
    InputFill,
}

fn lg(x: u64) -> u64 {
    (u64::BITS - x.leading_zeros()) as u64
}

impl Feature {
    /// Fine use count, previous gap and every request-shape feature (the
    /// fourth rung of [`FeatureSet::ladder`]).
    pub const SHAPE: [Feature; 8] = [
        Feature::CountFine,
        Feature::PrevGap,
        Feature::Depth,
        Feature::PromptBlocks,
        Feature::OutputLength,
        Feature::NewBlocks,
        Feature::SeenPrefix,
        Feature::TailDistance,
    ];

    /// Every feature (for one-at-a-time studies).
    pub const ALL: [Feature; 18] = [
        Feature::Count,
        Feature::CountFine,
        Feature::PrevGap,
        Feature::PrevGapMs,
        Feature::Depth,
        Feature::DepthFine,
        Feature::PromptBlocks,
        Feature::PromptBlocksFine,
        Feature::OutputLength,
        Feature::OutputLengthFine,
        Feature::NewBlocks,
        Feature::SeenPrefix,
        Feature::TailDistance,
        Feature::Turn,
        Feature::Minute,
        Feature::TenSeconds,
        Feature::Arrivals,
        Feature::InputFill,
    ];

    /// The feature's value for the use at `position` of request `request`.
    pub fn value(self, ix: &TraceIndex, request: usize, position: usize) -> u64 {
        let u = ix.use_at(request, position);
        let rq = ix.requests[request];
        let prev_gap =
            (u.prev_request != NO_REQUEST).then(|| request as u64 - u.prev_request as u64);
        match self {
            Feature::Count => u.count.min(4) as u64,
            Feature::CountFine => u.count.min(32) as u64,
            Feature::PrevGap => prev_gap.map_or(0, lg),
            Feature::PrevGapMs => prev_gap.map_or(0, |_| {
                let before = ix.timestamps_ms[u.prev_request as usize];
                1 + lg(ix.timestamps_ms[request].saturating_sub(before))
            }),
            Feature::Depth => lg(position as u64 + 1),
            Feature::DepthFine => (position as u64).min(255),
            Feature::PromptBlocks => lg(rq.prompt_blocks as u64),
            Feature::PromptBlocksFine => rq.prompt_blocks as u64,
            Feature::OutputLength => lg(ix.output_lengths[request] as u64),
            Feature::OutputLengthFine => ix.output_lengths[request] as u64 / 8,
            Feature::NewBlocks => lg(rq.new_blocks as u64),
            Feature::SeenPrefix => lg(rq.seen_prefix as u64),
            Feature::TailDistance => lg(rq.prompt_blocks as u64 - position as u64),
            Feature::Turn => rq.turn.min(32) as u64,
            Feature::Minute => ix.timestamps_ms[request] / 60_000,
            Feature::TenSeconds => ix.timestamps_ms[request] / 10_000,
            Feature::Arrivals => lg(rq.arrivals_10s as u64),
            Feature::InputFill => (ix.input_lengths[request] % 512) as u64 / 64,
        }
    }
}

/// A named combination of features; its cells are the distinct value
/// tuples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureSet {
    /// Label for tables.
    pub name: String,
    /// The features combined.
    pub features: Vec<Feature>,
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl FeatureSet {
    /// A set named `name` of `features`.
    pub fn new(name: impl Into<String>, features: &[Feature]) -> Self {
        Self {
            name: name.into(),
            features: features.to_vec(),
        }
    }

    /// The cell key of the use at `position` of request `request`.
    pub fn key(&self, ix: &TraceIndex, request: usize, position: usize) -> u64 {
        self.features.iter().fold(0x5eed, |k, f| {
            mix(k ^ mix(f.value(ix, request, position) ^ ((*f as u64) << 56)))
        })
    }

    /// The growing ladder of the bound study: age only; use count; fine
    /// count and previous gap; every request-shape feature; plus timing;
    /// everything in fine buckets.
    pub fn ladder() -> Vec<FeatureSet> {
        use Feature::*;
        let shape = Feature::SHAPE;
        let mut timing = shape.to_vec();
        timing.extend([Turn, Minute, PrevGapMs, Arrivals, InputFill]);
        vec![
            FeatureSet::new("age only", &[]),
            FeatureSet::new("uses 1/2/3/4+", &[Count]),
            FeatureSet::new("uses (fine) + previous gap", &[CountFine, PrevGap]),
            FeatureSet::new("+ depth, prompt/output/new/seen lengths, tail", &shape),
            FeatureSet::new("+ turn, minute, gap in ms, arrivals, fill", &timing),
            FeatureSet::new(
                "all, fine buckets",
                &[
                    CountFine,
                    PrevGap,
                    DepthFine,
                    PromptBlocksFine,
                    OutputLengthFine,
                    NewBlocks,
                    SeenPrefix,
                    TailDistance,
                    Turn,
                    TenSeconds,
                    PrevGapMs,
                    Arrivals,
                    InputFill,
                ],
            ),
        ]
    }
}

/// The episodes of one cell: their gaps (sorted) and how many never ended.
#[derive(Debug, Clone, Default)]
pub struct GapCell {
    gaps: Vec<u32>,
    /// `prefix[i]` = sum of `gaps[..i]` (filled when the table is fitted).
    prefix: Vec<u64>,
    never: u32,
}

impl GapCell {
    /// Episodes in the cell.
    pub fn episodes(&self) -> usize {
        self.gaps.len() + self.never as usize
    }

    fn returns_after(&self, age: u64) -> usize {
        self.gaps.len() - self.gaps.partition_point(|&g| (g as u64) <= age)
    }

    /// `P(gap in (age, age + horizon] | gap > age)`.
    pub fn within(&self, age: u64, horizon: u64) -> f64 {
        let alive = self.returns_after(age) + self.never as usize;
        if alive == 0 {
            return 0.0;
        }
        let within = self.returns_after(age) - self.returns_after(age + horizon);
        within as f64 / alive as f64
    }

    /// Returns within the horizon per request of occupancy until the
    /// return or the horizon, for episodes still alive at `age`.
    pub fn density(&self, age: u64, horizon: u64) -> f64 {
        let start = self.gaps.partition_point(|&g| (g as u64) <= age);
        let end = self.gaps.partition_point(|&g| (g as u64) <= age + horizon);
        let within = end - start;
        let alive = self.gaps.len() - start + self.never as usize;
        if alive == 0 {
            return 0.0;
        }
        let returned_at: u64 = if self.prefix.len() == self.gaps.len() + 1 {
            self.prefix[end] - self.prefix[start]
        } else {
            self.gaps[start..end].iter().map(|&g| g as u64).sum()
        };
        let occupied =
            (returned_at - within as u64 * age) as f64 + (alive - within) as f64 * horizon as f64;
        within as f64 / occupied.max(1.0)
    }
}

/// Cells of one feature set fitted on a set of episodes.
#[derive(Debug, Clone, Default)]
pub struct GapTable {
    cells: HashMap<u64, GapCell>,
}

impl GapTable {
    /// Fits `set` on the episodes that start in requests `from..to`.
    pub fn fit(ix: &TraceIndex, set: &FeatureSet, from: usize, to: usize) -> Self {
        let mut cells: HashMap<u64, GapCell> = HashMap::new();
        for r in from..to.min(ix.len()) {
            for i in 0..ix.requests[r].prompt_blocks as usize {
                let cell = cells.entry(set.key(ix, r, i)).or_default();
                match ix.gap(r, i) {
                    Some(g) => cell.gaps.push(g),
                    None => cell.never += 1,
                }
            }
        }
        for c in cells.values_mut() {
            c.gaps.sort_unstable();
            c.prefix = std::iter::once(0)
                .chain(c.gaps.iter().scan(0u64, |sum, &g| {
                    *sum += g as u64;
                    Some(*sum)
                }))
                .collect();
        }
        Self { cells }
    }

    /// Number of cells.
    pub fn cells(&self) -> usize {
        self.cells.len()
    }

    /// The cell for `key`, if it holds at least `min_support` episodes.
    pub fn cell(&self, key: u64, min_support: usize) -> Option<&GapCell> {
        self.cells.get(&key).filter(|c| c.episodes() >= min_support)
    }
}

/// How a block's cell and age become a score.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Objective {
    /// Probability of a use within the next `horizon` requests.
    Within {
        /// Look-ahead in requests.
        horizon: u64,
    },
    /// Uses within the horizon per request of occupancy.
    Density {
        /// Look-ahead in requests.
        horizon: u64,
    },
}

/// Where the scoring table comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// Fitted on the whole trace, the one it scores.
    InSample,
    /// Each half of the trace scored with the table fitted on the other.
    CrossFit,
}

/// Age buckets: quarter octaves of the age in requests. Scores are taken at
/// a bucket's lower edge, so a block's rank changes only when its age
/// crosses an edge.
pub fn age_bucket(age: u64) -> u64 {
    (((age + 1) as f64).log2() * 4.0).floor() as u64
}

/// The lowest age of `age`'s bucket.
pub fn bucket_floor(age: u64) -> u64 {
    let b = age_bucket(age);
    let mut lo = (2f64.powf(b as f64 / 4.0) - 1.0).floor().max(0.0) as u64;
    while age_bucket(lo) < b {
        lo += 1;
    }
    lo
}

/// The first age above `age` in a later bucket.
pub fn next_bucket_edge(age: u64) -> u64 {
    let b = age_bucket(age);
    let mut hi = (2f64.powf((b + 1) as f64 / 4.0) - 1.0)
        .floor()
        .max(age as f64 + 1.0) as u64;
    while hi > age + 1 && age_bucket(hi - 1) > b {
        hi -= 1;
    }
    while age_bucket(hi) == b {
        hi += 1;
    }
    hi
}

/// Scores blocks by a calibrated probability read from a hindsight table.
#[derive(Debug, Clone)]
pub struct HindsightScorer<'a> {
    ix: &'a TraceIndex,
    set: FeatureSet,
    objective: Objective,
    min_support: usize,
    /// Per fit half: the table of the feature set and the use-count
    /// fallback (index 0: first half's episodes; in-sample: both the same).
    tables: [(GapTable, GapTable); 2],
    split: usize,
    fit: Fit,
    counts: FeatureSet,
}

impl<'a> HindsightScorer<'a> {
    /// A scorer over `ix` with cells of `set`; a cell with fewer than
    /// `min_support` episodes falls back to the use-count cell.
    pub fn new(
        ix: &'a TraceIndex,
        set: FeatureSet,
        objective: Objective,
        fit: Fit,
        min_support: usize,
    ) -> Self {
        let counts = FeatureSet::new("uses", &[Feature::Count]);
        let n = ix.len();
        let split = n / 2;
        let tables = match fit {
            Fit::InSample => {
                let t = (
                    GapTable::fit(ix, &set, 0, n),
                    GapTable::fit(ix, &counts, 0, n),
                );
                [t.clone(), t]
            }
            Fit::CrossFit => [
                (
                    GapTable::fit(ix, &set, 0, split),
                    GapTable::fit(ix, &counts, 0, split),
                ),
                (
                    GapTable::fit(ix, &set, split, n),
                    GapTable::fit(ix, &counts, split, n),
                ),
            ],
        };
        Self {
            ix,
            set,
            objective,
            min_support: min_support.max(1),
            tables,
            split,
            fit,
            counts,
        }
    }

    /// Cells of the feature set's table(s), summed over both halves when
    /// cross-fitted.
    pub fn cells(&self) -> usize {
        match self.fit {
            Fit::InSample => self.tables[0].0.cells(),
            Fit::CrossFit => self.tables[0].0.cells() + self.tables[1].0.cells(),
        }
    }

    fn cell_for(&self, meta: &BlockMeta) -> Option<&GapCell> {
        let half = (meta.request as usize >= self.split) as usize;
        let (table, counts) = match self.fit {
            Fit::InSample => &self.tables[0],
            Fit::CrossFit => &self.tables[1 - half],
        };
        table.cell(meta.key, self.min_support).or_else(|| {
            let key = self
                .counts
                .key(self.ix, meta.request as usize, meta.position as usize);
            counts.cell(key, 1)
        })
    }
}

impl HindsightScorer<'_> {
    /// The calibrated probability that the use at `position` of request
    /// `request` is followed by another within `horizon` requests (the
    /// score at age 0).
    pub fn probability(&self, request: usize, position: usize, horizon: u64) -> f64 {
        let meta = BlockMeta {
            request: request as u32,
            position: position as u32,
            key: self.set.key(self.ix, request, position),
            count: 0,
            next_request: NO_REQUEST,
            partial: false,
        };
        self.cell_for(&meta).map_or(0.0, |c| c.within(0, horizon))
    }
}

/// Area under the ROC curve of `scores` for `labels` (ties count half):
/// the probability that a random positive scores above a random negative.
/// 0.5 is no information, 1 a perfect ranking. `None` without both classes.
pub fn auc(scored: &mut [(f64, bool)]) -> Option<f64> {
    scored.sort_by(|a, b| a.0.total_cmp(&b.0));
    let positives = scored.iter().filter(|s| s.1).count() as f64;
    let negatives = scored.len() as f64 - positives;
    if positives == 0.0 || negatives == 0.0 {
        return None;
    }
    // Sum of the (average, 1-based) ranks of the positives.
    let mut rank_sum = 0.0;
    let mut i = 0;
    while i < scored.len() {
        let mut j = i;
        while j < scored.len() && scored[j].0 == scored[i].0 {
            j += 1;
        }
        let average = (i + 1 + j) as f64 / 2.0;
        rank_sum += average * scored[i..j].iter().filter(|s| s.1).count() as f64;
        i = j;
    }
    Some((rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives))
}

/// Probability (or density) as a rank: positive `f64`s order like their bits.
pub fn rank_of(score: f64) -> u64 {
    score.max(0.0).to_bits()
}

impl BlockScorer for HindsightScorer<'_> {
    fn key(&self, request: usize, position: usize) -> u64 {
        self.set.key(self.ix, request, position)
    }

    fn rank(&self, meta: &BlockMeta, now: u64) -> u64 {
        let age = bucket_floor(now.saturating_sub(meta.request as u64));
        let Some(cell) = self.cell_for(meta) else {
            return 0;
        };
        rank_of(match self.objective {
            Objective::Within { horizon } => cell.within(age, horizon),
            Objective::Density { horizon } => cell.density(age, horizon),
        })
    }

    fn next_change(&self, meta: &BlockMeta, now: u64) -> Option<u64> {
        let age = now.saturating_sub(meta.request as u64);
        Some(meta.request as u64 + next_bucket_edge(age))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_edges_are_consistent() {
        for age in 0..5000 {
            let lo = bucket_floor(age);
            let hi = next_bucket_edge(age);
            assert!(lo <= age && age < hi, "{age}: {lo}..{hi}");
            assert_eq!(age_bucket(lo), age_bucket(age));
            assert_eq!(age_bucket(hi - 1), age_bucket(age));
            assert!(age_bucket(hi) > age_bucket(age));
            assert!(lo == 0 || age_bucket(lo - 1) < age_bucket(age));
        }
    }

    #[test]
    fn auc_of_known_rankings() {
        let mut perfect = [(0.1, false), (0.9, true), (0.2, false), (0.8, true)];
        assert_eq!(auc(&mut perfect), Some(1.0));
        let mut ties = [(0.5, false), (0.5, true)];
        assert_eq!(auc(&mut ties), Some(0.5));
        let mut reversed = [(0.9, false), (0.1, true)];
        assert_eq!(auc(&mut reversed), Some(0.0));
        // One of the two positives ranks above the one negative.
        let mut half = [(0.1, true), (0.5, false), (0.9, true)];
        assert_eq!(auc(&mut half), Some(0.5));
        assert_eq!(auc(&mut [(0.3, true)]), None);
    }

    #[test]
    fn cell_probabilities() {
        let c = GapCell {
            gaps: vec![1, 5, 10, 100],
            prefix: vec![0, 1, 6, 16, 116],
            never: 4,
        };
        assert_eq!(c.episodes(), 8);
        assert!((c.within(0, 10) - 3.0 / 8.0).abs() < 1e-12);
        assert!((c.within(5, 10) - 1.0 / 6.0).abs() < 1e-12);
        assert!((c.within(10, 1000) - 1.0 / 5.0).abs() < 1e-12);
        assert_eq!(c.within(100, 10), 0.0);
        // At age 5: one return at 10 (5 requests of occupancy), 100 and
        // the 4 nevers occupy the whole horizon of 10.
        assert!((c.density(5, 10) - 1.0 / (5.0 + 50.0)).abs() < 1e-12);
    }
}
