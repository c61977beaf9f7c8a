//! The ledger against a model of the two rules that keep bytes right: a
//! slot is never handed to a store while a load reads it or another store
//! writes it, and only committed keys are loadable.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;

fn h(k: u8) -> SequenceHash {
    SequenceHash(u64::from(k) + 1)
}

#[derive(Debug, Clone)]
enum Op {
    Reserve(Vec<u8>),
    Commit(Vec<u8>, bool),
    Pin(Vec<u8>),
    Unpin(u8),
    Touch(u8),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    let keys = || prop::collection::vec(0u8..12, 1..5);
    prop_oneof![
        3 => keys().prop_map(Op::Reserve),
        3 => (keys(), prop::bool::weighted(0.85)).prop_map(|(k, ok)| Op::Commit(k, ok)),
        2 => keys().prop_map(Op::Pin),
        2 => (0u8..12).prop_map(Op::Unpin),
        1 => (0u8..12).prop_map(Op::Touch),
        1 => Just(Op::Reset),
    ]
}

/// What the model knows: the slot of every key being written, of every
/// ready key, and how many loads read each.
#[derive(Default)]
struct Model {
    writing: HashMap<SequenceHash, u32>,
    ready: HashMap<SequenceHash, u32>,
    loads: HashMap<SequenceHash, u32>,
}

fn check_step(ledger: &Ledger, m: &mut Model, op: Op) {
    match op {
        Op::Reserve(keys) => {
            let keys: Vec<_> = keys.into_iter().map(|k| (h(k), None)).collect();
            let r = ledger.reserve(&keys);
            for e in &r.evicted {
                assert!(
                    !m.loads.contains_key(e),
                    "evicted {e:?} while a load reads it"
                );
                assert!(
                    m.ready.remove(e).is_some(),
                    "evicted {e:?}, which was not ready"
                );
            }
            let busy: HashSet<u32> = m.writing.values().copied().collect();
            for &(key, slot) in &r.slots {
                assert!(!busy.contains(&slot), "slot {slot} handed out twice");
                assert!(
                    !m.ready.values().any(|&s| s == slot),
                    "slot {slot} handed out while it holds a ready block"
                );
                assert!(m.writing.insert(key, slot).is_none());
            }
        }
        Op::Commit(keys, ok) => {
            let keys: Vec<_> = keys.into_iter().map(h).collect();
            ledger.commit(&keys, ok);
            for k in keys {
                if let Some(slot) = m.writing.remove(&k)
                    && ok
                {
                    m.ready.insert(k, slot);
                }
            }
        }
        Op::Pin(keys) => {
            let keys: Vec<_> = keys.into_iter().map(h).collect();
            let all_ready = keys.iter().all(|k| m.ready.contains_key(k));
            match ledger.pin(&keys) {
                Ok(slots) => {
                    assert!(all_ready, "pinned a key that is not ready: {keys:?}");
                    for (k, s) in keys.iter().zip(slots) {
                        assert_eq!(m.ready[k], s, "the slot of {k:?} moved");
                        *m.loads.entry(*k).or_default() += 1;
                    }
                }
                Err(_) => assert!(!all_ready, "refused to pin ready keys {keys:?}"),
            }
        }
        Op::Unpin(k) => {
            let k = h(k);
            if let Some(n) = m.loads.get_mut(&k) {
                ledger.unpin(&[k]);
                *n -= 1;
                if *n == 0 {
                    m.loads.remove(&k);
                }
            }
        }
        Op::Touch(k) => ledger.touch(&[h(k)]),
        Op::Reset => {
            ledger.reset();
            m.ready.retain(|k, _| m.loads.contains_key(k));
        }
    }
    for (k, _) in m.writing.iter() {
        assert_eq!(ledger.presence(*k), Presence::Writing);
    }
    for (k, _) in m.ready.iter() {
        assert_eq!(
            ledger.presence(*k),
            Presence::Ready,
            "{k:?} should be ready"
        );
    }
    let c = ledger.counts();
    assert_eq!(
        (c.ready, c.writing, c.reading),
        (m.ready.len(), m.writing.len(), m.loads.len())
    );
}

