//! Candidate defaults of the reuse score against single LRU, in the tiered
//! simulator, on every workload the benchmarks page reports: the Mooncake
//! conversation and synthetic traces, the embedded synthetic chat and the
//! agentic workload (no hints), with G1 keeping full blocks only as the
//! engine replay's does. Run with
//! `cargo run --release -p kvbm-bench --bin studies -- defaults_study`;
//! `KVBM_STUDY_FILTER` keeps the variants whose label contains it;
//! `KVBM_STUDY_GAPS=1` adds, per row, the hits of single LRU, Belady and
//! the default policy by reuse gap.

use crate::sim_support;

use kvbm_bench::sim::gaps::{GAP_RANGES, GapSplit, range_label};
use kvbm_bench::sim::reuse_score::{ClassFeature, ReuseScoreConfig, ReuseScoreTiers, ScoreModel};
use kvbm_bench::sim::{
    BeladySim, G1Keeps, LruSim, TierCapacities, TieredSim, capacity_for, replay,
};
use kvbm_testkit::trace::{
    AgenticConfig, MOONCAKE_BLOCK_TOKENS, Request, SyntheticConfig, TraceFacts, generate_agentic,
    generate_synthetic,
};

/// One workload: its name, requests, tokens per block and the capacity
/// rows (fractions of its distinct blocks).
struct Workload {
    name: &'static str,
    requests: Vec<Request>,
    block_tokens: u32,
    rows: Vec<[f64; 3]>,
}

const SMALL: [f64; 3] = [0.01, 0.04, 0.0];
const MID: [f64; 3] = [0.01, 0.09, 0.0];
const G3: [f64; 3] = [0.02, 0.06, 0.12];

fn workloads() -> Vec<Workload> {
    let mut out = Vec::new();
    for (name, rows) in [
        ("conversation", vec![SMALL, MID, G3]),
        ("synthetic", vec![MID, G3]),
    ] {
        if let Some((requests, _)) = sim_support::load(name) {
            out.push(Workload {
                name,
                requests,
                block_tokens: MOONCAKE_BLOCK_TOKENS,
                rows,
            });
        }
    }
    let synth = SyntheticConfig {
        conversations: 400,
        ..SyntheticConfig::default()
    };
    out.push(Workload {
        name: "embedded",
        requests: generate_synthetic(&synth),
        block_tokens: synth.block_tokens,
        rows: vec![G3],
    });
    let base = AgenticConfig::default();
    let agentic = generate_agentic(&AgenticConfig {
        programs: 300,
        chat: SyntheticConfig {
            conversations: 300,
            ..base.chat.clone()
        },
        ..base
    });
    out.push(Workload {
        name: "agentic",
        requests: agentic.requests,
        block_tokens: MOONCAKE_BLOCK_TOKENS,
        rows: vec![SMALL, MID, G3],
    });
    out
}

/// The engine replay's capacities: G1 holds at least the longest request.
fn caps_of(requests: &[Request], f: [f64; 3]) -> TierCapacities {
    let u = TraceFacts::of(requests).unique_blocks;
    let longest = requests.iter().map(|r| r.hash_ids.len()).max().unwrap_or(0);
    TierCapacities {
        g1: capacity_for(f[0], u).max(longest + 1),
        g2: capacity_for(f[1], u),
        g3: capacity_for(f[2], u),
    }
}

/// How a variant changes the tiers' capacities (the total stays the same).
#[derive(Clone, Copy, PartialEq)]
enum Split {
    /// As the row says.
    AsIs,
    /// G3's capacity added to G2 (no G3): does the third tier cost hits?
    NoG3,
    /// G1 only as large as the longest request, the rest added to G2: does
    /// G1's recency order cost hits?
    SmallG1,
}

impl Split {
    fn apply(self, caps: TierCapacities, longest: usize) -> TierCapacities {
        match self {
            Split::AsIs => caps,
            Split::NoG3 => TierCapacities {
                g2: caps.g2 + caps.g3,
                g3: 0,
                ..caps
            },
            Split::SmallG1 => {
                let g1 = (longest + 1).min(caps.g1);
                TierCapacities {
                    g1,
                    g2: caps.g2 + caps.g1 - g1,
                    ..caps
                }
            }
        }
    }
}

/// A candidate: label, capacity split and the policy's configuration.
type Variant = (
    String,
    Split,
    Box<dyn Fn(TierCapacities) -> ReuseScoreConfig>,
);

