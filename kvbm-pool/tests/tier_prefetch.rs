//! G3 prefetch at match time: staged bytes equal what was offloaded, a
//! request released (or matched again) while its read is in flight gives
//! back every block and slot, a failed read loads nothing, and any
//! interleaving of match, onboard and release keeps the books balanced.

mod tier_support;

use std::time::{Duration, Instant};

use kvbm_pool::metrics::Path;
use kvbm_pool::tier::{
    G1Lookup, LoadCost, MoverTiers, OnboardTarget, TierEngine, TierEngineBuilder,
};
use kvbm_pool::{Tier, TierError};
use kvbm_testkit::fault::{Fault, FaultRule};
use kvbm_transfer::Executor;
use kvbm_transfer::disk::IoDir;
use proptest::prelude::*;
use tier_support::*;

/// Staging slots in these tests; G2's memory is its pool (4) plus these.
const STAGING: usize = 8;
const G2_POOL: usize = 4;

/// Write-through everywhere; G1 of 64 blocks, G2 of its pool and the
/// staging area, G3 of 64 blocks in `dir`.
fn builder(exec: Executor, dir: &std::path::Path) -> TierEngineBuilder<MoverTiers> {
    write_through(tiers_with(64, G2_POOL + STAGING, 64, dir, exec))
        .g3_staging_bytes(STAGING as u64 * block_bytes())
}

fn prefetch_engine(exec: Executor, dir: &std::path::Path) -> TierEngine {
    let engine = builder(exec, dir).build().unwrap();
    assert_eq!(engine.pool(Tier::G2).unwrap().capacity(), G2_POOL);
    assert_eq!(engine.staging_free_blocks(), STAGING);
    engine
}

