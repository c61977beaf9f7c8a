//! The online counterpart of [`super::hindsight`]: the same cells and
//! objectives, learned from what has happened so far.
//!
//! Per cell the learner counts the episodes that entered it and, per
//! quarter-octave age bucket, those that ended (the block was used again)
//! at that age; an episode still open counts as alive at every age, as in
//! the study's winner. The score rows are recomputed every
//! `refresh_every` requests. A cell with fewer than `min_support` entered
//! episodes falls back to its use-count cell (1, 2, 3, 4+), so fine
//! feature combinations cost nothing while they have no data.

use std::collections::HashMap;

use super::hindsight::{
    FeatureSet, Objective, age_bucket, bucket_floor, next_bucket_edge, rank_of,
};
use super::replay::RequestCtx;
use super::scored_tiers::{BlockMeta, BlockScorer};
use super::trace_index::TraceIndex;
use kvbm_testkit::trace::BlockId;

const BUCKETS: usize = 80;

#[derive(Debug, Clone)]
struct CellStats {
    entered: f64,
    returned: [f64; BUCKETS],
}

impl Default for CellStats {
    fn default() -> Self {
        Self {
            entered: 0.0,
            returned: [0.0; BUCKETS],
        }
    }
}

fn bucket(age: u64) -> usize {
    (age_bucket(age) as usize).min(BUCKETS - 1)
}

impl CellStats {
    fn row(&self, objective: Objective) -> [f32; BUCKETS] {
        let r = &self.returned;
        let total: f64 = r.iter().sum();
        let n = self.entered.max(total).max(1.0);
        let mut suffix = [0.0; BUCKETS + 1];
        for i in (0..BUCKETS).rev() {
            suffix[i] = suffix[i + 1] + r[i];
        }
        let mut row = [0.0f32; BUCKETS];
        for (i, slot) in row.iter_mut().enumerate() {
            let age = (2f64.powf(i as f64 / 4.0) - 1.0).ceil() as u64;
            let alive = (n - (total - suffix[i])).max(1e-9);
            *slot = match objective {
                Objective::Within { horizon } => {
                    let end = bucket(age + horizon).max(i);
                    (suffix[i] - suffix[end]) / alive
                }
                Objective::Density { horizon } => {
                    let end = bucket(age + horizon).max(i);
                    let mut occupied = 0.0;
                    for (j, &returns) in r.iter().enumerate().take(end).skip(i) {
                        let at = 2f64.powf(j as f64 / 4.0) - 1.0;
                        occupied += returns * (at - age as f64).max(1.0);
                    }
                    let within = suffix[i] - suffix[end];
                    occupied += (alive - within).max(0.0) * horizon as f64;
                    within / occupied.max(1.0)
                }
            } as f32;
        }
        row
    }
}

/// Learns `P(use soon | cell, age)` online and ranks blocks by it.
#[derive(Debug, Clone)]
pub struct OnlineScorer<'a> {
    ix: &'a TraceIndex,
    set: FeatureSet,
    counts: FeatureSet,
    objective: Objective,
    min_support: f64,
    refresh_every: usize,
    /// Block -> (last request, its cell, its use-count cell).
    history: HashMap<BlockId, (u32, u64, u64)>,
    stats: HashMap<u64, CellStats>,
    count_stats: HashMap<u64, CellStats>,
    rows: HashMap<u64, [f32; BUCKETS]>,
    count_rows: HashMap<u64, [f32; BUCKETS]>,
    epoch: u64,
}

impl<'a> OnlineScorer<'a> {
    /// A learner over cells of `set`.
    pub fn new(
        ix: &'a TraceIndex,
        set: FeatureSet,
        objective: Objective,
        min_support: usize,
        refresh_every: usize,
    ) -> Self {
        Self {
            ix,
            set,
            counts: FeatureSet::new("uses", &[super::hindsight::Feature::Count]),
            objective,
            min_support: min_support as f64,
            refresh_every: refresh_every.max(1),
            history: HashMap::new(),
            stats: HashMap::new(),
            count_stats: HashMap::new(),
            rows: HashMap::new(),
            count_rows: HashMap::new(),
            epoch: 0,
        }
    }

    fn refresh(&mut self) {
        let objective = self.objective;
        self.rows = self
            .stats
            .iter()
            .filter(|(_, s)| s.entered >= self.min_support)
            .map(|(&k, s)| (k, s.row(objective)))
            .collect();
        self.count_rows = self
            .count_stats
            .iter()
            .map(|(&k, s)| (k, s.row(objective)))
            .collect();
        self.epoch += 1;
    }
}

impl BlockScorer for OnlineScorer<'_> {
    fn key(&self, request: usize, position: usize) -> u64 {
        self.set.key(self.ix, request, position)
    }

    fn rank(&self, meta: &BlockMeta, now: u64) -> u64 {
        let b = bucket(bucket_floor(now.saturating_sub(meta.request as u64)));
        let row = self.rows.get(&meta.key).or_else(|| {
            let ck = self
                .counts
                .key(self.ix, meta.request as usize, meta.position as usize);
            self.count_rows.get(&ck)
        });
        // No data yet: every block is equal and recency decides.
        rank_of(row.map_or(0.0, |r| r[b] as f64))
    }

    fn next_change(&self, meta: &BlockMeta, now: u64) -> Option<u64> {
        let age = now.saturating_sub(meta.request as u64);
        Some(meta.request as u64 + next_bucket_edge(age))
    }

    fn observe(&mut self, ctx: &RequestCtx<'_>) {
        let t = ctx.index;
        for i in 0..ctx.blocks().len() {
            let b = ctx.blocks()[i];
            if let Some((r0, k0, c0)) = self.history.get(&b).copied() {
                let a = bucket(t as u64 - r0 as u64);
                self.stats.entry(k0).or_default().returned[a] += 1.0;
                self.count_stats.entry(c0).or_default().returned[a] += 1.0;
            }
            let k = self.set.key(self.ix, t, i);
            let c = self.counts.key(self.ix, t, i);
            self.stats.entry(k).or_default().entered += 1.0;
            self.count_stats.entry(c).or_default().entered += 1.0;
            self.history.insert(b, (t as u32, k, c));
        }
        if t.is_multiple_of(self.refresh_every) {
            self.refresh();
        }
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }
}
