//! Property test of the slot API under a scheduler's interleaving of
//! requests that share prefixes: a block becomes matchable, and is copied
//! down to G2/G3, only once the engine committed it (after the forward pass
//! wrote its bytes), however the requests of a step interleave.
//!
//! A case is a tree of requests over shared prefixes (stems, siblings that
//! diverge from a stem, exact duplicates, prefixes of other requests) and a
//! schedule of engine steps. In a step, requests arrive (`create_slot`, or
//! again after a preemption), are scheduled (`allocate_slots` for a chunk,
//! onboard polled or waited) or are freed, finished or not; then the
//! forward runs: every allocated block not yet committed first holds junk
//! (an engine's memory before a forward writes it), the forward writes the
//! real bytes of the chunk each scheduled request computes, and the step
//! commits them. A later request of the same step may match what an
//! earlier one allocated but has not computed yet: that is the case the
//! property is about.
//!
//! Every block a slot reports computed (a G1 hit at arrival, a block loaded
//! from G2/G3, a committed block) must hold exactly its hash's bytes when
//! reported and at the end of every step. After all requests are freed,
//! the engine flushed and G1 emptied, a second round brings every request
//! back and checks what it matches or loads again, so junk copied down
//! would surface there. At the end nothing is held. G1 is small enough to
//! evict and G2 small enough to spill to G3; both offload modes run.
//!
//! The steps run on one thread in the order the case gives. Only the
//! offload worker and the copies run beside them, so an onboard that is
//! polled rather than waited may or may not be ready in its step; the
//! property must hold either way. The totals of G1 hits and of loads from
//! G2 and G3 over all cases must be non-zero, so the checks are not
//! vacuous.

mod tier_support;

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Arc;

use kvbm_block::SequenceHash;
use kvbm_pool::slot::{OnboardState, SlotManager};
use kvbm_pool::tier::{OffloadMode, TierPolicy};
use kvbm_pool::{Tier, TierError};
use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, TestRunner};
use tier_support::*;

/// Stems of the prefix tree; each is `chain(seed, STEM_BLOCKS)`.
const STEMS: u64 = 3;
const STEM_BLOCKS: usize = 8;
const G1_BLOCKS: usize = 24;
const G2_BLOCKS: usize = 6;
const G3_BLOCKS: usize = 96;

/// How a request's hashes relate to the tree.
#[derive(Clone, Debug)]
enum Shape {
    /// The first `cut` blocks of stem `stem`, then `tail` blocks of its own.
    Stem { stem: u64, cut: usize, tail: usize },
    /// Exactly the hashes of an earlier request.
    Duplicate { of: usize },
    /// The first `keep` blocks of an earlier request.
    Prefix { of: usize, keep: usize },
    /// Shares the first `at` blocks of an earlier request, then diverges
    /// for `tail` blocks of its own.
    Sibling { of: usize, at: usize, tail: usize },
}

#[derive(Clone, Debug)]
struct Request {
    shape: Shape,
    /// Tokens of the prompt past its full blocks (0: the prompt ends on a
    /// block boundary, so a full match gives back its last block).
    extra: usize,
}

/// One scheduler action within a step, on request `r` (modulo the
/// workload's size).
#[derive(Clone, Debug)]
enum Act {
    /// The request arrives, or arrives again (a preemption: the old slot
    /// is freed first).
    Arrive { r: usize },
    /// The request is scheduled: room for `alloc` more blocks, its onboard
    /// waited or only polled; this step's forward computes up to `compute`
    /// of its allocated blocks.
    Run {
        r: usize,
        alloc: usize,
        compute: usize,
        wait: bool,
    },
    /// The request finishes, or is aborted before computing everything.
    Free { r: usize },
    /// G1 drops what no request holds (forces later loads from G2/G3).
    EvictG1,
}

#[derive(Clone, Debug)]
struct Case {
    requests: Vec<Request>,
    steps: Vec<Vec<Act>>,
}