proptest! {
    #[test]
    fn stores_and_loads_never_share_a_slot(
        capacity in 1usize..6,
        policy in prop_oneof![Just(TierPolicy::WriteThrough), Just(TierPolicy::ReuseScore)],
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let ledger = Ledger::new(capacity, policy).unwrap();
        let mut m = Model::default();
        for op in ops {
            check_step(&ledger, &mut m, op);
        }
    }
}

#[test]
fn a_block_is_loadable_only_after_its_store_is_confirmed() {
    let ledger = Ledger::new(4, TierPolicy::WriteThrough).unwrap();
    let r = ledger.reserve(&[(h(1), None), (h(2), Some(h(1)))]);
    assert_eq!(r.slots.len(), 2);
    assert_eq!(ledger.presence(h(1)), Presence::Writing);
    assert_eq!(ledger.pin(&[h(1)]), Err(LedgerError::NotReady(h(1))));
    ledger.commit(&[h(1), h(2)], true);
    let slots = ledger.pin(&[h(1), h(2)]).unwrap();
    assert_eq!(slots, r.slots.iter().map(|s| s.1).collect::<Vec<_>>());
    let events = ledger.take_events();
    assert_eq!(events, vec![(true, h(1)), (true, h(2))]);
}

#[test]
fn a_full_tier_of_read_blocks_refuses_stores_instead_of_evicting_them() {
    let ledger = Ledger::new(2, TierPolicy::WriteThrough).unwrap();
    let r = ledger.reserve(&[(h(1), None), (h(2), None)]);
    assert_eq!(r.slots.len(), 2);
    ledger.commit(&[h(1), h(2)], true);
    ledger.pin(&[h(1), h(2)]).unwrap();
    let r = ledger.reserve(&[(h(3), None)]);
    assert_eq!((r.slots.len(), r.full), (0, 1));
    ledger.unpin(&[h(1)]);
    let r = ledger.reserve(&[(h(3), None)]);
    assert_eq!(r.evicted, vec![h(1)]);
}

#[test]
fn min_uses_admits_what_was_asked_for_often_enough() {
    let ledger = Ledger::new(4, TierPolicy::MinUses(2)).unwrap();
    ledger.record_request(&[h(1)]);
    assert_eq!(ledger.reserve(&[(h(1), None)]).refused, 1);
    ledger.record_request(&[h(1)]);
    assert_eq!(ledger.reserve(&[(h(1), None)]).slots.len(), 1);
    assert!(matches!(
        Ledger::new(4, TierPolicy::MinUses(0)),
        Err(LedgerError::Pool(_))
    ));
}

#[test]
fn a_doomed_block_is_never_loaded_again_and_stored_anew_once_evicted() {
    let ledger = Ledger::new(1, TierPolicy::WriteThrough).unwrap();
    ledger.reserve(&[(h(1), None)]);
    ledger.commit(&[h(1)], true);
    ledger.doom(&[h(1)]);
    assert_eq!(ledger.presence(h(1)), Presence::Absent);
    assert!(ledger.pin(&[h(1)]).is_err());
    // Still held: not stored again yet.
    assert_eq!(ledger.reserve(&[(h(1), None)]).present, 1);
    // Another block takes its slot; then it can be stored anew.
    assert_eq!(ledger.reserve(&[(h(2), None)]).evicted, vec![h(1)]);
    ledger.commit(&[h(2)], true);
    assert_eq!(ledger.reserve(&[(h(1), None)]).slots.len(), 1);
}

#[test]
fn clearing_forgets_copies_in_flight() {
    let ledger = Ledger::new(2, TierPolicy::WriteThrough).unwrap();
    ledger.reserve(&[(h(1), None), (h(2), None)]);
    ledger.commit(&[h(1)], true);
    ledger.pin(&[h(1)]).unwrap();
    ledger.clear();
    let c = ledger.counts();
    assert_eq!((c.ready, c.writing, c.reading), (0, 0, 0));
    assert_eq!(ledger.reserve(&[(h(3), None), (h(4), None)]).slots.len(), 2);
}
