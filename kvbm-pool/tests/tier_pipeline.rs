//! Offload batches in flight: the engine over a mover whose G1 → G2 copies
//! run only when the test says so, in any order, some losing a pair.
//!
//! What must hold whatever the order: no more than `offload_in_flight`
//! copies are ever in flight; a target is registered only after its copy
//! ran, and never when its pair was lost; a block in flight is not copied
//! twice; sources stay held while their copy is in flight; `flush` waits
//! for every batch in flight.
//!
//! What the worker did not do is checked once it says it has nothing left
//! to do ([`TierEngine::wait_offload_idle`]), never after a pause.

mod tier_support;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use kvbm_block::SequenceHash;
use kvbm_pool::metrics::SkipReason;
use kvbm_pool::tier::{LocalMover, OffloadMode, TierEngine, TierLayouts, TierMover, TierPolicy};
use kvbm_pool::{ImmutableBlocks, KvEvent, KvEventBatch, Tier};
use kvbm_transfer::{
    CancelToken, Completer, Completion, PhysicalLayout, TransferError, TransferFailure,
    TransferOutcome, completion_pair,
};
use parking_lot::{Condvar, Mutex};
use proptest::prelude::*;
use tier_support::*;

/// Pairs `(G1 block, G2 block)` of a copy.
type Pairs = Vec<(usize, usize)>;

/// A G1 → G2 copy the engine started and the test has not run yet.
struct Held {
    pairs: Vec<(usize, usize)>,
    completer: Completer<TransferOutcome>,
}

/// Runs G1 → G2 copies only in [`GatedMover::run`]; every other path goes
/// straight through.
struct GatedMover {
    inner: LocalMover,
    held: Mutex<Vec<Held>>,
    /// Signalled whenever a copy is held.
    arrived: Condvar,
    /// Most G1 → G2 copies held at once.
    most: AtomicUsize,
    /// Copies are no longer held (see [`Opener`]).
    open: AtomicBool,
}

/// Opens the gate when dropped: held copies fail and later ones run at
/// once. A test that fails with copies held would otherwise hang in the
/// engine's drop, which waits for its copies; bound after the engine, so
/// that it is dropped first.
struct Opener(Arc<GatedMover>);

impl Drop for Opener {
    fn drop(&mut self) {
        self.0.open.store(true, Ordering::SeqCst);
        // Dropped completers resolve their copies as lost.
        self.0.held.lock().clear();
    }
}

impl GatedMover {
    fn held(&self) -> usize {
        self.held.lock().len()
    }

    /// Waits (at most 10 s) until `n` copies are held.
    fn wait_held(&self, n: usize) {
        let end = Instant::now() + Duration::from_secs(10);
        let mut held = self.held.lock();
        while held.len() != n {
            let timed_out = self.arrived.wait_until(&mut held, end).timed_out();
            assert!(
                !timed_out || held.len() == n,
                "timed out waiting for {n} copies in flight ({} held)",
                held.len()
            );
        }
    }

    /// The pairs of the held copies, oldest first.
    fn held_pairs(&self) -> Vec<Vec<(usize, usize)>> {
        self.held.lock().iter().map(|h| h.pairs.clone()).collect()
    }

    /// Runs held copy `i` (modulo the number held; nothing when none is).
    /// With `lose_first`, its first pair is reported lost (its bytes still
    /// moved, as when one worker of several failed). Returns the pairs that
    /// landed and the one lost.
    fn run(&self, i: usize, lose_first: bool) -> Option<(Pairs, Option<(usize, usize)>)> {
        let held = {
            let mut h = self.held.lock();
            if h.is_empty() {
                return None;
            }
            let n = h.len();
            h.remove(i % n)
        };
        let outcome = self
            .inner
            .copy(Tier::G1, Tier::G2, held.pairs.clone(), CancelToken::new())
            .wait();
        assert!(outcome.is_ok(), "the local copy failed: {outcome:?}");
        let lost = lose_first.then(|| held.pairs[0]);
        let landed: Vec<_> = held
            .pairs
            .iter()
            .copied()
            .filter(|p| Some(*p) != lost)
            .collect();
        let result = match lost {
            None => outcome,
            Some(lost) => Err(Box::new(TransferFailure {
                error: TransferError::InvalidRequest("one worker did not answer".into()),
                completed: landed.clone(),
                failed: vec![lost],
                culprit: None,
            })),
        };
        held.completer.complete(result);
        Some((landed, lost))
    }
}

impl TierMover for GatedMover {
    fn capacity(&self, tier: Tier) -> Option<usize> {
        self.inner.capacity(tier)
    }

    fn block_bytes(&self, tier: Tier) -> u64 {
        self.inner.block_bytes(tier)
    }

