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
    Fetch(Vec<u8>),
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
        1 => keys().prop_map(Op::Fetch),
        3 => (keys(), prop::bool::weighted(0.85)).prop_map(|(k, ok)| Op::Commit(k, ok)),
        2 => keys().prop_map(Op::Pin),
        2 => (0u8..12).prop_map(Op::Unpin),
        1 => (0u8..12).prop_map(Op::Touch),
        1 => Just(Op::Reset),
    ]
}

/// What the model knows: the slot of every key being written (with the
/// block whose demotion rides on it), of every key held in each tier and
/// of every block being demoted, and how many loads read each key.
#[derive(Default)]
struct Model {
    writing: HashMap<SequenceHash, (u32, Option<SequenceHash>)>,
    ready: HashMap<SequenceHash, u32>,
    demoting: HashMap<SequenceHash, u32>,
    on_disk: HashMap<SequenceHash, u32>,
    loads: HashMap<SequenceHash, u32>,
}

impl Model {
    fn check_reservation(&mut self, r: &Reservation) {
        let taken: HashSet<u32> = r.slots.iter().map(|s| s.1).collect();
        for &(key, slot) in &r.vacated {
            // Its bytes were still in the slot the store takes.
            assert_eq!(self.ready.get(&key), Some(&slot), "vacated {key:?}");
            assert!(
                taken.contains(&slot),
                "vacated slot {slot}, which no store takes"
            );
        }
        for m in &r.demote {
            assert!(
                r.vacated.contains(&(m.key, m.from)),
                "demoted {m:?} not named as vacated"
            );
        }
        for e in &r.evicted {
            assert!(
                !self.loads.contains_key(e),
                "evicted {e:?} while a load reads it"
            );
            let was = self.ready.remove(e).or_else(|| self.on_disk.remove(e));
            assert!(was.is_some(), "evicted {e:?}, which was not held");
        }
        for m in &r.demote {
            assert!(
                !self.loads.contains_key(&m.key),
                "demoted {:?} while a load reads it",
                m.key
            );
            assert_eq!(
                self.ready.remove(&m.key),
                Some(m.from),
                "demoted {:?} from a slot it did not hold",
                m.key
            );
            assert!(
                taken.contains(&m.from),
                "demoted from slot {}, which no store takes",
                m.from
            );
            let busy = self.on_disk.values().chain(self.demoting.values());
            assert!(
                !busy.copied().any(|s| s == m.to),
                "G3 slot {} handed out while in use",
                m.to
            );
            self.demoting.insert(m.key, m.to);
        }
        let busy: HashSet<u32> = self.writing.values().map(|w| w.0).collect();
        for &(key, slot) in &r.slots {
            assert!(!busy.contains(&slot), "slot {slot} handed out twice");
            assert!(
                !self.ready.values().any(|&s| s == slot),
                "slot {slot} handed out while it holds a ready block"
            );
            let demotes = r.demote.iter().find(|m| m.from == slot).map(|m| m.key);
            assert!(self.writing.insert(key, (slot, demotes)).is_none());
        }
    }

    fn commit(&mut self, keys: &[SequenceHash], ok: bool) {
        for k in keys {
            let Some((slot, demotes)) = self.writing.remove(k) else {
                continue;
            };
            let demoted = demotes.and_then(|d| self.demoting.remove(&d).map(|s| (d, s)));
            if ok {
                self.ready.insert(*k, slot);
                if let Some((d, s)) = demoted {
                    self.on_disk.insert(d, s);
                }
            }
        }
    }

    fn source(&self, k: &SequenceHash) -> Option<Source> {
        let g2 = self.ready.get(k).map(|&slot| Source {
            tier: Tier::G2,
            slot,
        });
        g2.or_else(|| {
            self.on_disk.get(k).map(|&slot| Source {
                tier: Tier::G3,
                slot,
            })
        })
    }
}

