//! The use history recorded later ([`SharedHistory::record_later`]) makes
//! the decisions it makes recorded at once, whenever and by whichever
//! thread its queue is applied; and the history forgets the least recently
//! used block first (checked against a queue model).

mod policy_support;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvbm_block::SequenceHash;
use kvbm_pool::policy::{HintClock, RetentionHint, ReuseModel, Seen, SharedHistory, UseHistory};
use kvbm_pool::{BlockPool, Tier};
use policy_support::{h, pool, store};
use proptest::prelude::*;

/// Block ids drawn from `0..UNIVERSE`.
const UNIVERSE: u64 = 40;

fn hashes(blocks: &[u64]) -> Vec<SequenceHash> {
    blocks.iter().map(|&x| h(x)).collect()
}

/// A history remembering `capacity` blocks, on a manual clock.
fn history(capacity: usize, hyperbolic: bool) -> SharedHistory {
    let model = if hyperbolic {
        ReuseModel::Hyperbolic
    } else {
        ReuseModel::ReturnWithin { horizon: 20 }
    };
    let mut u = UseHistory::new(capacity).with_model(model);
    u.set_clock(HintClock::Manual(0));
    SharedHistory::new(u)
}

#[derive(Clone, Debug)]
enum Op {
    /// A request carrying these blocks: recorded, then each stored.
    Request(Vec<u64>),
    /// A match of these blocks in the pool, held, then let go.
    Match(Vec<u64>),
    /// A hint: `Some(ms)` returns within, `None` done.
    Hint(Vec<u64>, Option<u64>),
    /// These blocks were loaded into G1: G2's copies go first.
    Demote(Vec<u64>),
    /// G1 gave this block back.
    Undemote(u64),
    /// Time passes (ms).
    Wait(u64),
    /// The deferred history's queue is applied (a background thread).
    Apply,
}

fn op() -> impl Strategy<Value = Op> {
    let blocks = prop::collection::vec(0..UNIVERSE, 1..8);
    prop_oneof![
        8 => blocks.clone().prop_map(Op::Request),
        3 => blocks.clone().prop_map(Op::Match),
        1 => (blocks.clone(), prop::option::of(1u64..50)).prop_map(|(b, t)| Op::Hint(b, t)),
        1 => blocks.prop_map(Op::Demote),
        1 => (0..UNIVERSE).prop_map(Op::Undemote),
        1 => (1u64..100).prop_map(Op::Wait),
        3 => Just(Op::Apply),
    ]
}

/// Blocks resident, each block's history entry and score bits, the clock.
type State = (Vec<bool>, Vec<(Option<Seen>, u64)>, u64);

/// One history and its pool; `deferred` records through the queue.
struct World {
    history: SharedHistory,
    pool: BlockPool,
    deferred: bool,
    now: u64,
}

impl World {
    fn new(deferred: bool, history_capacity: usize, hyperbolic: bool) -> Self {
        let history = history(history_capacity, hyperbolic);
        let pool = pool(&history, 6);
        Self {
            history,
            pool,
            deferred,
            now: 0,
        }
    }

    /// Runs `op`; what it decided (blocks stored or matched).
    fn run(&mut self, op: &Op) -> Vec<bool> {
        match op {
            Op::Request(blocks) => {
                let hs = hashes(blocks);
                if self.deferred {
                    self.history.record_later(&hs);
                } else {
                    self.history.lock().record_request(&hs);
                }
                blocks.iter().map(|&x| store(&self.pool, x)).collect()
            }
            Op::Match(blocks) => {
                let held = self.pool.match_prefix(&hashes(blocks));
                let n = held.len();
                drop(held);
                vec![true; n]
            }
            Op::Hint(blocks, t) => {
                let hint = match t {
                    Some(ms) => RetentionHint::ReturnsWithin(Duration::from_millis(*ms)),
                    None => RetentionHint::Done,
                };
                let hs = hashes(blocks);
                self.history.lock().retain(&hs, hint);
                self.pool.touch(&hs);
                Vec::new()
            }
            Op::Demote(blocks) => {
                self.history.lock().demote(Tier::G2, hashes(blocks));
                Vec::new()
            }
            Op::Undemote(x) => {
                self.history.lock().undemote(h(*x));
                Vec::new()
            }
            Op::Wait(ms) => {
                self.now += ms;
                self.history.lock().set_clock(HintClock::Manual(self.now));
                Vec::new()
            }
            Op::Apply => {
                if self.deferred {
                    self.history.apply_pending();
                }
                Vec::new()
            }
        }
    }

