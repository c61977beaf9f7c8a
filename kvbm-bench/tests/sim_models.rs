//! Model-based and property tests of the simulators on small random traces.

use std::collections::{HashMap, HashSet};

use kvbm_bench::sim::reuse_score::{ReuseScoreConfig, ReuseScoreTiers};
use kvbm_bench::sim::{
    BeladySim, CacheSim, G1Keeps, KvbmTiers, LruFeed, LruSim, LruTiers, RequestCtx, Tier,
    TierCapacities, TieredSim, TouchOrder, replay,
};
use kvbm_testkit::trace::{BlockId, Request};
use proptest::prelude::*;

const BT: u32 = 4;

/// Requests whose blocks form prefix chains: each request picks a stem
/// (shared prefix family) and a length; ids are (stem, depth) pairs, with
/// occasional divergence so that trees branch.
fn trace_strategy() -> impl Strategy<Value = Vec<Request>> {
    prop::collection::vec((0u64..6, 1usize..8, 0u64..3, 1u32..4), 1..60).prop_map(|reqs| {
        reqs.into_iter()
            .map(|(stem, len, branch, tail)| {
                let hash_ids: Vec<BlockId> = (0..len as u64)
                    .map(|d| {
                        if d < 3 {
                            stem * 100 + d
                        } else {
                            stem * 100 + branch * 10 + d
                        }
                    })
                    .collect();
                let input_length = (len as u32 - 1) * BT + tail;
                Request {
                    timestamp_ms: 0,
                    input_length,
                    output_length: 1,
                    hash_ids,
                }
            })
            .collect()
    })
}

