//! Behaviour of the pool's individual operations and policies.

use kvbm_block::SequenceHash;
use kvbm_pool::{
    BlockPool, DuplicatePolicy, EvictionKind, ImmutableBlocks, KvEvent, PoolConfig, PoolError, Tier,
};

fn h(v: u64) -> SequenceHash {
    SequenceHash(v)
}

fn pool(capacity: usize, eviction: EvictionKind) -> BlockPool {
    BlockPool::new(PoolConfig::new(capacity, 4, Tier::G2).eviction(eviction)).unwrap()
}

/// Registers a chain of `hashes` (each the parent of the next).
fn chain(pool: &BlockPool, hashes: &[u64]) -> ImmutableBlocks {
    let blocks = pool.allocate(hashes.len()).unwrap();
    let mut parent = None;
    let complete = blocks
        .into_iter()
        .zip(hashes)
        .map(|(b, &v)| {
            let c = b.complete(h(v), parent).unwrap();
            parent = Some(h(v));
            c
        })
        .collect();
    pool.register(complete).unwrap()
}

#[test]
fn pool_is_send_sync_and_rejects_bad_configs() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<BlockPool>();
    send_sync::<kvbm_pool::ImmutableBlock>();
    assert!(matches!(
        BlockPool::new(PoolConfig::new(0, 4, Tier::G1)),
        Err(PoolError::InvalidConfig(_))
    ));
    assert!(matches!(
        BlockPool::new(PoolConfig::new(4, 0, Tier::G1)),
        Err(PoolError::InvalidConfig(_))
    ));
}

#[test]
fn allocation_is_all_or_nothing() {
    let p = pool(4, EvictionKind::Lru);
    let held = p.allocate(3).unwrap();
    let ids: Vec<u32> = held.iter().map(|b| b.block_id()).collect();
    assert!(ids.iter().all(|&id| id < 4));
    assert!(matches!(
        p.allocate(2),
        Err(PoolError::Exhausted { requested: 2, .. })
    ));
    assert!(matches!(p.allocate(5), Err(PoolError::Exhausted { .. })));
    assert_eq!(p.counts().free, 1, "a refused allocation takes nothing");
    drop(held);
    assert_eq!(p.counts().free, 4);
    assert!(p.allocate(0).unwrap().is_empty());
}

#[test]
fn allocation_evicts_only_inactive_blocks() {
    let p = pool(4, EvictionKind::Lru);
    let active = chain(&p, &[1, 2]);
    drop(chain(&p, &[3, 4]));
    let fresh = p.allocate(2).unwrap();
    assert!(p.contains(h(1)) && p.contains(h(2)), "held blocks stay");
    assert!(!p.contains(h(3)) && !p.contains(h(4)));
    assert!(p.allocate(1).is_err());
    drop((active, fresh));
    p.audit().unwrap();
}

#[test]
fn evicting_to_allocated_takes_the_victims_slots_not_free_ones() {
    let p = pool(6, EvictionKind::Lru);
    let cached = chain(&p, &[1, 2, 3, 4]);
    let ids: Vec<u32> = (0..4).map(|i| cached.get(i).unwrap().block_id()).collect();
    drop(cached);
    assert_eq!(p.counts().free, 2);
    let taken = p.evict_to_allocated(3);
    assert_eq!(taken.len(), 3);
    assert!(
        taken.iter().all(|b| ids.contains(&b.block_id())),
        "the victims' slots, not free ones"
    );
    assert_eq!(p.counts().free, 2, "the free blocks stay free");
    let still = [1, 2, 3, 4].iter().filter(|&&v| p.contains(h(v))).count();
    assert_eq!(still, 1, "three were evicted");
    assert_eq!(
        p.evict_to_allocated(5).len(),
        1,
        "one inactive block was left"
    );
    drop(taken);
    assert_eq!(p.counts().free, 6);
    p.audit().unwrap();
}

#[test]
fn duplicates_reuse_the_primary_or_stay_private() {
    let p = pool(4, EvictionKind::Lru);
    let first = chain(&p, &[7]);
    let second = chain(&p, &[7]);
    assert_eq!(
        first.block_ids(),
        second.block_ids(),
        "same block handed out"
    );
    assert_eq!(
        p.counts().free,
        3,
        "the duplicate went back to the free list"
    );
    drop((first, second));

    let p =
        BlockPool::new(PoolConfig::new(4, 4, Tier::G2).duplicates(DuplicatePolicy::KeepDuplicate))
            .unwrap();
    let first = chain(&p, &[7]);
    let second = chain(&p, &[7]);
    assert_ne!(first.block_ids(), second.block_ids());
    let hit = p.match_prefix(&[h(7)]);
    assert_eq!(
        hit.block_ids(),
        first.block_ids(),
        "matches find the primary only"
    );
    let weak = second.get(0).unwrap().downgrade();
    drop(second);
    assert!(weak.upgrade().is_none(), "a dropped duplicate is gone");
    assert_eq!(p.counts().free, 3);
    drop((first, hit));
    p.audit().unwrap();
}

