//! G1's free reserve in write-back mode: an allocation that fits in the
//! free slots returns without waiting for a write-back, the victims evicted
//! ahead of need are saved behind it, their slots are reused only once
//! saved, and every block read back holds the bytes that went out.

mod tier_support;

use kvbm_pool::metrics::Path;
use kvbm_pool::tier::{TierEngine, TierPolicy};
use kvbm_pool::{EvictionKind, Tier};
use tier_support::*;

/// G1 blocks: the automatic reserve is a sixty-fourth of them, 4.
const G1: usize = 256;
const G2: usize = 4;
const G3: usize = 64;

/// Write-back, every block admitted, LRU everywhere, no staging area (so a
/// G2 victim's disk write is part of the save), G1 keeping `reserve` slots
/// free (`None`: the automatic size).
fn engine(reserve: Option<usize>, dir: &std::path::Path) -> TierEngine {
    // Disk writes take 100 ms: a save that reaches G3 is slow.
    let mut builder = tiers_with(G1, G2, G3, dir, slow_writes(100))
        .g1_eviction(EvictionKind::Lru)
        .g2_policy(TierPolicy::WriteThrough)
        .g3_policy(TierPolicy::WriteThrough);
    if let Some(blocks) = reserve {
        builder = builder.g1_free_reserve(blocks);
    }
    builder.build().unwrap()
}

/// Fills G1 and pushes blocks down to G3, then allocates one block and
/// reports whether the G2 → G3 write its save causes had landed when the
/// allocation returned. The block is filled with other bytes at once;
/// afterwards every block evicted from G1 is read back and checked.
fn allocation_waited_for_the_save(reserve: Option<usize>, expected: usize) -> bool {
    let dir = tempdir();
    let engine = engine(reserve, dir.path());
    let reserve = engine.g1_free_reserve();
    assert_eq!(reserve, expected);
    let a = chain(11, G1 + 8);
    compute_each(&engine, &a);
    engine.flush();
    let g1 = engine.g1().counts();
    assert_eq!(g1.free, reserve, "G1 keeps its reserve free");
    assert_eq!(engine.stats().offload_copy_failures(), 0);

    let before = engine.stats().blocks_on(Path::G2ToG3);
    let block = engine.allocate_g1(1).unwrap().pop().unwrap();
    let waited = engine.stats().blocks_on(Path::G2ToG3) > before;
    // Overwrite the slot at once: had it been a victim not yet saved, its
    // copy in G2 would hold these bytes.
    let fresh = chain(12, 1)[0];
    fill(engine.layout(Tier::G1).unwrap(), block.block_id(), fresh);
    let held = engine
        .register_g1(vec![block.complete(fresh, None).unwrap()])
        .unwrap();
    drop(held);
    engine.flush();
    assert_eq!(engine.stats().offload_copy_failures(), 0);

    // G1 evicted its least recently used blocks, oldest first: the first
    // `evicted` blocks of the chain are in G2 or G3, byte for byte.
    let evicted = a.len() + 1 - (G1 - reserve);
    let down = &a[..evicted];
    assert_eq!(engine.g1().cached_prefix_len(down), 0);
    let g2 = engine.pool(Tier::G2).unwrap();
    let g3 = engine.pool(Tier::G3).unwrap();
    for h in down {
        assert!(
            g2.cached_prefix_len(std::slice::from_ref(h))
                + g3.cached_prefix_len(std::slice::from_ref(h))
                == 1,
            "an evicted block is kept in G2 or G3"
        );
    }
    assert_eq!(load(&engine, "down", down).unwrap(), evicted);
    waited
}

#[test]
fn an_allocation_within_the_reserve_does_not_wait_for_the_save() {
    assert!(!allocation_waited_for_the_save(None, G1 / 64));
}

#[test]
fn an_explicit_reserve_is_kept_beyond_the_automatic_size() {
    assert!(!allocation_waited_for_the_save(Some(40), 40));
}

#[test]
fn without_a_reserve_the_allocation_waits_for_the_save() {
    assert!(allocation_waited_for_the_save(Some(0), 0));
}