/// Hit count under the replay definition with a plain model cache.
fn model_hits(
    reqs: &[Request],
    mut contains: impl FnMut(BlockId) -> bool,
    mut record: impl FnMut(usize, &Request),
) -> u64 {
    let mut hits = 0;
    for (i, r) in reqs.iter().enumerate() {
        for &b in &r.hash_ids {
            if !contains(b) {
                break;
            }
            hits += 1;
        }
        record(i, r);
    }
    hits
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn lru_matches_a_vec_model(reqs in trace_strategy(), cap in 0usize..12, leaf_first: bool) {
        let order = if leaf_first { TouchOrder::LeafFirst } else { TouchOrder::Prompt };
        let got = replay(&reqs, BT, &mut LruSim::with_order(cap, order)).total_hits();
        let model = std::cell::RefCell::new(Vec::<BlockId>::new()); // least recent first
        let want = model_hits(
            &reqs,
            |b| model.borrow().contains(&b),
            |_, r| {
                let mut m = model.borrow_mut();
                let blocks: Vec<BlockId> = if leaf_first { r.hash_ids.iter().rev().copied().collect() } else { r.hash_ids.clone() };
                for b in blocks {
                    m.retain(|&x| x != b);
                    m.push(b);
                    if m.len() > cap { m.remove(0); }
                }
            },
        );
        prop_assert_eq!(got, want);
    }

    #[test]
    fn belady_matches_a_brute_force_model(reqs in trace_strategy(), cap in 0usize..12) {
        let got = replay(&reqs, BT, &mut BeladySim::new(&reqs, cap)).total_hits();
        let flat: Vec<BlockId> = reqs.iter().flat_map(|r| r.hash_ids.iter().copied()).collect();
        let next_use = |pos: usize| -> u64 {
            flat[pos + 1..].iter().position(|&x| x == flat[pos]).map_or(u64::MAX, |d| (pos + 1 + d) as u64)
        };
        let cache = std::cell::RefCell::new(HashMap::<BlockId, u64>::new());
        let mut pos = 0;
        let want = model_hits(
            &reqs,
            |b| cache.borrow().contains_key(&b),
            |_, r| {
                let mut c = cache.borrow_mut();
                for &b in &r.hash_ids {
                    let nu = next_use(pos);
                    pos += 1;
                    if c.contains_key(&b) || c.len() < cap {
                        c.insert(b, nu);
                        continue;
                    }
                    let Some((&victim, &far)) = c.iter().max_by_key(|&(&blk, &n)| (n, blk)) else { continue };
                    if nu < far {
                        c.remove(&victim);
                        c.insert(b, nu);
                    }
                }
            },
        );
        prop_assert_eq!(got, want);
    }

    #[test]
    fn replay_hits_are_bounded_by_the_infinite_cache(reqs in trace_strategy(), cap in 0usize..12) {
        // An infinite cache: every block ever seen.
        let mut seen = HashSet::new();
        let mut inf = 0;
        for r in &reqs {
            for b in &r.hash_ids { if seen.contains(b) { inf += 1 } else { break } }
            seen.extend(r.hash_ids.iter().copied());
        }
        for hits in [
            replay(&reqs, BT, &mut LruSim::new(cap)).total_hits(),
            replay(&reqs, BT, &mut BeladySim::new(&reqs, cap)).total_hits(),
        ] {
            prop_assert!(hits <= inf);
        }
        let unique = reqs.iter().flat_map(|r| r.hash_ids.iter()).collect::<HashSet<_>>().len();
        prop_assert_eq!(replay(&reqs, BT, &mut LruSim::new(unique)).total_hits(), inf);
    }

    #[test]
    fn tiers_never_exceed_their_capacities(reqs in trace_strategy(), g1 in 0usize..5, g2 in 0usize..6, g3 in 0usize..6) {
        let caps = TierCapacities { g1, g2, g3 };
        check_capacity(&reqs, caps, LruTiers::new(g2, g3, LruFeed::Victim))?;
        check_capacity(&reqs, caps, LruTiers::new(g2, g3, LruFeed::WriteThrough))?;
        check_capacity(&reqs, caps, ReuseScoreTiers::new(ReuseScoreConfig::for_tiers(caps)))?;
    }

    #[test]
    fn tiered_with_empty_kvbm_tiers_is_the_engine_lru(reqs in trace_strategy(), g1 in 0usize..10) {
        let alone = replay(&reqs, BT, &mut LruSim::with_order(g1, TouchOrder::LeafFirst));
        let caps = TierCapacities { g1, g2: 0, g3: 0 };
        let t = replay(&reqs, BT, &mut TieredSim::new(g1, ReuseScoreTiers::new(ReuseScoreConfig::for_tiers(caps))));
        prop_assert_eq!(t.hits[Tier::G1 as usize], alone.total_hits());
        prop_assert_eq!(t.total_hits(), alone.total_hits());
    }
}

/// Like `trace_strategy`, but a partially filled last block always gets a
/// fresh id, as with real chained hashes (its tokens differ every time).
fn realistic_trace_strategy() -> impl Strategy<Value = Vec<Request>> {
    trace_strategy().prop_map(|mut reqs| {
        for (i, r) in reqs.iter_mut().enumerate() {
            if r.last_block_partial(BT) {
                let last = r.hash_ids.len() - 1;
                r.hash_ids[last] = 1_000_000 + i as u64;
            }
        }
        reqs
    })
}

/// Counts, after every request, kvbm blocks whose parent is in no tier.
struct OrphanCheck<K> {
    sim: TieredSim<K>,
    parent: HashMap<BlockId, BlockId>,
    orphans: usize,
}

impl<K: KvbmTiers> CacheSim for OrphanCheck<K> {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        self.sim.lookup(block)
    }
    fn record(&mut self, ctx: &RequestCtx<'_>) {
        self.sim.record(ctx);
        let cached = self.sim.kvbm().cached();
        let held: HashSet<BlockId> = cached.iter().map(|c| c.0).collect();
        self.orphans += cached
            .iter()
            .filter(|(b, _)| {
                self.parent
                    .get(b)
                    .is_some_and(|p| !held.contains(p) && !self.sim.g1_contains(*p))
            })
            .count();
    }
}

