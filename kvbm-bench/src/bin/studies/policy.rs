//! The policy study: every candidate kvbm policy on every tiered
//! configuration, printed as a table. Run with
//! `cargo run --release -p kvbm-bench --bin studies -- policy_study`.

use crate::sim_support;

use ClassFeature::{Depth, None as CountOnly, OutputLength, SeenPrefix};
use kvbm_bench::sim::reuse_score::{
    ClassFeature, Clock, ReuseScoreConfig, ReuseScoreTiers, ScoreModel,
};
use kvbm_bench::sim::{
    BeladySim, CacheSim, KvbmTiers, LruFeed, LruSim, LruTiers, ReplayStats, RequestCtx, Tier,
    TierCapacities, TieredSim, capacity_for, replay,
};
use kvbm_testkit::trace::{MOONCAKE_BLOCK_TOKENS, Request};

const CONFIGS: [(&str, [f64; 3]); 3] = [
    ("conversation", [0.01, 0.04, 0.0]),
    ("conversation", [0.01, 0.04, 0.15]),
    ("synthetic", [0.01, 0.09, 0.0]),
];

fn row(policy: &str, name: &str, f: [f64; 3], s: &ReplayStats) {
    println!(
        "| {policy} | {name} | {:.0}%+{:.0}%+{:.0}% | {:.2} | {:.2} / {:.2} / {:.2} |",
        f[0] * 100.0,
        f[1] * 100.0,
        f[2] * 100.0,
        s.hit_rate_pct(),
        s.tier_rate_pct(Tier::G1),
        s.tier_rate_pct(Tier::G2),
        s.tier_rate_pct(Tier::G3),
    );
}

fn tiered<K: KvbmTiers>(requests: &[Request], g1: usize, kvbm: K) -> ReplayStats {
    replay(
        requests,
        MOONCAKE_BLOCK_TOKENS,
        &mut TieredSim::new(g1, kvbm),
    )
}

fn single<C: CacheSim>(requests: &[Request], mut c: C) -> ReplayStats {
    replay(requests, MOONCAKE_BLOCK_TOKENS, &mut c)
}

/// The hyperbolic score model with weight exponent `exponent`.
fn hyp(exponent: f64) -> ScoreModel {
    ScoreModel::Hyperbolic { exponent }
}

/// The score model of a return within `horizon`.
fn within(horizon: u64) -> ScoreModel {
    ScoreModel::ReturnWithin { horizon }
}

/// The reuse-score configuration `base` with these knobs.
fn variant(
    base: ReuseScoreConfig,
    skip_partial: bool,
    history_factor: f64,
    model: ScoreModel,
    feature: ClassFeature,
) -> ReuseScoreConfig {
    ReuseScoreConfig {
        skip_partial,
        history_factor,
        model,
        feature,
        ..base
    }
}

/// Every reuse-score variant the study runs, labelled, in table order.
fn reuse_score_variants(caps: TierCapacities) -> Vec<(&'static str, ReuseScoreConfig)> {
    let base = ReuseScoreConfig::for_tiers(caps);
    let mut all = hyperbolic_variants(base);
    all.extend(horizon_variants(base));
    all.extend(tuned_variants(base));
    all
}

/// The hyperbolic score: partial blocks, history and the weight's exponent,
/// then the class features.
fn hyperbolic_variants(base: ReuseScoreConfig) -> Vec<(&'static str, ReuseScoreConfig)> {
    let v = |skip_partial, history_factor, model, feature| {
        variant(base, skip_partial, history_factor, model, feature)
    };
    vec![
        (
            "reuse-score, hyperbolic, keep partial, history 1x",
            v(false, 1.0, hyp(1.0), CountOnly),
        ),
        (
            "reuse-score, hyperbolic, history 1x",
            v(true, 1.0, hyp(1.0), CountOnly),
        ),
        ("reuse-score, hyperbolic", v(true, 4.0, hyp(1.0), CountOnly)),
        (
            "reuse-score, hyperbolic, history 16x",
            v(true, 16.0, hyp(1.0), CountOnly),
        ),
        (
            "reuse-score, hyperbolic, w^0.5",
            v(true, 4.0, hyp(0.5), CountOnly),
        ),
        (
            "reuse-score, hyperbolic, w^2",
            v(true, 4.0, hyp(2.0), CountOnly),
        ),
        (
            "reuse-score, hyperbolic, count x depth",
            v(true, 4.0, hyp(1.0), Depth),
        ),
        (
            "reuse-score, hyperbolic, count x output length",
            v(true, 4.0, hyp(1.0), OutputLength),
        ),
    ]
}