    fn copy(
        &self,
        src: Tier,
        dst: Tier,
        pairs: Vec<(usize, usize)>,
        cancel: CancelToken,
    ) -> Completion<TransferOutcome> {
        if (src, dst) != (Tier::G1, Tier::G2) || self.open.load(Ordering::SeqCst) {
            return self.inner.copy(src, dst, pairs, cancel);
        }
        let (completer, completion) = completion_pair();
        let mut held = self.held.lock();
        held.push(Held { pairs, completer });
        self.most.fetch_max(held.len(), Ordering::SeqCst);
        self.arrived.notify_all();
        completion
    }

    fn local_layout(&self, tier: Tier) -> Option<&PhysicalLayout> {
        self.inner.local_layout(tier)
    }
}

/// [`gated_engine_with`] with batches of exactly `batch` blocks (no byte
/// floor), so each test's batches are the ones it names.
fn gated_engine(
    in_flight: usize,
    batch: usize,
    g1: usize,
    g2: usize,
) -> (TierEngine, Arc<GatedMover>, Opener) {
    gated_engine_with(in_flight, batch, Some(0), g1, g2)
}

/// An engine over a gated mover: G1 and G2 of `g1` and `g2` host blocks of
/// 8 KiB, `in_flight` batches of `batch` blocks raised to `batch_bytes`
/// (`None`: the default).
fn gated_engine_with(
    in_flight: usize,
    batch: usize,
    batch_bytes: Option<u64>,
    g1: usize,
    g2: usize,
) -> (TierEngine, Arc<GatedMover>, Opener) {
    let layouts = TierLayouts {
        g1: host(g1),
        g2: Some(host(g2)),
        g3: None,
    };
    let mover = Arc::new(GatedMover {
        inner: LocalMover::new(layouts, executor()).unwrap(),
        held: Mutex::new(Vec::new()),
        arrived: Condvar::new(),
        most: AtomicUsize::new(0),
        open: AtomicBool::new(false),
    });
    let mut builder = TierEngine::builder_with_mover(Arc::clone(&mover) as _, BLOCK_TOKENS)
        .offload_mode(OffloadMode::WriteThrough)
        .g2_policy(TierPolicy::WriteThrough)
        .offload_limits(batch, 4096)
        .offload_in_flight(in_flight);
    if let Some(bytes) = batch_bytes {
        builder = builder.offload_batch_bytes(bytes);
    }
    let engine = builder.build().unwrap();
    let opener = Opener(Arc::clone(&mover));
    (engine, mover, opener)
}

/// Whether G2 holds `hash`, and then with its bytes.
fn in_g2(engine: &TierEngine, hash: SequenceHash) -> bool {
    let g2 = engine.pool(Tier::G2).unwrap();
    let found = g2.match_prefix(&[hash]);
    let Some(block) = found.get(0) else {
        return false;
    };
    assert!(
        holds(engine.layout(Tier::G2).unwrap(), block.block_id(), hash),
        "G2 registered {hash:?} without its bytes"
    );
    true
}

/// The hashes of the G2 `Stored` events received so far, in order.
fn stored_order(events: &Receiver<KvEventBatch>) -> Vec<SequenceHash> {
    events
        .try_iter()
        .flat_map(|batch| batch.to_vec())
        .filter_map(|e| match e {
            KvEvent::Stored { hash, .. } => Some(hash),
            KvEvent::Removed { .. } => None,
        })
        .collect()
}

/// Runs held copies, oldest first, until the worker has nothing left to
/// do and none is held; returns the pairs that ran. `flush` then has
/// nothing to wait for.
fn settle(engine: &TierEngine, mover: &GatedMover) -> Vec<(usize, usize)> {
    let mut ran = Vec::new();
    loop {
        engine.wait_offload_idle();
        let Some((landed, _)) = mover.run(0, false) else {
            break;
        };
        ran.extend(landed);
    }
    engine.flush();
    ran
}