fn orphans<K: KvbmTiers>(reqs: &[Request], g1: usize, kvbm: K) -> usize {
    let mut parent = HashMap::new();
    for r in reqs {
        for w in r.hash_ids.windows(2) {
            parent.insert(w[1], w[0]);
        }
    }
    let mut check = OrphanCheck {
        sim: TieredSim::new(g1, kvbm),
        parent,
        orphans: 0,
    };
    replay(reqs, BT, &mut check);
    check.orphans
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Leaf-first ordering keeps kvbm free of blocks that can never hit.
    #[test]
    fn kvbm_tiers_hold_no_orphans(reqs in realistic_trace_strategy(), g1 in 0usize..5, g2 in 0usize..6, g3 in 0usize..6) {
        let caps = TierCapacities { g1, g2, g3 };
        prop_assert_eq!(orphans(&reqs, g1, ReuseScoreTiers::new(ReuseScoreConfig::for_tiers(caps))), 0);
        prop_assert_eq!(orphans(&reqs, g1, LruTiers::new(g2, g3, LruFeed::Victim)), 0);
    }
}

/// Wraps a policy and checks occupancy after every request.
struct Checked<K> {
    inner: K,
    caps: TierCapacities,
    ok: bool,
}

impl<K: KvbmTiers> KvbmTiers for Checked<K> {
    fn lookup(&mut self, block: BlockId) -> Option<Tier> {
        self.inner.lookup(block)
    }
    fn record(&mut self, ctx: &RequestCtx<'_>, g1_evicted: &[BlockId]) {
        self.inner.record(ctx, g1_evicted);
        let (g2, g3) = self.inner.occupancy();
        self.ok &= g2 <= self.caps.g2 && g3 <= self.caps.g3;
    }
    fn occupancy(&self) -> (usize, usize) {
        self.inner.occupancy()
    }
    fn cached(&self) -> Vec<(BlockId, Tier)> {
        self.inner.cached()
    }
}

fn check_capacity<K: KvbmTiers>(
    reqs: &[Request],
    caps: TierCapacities,
    kvbm: K,
) -> Result<(), TestCaseError> {
    let mut sim = TieredSim::new(
        caps.g1,
        Checked {
            inner: kvbm,
            caps,
            ok: true,
        },
    );
    let stats = replay(reqs, BT, &mut sim);
    prop_assert!(sim.kvbm().ok, "a tier overflowed");
    prop_assert!(sim.g1_len() <= caps.g1);
    prop_assert!(stats.total_hits() <= stats.block_references);
    Ok(())
}

#[test]
fn victim_lru_tiers_serve_what_g1_dropped() {
    // G1 holds 2 blocks, G2 holds 2: the first request's blocks fall to G2
    // and come back from there.
    let r = |ids: &[BlockId]| Request {
        timestamp_ms: 0,
        input_length: ids.len() as u32 * BT,
        output_length: 1,
        hash_ids: ids.to_vec(),
    };
    let reqs = vec![r(&[1, 2]), r(&[3, 4]), r(&[1, 2])];
    let mut sim = TieredSim::new(2, LruTiers::new(2, 0, LruFeed::Victim));
    let s = replay(&reqs, BT, &mut sim);
    assert_eq!(s.hits, [0, 2, 0]);
    // Served blocks moved back to G1 and left kvbm (exclusive tiers).
    assert_eq!(sim.lookup(1), Some(Tier::G1));
    assert_eq!(sim.kvbm().occupancy().0, 2);
}