fn request(index: usize) -> impl Strategy<Value = Request> {
    let stem = (0..STEMS, 1..=STEM_BLOCKS, 0..4usize).prop_map(|(stem, cut, tail)| Shape::Stem {
        stem,
        cut,
        tail,
    });
    let shape = if index == 0 {
        stem.boxed()
    } else {
        prop_oneof![
            3 => stem,
            2 => (0..index).prop_map(|of| Shape::Duplicate { of }),
            2 => (0..index, 1..=STEM_BLOCKS).prop_map(|(of, keep)| Shape::Prefix { of, keep }),
            3 => (0..index, 0..STEM_BLOCKS, 1..4usize)
                .prop_map(|(of, at, tail)| Shape::Sibling { of, at, tail }),
        ]
        .boxed()
    };
    (shape, prop_oneof![Just(0usize), 1..BLOCK_TOKENS])
        .prop_map(|(shape, extra)| Request { shape, extra })
}

fn act() -> impl Strategy<Value = Act> {
    prop_oneof![
        4 => (0..8usize).prop_map(|r| Act::Arrive { r }),
        6 => (0..8usize, 1..5usize, 0..5usize, any::<bool>())
            .prop_map(|(r, alloc, compute, wait)| Act::Run { r, alloc, compute, wait }),
        2 => (0..8usize).prop_map(|r| Act::Free { r }),
        1 => Just(Act::EvictG1),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (3..=8usize)
        .prop_flat_map(|n| {
            let requests: Vec<_> = (0..n).map(request).collect();
            let steps = proptest::collection::vec(proptest::collection::vec(act(), 1..6), 4..28);
            (requests, steps)
        })
        .prop_map(|(requests, steps)| Case { requests, steps })
}

/// The hashes of every request of the workload.
fn hashes_of(requests: &[Request]) -> Vec<Vec<SequenceHash>> {
    let mut out: Vec<Vec<SequenceHash>> = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        // Tails are salted by the request, so siblings diverge.
        let salt = i as u64 + 1;
        let h = match r.shape {
            Shape::Stem { stem, cut, tail } => {
                let mut h = chain(stem + 1, cut);
                let parent = h.last().copied();
                h.extend(branch(parent, salt, tail));
                h
            }
            Shape::Duplicate { of } => out[of].clone(),
            Shape::Prefix { of, keep } => out[of][..keep.min(out[of].len())].to_vec(),
            Shape::Sibling { of, at, tail } => {
                let mut h = out[of][..at.min(out[of].len() - 1)].to_vec();
                let parent = h.last().copied();
                h.extend(branch(parent, salt, tail));
                h
            }
        };
        out.push(h);
    }
    out
}

/// What the test knows of a live request.
struct Live {
    /// Blocks the match found at arrival (G1 and external).
    matched: usize,
    /// Whether its onboard ended (ready or failed), so it may compute.
    loaded: bool,
}

struct Harness {
    slots: SlotManager,
    mode: OffloadMode,
    hashes: Vec<Vec<SequenceHash>>,
    prompts: Vec<usize>,
    live: HashMap<usize, Live>,
}

impl Harness {
    fn g1(&self) -> &kvbm_transfer::PhysicalLayout {
        self.slots.engine().layout(Tier::G1).unwrap()
    }

    /// Blocks the request has computed, and its block table.
    fn table(&self, r: usize) -> (usize, Vec<u32>) {
        let computed = self.slots.computed_tokens(r as u64).unwrap() / BLOCK_TOKENS;
        (computed, self.slots.block_ids(r as u64).unwrap())
    }

    /// Every block the request reports computed holds its hash's bytes.
    fn check(&mut self, r: usize, when: &str) {
        let (computed, table) = self.table(r);
        let hashes = &self.hashes[r];
        assert!(
            computed <= hashes.len(),
            "request {r} {when}: {computed} computed"
        );
        for (k, &block) in table.iter().take(computed).enumerate() {
            assert!(
                holds(self.g1(), block, hashes[k]),
                "request {r} {when}: block {k} (G1 {block}) does not hold {:?}",
                hashes[k]
            );
        }
    }