#[test]
fn registering_a_foreign_block_hands_everything_back() {
    let a = pool(2, EvictionKind::Lru);
    let b = pool(2, EvictionKind::Lru);
    let mine = a
        .allocate(1)
        .unwrap()
        .pop()
        .unwrap()
        .complete(h(1), None)
        .unwrap();
    let theirs = b
        .allocate(1)
        .unwrap()
        .pop()
        .unwrap()
        .complete(h(2), None)
        .unwrap();
    let err = a.register(vec![mine, theirs]).unwrap_err();
    assert_eq!(err.blocks.len(), 2);
    assert!(!a.contains(h(1)), "nothing was registered");
    drop(err);
    assert_eq!((a.counts().free, b.counts().free), (2, 2));
}

#[test]
fn match_is_contiguous_and_presence_does_not_reactivate() {
    let p = pool(8, EvictionKind::Lru);
    drop(chain(&p, &[1, 2, 3]));
    assert_eq!(p.counts().inactive, 3);
    assert_eq!(p.cached_prefix_len(&[h(1), h(2), h(9), h(3)]), 2);
    assert_eq!(p.counts().inactive, 3, "presence checks do not reactivate");
    let hit = p.match_prefix(&[h(1), h(2), h(9), h(3)]);
    assert_eq!(hit.len(), 2);
    assert_eq!(p.counts().inactive, 1);
    assert!(p.match_prefix(&[h(9), h(1)]).is_empty());
    assert!(p.match_prefix(&[]).is_empty());
}

#[test]
fn touch_and_priority_reorder_eviction() {
    let p = BlockPool::new(PoolConfig::new(3, 4, Tier::G2).priorities(true)).unwrap();
    drop(chain(&p, &[1]));
    drop(chain(&p, &[2]));
    drop(chain(&p, &[3]));
    assert_eq!(p.touch(&[h(1), h(42)]), 1, "1 is now the most recent");
    assert!(p.set_priority(h(2), 90));
    assert!(!p.set_priority(h(42), 90));
    // LRU order is now 3, 1 (priority 35) then 2 (priority 90).
    assert_eq!(p.evict(1), 1);
    assert!(!p.contains(h(3)));
    assert_eq!(p.evict(1), 1);
    assert!(!p.contains(h(1)));
    assert!(p.contains(h(2)), "the high-priority block goes last");
}

#[test]
fn leaf_first_keeps_prefixes_whole() {
    let p = pool(4, EvictionKind::LeafFirst);
    drop(chain(&p, &[1, 2, 3]));
    drop(chain(&p, &[10]));
    assert_eq!(p.evict(2), 2);
    // The oldest leaf is 3, then its parent 2 (older than 10).
    assert!(p.contains(h(1)) && p.contains(h(10)));
    assert_eq!(p.cached_prefix_len(&[h(1), h(2)]), 1);
}

#[test]
fn leaf_first_adopts_children_registered_before_their_parent() {
    let p = pool(4, EvictionKind::LeafFirst);
    let child = {
        let c = p.allocate(1).unwrap().pop().unwrap();
        p.register_block(c.complete(h(2), Some(h(1))).unwrap())
            .unwrap()
    };
    drop(chain(&p, &[1]));
    drop(child);
    assert_eq!(p.evict(1), 1);
    assert!(p.contains(h(1)), "the parent outlives its cached child");
    assert!(!p.contains(h(2)));
    p.audit().unwrap();
}

#[test]
fn frequency_keeps_popular_blocks_and_gates_admission() {
    let p = pool(4, EvictionKind::Frequency { sample: 4 });
    drop(chain(&p, &[1]));
    for _ in 0..8 {
        drop(p.match_prefix(&[h(1)]));
    }
    drop(chain(&p, &[2]));
    drop(chain(&p, &[3]));
    drop(chain(&p, &[4]));
    // 1 is the least recently used, but the most frequent.
    assert!(!p.admit(h(99)), "an unseen block does not displace");
    assert_eq!(p.evict(1), 1);
    assert!(p.contains(h(1)));
    assert_eq!(p.counts().free, 1);
    assert!(p.admit(h(99)), "free blocks admit anything");
}