/// Waits until the staging area is free again and no tier holds a block,
/// then checks every pool's books. A stopped read gives its slots and
/// blocks back when it ends, which the engine signals nowhere: this polls
/// (every 5 ms, failing after [`WAIT`]).
fn assert_settled(engine: &TierEngine) {
    let deadline = Instant::now() + WAIT;
    loop {
        let active: Vec<usize> = [Tier::G1, Tier::G2, Tier::G3]
            .iter()
            .map(|&t| engine.pool(t).unwrap().audit().unwrap().active)
            .collect();
        let free = engine.staging_free_blocks();
        if free == STAGING && active.iter().all(|&a| a == 0) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not settled: staging free {free}/{STAGING}, active {active:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn prefetched_bytes_equal_what_was_offloaded() {
    let dir = tempdir();
    let engine = prefetch_engine(executor(), dir.path());
    // 12 blocks in G3, 8 staging slots: 8 staged, 4 read straight.
    let a = chain(1, 12);
    push_to_g3(&engine, std::slice::from_ref(&a), G2_POOL);
    let tokens = 12 * BLOCK_TOKENS + 1;
    let m = engine
        .match_request("a", &a, tokens, G1Lookup::Pool)
        .unwrap();
    assert_eq!(m.g3_blocks, 12);
    assert_eq!(engine.staging_free_blocks(), 0, "the read starts at match");
    let done = engine
        .onboard("a", OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(done.count, 12);
    let blocks = done.blocks.into_blocks();
    verify(&engine, &blocks);
    assert_eq!(engine.stats().blocks_on(Path::G3ToG1), 12);
    drop(blocks);
    assert!(engine.release("a"));
    assert_settled(&engine);
}

#[test]
fn engine_given_blocks_get_the_staged_bytes() {
    let dir = tempdir();
    let engine = prefetch_engine(executor(), dir.path());
    let a = chain(2, 5);
    push_to_g3(&engine, std::slice::from_ref(&a), G2_POOL);
    let m = engine
        .match_request(
            "e",
            &a,
            5 * BLOCK_TOKENS + 1,
            G1Lookup::Engine { blocks: 0 },
        )
        .unwrap();
    assert_eq!(m.g3_blocks, 5);
    let targets = engine.g1().allocate(5).unwrap();
    let ids: Vec<u32> = targets.iter().map(|b| b.block_id()).collect();
    let done = engine
        .onboard("e", OnboardTarget::Blocks(ids.clone()))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(done.count, 5);
    let g1 = engine.layout(Tier::G1).unwrap();
    for (id, h) in ids.iter().zip(&a) {
        assert!(holds(g1, *id, *h), "G1 block {id} does not hold {h:?}");
    }
    drop(targets);
    assert!(engine.release("e"));
    assert_settled(&engine);
}

#[test]
fn release_during_prefetch_gives_everything_back() {
    let dir = tempdir();
    // Disk reads wait at a gate: the prefetch is in flight at release.
    let (exec, control) = gated_reads_executor();
    let gate = control.gate();
    let engine = prefetch_engine(exec, dir.path());
    let a = chain(3, 6);
    push_to_g3(&engine, std::slice::from_ref(&a), G2_POOL);
    let start = [Tier::G1, Tier::G2, Tier::G3].map(|t| engine.pool(t).unwrap().counts());
    let tokens = 6 * BLOCK_TOKENS + 1;
    engine
        .match_request("r", &a, tokens, G1Lookup::Pool)
        .unwrap();
    assert_eq!(engine.staging_free_blocks(), STAGING - 6);
    gate.wait_until(WAIT, |c| c.held() > 0)
        .expect("the prefetch read reaches the disk");
    // Matching again (a scheduler asks at every step) keeps the read.
    engine
        .match_request("r", &a, tokens, G1Lookup::Pool)
        .unwrap();
    assert_eq!(engine.staging_free_blocks(), STAGING - 6);
    // A shorter match replaces it and stops the read.
    engine
        .match_request("r", &a[..3], tokens, G1Lookup::Pool)
        .unwrap();
    let free = engine.staging_free_blocks();
    let g3_held = engine.pool(Tier::G3).unwrap().audit().unwrap().active;
    assert!(free < STAGING && g3_held > 0);
    assert!(engine.release("r"));
    // The reads are stopped but still held at the disk, where they may yet
    // write: no slot they read into and no G3 block they read from is given
    // back until they end.
    assert!(gate.counts().held() > 0);
    assert_eq!(
        engine.staging_free_blocks(),
        free,
        "a slot returned under a read"
    );
    assert_eq!(
        engine.pool(Tier::G3).unwrap().audit().unwrap().active,
        g3_held,
        "a G3 block was let go under a read"
    );
    gate.open();
    assert_settled(&engine);
    let end = [Tier::G1, Tier::G2, Tier::G3].map(|t| engine.pool(t).unwrap().counts());
    assert_eq!(start, end, "pool counts return to where they started");
    // Nothing was loaded into G1 and the G3 copies are intact.
    assert_eq!(engine.stats().blocks_on(Path::G3ToG1), 0);
    assert_eq!(engine.g1().cached_prefix_len(&a), 0);
    assert_eq!(engine.pool(Tier::G3).unwrap().cached_prefix_len(&a), 6);
    let m = engine
        .match_request("again", &a, tokens, G1Lookup::Pool)
        .unwrap();
    assert_eq!(m.g3_blocks, 6);
    let done = engine
        .onboard("again", OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap();
    verify(&engine, &done.blocks.into_blocks());
    engine.release("again");
    assert_settled(&engine);
}

#[test]
fn failed_prefetch_reports_nothing_loaded() {
    let dir = tempdir();
    // The first read from disk (the prefetch) fails.
    let exec = faulty_executor(
        FaultRule::always(Fault::Errno(libc::EIO))
            .on_dir(IoDir::Read)
            .times(1),
    );
    let engine = prefetch_engine(exec, dir.path());
    let a = chain(4, 4);
    push_to_g3(&engine, std::slice::from_ref(&a), G2_POOL);
    let tokens = 4 * BLOCK_TOKENS + 1;
    engine
        .match_request("f", &a, tokens, G1Lookup::Pool)
        .unwrap();
    let free_before = engine.g1().counts().free;
    let err = engine
        .onboard("f", OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(matches!(err, TierError::Onboard { .. }), "{err}");
    assert_eq!(engine.g1().counts().free, free_before);
    assert_eq!(engine.g1().cached_prefix_len(&a), 0);
    assert_eq!(engine.stats().onboard_failures, 1);
    assert_eq!(engine.stats().blocks_on(Path::G3ToG1), 0);
    assert!(engine.release("f"));
    assert_settled(&engine);
    // The fault fired once: a retry loads the right bytes.
    engine
        .match_request("f2", &a, tokens, G1Lookup::Pool)
        .unwrap();
    let done = engine
        .onboard("f2", OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap();
    verify(&engine, &done.blocks.into_blocks());
    engine.release("f2");
    assert_settled(&engine);
}

#[test]
fn the_cost_model_leaves_loads_slower_than_recompute() {
    let dir = tempdir();
    let a = chain(5, 6);
    let tokens = 6 * BLOCK_TOKENS + 1;
    // Recomputing a trillion tokens a second beats any disk.
    let engine = builder(executor(), dir.path())
        .load_cost(LoadCost::recompute_at(1e12))
        .build()
        .unwrap();
    push_to_g3(&engine, std::slice::from_ref(&a), G2_POOL);
    let m = engine
        .match_request("c", &a, tokens, G1Lookup::Pool)
        .unwrap();
    assert_eq!((m.g3_blocks, m.declined_blocks), (0, 6));
    // Nothing declined is held or read.
    assert_eq!(engine.staging_free_blocks(), STAGING);
    assert_eq!(engine.pool(Tier::G3).unwrap().audit().unwrap().active, 0);
    let done = engine
        .onboard("c", OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(done.count, 0);
    engine.release("c");
    drop(engine);

    // One token a second: every block is worth loading.
    let dir = tempdir();
    let engine = builder(executor(), dir.path())
        .load_cost(LoadCost::recompute_at(1.0))
        .build()
        .unwrap();
    push_to_g3(&engine, std::slice::from_ref(&a), G2_POOL);
    let m = engine
        .match_request("c", &a, tokens, G1Lookup::Pool)
        .unwrap();
    assert_eq!((m.g3_blocks, m.declined_blocks), (6, 0));
    let done = engine
        .onboard("c", OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap();
    verify(&engine, &done.blocks.into_blocks());
    engine.release("c");
    assert_settled(&engine);
}

#[test]
fn dropping_the_engine_during_a_prefetch_is_clean() {
    let dir = tempdir();
    // Disk reads wait at a gate the test holds: the prefetch stays in
    // flight until the test lets it through.
    let (exec, control) = gated_reads_executor();
    let engine = prefetch_engine(exec, dir.path());
    let a = chain(6, 4);
    push_to_g3(&engine, std::slice::from_ref(&a), G2_POOL);
    engine
        .match_request("d", &a, 4 * BLOCK_TOKENS + 1, G1Lookup::Pool)
        .unwrap();
    assert!(engine.staging_free_blocks() < STAGING);
    let gate = control.gate();
    gate.wait_until(WAIT, |c| c.held() > 0)
        .expect("the prefetch read reaches the disk");
    // The memory the read writes into (the staging area is part of G2's).
    let g2_memory: Vec<_> = engine
        .layout(Tier::G2)
        .unwrap()
        .regions()
        .iter()
        .map(|r| std::sync::Arc::downgrade(r.owner().expect("G2 is owned memory")))
        .collect();
    // The drop does not wait for the read, which is still held.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(engine);
        let _ = tx.send(());
    });
    rx.recv_timeout(WAIT)
        .expect("dropping the engine waited for a prefetch read");
    // The read may still write into that memory: it stays alive.
    assert!(
        g2_memory.iter().all(|m| m.upgrade().is_some()),
        "G2's memory was freed under a read in flight"
    );
    // Let the read through: it ends on its own, and then the last of the
    // engine goes with it. Nothing signals that last drop, so it is polled
    // for (every millisecond, up to `WAIT`).
    gate.open();
    gate.wait_until(WAIT, |c| c.ended == c.arrived)
        .expect("the read ends once let through");
    let deadline = Instant::now() + WAIT;
    while g2_memory.iter().any(|m| m.upgrade().is_some()) {
        assert!(
            Instant::now() < deadline,
            "G2's memory outlived the read by {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// One step of the model test.
#[derive(Debug, Clone)]
enum Op {
    /// Match request `r` against chain `c`.
    Match { r: u8, c: u8 },
    /// Onboard request `r` (when matched) and wait for it.
    Onboard { r: u8 },
    /// Onboard request `r` without waiting: its handle is dropped.
    OnboardAsync { r: u8 },
    /// Release request `r`.
    Release { r: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..3, 0u8..3).prop_map(|(r, c)| Op::Match { r, c }),
        (0u8..3).prop_map(|r| Op::Onboard { r }),
        (0u8..3).prop_map(|r| Op::OnboardAsync { r }),
        (0u8..3).prop_map(|r| Op::Release { r }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Whatever the order of matches, onboards and releases (reads slowed
    /// so they overlap), every successful onboard holds the right bytes
    /// and, once every request is released, no block or slot stays taken.
    #[test]
    fn interleavings_keep_the_books(ops in prop::collection::vec(op(), 1..24)) {
        let dir = tempdir();
        let exec = faulty_executor(
            FaultRule::always(Fault::Delay(Duration::from_millis(3))).on_dir(IoDir::Read),
        );
        let engine = prefetch_engine(exec, dir.path());
        let chains = [chain(10, 5), chain(11, 3), chain(12, 7)];
        push_to_g3(&engine, &chains, G2_POOL);
        let mut onboarded = [false; 3];
        let mut matched = [false; 3];
        for o in ops {
            match o {
                Op::Match { r, c } => {
                    let hashes = &chains[c as usize];
                    let res = engine.match_request(
                        u64::from(r),
                        hashes,
                        hashes.len() * BLOCK_TOKENS + 1,
                        G1Lookup::Pool,
                    );
                    match res {
                        Ok(_) => matched[r as usize] = true,
                        Err(TierError::AlreadyOnboarding(_)) => {
                            prop_assert!(onboarded[r as usize]);
                        }
                        Err(e) => prop_assert!(false, "match failed: {e}"),
                    }
                }
                Op::Onboard { r } | Op::OnboardAsync { r } => {
                    let wait = matches!(o, Op::Onboard { .. });
                    match engine.onboard(u64::from(r), OnboardTarget::Pool) {
                        Ok(h) => {
                            onboarded[r as usize] = true;
                            if wait {
                                let done = h.wait();
                                prop_assert!(done.is_ok(), "{:?}", done.err());
                                verify(&engine, &done.unwrap().blocks.into_blocks());
                            }
                        }
                        Err(TierError::UnknownRequest(_)) => {
                            prop_assert!(!matched[r as usize]);
                        }
                        Err(TierError::AlreadyOnboarding(_)) => {
                            prop_assert!(onboarded[r as usize]);
                        }
                        Err(e) => prop_assert!(false, "onboard failed: {e}"),
                    }
                }
                Op::Release { r } => {
                    engine.release(u64::from(r));
                    matched[r as usize] = false;
                    onboarded[r as usize] = false;
                }
            }
        }
        for r in 0..3u64 {
            engine.release(r);
        }
        assert_settled(&engine);
        // Whatever landed in G1 holds the right bytes.
        for c in &chains {
            let held = engine.g1().match_prefix(c).into_blocks();
            verify(&engine, &held);
        }
    }
}