#[test]
fn batches_overlap_up_to_the_limit_and_register_in_order() {
    let (engine, mover, _open) = gated_engine(2, 2, 16, 64);
    assert_eq!(engine.offload_batch_limit(), 2);
    let g2_events = engine.pool(Tier::G2).unwrap().subscribe();
    let hashes = chain(3, 6);
    let blocks = compute(&engine, &hashes, None);
    let ids: Vec<usize> = (0..6)
        .map(|i| blocks.get(i).unwrap().block_id() as usize)
        .collect();
    drop(blocks);
    mover.wait_held(2);
    // Three batches of two are queued; once the worker has nothing left
    // to do, only two are in flight.
    engine.wait_offload_idle();
    assert_eq!(mover.held(), 2, "more batches in flight than allowed");
    let held = mover.held_pairs();
    let srcs = |k: usize| held[k].iter().map(|p| p.0).collect::<Vec<_>>();
    assert_eq!((srcs(0), srcs(1)), (ids[0..2].to_vec(), ids[2..4].to_vec()));
    // Sources in flight stay held: evicting G1 frees only the third batch's.
    engine.g1().evict(usize::MAX >> 1);
    for &h in &hashes[..4] {
        assert!(engine.g1().contains(h), "a source in flight was evicted");
        assert!(!in_g2(&engine, h), "registered before its copy ran");
    }
    // The second batch lands first: it waits for the first to register.
    mover.run(1, false);
    engine.wait_offload_idle();
    assert!(!in_g2(&engine, hashes[2]), "registered out of order");
    mover.run(0, false);
    engine.wait_offload_idle();
    for &h in &hashes[..4] {
        assert!(in_g2(&engine, h), "{h:?} landed but is not registered");
    }
    // G2 stored the first batch before the second.
    assert_eq!(stored_order(&g2_events), hashes[..4].to_vec());
    settle(&engine, &mover);
    // The third batch's sources were freed before it started: cancelled.
    assert!(!in_g2(&engine, hashes[4]) && !in_g2(&engine, hashes[5]));
    assert_eq!(engine.stats().skipped[SkipReason::SourceGone as usize], 2);
    assert_eq!(mover.most.load(Ordering::SeqCst), 2);
}

#[test]
fn batches_in_flight_hold_at_most_a_quarter_of_g1_and_g2() {
    // (in flight, batch, bytes floor (None: the default), G1, G2) → blocks
    // per batch (of 8 KiB).
    for (in_flight, batch, bytes, g1, g2, runs) in [
        (1, 64, Some(0), 1024, 1024, 64),
        (4, 64, Some(0), 1024, 1024, 64),
        (4, 256, Some(0), 2048, 2048, 128),
        (2, 64, Some(0), 64, 1024, 8),
        (2, 64, Some(0), 1024, 96, 12),
        (4, 64, Some(0), 8, 8, 1),
        // Raised to the floor: 256 KiB is 32 blocks; 64 MiB would be 8192,
        // capped by the quarter rule.
        (4, 16, Some(256 << 10), 4096, 4096, 32),
        (4, 64, Some(256 << 10), 4096, 4096, 64),
        (4, 16, Some((256 << 10) + 1), 4096, 4096, 33),
        (1, 64, None, 1024, 1024, 256),
        (4, 64, None, 4096, 1024, 64),
    ] {
        let (engine, _mover, _open) = gated_engine_with(in_flight, batch, bytes, g1, g2);
        assert_eq!(
            engine.offload_batch_limit(),
            runs,
            "{in_flight} in flight, batches of {batch} raised to {bytes:?} bytes, G1 {g1}, G2 {g2}"
        );
    }
}

#[test]
fn a_block_in_flight_is_not_copied_again() {
    let (engine, mover, _open) = gated_engine(2, 2, 16, 64);
    let hashes = chain(5, 2);
    let blocks = compute(&engine, &hashes, None);
    mover.wait_held(1);
    // Queue the same two blocks again while their copy is in flight.
    engine.offload((0..2).map(|i| (blocks.get(i).unwrap().downgrade(), None)));
    engine.wait_offload_idle();
    assert_eq!(engine.stats().skipped[SkipReason::Present as usize], 2);
    assert_eq!(mover.held(), 1, "a block in flight was copied again");
    settle(&engine, &mover);
    assert!(hashes.iter().all(|&h| in_g2(&engine, h)));
    assert_eq!(engine.pool(Tier::G2).unwrap().counts().inactive, 2);
}

#[test]
fn flush_and_drop_wait_for_batches_in_flight() {
    let (engine, mover, _open) = gated_engine(3, 1, 16, 64);
    let hashes = chain(8, 3);
    drop(compute(&engine, &hashes, None));
    mover.wait_held(3);
    engine.wait_offload_idle();
    // What flush finds when it returns: the copies still held then.
    let entered = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        let flushed = s.spawn(|| {
            entered.wait();
            engine.flush();
            mover.held()
        });
        entered.wait();
        mover.run(2, false);
        mover.run(0, true);
        mover.run(0, false);
        assert_eq!(
            flushed.join().unwrap(),
            0,
            "flush returned with copies in flight"
        );
    });
    // The first batch (hashes[0]) lost its pair.
    assert!(!in_g2(&engine, hashes[0]), "a lost pair was registered");
    assert!(in_g2(&engine, hashes[1]) && in_g2(&engine, hashes[2]));
    // Dropping the engine with a copy in flight waits for it, and registers
    // what landed.
    let more = chain(9, 1);
    drop(compute(&engine, &more, None));
    mover.wait_held(1);
    let g2 = engine.pool(Tier::G2).unwrap().clone();
    let (entered, gated) = (&entered, &*mover);
    std::thread::scope(|s| {
        let dropper = s.spawn(move || {
            entered.wait();
            drop(engine);
            // Copies still held when the drop returned.
            gated.held()
        });
        entered.wait();
        assert!(mover.run(0, false).is_some());
        assert_eq!(
            dropper.join().unwrap(),
            0,
            "the engine was dropped before its copy ran"
        );
    });
    assert!(
        g2.contains(more[0]),
        "the copy that landed during the drop was not registered"
    );
}