#[test]
fn subscribers_get_a_snapshot_then_changes_in_order() {
    let p = pool(2, EvictionKind::Lru);
    drop(chain(&p, &[1, 2]));
    let rx = p.subscribe();
    let snapshot = rx.try_recv().unwrap();
    let mut stored: Vec<_> = snapshot
        .iter()
        .map(|e| match e {
            KvEvent::Stored { hash, parent, tier } => {
                assert_eq!(*tier, Tier::G2);
                (*hash, *parent)
            }
            KvEvent::Removed { .. } => panic!("snapshot holds only stored blocks"),
        })
        .collect();
    stored.sort();
    assert_eq!(stored, vec![(h(1), None), (h(2), Some(h(1)))]);
    drop(chain(&p, &[5]));
    let batch = rx.try_recv().unwrap();
    assert_eq!(batch.len(), 1, "one eviction batch");
    assert!(matches!(batch[0], KvEvent::Removed { hash, .. } if hash == h(1)));
    let batch = rx.try_recv().unwrap();
    assert_eq!(
        &batch[..],
        &[KvEvent::Stored {
            hash: h(5),
            parent: None,
            tier: Tier::G2
        }]
    );
    assert!(rx.try_recv().is_err());
}

#[test]
fn weak_handles_follow_the_cache() {
    let p = pool(1, EvictionKind::Lru);
    let held = chain(&p, &[1]);
    let weak = held.get(0).unwrap().downgrade();
    drop(held);
    let again = weak.upgrade().expect("inactive but cached");
    assert_eq!(p.counts().active, 1);
    drop(again);
    drop(chain(&p, &[2]));
    assert!(weak.upgrade().is_none(), "evicted");
}

mod lru_order {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Hundreds of match/release cycles (enough to make the eviction
        /// queue compact itself several times), then the eviction order
        /// must be exactly least recently released first.
        #[test]
        fn eviction_order_survives_compaction(
            touches in prop::collection::vec(prop::collection::vec(0u64..6, 1..4), 100..400),
            frequency in any::<bool>(),
        ) {
            let kind = if frequency { EvictionKind::Frequency { sample: 1 } } else { EvictionKind::Lru };
            let p = pool(6, kind);
            let mut order: Vec<u64> = Vec::new();
            for v in 0..6 {
                drop(chain(&p, &[v + 1]));
                order.push(v + 1);
            }
            for group in touches {
                let held: Vec<_> = group.iter().map(|&v| p.match_prefix(&[h(v + 1)])).collect();
                // Released in this order: each becomes the most recent.
                for (v, b) in group.iter().zip(held) {
                    drop(b);
                    if let Some(pos) = order.iter().position(|&x| x == v + 1) {
                        let x = order.remove(pos);
                        order.push(x);
                    }
                }
            }
            for expected in order {
                prop_assert_eq!(p.evict(1), 1);
                prop_assert!(!p.contains(h(expected)), "evicted out of LRU order");
            }
            p.audit().unwrap();
        }
    }
}

#[test]
fn eviction_order_is_global_across_threads() {
    // Each release happens on a fresh thread, so releases land in different
    // policy shards; eviction must still follow the global release order.
    for kind in [EvictionKind::Lru, EvictionKind::LeafFirst] {
        let p = pool(8, kind);
        let order = [5u64, 2, 7, 1, 8, 3, 6, 4];
        let held: Vec<_> = order.iter().map(|&v| chain(&p, &[v])).collect();
        for b in held {
            std::thread::scope(|s| {
                s.spawn(move || drop(b));
            });
        }
        for v in order {
            assert_eq!(p.evict(1), 1);
            assert!(!p.contains(h(v)), "{kind:?}: {v} should have gone next");
        }
    }
}

#[test]
fn handles_made_on_different_threads_belong_to_one_pool() {
    // Each thread gets handles through its own store of the pool; blocks
    // must still move freely between threads and batches.
    let p = pool(64, EvictionKind::Lru);
    let other = pool(8, EvictionKind::Lru);
    let held = chain(&p, &[1, 2]);
    let mut threads_blocks = Vec::new();
    for t in 0..6u64 {
        let p = p.clone();
        threads_blocks.push(
            std::thread::spawn(move || {
                let b = p.allocate(1).unwrap().pop().unwrap();
                let complete = b.complete(h(100 + t), Some(h(2))).unwrap();
                (
                    complete,
                    p.match_prefix(&[h(1)]).into_blocks().pop().unwrap(),
                )
            })
            .join()
            .unwrap(),
        );
    }
    let (completes, matched): (Vec<_>, Vec<_>) = threads_blocks.into_iter().unzip();
    // Registered on this thread, allocated on six others.
    let registered = p.register(completes).expect("same pool");
    assert_eq!(registered.len(), 6);
    // Pushed into one batch from handles made on six threads.
    let mut batch = p.match_prefix(&[h(2)]);
    for b in matched {
        batch.push(b).expect("same pool");
    }
    assert_eq!(batch.len(), 7);
    let foreign = chain(&other, &[1]).into_blocks().pop().unwrap();
    assert!(batch.push(foreign).is_err(), "a block of another pool");
    drop((held, registered, batch));
    let counts = p.audit().unwrap();
    assert_eq!(counts.active, 0);
    assert_eq!(counts.inactive, 8);
}