    fn arrive(&mut self, r: usize) {
        let m = self
            .slots
            .create_slot(r as u64, self.hashes[r].clone(), self.prompts[r])
            .unwrap();
        let matched = (m.g1_tokens + m.external_tokens) / BLOCK_TOKENS;
        self.live.insert(
            r,
            Live {
                matched,
                loaded: m.external_tokens == 0,
            },
        );
        self.check(r, "after a G1 hit");
    }

    /// Allocates room for `alloc` more blocks and polls or waits the
    /// onboard; whether the request may compute in this step's forward.
    fn schedule(&mut self, r: usize, alloc: usize, wait: bool) -> bool {
        let Some(live) = self.live.get(&r) else {
            return false;
        };
        let (computed, _) = self.table(r);
        let base = live.matched.max(computed);
        let total = ((base + alloc) * BLOCK_TOKENS).min(self.prompts[r]);
        match self.slots.allocate_slots(r as u64, total) {
            Ok(()) => {}
            // G1 full of blocks other requests hold: not scheduled now.
            Err(TierError::Pool(_)) => return false,
            Err(e) => panic!("allocate {r}: {e}"),
        }
        let state = if wait {
            self.slots.wait_onboard(r as u64)
        } else {
            self.slots.poll_onboard(r as u64)
        };
        let ready = match state.unwrap() {
            OnboardState::Ready => true,
            OnboardState::Pending => false,
            // The load this request shared could not get G1 space: nothing
            // of it was reported loaded; the request computes the rest.
            OnboardState::Failed {
                error: TierError::SharedOnboardFailed(_),
                computed_tokens,
            } => {
                let l = self.live.get_mut(&r).unwrap();
                l.matched = computed_tokens / BLOCK_TOKENS;
                true
            }
            other => panic!("onboard of {r}: {other:?}"),
        };
        if ready {
            let l = self.live.get_mut(&r).unwrap();
            if !l.loaded {
                l.loaded = true;
                self.check(r, "after its onboard");
            }
        }
        ready
    }

    fn free(&mut self, r: usize) {
        assert_eq!(self.slots.free(r as u64), self.live.remove(&r).is_some());
    }

    fn evict_g1(&self) {
        let engine = self.slots.engine();
        engine.g1().evict(usize::MAX >> 1);
        if self.mode == OffloadMode::WriteBack {
            // The engine's next allocation saves what G1 evicted.
            engine.allocate_g1(0).unwrap();
        }
    }

    /// The forward pass of a step: junk in every allocated, uncommitted
    /// block of every live request, then the real bytes of the blocks each
    /// of `runs` computes, then their commit.
    fn forward(&mut self, runs: &[(usize, usize)]) {
        let mut ids: Vec<usize> = self.live.keys().copied().collect();
        ids.sort_unstable();
        for r in ids {
            let (computed, table) = self.table(r);
            for &block in &table[computed..] {
                scribble(self.g1(), block);
            }
        }
        for &(r, compute) in runs {
            let (computed, table) = self.table(r);
            let full = table.len().min(self.hashes[r].len());
            let n = compute.min(full.saturating_sub(computed));
            let todo = &self.hashes[r][computed..computed + n];
            for (k, &h) in todo.iter().enumerate() {
                fill(self.g1(), table[computed + k], h);
            }
            self.slots.commit_blocks(r as u64, todo).unwrap();
        }
    }

    fn step(&mut self, acts: &[Act]) {
        let n = self.hashes.len();
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for act in acts {
            match *act {
                Act::Arrive { r } => {
                    let r = r % n;
                    runs.retain(|&(q, _)| q != r);
                    self.arrive(r);
                }
                Act::Run {
                    r,
                    alloc,
                    compute,
                    wait,
                } => {
                    let r = r % n;
                    if self.schedule(r, alloc, wait) {
                        runs.retain(|&(q, _)| q != r);
                        runs.push((r, compute));
                    }
                }
                Act::Free { r } => {
                    let r = r % n;
                    runs.retain(|&(q, _)| q != r);
                    self.free(r);
                }
                Act::EvictG1 => self.evict_g1(),
            }
        }
        self.forward(&runs);
        let mut ids: Vec<usize> = self.live.keys().copied().collect();
        ids.sort_unstable();
        for r in ids {
            self.check(r, "at the end of a step");
        }
    }