fn check_step(ledger: &Ledger, m: &mut Model, op: Op) {
    match op {
        Op::Reserve(keys) => {
            let keys: Vec<_> = keys.into_iter().map(|k| (h(k), None)).collect();
            m.check_reservation(&ledger.reserve(&keys));
        }
        Op::Fetch(keys) => {
            let keys: Vec<_> = keys.into_iter().map(|k| (h(k), None)).collect();
            let r = ledger.reserve_fetched(&keys);
            assert_eq!(r.refused, 0, "a fetch is never refused by admission");
            m.check_reservation(&r);
        }
        Op::Commit(keys, ok) => {
            let keys: Vec<_> = keys.into_iter().map(h).collect();
            ledger.commit(&keys, ok);
            m.commit(&keys, ok);
        }
        Op::Pin(keys) => {
            let keys: Vec<_> = keys.into_iter().map(h).collect();
            let all_ready = keys.iter().all(|k| m.source(k).is_some());
            match ledger.pin(&keys) {
                Ok(sources) => {
                    assert!(all_ready, "pinned a key that is not ready: {keys:?}");
                    for (k, s) in keys.iter().zip(sources) {
                        assert_eq!(m.source(k), Some(s), "the slot of {k:?} moved");
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
            m.on_disk.retain(|k, _| m.loads.contains_key(k));
        }
    }
    for k in m.writing.keys().chain(m.demoting.keys()) {
        assert_eq!(
            ledger.presence(*k),
            Presence::Writing,
            "{k:?} should be written"
        );
    }
    for k in m.ready.keys().chain(m.on_disk.keys()) {
        assert_eq!(
            ledger.presence(*k),
            Presence::Ready,
            "{k:?} should be ready"
        );
    }
    check_ready_prefix(ledger, m);
    let c = ledger.counts();
    assert_eq!(
        (c.ready, c.writing, c.reading, c.on_disk, c.demoting),
        (
            m.ready.len(),
            m.writing.len(),
            m.loads.len(),
            m.on_disk.len(),
            m.demoting.len()
        )
    );
}

/// `ready_prefix` counts what asking `presence` key by key would, over
/// runs of keys that start with the ready ones (G2's and G3's mixed) and
/// over every key in both orders.
fn check_ready_prefix(ledger: &Ledger, m: &Model) {
    let mut ready: Vec<SequenceHash> = m.ready.keys().chain(m.on_disk.keys()).copied().collect();
    ready.sort_by_key(|k| std::cmp::Reverse(k.0));
    let all: Vec<SequenceHash> = (0..12).map(h).collect();
    let rest = all.iter().filter(|k| !ready.contains(k)).copied();
    let runs = [
        ready.iter().copied().chain(rest).collect::<Vec<_>>(),
        all.clone(),
        all.iter().rev().copied().collect(),
    ];
    for keys in runs {
        let one_by_one = keys
            .iter()
            .take_while(|k| ledger.presence(**k) == Presence::Ready)
            .count();
        assert_eq!(ledger.ready_prefix(&keys), one_by_one, "over {keys:?}");
    }
}

fn policy() -> impl Strategy<Value = TierPolicy> {
    prop_oneof![Just(TierPolicy::WriteThrough), Just(TierPolicy::ReuseScore)]
}

proptest! {
    #[test]
    fn stores_and_loads_never_share_a_slot(
        capacity in 1usize..6,
        policy in policy(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let ledger = Ledger::new(capacity, policy).unwrap();
        let mut m = Model::default();
        for op in ops {
            check_step(&ledger, &mut m, op);
        }
    }

    #[test]
    fn demotions_and_disk_loads_never_share_a_slot(
        capacity in 1usize..5,
        disk in 1usize..6,
        policy in policy(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let ledger = Ledger::with_disk(capacity, disk, policy).unwrap();
        let mut m = Model::default();
        for op in ops {
            check_step(&ledger, &mut m, op);
        }
    }
}

#[test]
fn an_evicted_block_moves_to_disk_with_the_store_that_took_its_slot() {
    let ledger = Ledger::with_disk(1, 2, TierPolicy::WriteThrough).unwrap();
    let first = ledger.reserve(&[(h(1), None)]);
    ledger.commit(&[h(1)], true);
    let r = ledger.reserve(&[(h(2), None)]);
    assert_eq!(r.evicted, vec![]);
    let m = r.demote[0];
    assert_eq!((m.key, m.from), (h(1), first.slots[0].1));
    // Not loadable from disk until the store that moves it is confirmed.
    assert_eq!(ledger.presence(h(1)), Presence::Writing);
    assert!(ledger.pin(&[h(1)]).is_err());
    ledger.commit(&[h(2)], true);
    let at = ledger.pin(&[h(1), h(2)]).unwrap();
    assert_eq!(
        at[0],
        Source {
            tier: Tier::G3,
            slot: m.to
        }
    );
    assert_eq!(at[1].tier, Tier::G2);
    // A key on disk is held: not stored again.
    ledger.unpin(&[h(1), h(2)]);
    assert_eq!(ledger.reserve(&[(h(1), None)]).present, 1);
}

#[test]
fn an_abandoned_store_loses_the_block_it_was_demoting() {
    let ledger = Ledger::with_disk(1, 1, TierPolicy::WriteThrough).unwrap();
    ledger.reserve(&[(h(1), None)]);
    ledger.commit(&[h(1)], true);
    assert_eq!(ledger.reserve(&[(h(2), None)]).demote.len(), 1);
    ledger.commit(&[h(2)], false);
    assert_eq!(ledger.presence(h(1)), Presence::Absent);
    let c = ledger.counts();
    assert_eq!((c.ready, c.on_disk, c.demoting), (0, 0, 0));
}

#[test]
fn a_doomed_block_is_not_demoted() {
    let ledger = Ledger::with_disk(1, 1, TierPolicy::WriteThrough).unwrap();
    ledger.reserve(&[(h(1), None)]);
    ledger.commit(&[h(1)], true);
    ledger.doom(&[h(1)]);
    let r = ledger.reserve(&[(h(2), None)]);
    assert_eq!((r.demote.len(), r.evicted.clone()), (0, vec![h(1)]));
}

#[test]
fn a_block_is_loadable_only_after_its_store_is_confirmed() {
    let ledger = Ledger::new(4, TierPolicy::WriteThrough).unwrap();
    let r = ledger.reserve(&[(h(1), None), (h(2), Some(h(1)))]);
    assert_eq!(r.slots.len(), 2);
    assert_eq!(ledger.presence(h(1)), Presence::Writing);
    assert_eq!(ledger.pin(&[h(1)]), Err(LedgerError::NotReady(h(1))));
    ledger.commit(&[h(1), h(2)], true);
    let slots: Vec<u32> = ledger
        .pin(&[h(1), h(2)])
        .unwrap()
        .iter()
        .map(|s| s.slot)
        .collect();
    assert_eq!(slots, r.slots.iter().map(|s| s.1).collect::<Vec<_>>());
    let events = ledger.take_events();
    assert_eq!(events, vec![(Tier::G2, true, h(1)), (Tier::G2, true, h(2))]);
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
fn a_reservation_names_the_blocks_it_took_slots_from() {
    let ledger = Ledger::with_disk(1, 1, TierPolicy::WriteThrough).unwrap();
    let r = ledger.reserve(&[(h(1), None)]);
    assert!(r.vacated.is_empty());
    ledger.commit(&[h(1)], true);
    let slot = r.slots[0].1;
    // Block 1 leaves G2 (to G3) for block 2, then block 2 (dropped) for 3.
    let r = ledger.reserve(&[(h(2), None)]);
    assert_eq!(r.vacated, vec![(h(1), slot)]);
    ledger.commit(&[h(2)], true);
    let r = ledger.reserve(&[(h(3), None)]);
    assert_eq!(r.vacated, vec![(h(2), slot)]);
}

#[test]
fn a_fetched_block_skips_admission_and_is_loadable_once_committed() {
    let ledger = Ledger::new(4, TierPolicy::MinUses(2)).unwrap();
    assert_eq!(ledger.reserve(&[(h(1), None)]).refused, 1);
    let r = ledger.reserve_fetched(&[(h(1), None), (h(2), Some(h(1)))]);
    assert_eq!((r.slots.len(), r.refused), (2, 0));
    assert_eq!(ledger.presence(h(1)), Presence::Writing);
    assert!(ledger.pin(&[h(1)]).is_err());
    ledger.commit(&[h(1)], true);
    ledger.commit(&[h(2)], false);
    assert_eq!(ledger.presence(h(1)), Presence::Ready);
    assert_eq!(ledger.presence(h(2)), Presence::Absent);
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

#[test]
fn retention_hints_rank_blocks_in_both_tiers() {
    use std::time::Duration;
    for (hint, first_to_go) in [
        (RetentionHint::ReturnsWithin(Duration::from_secs(30)), h(2)),
        (RetentionHint::Done, h(1)),
    ] {
        let ledger = Ledger::new(2, TierPolicy::ReuseScore).unwrap();
        // A hint's weight depends on how many requests come before it is
        // due: on a fixed clock none do, whatever the machine's speed.
        ledger.set_time(Duration::from_secs(1));
        for k in [1, 2] {
            ledger.record_request(&[h(k)]);
            ledger.reserve(&[(h(k), None)]);
            ledger.commit(&[h(k)], true);
        }
        // Block 1 is the older: without a hint it would go first.
        ledger.retain(&[h(1)], hint);
        ledger.record_request(&[h(3)]);
        let r = ledger.reserve(&[(h(3), None)]);
        assert_eq!(r.evicted, vec![first_to_go], "{hint:?}");
    }
}

#[test]
fn blocks_a_kept_disk_held_are_loadable_from_their_slots_and_evictable() {
    let ledger = Ledger::with_disk(1, 3, TierPolicy::WriteThrough).unwrap();
    // Slot 5 is beyond G3, slot 0 and key 1 are listed twice.
    let n = ledger.restore_disk(&[(2, h(1)), (0, h(2)), (5, h(3)), (0, h(4)), (1, h(1))]);
    assert_eq!(n, vec![(2, h(1)), (0, h(2))]);
    assert_eq!(ledger.counts().on_disk, 2);
    assert_eq!(ledger.ready_prefix(&[h(1), h(2), h(3)]), 2);
    let sources = ledger.pin(&[h(2), h(1)]).unwrap();
    let at = |slot| Source {
        tier: Tier::G3,
        slot,
    };
    assert_eq!(sources, vec![at(0), at(2)]);
    ledger.unpin(&[h(1), h(2)]);
    // A key already held is not taken up again, and the free slot 1 is
    // what the next demotion gets.
    assert!(ledger.restore_disk(&[(1, h(1))]).is_empty());
    let r = ledger.reserve(&[(h(7), None)]);
    ledger.commit(&[h(7)], true);
    let r2 = ledger.reserve(&[(h(8), None)]);
    assert!(r.demote.is_empty());
    assert_eq!(
        r2.demote,
        vec![Move {
            key: h(7),
            from: 0,
            to: 1
        }]
    );
    // Without a disk tier nothing is taken up.
    let no_disk = Ledger::new(2, TierPolicy::WriteThrough).unwrap();
    assert!(no_disk.restore_disk(&[(0, h(1))]).is_empty());
}

#[test]
fn blocks_a_kept_host_tier_held_come_first_and_stay_exclusive_of_disk() {
    let ledger = Ledger::with_disk(3, 3, TierPolicy::WriteThrough).unwrap();
    // Slot 3 is beyond G2; key 1 was moved to disk just before the
    // restart, its G2 slot not yet written again.
    let host = ledger.restore_host(&[(1, h(1)), (3, h(5)), (0, h(3))]);
    assert_eq!(host, vec![(1, h(1)), (0, h(3))]);
    let disk = ledger.restore_disk(&[(0, h(1)), (2, h(2))]);
    assert_eq!(disk, vec![(2, h(2))]);
    assert_eq!(ledger.counts().on_disk, 1);
    let sources = ledger.pin(&[h(1), h(2), h(3)]).unwrap();
    let at = |tier, slot| Source { tier, slot };
    assert_eq!(
        sources,
        vec![at(Tier::G2, 1), at(Tier::G3, 2), at(Tier::G2, 0)]
    );
    ledger.unpin(&[h(1), h(2), h(3)]);
    // The free G2 slot is what the next store gets.
    let r = ledger.reserve(&[(h(7), None)]);
    assert_eq!(r.slots, vec![(h(7), 2)]);
    assert!(r.evicted.is_empty() && r.demote.is_empty(), "{r:?}");
}

/// Which of two blocks a kept disk tier holds is evicted first, when a
/// restarted ledger takes them up with `history` (or without one).
fn evicted_after_restart(history: Option<&HistorySnapshot>) -> Vec<SequenceHash> {
    let ledger = Ledger::with_disk(1, 2, TierPolicy::ReuseScore).unwrap();
    if let Some(h) = history {
        ledger.restore_history(h);
    }
    ledger.restore_disk(&[(0, h(1)), (1, h(2))]);
    // Two new blocks through a G2 of one slot: the first moves to disk,
    // which must let one kept block go.
    let mut evicted = Vec::new();
    for k in [7, 8] {
        ledger.record_request(&[h(k)]);
        let r = ledger.reserve(&[(h(k), None)]);
        ledger.commit(&[h(k)], true);
        evicted.extend(r.evicted);
    }
    evicted
}

#[test]
fn a_restored_history_ranks_kept_blocks_by_their_past_uses() {
    // Before the restart block 2 was asked for once, then block 1 five
    // times.
    let before = Ledger::with_disk(1, 2, TierPolicy::ReuseScore).unwrap();
    before.record_request(&[h(2)]);
    for _ in 0..5 {
        before.record_request(&[h(1)]);
    }
    let history = before.history_snapshot();
    let again = HistorySnapshot::from_bytes(&history.to_bytes()).unwrap();
    assert_eq!(evicted_after_restart(Some(&again)), vec![h(2)]);
    // Without it the two look alike, and the one taken up first goes.
    assert_eq!(evicted_after_restart(None), vec![h(1)]);
}