fn variants() -> Vec<Variant> {
    fn with(
        model: ScoreModel,
        history_factor: f64,
    ) -> Box<dyn Fn(TierCapacities) -> ReuseScoreConfig> {
        Box::new(move |caps| ReuseScoreConfig {
            model,
            history_factor,
            ..ReuseScoreConfig::for_tiers(caps)
        })
    }
    let within = |horizon| ScoreModel::ReturnWithin { horizon };
    let mut v: Vec<Variant> = vec![
        (
            "default (within 350)".into(),
            Split::AsIs,
            with(within(350), 4.0),
        ),
        (
            "default, G3 folded into G2".into(),
            Split::NoG3,
            with(within(350), 4.0),
        ),
        (
            "default, smallest G1".into(),
            Split::SmallG1,
            with(within(350), 4.0),
        ),
    ];
    for h in [50u64, 100, 250, 500, 700, 1000, 2500] {
        v.push((format!("within {h}"), Split::AsIs, with(within(h), 4.0)));
    }
    for h in [50u64, 2500] {
        v.push((
            format!("within 350 in G2, {h} in G3"),
            Split::AsIs,
            Box::new(move |caps| ReuseScoreConfig {
                g3_model: Some(within(h)),
                ..with(within(350), 4.0)(caps)
            }),
        ));
    }
    for h in [250u64, 350, 500] {
        let spread = ScoreModel::ReturnWithinSpread { horizon: h };
        v.push((format!("spread within {h}"), Split::AsIs, with(spread, 4.0)));
    }
    v.push((
        "within 350, seen-prefix groups".into(),
        Split::AsIs,
        Box::new(move |caps| ReuseScoreConfig {
            feature: ClassFeature::SeenPrefix,
            ..with(within(350), 4.0)(caps)
        }),
    ));
    for h in [350u64, 1000, 4000] {
        let density = ScoreModel::DensityWithin { horizon: h };
        v.push((
            format!("density within {h}"),
            Split::AsIs,
            with(density, 4.0),
        ));
    }
    let hyperbolic = ScoreModel::Hyperbolic { exponent: 1.0 };
    v.push(("hyperbolic".into(), Split::AsIs, with(hyperbolic, 4.0)));
    for hf in [1.0, 16.0] {
        v.push((
            format!("within 350, history {hf}x"),
            Split::AsIs,
            with(within(350), hf),
        ));
    }
    v
}

pub fn defaults_study() {
    let filter = std::env::var("KVBM_STUDY_FILTER").unwrap_or_default();
    let variants = variants();
    for w in &workloads() {
        let longest = w
            .requests
            .iter()
            .map(|r| r.hash_ids.len())
            .max()
            .unwrap_or(0);
        for &f in &w.rows {
            let caps = caps_of(&w.requests, f);
            let lru =
                replay(&w.requests, w.block_tokens, &mut LruSim::new(caps.total())).hit_rate_pct();
            println!(
                "## {} {:.0}/{:.0}/{:.0} {:?}: single LRU {lru:.2}",
                w.name,
                f[0] * 100.0,
                f[1] * 100.0,
                f[2] * 100.0,
                (caps.g1, caps.g2, caps.g3)
            );
            if std::env::var("KVBM_STUDY_GAPS").is_ok() {
                gaps(w, caps);
            }
            for (label, split, make) in &variants {
                if !label.contains(&filter) {
                    continue;
                }
                let caps = split.apply(caps, longest);
                let mut sim = TieredSim::new(caps.g1, ReuseScoreTiers::new(make(caps)))
                    .with_g1_keeping(G1Keeps::FullOnly);
                let hit = replay(&w.requests, w.block_tokens, &mut sim).hit_rate_pct();
                println!("  {label:<32} {hit:.2}  ({:+.2})", hit - lru);
            }
        }
    }
}

/// Hits by reuse gap of single LRU, Belady and the default policy.
fn gaps(w: &Workload, caps: TierCapacities) {
    let mut lru = GapSplit::new(LruSim::new(caps.total()));
    replay(&w.requests, w.block_tokens, &mut lru);
    let mut belady = GapSplit::new(BeladySim::new(&w.requests, caps.total()));
    replay(&w.requests, w.block_tokens, &mut belady);
    let policy = ReuseScoreTiers::new(ReuseScoreConfig::for_tiers(caps));
    let mut ours =
        GapSplit::new(TieredSim::new(caps.g1, policy).with_g1_keeping(G1Keeps::FullOnly));
    replay(&w.requests, w.block_tokens, &mut ours);
    let labels: Vec<String> = (0..GAP_RANGES).map(range_label).collect();
    println!("    gap:        {}", labels.join(" | "));
    let refs = lru.counts().references;
    println!("    references: {refs:?}");
    for (name, c) in [
        ("LRU", lru.counts()),
        ("Belady", belady.counts()),
        ("policy", ours.counts()),
    ] {
        println!("    {name:<10}  {:?}", c.hits);
    }
}
