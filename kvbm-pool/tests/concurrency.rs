//! Several threads allocating, registering, matching, upgrading, evicting
//! and dropping on one pool: no deadlock, and every invariant holds at the
//! end. Bounded in iterations and in time.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvbm_block::SequenceHash;
use kvbm_pool::{
    BlockPool, DuplicatePolicy, EvictionKind, ImmutableBlocks, KvEvent, PoolConfig, Tier, WeakBlock,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const THREADS: usize = 4;
const ITERATIONS: usize = 3_000;
const TIME_BUDGET: Duration = Duration::from_secs(4);
const CHAINS: u64 = 24;
const DEPTH: u64 = 12;

fn chain(c: u64, len: u64) -> Vec<SequenceHash> {
    (0..len).map(|p| SequenceHash(c * 1_000 + p + 1)).collect()
}

/// One worker: a random mix of every operation, holding a few handles.
fn worker(pool: BlockPool, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut held: Vec<ImmutableBlocks> = Vec::new();
    let mut weaks: Vec<WeakBlock> = Vec::new();
    let start = Instant::now();
    for _ in 0..ITERATIONS {
        if start.elapsed() > TIME_BUDGET {
            break;
        }
        match rng.random_range(0..10) {
            0..=2 => {
                // Fill a chain prefix: register the blocks the pool lacks.
                let c = rng.random_range(0..CHAINS);
                let hashes = chain(c, rng.random_range(1..=DEPTH));
                let hit = pool.match_prefix(&hashes);
                let missing = &hashes[hit.len()..];
                if let Ok(blocks) = pool.allocate(missing.len()) {
                    let mut parent = hit.len().checked_sub(1).map(|i| hashes[i]);
                    let complete = blocks
                        .into_iter()
                        .zip(missing)
                        .map(|(b, &h)| {
                            let c = b.complete(h, parent).expect("no tokens: completes");
                            parent = Some(h);
                            c.with_priority(rng.random_range(0..=100))
                        })
                        .collect();
                    let registered = pool.register(complete).expect("own pool");
                    assert_eq!(registered.len(), missing.len());
                    held.push(registered);
                }
                held.push(hit);
            }
            3..=4 => {
                let c = rng.random_range(0..CHAINS);
                let hashes = chain(c, DEPTH);
                let hit = pool.match_prefix(&hashes);
                for (i, &expected) in hashes.iter().enumerate().take(hit.len()) {
                    assert_eq!(hit.sequence_hash(i), Some(expected), "match is a prefix");
                }
                if rng.random_bool(0.3)
                    && let Some(b) = hit.get(0)
                {
                    weaks.push(b.downgrade());
                }
                held.push(hit);
            }
            5..=6 => {
                if !held.is_empty() {
                    let i = rng.random_range(0..held.len());
                    held.swap_remove(i);
                }
            }
            7 => {
                if let Some(w) = weaks.pop()
                    && let Some(b) = w.upgrade()
                {
                    assert_eq!(b.sequence_hash(), w.sequence_hash());
                    assert!(pool.contains(b.sequence_hash()));
                }
            }
            8 => {
                pool.evict(rng.random_range(0..4));
                let c = rng.random_range(0..CHAINS);
                pool.touch(&chain(c, DEPTH));
            }
            _ => {
                // Allocate and give back without registering.
                if let Ok(blocks) = pool.allocate(rng.random_range(0..4)) {
                    drop(blocks);
                }
                let c = rng.random_range(0..CHAINS);
                let _ = pool.cached_prefix_len(&chain(c, DEPTH));
            }
        }
        if held.len() > 6 {
            held.remove(0);
        }
    }
}

fn stress(eviction: EvictionKind, priorities: bool, duplicates: DuplicatePolicy) {
    let config = PoolConfig::new(160, 16, Tier::G1)
        .eviction(eviction)
        .priorities(priorities)
        .duplicates(duplicates);
    let pool = BlockPool::new(config).unwrap();
    let events = pool.subscribe();
    let (done_tx, done_rx) = mpsc::channel();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let pool = pool.clone();
            let done = done_tx.clone();
            std::thread::spawn(move || {
                worker(pool, 0xC0FFEE + t as u64);
                let _ = done.send(());
            })
        })
        .collect();
    for _ in 0..THREADS {
        done_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a worker did not finish: deadlock?");
    }
    for h in handles {
        h.join().expect("worker panicked");
    }

    let counts = pool.audit().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(counts.active, 0, "every handle was dropped");
    assert_eq!(counts.free + counts.inactive, counts.capacity);
    assert_eq!(pool.counts(), counts);

    // Replaying the events gives exactly what the pool holds, and
    // leaf-first never removed a block while a child was cached.
    let mut replayed: BTreeMap<SequenceHash, Option<SequenceHash>> = BTreeMap::new();
    for batch in events.try_iter() {
        for ev in batch.iter() {
            match *ev {
                KvEvent::Stored { hash, parent, .. } => {
                    assert!(replayed.insert(hash, parent).is_none(), "stored twice");
                }
                KvEvent::Removed { hash, .. } => {
                    assert!(replayed.remove(&hash).is_some(), "removed unknown");
                    if eviction == EvictionKind::LeafFirst {
                        assert!(!replayed.values().any(|p| *p == Some(hash)));
                    }
                }
            }
        }
    }
    assert_eq!(replayed.len(), counts.inactive);
    for h in replayed.keys() {
        assert!(pool.contains(*h));
    }
    // Everything cached can be evicted once nobody holds anything.
    assert_eq!(pool.evict(usize::MAX), counts.inactive);
    assert_eq!(pool.audit().unwrap().free, counts.capacity);
}