    /// Brings request `r` back alone: matches, loads, checks, computes the
    /// rest and finishes.
    fn replay(&mut self, r: usize) {
        self.arrive(r);
        let all = self.hashes[r].len() + 1;
        assert!(self.schedule(r, all, true), "request {r} replayed");
        self.forward(&[(r, usize::MAX)]);
        self.check(r, "after the replay's forward");
        self.free(r);
    }
}

/// Loads a case saw, summed over cases to show the property is not
/// vacuous: G1 hits, and loads from G2 and from G3.
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    g1_hits: u64,
    g2_loads: u64,
    g3_loads: u64,
}

fn run(case: Case, mode: OffloadMode, policy: TierPolicy) -> Seen {
    let dir = tempdir();
    let mut builder = tiers(G1_BLOCKS, G2_BLOCKS, G3_BLOCKS, dir.path())
        .offload_mode(mode)
        .g2_policy(policy)
        .g3_policy(policy);
    if mode == OffloadMode::WriteBack {
        // Some allocations take the reserve and save G1's victims behind.
        builder = builder.g1_free_reserve(2);
    }
    let engine = builder.build().unwrap();
    let hashes = hashes_of(&case.requests);
    let prompts = case
        .requests
        .iter()
        .zip(&hashes)
        .map(|(r, h)| h.len() * BLOCK_TOKENS + r.extra)
        .collect();
    let mut h = Harness {
        slots: SlotManager::new(Arc::new(engine)),
        mode,
        hashes,
        prompts,
        live: HashMap::new(),
    };
    for acts in &case.steps {
        h.step(acts);
    }
    let mut ids: Vec<usize> = h.live.keys().copied().collect();
    ids.sort_unstable();
    for r in ids {
        h.free(r);
    }

    // Second round: whatever the first round copied down comes back.
    h.slots.engine().flush();
    h.evict_g1();
    h.slots.engine().flush();
    for r in 0..h.hashes.len() {
        h.replay(r);
    }

    let engine = h.slots.engine();
    engine.flush();
    assert!(h.slots.is_empty());
    assert_eq!(engine.live_requests(), 0);
    for t in [Tier::G1, Tier::G2, Tier::G3] {
        let counts = engine.pool(t).unwrap().audit().unwrap();
        assert_eq!(counts.active, 0, "{t:?} holds blocks at the end");
    }
    let hits = engine.stats().hits;
    Seen {
        g1_hits: hits[0],
        g2_loads: hits[1],
        g3_loads: hits[2],
    }
}

/// Runs the property over `cases` generated cases; a failure panics with
/// the smallest failing case proptest found (and records its seed in
/// `slot_shared_prefixes.proptest-regressions`).
fn check(mode: OffloadMode, policy: TierPolicy, cases: u32) {
    let config = ProptestConfig {
        cases,
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    };
    let mut runner = TestRunner::new(config);
    let seen = Cell::new(Seen::default());
    let result = runner.run(&case(), |c| {
        let s = run(c, mode, policy);
        let mut total = seen.get();
        total.g1_hits += s.g1_hits;
        total.g2_loads += s.g2_loads;
        total.g3_loads += s.g3_loads;
        seen.set(total);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{mode:?}: {e}");
    }
    let seen = seen.get();
    println!("{mode:?} {policy:?}: {seen:?}");
    assert!(
        seen.g1_hits > 0 && seen.g2_loads > 0 && seen.g3_loads > 0,
        "the cases never hit G1 or never loaded from G2 or G3: {seen:?}"
    );
}

#[test]
fn shared_prefixes_write_through() {
    check(OffloadMode::WriteThrough, TierPolicy::WriteThrough, 48);
}

#[test]
fn shared_prefixes_write_back() {
    check(OffloadMode::WriteBack, TierPolicy::WriteThrough, 48);
}

/// The default admission and eviction of G2 and G3: what stays in them
/// depends on reuse scores, not on arrival order alone.
#[test]
fn shared_prefixes_write_back_reuse_score() {
    check(OffloadMode::WriteBack, TierPolicy::ReuseScore, 48);
}
