//! Retention hints: their invariants on a reuse-score pool (model-based,
//! with proptest), and their effect through the tier engine and the slot
//! API.

mod policy_support;
mod tier_support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kvbm_block::SequenceHash;
use kvbm_pool::policy::{
    HintClock, Retained, RetentionHint, ReuseModel, SharedHistory, UseHistory,
};
use kvbm_pool::tier::G1Lookup;
use kvbm_pool::{SlotManager, Tier};
use policy_support::{h, pool, store};
use proptest::prelude::*;
use tier_support::*;

fn history() -> SharedHistory {
    let mut u = UseHistory::new(4096).with_model(ReuseModel::ReturnWithin { horizon: 350 });
    u.set_clock(HintClock::Manual(0));
    SharedHistory::new(u)
}

#[derive(Clone, Debug)]
enum Op {
    /// A request carrying these blocks (recorded in the history, then
    /// stored).
    Request(Vec<u64>),
    /// A hint for these blocks: `Some(ms)` returns within, `None` done.
    Hint(Vec<u64>, Option<u64>),
    /// Time passes (ms).
    Wait(u64),
}

fn op() -> impl Strategy<Value = Op> {
    let blocks = prop::collection::vec(0u64..24, 1..4);
    prop_oneof![
        4 => blocks.clone().prop_map(Op::Request),
        2 => (blocks, prop::option::of(1u64..50)).prop_map(|(b, t)| Op::Hint(b, t)),
        1 => (1u64..200).prop_map(Op::Wait),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Whatever the hints: a block marked done goes before any unhinted
    /// one, a block kept by a live short hint goes after every unhinted
    /// one, an expired hint keeps nothing, and the pool's books stay whole
    /// (every block once, none lost).
    #[test]
    fn hints_order_evictions_and_lapse(ops in prop::collection::vec(op(), 1..80)) {
        let history = history();
        let capacity = 6;
        let pool = pool(&history, capacity);
        let mut now = 0u64;
        for op in ops {
            match op {
                Op::Request(blocks) => {
                    now += 1;
                    history.lock().set_clock(HintClock::Manual(now));
                    let hashes: Vec<_> = blocks.iter().map(|&x| h(x)).collect();
                    history.lock().record_request(&hashes);
                    for &x in &blocks {
                        // What is resident and how hints rank it, before.
                        let resident: Vec<(u64, Retained)> = (0..24)
                            .filter(|&y| pool.contains(h(y)))
                            .map(|y| (y, history.lock().retained(h(y))))
                            .collect();
                        let full = pool.counts().free == 0;
                        let stored = store(&pool, x);
                        if !(stored && full) {
                            continue;
                        }
                        let gone: Vec<(u64, Retained)> = resident
                            .iter()
                            .filter(|(y, _)| !pool.contains(h(*y)))
                            .copied()
                            .collect();
                        prop_assert_eq!(gone.len(), 1, "one block makes room for one");
                        let (victim, how) = gone[0];
                        let any = |r: fn(&Retained) -> bool| {
                            resident.iter().any(|(y, k)| *y != x && r(k))
                        };
                        if any(|k| *k == Retained::Done) {
                            prop_assert_eq!(how, Retained::Done, "victim {}", victim);
                        }
                        if matches!(how, Retained::Kept { .. }) {
                            prop_assert!(
                                !any(|k| *k == Retained::No),
                                "kept block {} evicted while an unhinted one stayed",
                                victim
                            );
                        }
                    }
                }
                Op::Hint(blocks, t) => {
                    let hashes: Vec<_> = blocks.iter().map(|&x| h(x)).collect();
                    let hint = match t {
                        Some(ms) => RetentionHint::ReturnsWithin(Duration::from_millis(ms)),
                        None => RetentionHint::Done,
                    };
                    history.lock().retain(&hashes, hint);
                    // As the engine does: requeue the evictable ones.
                    pool.touch(&hashes);
                }
                Op::Wait(ms) => {
                    now += ms;
                    history.lock().set_clock(HintClock::Manual(now));
                }
            }
            // Expired hints keep nothing.
            let u = history.lock();
            for y in 0..24u64 {
                if let Retained::Kept { until, .. } = u.retained(h(y)) {
                    prop_assert!(until > now);
                }
            }
            drop(u);
            let counts = pool.audit().unwrap();
            prop_assert_eq!(counts.inactive + counts.free, capacity);
            let resident: HashSet<u64> = (0..24).filter(|&y| pool.contains(h(y))).collect();
            prop_assert_eq!(resident.len(), counts.inactive);
        }
    }
}

#[test]
fn done_blocks_are_not_admitted_when_full() {
    let history = history();
    let pool = pool(&history, 2);
    history.lock().record_request(&[h(1), h(2)]);
    assert!(store(&pool, 1) && store(&pool, 2));
    history.lock().record_request(&[h(3)]);
    history.lock().retain(&[h(3)], RetentionHint::Done);
    assert!(!pool.admit(h(3)));
    assert!(!store(&pool, 3));
    // A later use spends the mark: admitted again.
    history.lock().record_request(&[h(3)]);
    assert!(pool.admit(h(3)));
}

#[test]
fn a_kept_block_survives_pressure_until_its_hint_lapses() {
    let history = history();
    let pool = pool(&history, 4);
    history.lock().record_request(&[h(100)]);
    assert!(store(&pool, 100));
    history.lock().retain(
        &[h(100)],
        RetentionHint::ReturnsWithin(Duration::from_millis(1_000)),
    );
    let mut t = 0;
    for x in 0..40u64 {
        t += 10;
        history.lock().set_clock(HintClock::Manual(t));
        history.lock().record_request(&[h(x)]);
        store(&pool, x);
        // Kept for 2 × 1 s (the default slack): until t = 2 000.
        assert!(pool.contains(h(100)), "evicted at t = {t}");
    }
    // Lapsed: it ranks by its history again, and it is old now.
    history.lock().set_clock(HintClock::Manual(2_500));
    for x in 40..50u64 {
        history.lock().record_request(&[h(x)]);
        store(&pool, x);
    }
    assert!(!pool.contains(h(100)));
}

#[test]
fn engine_hints_keep_a_paused_prefix_and_drop_a_done_one() {
    let dir = tempdir();
    // G1 8 blocks, G2 8 blocks, no G3: three prompts of 8 compete.
    let engine = tiers(8, 8, 0, dir.path()).build().unwrap();
    let kept = chain(1, 8);
    let done = chain(2, 8);
    let run = |id: u64, hashes: &[SequenceHash], t_ms: u64, hint: Option<RetentionHint>| {
        engine.set_time(Duration::from_millis(t_ms));
        let m = engine
            .match_request(id, hashes, hashes.len() * BLOCK_TOKENS + 1, G1Lookup::Pool)
            .unwrap();
        if let Some(hint) = hint {
            assert!(engine.hint_request(id, hint));
        }
        let have = m.total_blocks();
        let external = m.external_blocks();
        let mut held = m.g1.into_blocks();
        if external > 0 {
            let d = engine
                .onboard(id, kvbm_pool::tier::OnboardTarget::Pool)
                .unwrap()
                .wait()
                .unwrap();
            held.extend(d.blocks.into_blocks());
        }
        let at = held.len();
        if at < hashes.len() {
            let parent = at.checked_sub(1).map(|p| hashes[p]);
            held.extend(compute(&engine, &hashes[at..], parent).into_blocks());
        }
        drop(held);
        engine.release(id);
        engine.flush();
        have
    };
    // A request a second; the hint's minute is 60 requests, well within
    // the reuse score's horizon.
    run(
        1,
        &kept,
        0,
        Some(RetentionHint::ReturnsWithin(Duration::from_secs(60))),
    );
    run(2, &done, 1_000, Some(RetentionHint::Done));
    // Unhinted traffic fills the tiers twice over.
    for k in 0..4u64 {
        run(10 + k, &chain(100 + k, 8), 2_000 + 1_000 * k, None);
    }
    // The paused program comes back: its whole prefix is still there.
    assert_eq!(run(20, &kept, 30_000, None), 8);
    // The closed one was dropped first.
    assert_eq!(run(21, &done, 31_000, None), 0);
    engine.g1().audit().unwrap();
    engine.pool(Tier::G2).unwrap().audit().unwrap();
}

#[test]
fn slot_hints_apply_when_the_slot_is_freed() {
    let dir = tempdir();
    let engine = Arc::new(tiers(8, 8, 0, dir.path()).build().unwrap());
    let slots = SlotManager::new(Arc::clone(&engine));
    let hashes = chain(3, 4);
    slots
        .create_slot("a", hashes.clone(), 4 * BLOCK_TOKENS)
        .unwrap();
    slots.set_retention("a", RetentionHint::Done).unwrap();
    assert!(slots.set_retention("nobody", RetentionHint::Done).is_err());
    assert_eq!(engine.retained(hashes[0]), Retained::No);
    assert!(slots.free("a"));
    // The slot's blocks carry the mark now.
    for &x in &hashes {
        assert_eq!(engine.retained(x), Retained::Done);
    }
    engine.set_time(Duration::from_secs(100));
    let other = chain(4, 2);
    slots
        .create_slot("b", other.clone(), 2 * BLOCK_TOKENS)
        .unwrap();
    assert!(slots.free_with_hint(
        "b",
        Some(RetentionHint::ReturnsWithin(Duration::from_secs(5)))
    ));
    // Due back within 5 s, kept for twice that.
    assert_eq!(
        engine.retained(other[1]),
        Retained::Kept {
            due: 105_000,
            until: 110_000
        }
    );
    assert!(!slots.free_with_hint("c", Some(RetentionHint::Done)));
}

#[test]
fn done_hints_that_prove_wrong_are_ignored() {
    let history = history();
    let mut u = history.lock();
    // Conversations said "done" and came back, again and again.
    for k in 0..6u64 {
        u.record_request(&[h(k)]);
        u.retain(&[h(k)], RetentionHint::Done);
        assert!(k > 0 || u.retained(h(0)) == Retained::Done);
        u.record_request(&[h(k)]);
    }
    assert!(!u.done_trusted());
    u.record_request(&[h(50)]);
    u.retain(&[h(50)], RetentionHint::Done);
    assert_eq!(u.retained(h(50)), Retained::No, "ranked by its history");
    // Right ones restore the trust.
    for k in 100..200u64 {
        u.record_request(&[h(k)]);
        u.retain(&[h(k)], RetentionHint::Done);
    }
    assert!(u.done_trusted());
    // A hint is judged when given: the doubted one stays ranked by its
    // history, a new one is acted on.
    assert_eq!(u.retained(h(50)), Retained::No);
    u.record_request(&[h(60)]);
    u.retain(&[h(60)], RetentionHint::Done);
    assert_eq!(u.retained(h(60)), Retained::Done);
}