/// Returns within a horizon, and densities within one.
fn horizon_variants(base: ReuseScoreConfig) -> Vec<(&'static str, ReuseScoreConfig)> {
    let v = |skip_partial, history_factor, model, feature| {
        variant(base, skip_partial, history_factor, model, feature)
    };
    vec![
        (
            "reuse-score, return within 100",
            v(true, 4.0, within(100), CountOnly),
        ),
        (
            "reuse-score, return within 250 (winner)",
            v(true, 4.0, within(250), CountOnly),
        ),
        (
            "reuse-score, return within 250, keep partial",
            v(false, 4.0, within(250), CountOnly),
        ),
        (
            "reuse-score, density within 250",
            v(
                true,
                4.0,
                ScoreModel::DensityWithin { horizon: 250 },
                CountOnly,
            ),
        ),
        (
            "reuse-score, density within 1000",
            v(
                true,
                4.0,
                ScoreModel::DensityWithin { horizon: 1000 },
                CountOnly,
            ),
        ),
        (
            "reuse-score, density within 4000",
            v(
                true,
                4.0,
                ScoreModel::DensityWithin { horizon: 4000 },
                CountOnly,
            ),
        ),
    ]
}

/// The return-within-250 winner tuned: ghosts, history, horizon, clock,
/// decay and class features.
fn tuned_variants(base: ReuseScoreConfig) -> Vec<(&'static str, ReuseScoreConfig)> {
    let v = |skip_partial, history_factor, model, feature| {
        variant(base, skip_partial, history_factor, model, feature)
    };
    vec![
        (
            "reuse-score, return within 250, no ghosts",
            v(true, 0.0, within(250), CountOnly),
        ),
        (
            "reuse-score, return within 250, history 1x",
            v(true, 1.0, within(250), CountOnly),
        ),
        (
            "reuse-score, return within 250, history 16x",
            v(true, 16.0, within(250), CountOnly),
        ),
        (
            "reuse-score, return within 500",
            v(true, 4.0, within(500), CountOnly),
        ),
        (
            "reuse-score, return within 1000",
            v(true, 4.0, within(1000), CountOnly),
        ),
        (
            "reuse-score, return within 2000",
            v(true, 4.0, within(2000), CountOnly),
        ),
        (
            "reuse-score, return within 250, count x depth",
            v(true, 4.0, within(250), Depth),
        ),
        (
            "reuse-score, block clock, return within 6000 blocks",
            ReuseScoreConfig {
                clock: Clock::Blocks,
                ..v(true, 4.0, within(6000), CountOnly)
            },
        ),
        (
            "reuse-score, return within 250, decay 0.9 per 256 requests",
            ReuseScoreConfig {
                decay: 0.9,
                ..v(true, 4.0, within(250), CountOnly)
            },
        ),
        (
            "reuse-score, return within 250, decay 0.5 per 256 requests",
            ReuseScoreConfig {
                decay: 0.5,
                ..v(true, 4.0, within(250), CountOnly)
            },
        ),
        (
            "reuse-score, return within 250, count x seen prefix",
            v(true, 4.0, within(250), SeenPrefix),
        ),
        (
            "reuse-score, hyperbolic, count x seen prefix",
            v(true, 4.0, hyp(1.0), SeenPrefix),
        ),
        (
            "reuse-score, return within 250, count x output length",
            v(true, 4.0, within(250), OutputLength),
        ),
    ]
}

pub fn policy_study() {
    println!("| policy | trace | G1+G2+G3 | hit % | G1 / G2 / G3 % |");
    println!("|---|---|---|---|---|");
    for (name, f) in CONFIGS {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let total = capacity_for(f.iter().sum(), facts.unique_blocks);
        row(
            "single LRU (reference)",
            name,
            f,
            &single(&requests, LruSim::new(total)),
        );
        row(
            "single Belady (reference)",
            name,
            f,
            &single(&requests, BeladySim::new(&requests, total)),
        );
        for feed in [LruFeed::Victim, LruFeed::WriteThrough] {
            let s = tiered(&requests, caps.g1, LruTiers::new(caps.g2, caps.g3, feed));
            row(&format!("tiered LRU {feed:?}"), name, f, &s);
        }
        admission_study(name, f, &requests, caps);
        let variants = reuse_score_variants(caps);
        for (label, cfg) in variants {
            if !wanted(label) {
                continue;
            }
            let s = tiered(&requests, caps.g1, ReuseScoreTiers::new(cfg));
            row(label, name, f, &s);
        }
    }
}

/// What an admission rule may look at when G1 evicts a block.
struct Candidate {
    /// Requests that carried the block so far.
    count: u32,
    /// Use count of the block it would displace (0 when there is room).
    victim_count: u32,
    /// Whether the block is referenced again later (offline knowledge;
    /// only the oracle bounds read it).
    used_again: bool,
    /// Whether it was the partial last block of a request.
    partial: bool,
}