/// With G1 keeping full blocks only, a partial last block holds a G1 slot
/// while its request runs and is freed with it; kvbm never receives it, so
/// the same prompt later hits its full blocks only. Keeping every block,
/// the same replay hits the partial block in G1.
#[test]
fn a_g1_keeping_full_blocks_frees_the_partial_block_and_never_offers_it() {
    let r = |ids: &[BlockId], tokens: u32| Request {
        timestamp_ms: 0,
        input_length: tokens,
        output_length: 1,
        hash_ids: ids.to_vec(),
    };
    // Blocks 1 and 2 are full, 3 holds 2 of its 4 tokens.
    let a = r(&[1, 2, 3], 2 * BT + 2);
    let mut sim =
        TieredSim::new(3, LruTiers::new(8, 0, LruFeed::Victim)).with_g1_keeping(G1Keeps::FullOnly);
    replay(std::slice::from_ref(&a), BT, &mut sim);
    assert!(sim.g1_contains(1) && sim.g1_contains(2));
    assert!(!sim.g1_contains(3), "the partial block's slot is freed");
    assert_eq!(sim.g1_len(), 2);
    // Two other prompts push a's blocks out of G1 into kvbm's G2.
    replay(&[r(&[10, 11], 2 * BT), r(&[20, 21], 2 * BT)], BT, &mut sim);
    let held: HashSet<BlockId> = sim.kvbm().cached().into_iter().map(|(b, _)| b).collect();
    assert!(held.contains(&1) && held.contains(&2));
    assert!(!held.contains(&3), "kvbm never receives a partial block");
    let s = replay(std::slice::from_ref(&a), BT, &mut sim);
    assert_eq!(s.total_hits(), 2);

    let mut every = TieredSim::new(3, LruTiers::new(8, 0, LruFeed::Victim));
    let s = replay(&[a.clone(), a], BT, &mut every);
    assert_eq!(s.hits, [3, 0, 0]);
}

mod weights {
    use kvbm_bench::sim::reuse_score::{COUNT_CLASSES, ReuseWeights, ScoreModel};
    use proptest::prelude::*;

    fn model() -> impl Strategy<Value = ScoreModel> {
        prop_oneof![
            (0.25f64..3.0).prop_map(|exponent| ScoreModel::Hyperbolic { exponent }),
            (1u64..5_000).prop_map(|horizon| ScoreModel::ReturnWithin { horizon }),
            (1u64..5_000).prop_map(|horizon| ScoreModel::DensityWithin { horizon }),
            (1u64..5_000).prop_map(|horizon| ScoreModel::ReturnWithinSpread { horizon }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(100))]

        /// The two orderings eviction relies on hold for any learned state:
        /// older never scores above younger within a class (so a class's
        /// least recent block is its minimum), and more uses never score
        /// below fewer (so a parent never ranks below its child), across
        /// depth groups too when groups are depths.
        #[test]
        fn scores_are_monotone(
            model in model(),
            groups in 1usize..4,
            depth_groups: bool,
            events in prop::collection::vec((0usize..16, 0u64..20_000, 0usize..16, any::<bool>()), 0..400),
        ) {
            let classes = groups * COUNT_CLASSES;
            let mut w = ReuseWeights::new(classes, model, depth_groups);
            for (prev, age, now, has_prev) in events {
                w.observe(has_prev.then_some((prev % classes, age)), now % classes);
            }
            w.refresh();
            let ages = [0u64, 1, 5, 30, 200, 1_000, 7_000, 50_000];
            for c in 0..classes {
                for pair in ages.windows(2) {
                    prop_assert!(w.score(c, pair[0]) >= w.score(c, pair[1]), "class {c} ages {pair:?}");
                }
                for &a in &ages {
                    if c % COUNT_CLASSES + 1 < COUNT_CLASSES {
                        prop_assert!(w.score(c + 1, a) >= w.score(c, a), "count order, class {c} age {a}");
                    }
                    if depth_groups && c + COUNT_CLASSES < classes {
                        prop_assert!(w.score(c, a) >= w.score(c + COUNT_CLASSES, a), "depth order, class {c} age {a}");
                    }
                }
            }
        }
    }
}