    /// Everything a decision can depend on, as the world sees it now.
    fn state(&self) -> State {
        let resident = (0..UNIVERSE).map(|y| self.pool.contains(h(y))).collect();
        let u = self.history.lock();
        let seen = (0..UNIVERSE)
            .map(|y| (u.get(h(y)), u.score(h(y)).to_bits()))
            .collect();
        (resident, seen, u.now())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Recording later, with the queue applied at random points, gives
    /// every decision (admissions, evictions, matches) and every score of
    /// recording at once.
    #[test]
    fn deferred_recording_decides_as_immediate_recording(
        ops in prop::collection::vec(op(), 1..120),
        history_capacity in 4usize..30,
        hyperbolic in any::<bool>(),
    ) {
        let mut now = World::new(false, history_capacity, hyperbolic);
        let mut later = World::new(true, history_capacity, hyperbolic);
        for (i, op) in ops.iter().enumerate() {
            let a = now.run(op);
            let b = later.run(op);
            prop_assert_eq!(a, b, "op {} {:?}", i, op);
            if i % 7 == 0 {
                prop_assert_eq!(now.state(), later.state(), "after op {} {:?}", i, op);
            }
        }
        prop_assert_eq!(now.state(), later.state());
        prop_assert_eq!(later.history.pending_blocks(), 0);
    }

    /// The same with a thread applying the queue all along, as the tier
    /// engine's worker does.
    #[test]
    fn a_background_applier_changes_no_decision(
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut now = World::new(false, 12, false);
        let mut later = World::new(true, 12, false);
        let stop = Arc::new(AtomicBool::new(false));
        let applier = {
            let history = later.history.clone();
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    history.apply_pending();
                    std::thread::yield_now();
                }
            })
        };
        for op in &ops {
            let a = now.run(op);
            let b = later.run(op);
            prop_assert_eq!(a, b, "{:?}", op);
        }
        stop.store(true, Ordering::Relaxed);
        applier.join().unwrap();
        prop_assert_eq!(now.state(), later.state());
    }

    /// The history forgets the block whose last use is oldest, exactly as
    /// a queue of `(block, use)` entries with stale ones skipped does.
    #[test]
    fn forgets_the_least_recently_used_block(
        requests in prop::collection::vec(prop::collection::vec(0..UNIVERSE, 0..10), 1..100),
        capacity in 1usize..25,
    ) {
        let mut u = UseHistory::new(capacity);
        let mut model = QueueModel::default();
        for blocks in &requests {
            u.record_request(&hashes(blocks));
            model.record(blocks, capacity);
            for y in 0..UNIVERSE {
                prop_assert_eq!(u.get(h(y)), model.seen.get(&y).copied(), "block {}", y);
            }
        }
    }
}

/// The history's forgetting as a queue of uses (stale entries skipped).
#[derive(Default)]
struct QueueModel {
    seen: HashMap<u64, Seen>,
    order: VecDeque<(u64, u64)>,
    now: u64,
    seq: u64,
}

impl QueueModel {
    fn record(&mut self, blocks: &[u64], capacity: usize) {
        self.now += 1;
        for &x in blocks.iter().rev() {
            self.seq += 1;
            let s = self.seen.entry(x).or_insert(Seen {
                count: 0,
                last: 0,
                seq: 0,
            });
            s.count += 1;
            s.last = self.now;
            s.seq = self.seq;
            self.order.push_back((x, self.seq));
        }
        while self.seen.len() > capacity {
            let Some((x, seq)) = self.order.pop_front() else {
                break;
            };
            if self.seen.get(&x).is_some_and(|s| s.seq == seq) {
                self.seen.remove(&x);
            }
        }
    }
}

#[test]
fn the_queue_is_applied_before_any_reader_reads() {
    let shared = history(100, false);
    shared.record_later(&hashes(&[1, 2, 3]));
    shared.record_later(&hashes(&[1, 2]));
    shared.record_later(&hashes(&[1]));
    assert_eq!(
        shared.pending_blocks(),
        3,
        "the first request applies at once"
    );
    let pool = pool(&shared, 2);
    // The policy reads the uses when a block is released into it.
    assert!(store(&pool, 1));
    assert_eq!(shared.pending_blocks(), 0);
    assert_eq!(shared.lock().uses(h(1)), 3);
}