/// Study-only kvbm policy: exclusive LRU victim tiers (as
/// `LruFeed::Victim`) with an admission rule in front of each tier.
struct AdmitLru<F> {
    g2: LruSim,
    g3: LruSim,
    admit: F,
    counts: std::collections::HashMap<u64, (u32, bool)>,
    /// Request indices carrying each block (for the oracle bounds).
    uses: std::collections::HashMap<u64, Vec<usize>>,
    now: usize,
}

impl<F: FnMut(&Candidate) -> bool> AdmitLru<F> {
    fn new(requests: &[Request], g2: usize, g3: usize, admit: F) -> Self {
        let mut uses: std::collections::HashMap<u64, Vec<usize>> = Default::default();
        for (i, r) in requests.iter().enumerate() {
            for &b in &r.hash_ids {
                uses.entry(b).or_default().push(i);
            }
        }
        Self {
            g2: LruSim::new(g2),
            g3: LruSim::new(g3),
            admit,
            counts: Default::default(),
            uses,
            now: 0,
        }
    }

    fn candidate(&self, b: u64, victim: Option<u64>) -> Candidate {
        let (count, partial) = self.counts.get(&b).copied().unwrap_or((1, false));
        let uses = self.uses.get(&b).map_or(&[][..], Vec::as_slice);
        Candidate {
            count,
            victim_count: victim.map_or(0, |v| self.counts.get(&v).map_or(0, |c| c.0)),
            used_again: uses.last().is_some_and(|&last| last > self.now),
            partial,
        }
    }

    /// Offers `b` to one tier; returns what falls out of it.
    fn offer(&mut self, b: u64, to_g3: bool) -> Option<u64> {
        let tier = if to_g3 { &self.g3 } else { &self.g2 };
        let full = tier.len() >= tier.capacity();
        let victim = if full { lru_victim(tier) } else { None };
        let c = self.candidate(b, victim);
        if !(self.admit)(&c) || tier.capacity() == 0 {
            return Some(b);
        }
        let tier = if to_g3 { &mut self.g3 } else { &mut self.g2 };
        tier.touch_all(&[b]).first().copied()
    }
}

fn lru_victim(tier: &LruSim) -> Option<u64> {
    tier.peek_lru()
}

impl<F: FnMut(&Candidate) -> bool> KvbmTiers for AdmitLru<F> {
    fn lookup(&mut self, block: u64) -> Option<Tier> {
        if self.g2.contains(block) {
            Some(Tier::G2)
        } else if self.g3.contains(block) {
            Some(Tier::G3)
        } else {
            None
        }
    }

    fn record(&mut self, ctx: &RequestCtx<'_>, g1_evicted: &[u64]) {
        self.now = ctx.index;
        let n = ctx.blocks().len();
        for (i, &b) in ctx.blocks().iter().enumerate() {
            let e = self.counts.entry(b).or_insert((0, false));
            e.0 += 1;
            e.1 |= ctx.last_block_partial && i + 1 == n;
            self.g2.remove(b);
            self.g3.remove(b);
        }
        for &b in g1_evicted {
            if let Some(out) = self.offer(b, false) {
                self.offer(out, true);
            }
        }
    }

    fn occupancy(&self) -> (usize, usize) {
        (self.g2.len(), self.g3.len())
    }

    fn cached(&self) -> Vec<(u64, Tier)> {
        let g2 = self.g2.blocks().map(|b| (b, Tier::G2));
        g2.chain(self.g3.blocks().map(|b| (b, Tier::G3))).collect()
    }
}

fn admission_study(name: &str, f: [f64; 3], requests: &[Request], caps: TierCapacities) {
    type Rule = fn(&Candidate) -> bool;
    let rules: [(&str, Rule); 5] = [
        ("LRU victim tiers, oracle admission (offline bound)", |c| {
            c.used_again
        }),
        ("LRU victim tiers, skip partial blocks", |c| !c.partial),
        ("LRU victim tiers, admit if seen >= 2 times", |c| {
            !c.partial && c.count >= 2
        }),
        (
            "LRU victim tiers, TinyLFU admission (count >= victim's)",
            |c| !c.partial && c.count >= c.victim_count,
        ),
        (
            "LRU victim tiers, TinyLFU admission (count > victim's)",
            |c| !c.partial && (c.victim_count == 0 || c.count > c.victim_count),
        ),
    ];
    for (label, rule) in rules {
        if !wanted(label) {
            continue;
        }
        let s = tiered(
            requests,
            caps.g1,
            AdmitLru::new(requests, caps.g2, caps.g3, rule),
        );
        row(label, name, f, &s);
    }
}

