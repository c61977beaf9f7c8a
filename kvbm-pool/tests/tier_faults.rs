//! Faults: a G3 read error fails only the request whose blocks it carried,
//! releases what that request held and leaves the engine consistent; slow
//! G3 reads let two requests that share a prefix overlap, and the second
//! waits for the first instead of copying again.

mod tier_support;

use std::time::Duration;

use kvbm_pool::metrics::Path;
use kvbm_pool::tier::{G1Lookup, OnboardTarget, TierPolicy};
use kvbm_pool::{Tier, TierError};
use kvbm_testkit::fault::{Fault, FaultRule};
use kvbm_transfer::disk::IoDir;
use tier_support::*;

#[test]
fn g3_read_error_fails_only_that_request() {
    let dir = tempdir();
    // The first read from disk fails.
    let exec = faulty_executor(
        FaultRule::always(Fault::Errno(libc::EIO))
            .on_dir(IoDir::Read)
            .times(1),
    );
    let engine = write_through_engine(dir.path(), exec);
    let (a, b) = (chain(1, 4), chain(2, 4));
    push_to_g3(&engine, &[a.clone(), b.clone()], 4);
    let tokens = 4 * BLOCK_TOKENS + 1;
    let ma = engine
        .match_request("a", &a, tokens, G1Lookup::Pool)
        .unwrap();
    let mb = engine
        .match_request("b", &b, tokens, G1Lookup::Pool)
        .unwrap();
    assert_eq!((ma.g3_blocks, mb.g3_blocks), (4, 4));
    let free_before = engine.g1().counts().free;

    let err = engine
        .onboard("a", OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(matches!(err, TierError::Onboard { .. }), "{err}");
    // Nothing of the failed request stayed allocated in G1.
    assert_eq!(engine.g1().counts().free, free_before);
    assert_eq!(engine.stats().onboard_failures, 1);

    let done = engine
        .onboard("b", OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(done.count, 4);
    verify(&engine, &done.blocks.into_blocks());

    // A failed request is released like any other; its G3 blocks are still
    // there (a read error does not lose them) and nothing is held.
    assert!(engine.release("a"));
    assert!(engine.release("b"));
    assert_eq!(engine.pool(Tier::G3).unwrap().cached_prefix_len(&a), 4);
    for t in [Tier::G1, Tier::G2, Tier::G3] {
        let counts = engine.pool(t).unwrap().audit().unwrap();
        assert_eq!(counts.active, 0, "{t:?} holds blocks after release");
    }
    // A retry succeeds: the fault fired once.
    engine
        .match_request("a2", &a, tokens, G1Lookup::Pool)
        .unwrap();
    let again = engine
        .onboard("a2", OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap();
    verify(&engine, &again.blocks.into_blocks());
}

#[test]
fn shared_prefix_is_onboarded_once() {
    let dir = tempdir();
    // Every disk read takes 150 ms: both onboards overlap.
    let exec = faulty_executor(
        FaultRule::always(Fault::Delay(Duration::from_millis(150))).on_dir(IoDir::Read),
    );
    let engine = write_through_engine(dir.path(), exec);
    let a = chain(3, 6);
    push_to_g3(&engine, std::slice::from_ref(&a), 4);
    let tokens = 6 * BLOCK_TOKENS + 1;
    engine
        .match_request("x", &a, tokens, G1Lookup::Pool)
        .unwrap();
    engine
        .match_request("y", &a[..4], tokens, G1Lookup::Pool)
        .unwrap();
    let hx = engine.onboard("x", OnboardTarget::Pool).unwrap();
    let hy = engine.onboard("y", OnboardTarget::Pool).unwrap();
    let x = hx.wait().unwrap();
    let y = hy.wait().unwrap();
    assert_eq!((x.count, y.count), (6, 4));
    let xb = x.blocks.into_blocks();
    let yb = y.blocks.into_blocks();
    verify(&engine, &xb);
    verify(&engine, &yb);
    // The shared 4 blocks are the same G1 blocks, copied once.
    for k in 0..4 {
        assert_eq!(xb[k].block_id(), yb[k].block_id());
    }
    assert_eq!(engine.stats().blocks_on(Path::G3ToG1), 6);
}

#[test]
fn release_during_onboard_frees_everything() {
    let dir = tempdir();
    let exec = faulty_executor(
        FaultRule::always(Fault::Delay(Duration::from_millis(100))).on_dir(IoDir::Read),
    );
    let engine = write_through_engine(dir.path(), exec);
    let a = chain(4, 4);
    push_to_g3(&engine, std::slice::from_ref(&a), 4);
    engine
        .match_request("z", &a, 4 * BLOCK_TOKENS + 1, G1Lookup::Pool)
        .unwrap();
    let h = engine.onboard("z", OnboardTarget::Pool).unwrap();
    assert!(engine.release("z"));
    let err = h.wait().unwrap_err();
    assert!(matches!(err, TierError::Released(_)), "{err}");
    for t in [Tier::G1, Tier::G2, Tier::G3] {
        assert_eq!(engine.pool(t).unwrap().audit().unwrap().active, 0);
    }
    // The loaded blocks were kept in G1's cache: a later request finds them.
    let m = engine
        .match_request("w", &a, 4 * BLOCK_TOKENS + 1, G1Lookup::Pool)
        .unwrap();
    assert_eq!(m.g1_blocks, 4);
    verify(&engine, &m.g1.into_blocks());
}

#[test]
fn dropped_caches_are_forgotten_and_never_saved() {
    let dir = tempdir();
    // Write-back: G1's victims go to G2 at the next allocation, G2's to G3.
    let engine = tiers(4, 4, 8, dir.path())
        .g2_policy(TierPolicy::WriteThrough)
        .g3_policy(TierPolicy::WriteThrough)
        .build()
        .unwrap();
    for seed in 0..3 {
        drop(compute(&engine, &chain(seed, 4), None));
        engine.flush();
    }
    let before = engine.stats();
    assert!(before.blocks_on(Path::G1ToG2) > 0, "nothing reached G2");
    // Their bytes are gone: nothing of them may be copied anywhere.
    assert!(engine.drop_cached() > 0);
    drop(compute(&engine, &chain(7, 4), None));
    engine.flush();
    let after = engine.stats();
    assert_eq!(
        after.blocks_on(Path::G1ToG2),
        before.blocks_on(Path::G1ToG2)
    );
    assert_eq!(
        after.blocks_on(Path::G2ToG3),
        before.blocks_on(Path::G2ToG3)
    );
    for seed in 0..3 {
        let m = engine
            .match_request(seed, &chain(seed, 4), 4 * BLOCK_TOKENS + 1, G1Lookup::Pool)
            .unwrap();
        assert_eq!(m.total_blocks(), 0, "a dropped block still matches");
        engine.release(seed);
    }
}