#[test]
fn lru_under_contention() {
    stress(EvictionKind::Lru, false, DuplicatePolicy::ReuseExisting);
}

#[test]
fn leaf_first_under_contention() {
    stress(
        EvictionKind::LeafFirst,
        false,
        DuplicatePolicy::ReuseExisting,
    );
}

#[test]
fn prioritized_frequency_with_duplicates_under_contention() {
    stress(
        EvictionKind::Frequency { sample: 4 },
        true,
        DuplicatePolicy::KeepDuplicate,
    );
}

/// A match whose first hash is absent takes no lock: it must still never
/// miss a cached block while another thread evicts around it (eviction
/// moves registry entries). Half the pool stays held (cached, never
/// evicted) while a churner keeps evicting and registering the other half;
/// a matcher checks that every held hash is found each time.
#[test]
fn lock_free_absence_never_hides_a_cached_block() {
    const CAPACITY: usize = 256;
    let pool = BlockPool::new(PoolConfig::new(CAPACITY, 16, Tier::G1)).expect("pool");
    let spread = |x: u64| SequenceHash(x.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let pinned_hashes: Vec<SequenceHash> = (1..=(CAPACITY as u64 / 2)).map(spread).collect();
    let mut pinned = Vec::new();
    for &h in &pinned_hashes {
        let block = pool
            .allocate(1)
            .expect("allocate")
            .pop()
            .expect("one block");
        let complete = block.complete(h, None).expect("complete");
        pinned.push(pool.register_block(complete).expect("register"));
    }
    let start = Instant::now();
    std::thread::scope(|s| {
        let churner = s.spawn(|| {
            let mut next = 1u64 << 40;
            for _ in 0..2_000 {
                if start.elapsed() > TIME_BUDGET {
                    break;
                }
                let blocks = pool.allocate(16).expect("allocate from the free half");
                let complete: Vec<_> = blocks
                    .into_iter()
                    .map(|b| {
                        next += 1;
                        b.complete(spread(next), None).expect("complete")
                    })
                    .collect();
                drop(pool.register(complete).expect("register"));
            }
        });
        let mut rounds = 0;
        while !churner.is_finished() && rounds < 2_000 {
            for &h in &pinned_hashes {
                assert_eq!(pool.match_prefix(&[h]).len(), 1, "held block not found");
            }
            rounds += 1;
        }
    });
    drop(pinned);
    pool.audit().expect("audit");
}