/// `KVBM_STUDY_FILTER=text` runs only the policies whose label contains it.
fn wanted(label: &str) -> bool {
    std::env::var("KVBM_STUDY_FILTER").map_or(true, |f| label.contains(&f))
}

/// Splits a policy's hits by how often the block had been used before the
/// hit (1 = first reuse), next to what an infinite cache would hit.
struct ReuseSplit<C> {
    inner: C,
    uses: std::collections::HashMap<u64, u32>,
    hits_by_prior: [u64; 4],
}

impl<C: CacheSim> CacheSim for ReuseSplit<C> {
    fn lookup(&mut self, block: u64) -> Option<Tier> {
        let t = self.inner.lookup(block);
        if t.is_some() {
            let prior = self.uses.get(&block).copied().unwrap_or(0) as usize;
            self.hits_by_prior[prior.clamp(1, 4) - 1] += 1;
        }
        t
    }
    fn record(&mut self, ctx: &RequestCtx<'_>) {
        for &b in ctx.blocks() {
            *self.uses.entry(b).or_default() += 1;
        }
        self.inner.record(ctx);
    }
}

pub fn reuse_split() {
    for (name, f) in CONFIGS {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let inf = split(&requests, LruSim::new(facts.unique_blocks));
        let lru = split(
            &requests,
            TieredSim::new(caps.g1, LruTiers::new(caps.g2, caps.g3, LruFeed::Victim)),
        );
        let win = split(
            &requests,
            TieredSim::new(
                caps.g1,
                ReuseScoreTiers::new(ReuseScoreConfig::for_tiers(caps)),
            ),
        );
        println!(
            "{name} {f:?} hits by prior uses 1/2/3/4+: infinite {inf:?} lru {lru:?} winner {win:?}"
        );
    }
}

fn split<C: CacheSim>(requests: &[Request], inner: C) -> [u64; 4] {
    let mut s = ReuseSplit {
        inner,
        uses: Default::default(),
        hits_by_prior: [0; 4],
    };
    replay(requests, MOONCAKE_BLOCK_TOKENS, &mut s);
    s.hits_by_prior
}

/// Samples, every 50 requests, how many of kvbm's blocks are orphans
/// (their parent is in no tier, so they cannot hit).
struct OrphanProbe<K> {
    sim: TieredSim<K>,
    parent: std::collections::HashMap<u64, u64>,
    orphans: usize,
    held: usize,
}

impl<K: KvbmTiers> CacheSim for OrphanProbe<K> {
    fn lookup(&mut self, block: u64) -> Option<Tier> {
        self.sim.lookup(block)
    }
    fn record(&mut self, ctx: &RequestCtx<'_>) {
        self.sim.record(ctx);
        if !ctx.index.is_multiple_of(50) {
            return;
        }
        let cached = self.sim.kvbm().cached();
        let set: std::collections::HashSet<u64> = cached.iter().map(|c| c.0).collect();
        self.held += cached.len();
        self.orphans += cached
            .iter()
            .filter(|(b, _)| {
                self.parent
                    .get(b)
                    .is_some_and(|p| !set.contains(p) && !self.sim.g1_contains(*p))
            })
            .count();
    }
}

/// Average share of kvbm's blocks that are orphans.
fn orphan_share<K: KvbmTiers>(requests: &[Request], g1: usize, kvbm: K) -> f64 {
    let mut parent = std::collections::HashMap::new();
    for r in requests {
        for w in r.hash_ids.windows(2) {
            parent.entry(w[1]).or_insert(w[0]);
        }
    }
    let mut probe = OrphanProbe {
        sim: TieredSim::new(g1, kvbm),
        parent,
        orphans: 0,
        held: 0,
    };
    replay(requests, MOONCAKE_BLOCK_TOKENS, &mut probe);
    probe.orphans as f64 / probe.held.max(1) as f64
}

pub fn orphans() {
    for (name, f) in CONFIGS {
        let Some((requests, facts)) = sim_support::load(name) else {
            return;
        };
        let caps = TierCapacities::from_fractions(f[0], f[1], f[2], facts.unique_blocks);
        let lru = orphan_share(
            &requests,
            caps.g1,
            LruTiers::new(caps.g2, caps.g3, LruFeed::Victim),
        );
        let win = orphan_share(
            &requests,
            caps.g1,
            ReuseScoreTiers::new(ReuseScoreConfig::for_tiers(caps)),
        );
        println!(
            "{name} {f:?} orphan share: lru victim {:.2}% winner {:.2}%",
            lru * 100.0,
            win * 100.0
        );
    }
}