#[derive(Debug, Clone)]
enum Op {
    /// Compute a fresh chain of `len` blocks; keep them or drop them.
    Compute { len: usize, keep: bool },
    /// Drop kept chain `i` (modulo).
    Drop(usize),
    /// Queue kept chain `i` (modulo) for offload again.
    Again(usize),
    /// Evict every unreferenced G1 block.
    EvictG1,
    /// Run held copy `i` (modulo), losing its first pair or not.
    Run { i: usize, lose_first: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..6, any::<bool>()).prop_map(|(len, keep)| Op::Compute { len, keep }),
        1 => any::<usize>().prop_map(Op::Drop),
        1 => any::<usize>().prop_map(Op::Again),
        1 => Just(Op::EvictG1),
        4 => (any::<usize>(), prop::bool::weighted(0.2))
            .prop_map(|(i, lose_first)| Op::Run { i, lose_first }),
    ]
}

fn run_model(in_flight: usize, batch: usize, ops: Vec<Op>) {
    let (engine, mover, _open) = gated_engine(in_flight, batch, 256, 256);
    let mut kept: Vec<(Vec<SequenceHash>, ImmutableBlocks)> = Vec::new();
    // G1 block id → the hash computed into it last (a held source keeps
    // its id, so this names the hash of every pair in flight).
    let mut name: HashMap<usize, SequenceHash> = HashMap::new();
    // Hashes whose last copy lost them: G2 must not hold them.
    let mut lost: HashSet<SequenceHash> = HashSet::new();
    for (n, op) in ops.into_iter().enumerate() {
        match op {
            Op::Compute { len, keep } => {
                let hashes = chain(1000 + n as u64, len);
                let blocks = compute(&engine, &hashes, None);
                for (i, &h) in hashes.iter().enumerate() {
                    name.insert(blocks.get(i).unwrap().block_id() as usize, h);
                }
                if keep {
                    kept.push((hashes, blocks));
                }
            }
            Op::Drop(i) if !kept.is_empty() => {
                let k = i % kept.len();
                kept.remove(k);
            }
            Op::Again(i) if !kept.is_empty() => {
                let (_, blocks) = &kept[i % kept.len()];
                engine
                    .offload((0..blocks.len()).map(|j| (blocks.get(j).unwrap().downgrade(), None)));
            }
            Op::EvictG1 => {
                engine.g1().evict(usize::MAX >> 1);
            }
            Op::Run { i, lose_first } => {
                let held = mover.held_pairs();
                // In flight: no source and no target twice.
                let all: Vec<_> = held.iter().flatten().collect();
                let srcs: HashSet<_> = all.iter().map(|p| p.0).collect();
                let dsts: HashSet<_> = all.iter().map(|p| p.1).collect();
                assert_eq!(srcs.len(), all.len(), "a block is in two copies in flight");
                assert_eq!(dsts.len(), all.len(), "a target is in two copies in flight");
                if let Some((landed, gone)) = mover.run(i, lose_first) {
                    for p in landed {
                        let h = name[&p.0];
                        lost.remove(&h);
                    }
                    if let Some(p) = gone {
                        lost.insert(name[&p.0]);
                    }
                }
            }
            _ => {}
        }
        // Checked once the worker has done all it can.
        engine.wait_offload_idle();
        assert!(
            mover.held() <= in_flight,
            "more batches in flight than allowed"
        );
        for &h in &lost {
            assert!(!in_g2(&engine, h), "a lost pair was registered");
        }
    }
    for p in settle(&engine, &mover) {
        lost.remove(&name[&p.0]);
    }
    assert!(mover.most.load(Ordering::SeqCst) <= in_flight);
    // Every block still referenced was offloaded unless its copy lost it;
    // every block in G2 holds its bytes (checked by `in_g2`).
    for (hashes, _) in &kept {
        for &h in hashes {
            assert_eq!(
                in_g2(&engine, h),
                !lost.contains(&h),
                "{h:?} lost={}",
                lost.contains(&h)
            );
        }
    }
    for &h in name.values() {
        in_g2(&engine, h);
    }
    engine.pool(Tier::G2).unwrap().audit().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn batches_in_flight_match_the_model(
        in_flight in 1usize..4,
        batch in 1usize..5,
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        run_model(in_flight, batch, ops);
    }
}
