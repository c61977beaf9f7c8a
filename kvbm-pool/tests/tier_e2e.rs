//! End to end on CPU: blocks computed in G1 go down to G2 and G3, are
//! pushed out of G1 and G2, and come back byte for byte.

mod tier_support;

use kvbm_pool::metrics::{Path, SkipReason};
use kvbm_pool::tier::{G1Lookup, OffloadMode, OnboardTarget};
use kvbm_pool::{KvEvent, Tier};
use tier_support::*;

#[test]
fn blocks_come_back_from_g2_and_g3_byte_exact() {
    let dir = tempdir();
    let engine = write_through(tiers(48, 16, 64, dir.path()))
        .build()
        .unwrap();
    let hashes = chain(1, 40);
    // Computed in chunks of 4, released at once (cached in G1).
    for (k, part) in hashes.chunks(4).enumerate() {
        let parent = (k > 0).then(|| hashes[k * 4 - 1]);
        drop(compute(&engine, part, parent));
    }
    engine.flush();
    let stats = engine.stats();
    assert_eq!(stats.blocks_on(Path::G1ToG2), 40);
    // G2 holds 16: 24 victims went to G3.
    assert_eq!(stats.blocks_on(Path::G2ToG3), 24);
    assert_eq!(engine.pool(Tier::G2).unwrap().counts().inactive, 16);
    assert_eq!(engine.pool(Tier::G3).unwrap().counts().inactive, 24);

    // Push everything out of G1.
    assert_eq!(engine.g1().evict(48), 40);
    let prompt_tokens = 40 * BLOCK_TOKENS + 3;
    let m = engine
        .match_request(7u64, &hashes, prompt_tokens, G1Lookup::Pool)
        .unwrap();
    assert_eq!((m.g1_blocks, m.g2_blocks, m.g3_blocks), (0, 16, 24));
    assert!(!m.gave_back);
    // Dirty G1 so that stale bytes could not pass the check.
    let scratch = engine.g1().allocate(48).unwrap();
    let g1 = engine.layout(Tier::G1).unwrap();
    for b in &scratch {
        fill(g1, b.block_id(), kvbm_block::SequenceHash(0xdead));
    }
    drop(scratch);
    let done = engine
        .onboard(7u64, OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(done.count, 40);
    let blocks = done.blocks.into_blocks();
    let names: Vec<_> = blocks.iter().map(|b| b.sequence_hash()).collect();
    assert_eq!(names, hashes);
    verify(&engine, &blocks);
    let stats = engine.stats();
    assert_eq!(stats.blocks_on(Path::G2ToG1), 16);
    assert_eq!(stats.blocks_on(Path::G3ToG1), 24);
    assert!(engine.release(7u64));
    // Loaded blocks are registered in G1: a new request finds them there.
    drop(blocks);
    let again = engine
        .match_request(8u64, &hashes, prompt_tokens, G1Lookup::Pool)
        .unwrap();
    assert_eq!(again.g1_blocks, 40);
    engine.release(8u64);
    engine.g1().audit().unwrap();
    engine.pool(Tier::G2).unwrap().audit().unwrap();
    engine.pool(Tier::G3).unwrap().audit().unwrap();
}

#[test]
fn full_prompt_hit_gives_one_block_back() {
    let dir = tempdir();
    let engine = write_through(tiers(16, 16, 0, dir.path())).build().unwrap();
    let hashes = chain(2, 4);
    drop(compute(&engine, &hashes, None));
    engine.flush();
    engine.g1().evict(16);
    let m = engine
        .match_request("r", &hashes, 4 * BLOCK_TOKENS, G1Lookup::Pool)
        .unwrap();
    assert!(m.gave_back);
    assert_eq!((m.g1_blocks, m.g2_blocks), (0, 3));
    // One token more than the blocks: nothing to give back.
    let m = engine
        .match_request("s", &hashes, 4 * BLOCK_TOKENS + 1, G1Lookup::Pool)
        .unwrap();
    assert!(!m.gave_back);
    assert_eq!(m.g2_blocks, 4);
    // G1 fully covering: the last G1 block is given back.
    let held = compute(&engine, &chain(3, 2), None);
    let h3 = chain(3, 2);
    drop(held);
    let m = engine
        .match_request("t", &h3, 2 * BLOCK_TOKENS, G1Lookup::Pool)
        .unwrap();
    assert!(m.gave_back);
    assert_eq!((m.g1_blocks, m.external_blocks()), (1, 0));
}

#[test]
fn engine_given_destinations_and_g1_count() {
    let dir = tempdir();
    let engine = write_through(tiers(32, 32, 0, dir.path())).build().unwrap();
    let hashes = chain(4, 6);
    drop(compute(&engine, &hashes, None));
    engine.flush();
    engine.g1().evict(32);
    // The engine says it has the first 2 blocks itself.
    let m = engine
        .match_request(
            "v",
            &hashes,
            6 * BLOCK_TOKENS + 1,
            G1Lookup::Engine { blocks: 2 },
        )
        .unwrap();
    assert_eq!((m.g1_blocks, m.g2_blocks), (2, 4));
    assert!(m.g1.is_empty());
    let err = engine
        .onboard("v", OnboardTarget::Blocks(vec![20, 21]))
        .unwrap_err();
    assert!(matches!(
        err,
        kvbm_pool::TierError::DestinationMismatch { .. }
    ));
    let done = engine
        .onboard("v", OnboardTarget::Blocks(vec![20, 21, 22, 23]))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(done.count, 4);
    let g1 = engine.layout(Tier::G1).unwrap();
    for (k, id) in (20..24).enumerate() {
        assert!(holds(g1, id, hashes[2 + k]));
    }
    assert!(engine.release("v"));
    assert!(!engine.release("v"));
}

#[test]
fn offload_skips_present_cancelled_and_full() {
    let dir = tempdir();
    let engine = write_through(tiers(16, 4, 0, dir.path())).build().unwrap();
    let hashes = chain(5, 4);
    drop(compute(&engine, &hashes, None));
    engine.flush();
    assert_eq!(engine.stats().blocks_on(Path::G1ToG2), 4);
    // Same hashes again in G1 (a second copy via another chain is not
    // possible; re-offload the cached blocks instead).
    let held = engine.g1().match_prefix(&hashes);
    engine.offload((0..held.len()).map(|i| (held.get(i).unwrap().downgrade(), None)));
    engine.flush();
    assert_eq!(engine.stats().skipped_for(SkipReason::Present), 4);
    // G2 full of held blocks: offload skipped, counted, no error.
    let pinned = engine.pool(Tier::G2).unwrap().match_prefix(&hashes);
    assert_eq!(pinned.len(), 4);
    drop(compute(&engine, &chain(6, 2), None));
    engine.flush();
    assert_eq!(engine.stats().skipped_for(SkipReason::TierFull), 2);
    drop(pinned);
    // A source freed before its copy starts: cancelled.
    let h7 = chain(7, 1);
    let b = engine.g1().allocate(1).unwrap().pop().unwrap();
    let blk = engine
        .g1()
        .register_block(b.complete(h7[0], None).unwrap())
        .unwrap();
    let weak = blk.downgrade();
    drop(blk);
    engine.g1().evict(16);
    engine.offload([(weak, None)]);
    engine.flush();
    assert_eq!(engine.stats().skipped_for(SkipReason::SourceGone), 1);
    drop(held);
}

#[test]
fn events_report_stores_and_removals_per_tier() {
    let dir = tempdir();
    let engine = write_through(tiers(8, 2, 4, dir.path())).build().unwrap();
    let rx = engine.subscribe();
    let hashes = chain(9, 4);
    for (i, h) in hashes.iter().enumerate() {
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        drop(compute(&engine, std::slice::from_ref(h), parent));
        engine.flush();
    }
    let mut stored = std::collections::HashMap::<Tier, usize>::new();
    let mut removed = std::collections::HashMap::<Tier, usize>::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while stored.values().sum::<usize>() < 4 + 4 + 2 && std::time::Instant::now() < deadline {
        let Ok(batch) = rx.recv_timeout(std::time::Duration::from_millis(200)) else {
            continue;
        };
        for e in batch.iter() {
            match *e {
                KvEvent::Stored { tier, .. } => *stored.entry(tier).or_default() += 1,
                KvEvent::Removed { tier, .. } => *removed.entry(tier).or_default() += 1,
            }
        }
    }
    assert_eq!(stored.get(&Tier::G1), Some(&4));
    assert_eq!(stored.get(&Tier::G2), Some(&4));
    assert_eq!(stored.get(&Tier::G3), Some(&2));
    assert_eq!(removed.get(&Tier::G2), Some(&2));
}

#[test]
fn write_back_saves_g1_victims_before_their_slots_are_reused() {
    let dir = tempdir();
    let engine = write_through(tiers(8, 32, 0, dir.path()))
        .offload_mode(OffloadMode::WriteBack)
        .build()
        .unwrap();
    let hashes = chain(11, 24);
    for (k, part) in hashes.chunks(4).enumerate() {
        let parent = (k > 0).then(|| hashes[k * 4 - 1]);
        drop(compute(&engine, part, parent));
    }
    engine.flush();
    // Nothing is written through; only what G1 evicted (16 of 24) is in G2.
    let stats = engine.stats();
    assert_eq!(stats.blocks_on(Path::G1ToG2), 16);
    assert_eq!(
        engine.pool(Tier::G2).unwrap().cached_prefix_len(&hashes),
        16
    );
    let m = engine
        .match_request(1u64, &hashes, 24 * BLOCK_TOKENS + 1, G1Lookup::Pool)
        .unwrap();
    // G1 kept the last 8 (a suffix), so the prefix comes from G2.
    assert_eq!((m.g1_blocks, m.g2_blocks), (0, 16));
    drop(m);
    // Onboarding 16 blocks into G1 (8 blocks) cannot fit: typed error.
    let err = engine.onboard(1u64, OnboardTarget::Pool).unwrap_err();
    assert!(matches!(err, kvbm_pool::TierError::Pool(_)), "{err}");
    engine.release(1u64);
    let m = engine
        .match_request(2u64, &hashes[..6], 6 * BLOCK_TOKENS + 1, G1Lookup::Pool)
        .unwrap();
    assert_eq!(m.g2_blocks, 6);
    let done = engine
        .onboard(2u64, OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap();
    verify(&engine, &done.blocks.into_blocks());
    engine.release(2u64);
    engine.g1().audit().unwrap();
    engine.pool(Tier::G2).unwrap().audit().unwrap();
}

#[test]
fn engine_owned_g1_blocks_offload_and_come_back() {
    let dir = tempdir();
    let engine = write_through(tiers(16, 16, 0, dir.path())).build().unwrap();
    let g1 = engine.layout(Tier::G1).unwrap();
    let h = chain(12, 3);
    // vLLM-style: the engine owns G1 block ids 5, 6, 7 and filled them.
    for (k, id) in (5..8).enumerate() {
        fill(g1, id, h[k]);
    }
    let blocks: Vec<_> = (0..3)
        .map(|k| (5 + k as u32, h[k], k.checked_sub(1).map(|p| h[p])))
        .collect();
    engine.offload_engine_blocks("e", &blocks);
    engine.flush();
    assert!(engine.release("e"));
    assert_eq!(engine.stats().blocks_on(Path::G1ToG2), 3);
    // The engine reuses its blocks; a later request loads the prefix back
    // into other engine-owned blocks.
    for id in 5..8 {
        fill(g1, id, kvbm_block::SequenceHash(0xbad));
    }
    let m = engine
        .match_request(
            "f",
            &h,
            3 * BLOCK_TOKENS + 1,
            G1Lookup::Engine { blocks: 0 },
        )
        .unwrap();
    assert_eq!(m.g2_blocks, 3);
    let done = engine
        .onboard("f", OnboardTarget::Blocks(vec![9, 10, 11]))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(done.count, 3);
    for (k, id) in (9..12).enumerate() {
        assert!(holds(g1, id, h[k]));
    }
    engine.release("f");
    // Released at once: the copy is cancelled or has finished when release
    // returns; either way it is counted at most once.
    engine.offload_engine_blocks("g", &[(12, chain(13, 1)[0], None)]);
    engine.release("g");
    engine.flush();
    assert!(engine.stats().blocks_on(Path::G1ToG2) <= 4);
}

#[test]
fn release_after_offloads_waits_for_the_requests_own_copies() {
    let dir = tempdir();
    let engine = write_through(tiers(16, 16, 0, dir.path())).build().unwrap();
    let g1 = engine.layout(Tier::G1).unwrap();
    let h = chain(14, 4);
    for (k, id) in (0..4).enumerate() {
        fill(g1, id, h[k]);
    }
    let blocks: Vec<_> = (0..4)
        .map(|k| (k as u32, h[k], k.checked_sub(1).map(|p| h[p])))
        .collect();
    engine.offload_engine_blocks("e", &blocks);
    // No flush: the release itself waits until all four were copied.
    assert!(engine.release_after_offloads("e"));
    assert_eq!(engine.stats().blocks_on(Path::G1ToG2), 4);
    assert_eq!(engine.live_requests(), 0);
    // A request with nothing queued is released at once.
    assert!(!engine.release_after_offloads("never-seen"));
}

/// A request released while its onboard copies into kvbm's G1 leaves its
/// targets held until the copies end; `flush` waits for that, so a flushed
/// engine holds nothing.
#[test]
fn flush_waits_for_a_released_requests_onboard() {
    let dir = tempdir();
    // Disk reads wait at a gate: the onboard is in flight at release.
    let (exec, control) = gated_reads_executor();
    let gate = control.gate();
    let engine = write_through_engine(dir.path(), exec);
    let a = chain(15, 3);
    push_to_g3(&engine, std::slice::from_ref(&a), 4);
    let m = engine
        .match_request("r", &a, 3 * BLOCK_TOKENS + 1, G1Lookup::Pool)
        .unwrap();
    assert_eq!(m.g3_blocks, 3);
    drop(m);
    let handle = engine.onboard("r", OnboardTarget::Pool).unwrap();
    gate.wait_until(std::time::Duration::from_secs(10), |c| c.held() > 0)
        .expect("the onboard's read reaches the disk");
    drop(handle);
    assert!(engine.release("r"));
    assert_eq!(engine.live_requests(), 0);
    assert!(engine.g1().audit().unwrap().active > 0, "targets held");
    std::thread::scope(|s| {
        let flushed = s.spawn(|| engine.flush());
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!flushed.is_finished(), "flush returned under a read");
        gate.open();
        flushed.join().unwrap();
    });
    for t in [Tier::G1, Tier::G2, Tier::G3] {
        let counts = engine.pool(t).unwrap().audit().unwrap();
        assert_eq!(counts.active, 0, "{t:?} holds blocks after a flush");
    }
}
