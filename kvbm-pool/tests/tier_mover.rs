//! The engine over a mover of its own: a copy that lands only some of its
//! pairs (as a distributed copy does when one worker fails) registers
//! exactly those, and an onboard that does not land everywhere reports
//! nothing as loaded.

mod tier_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvbm_pool::Tier;
use kvbm_pool::tier::{
    G1Lookup, LocalMover, OffloadMode, OnboardTarget, TierEngine, TierLayouts, TierMover,
    TierPolicy,
};
use kvbm_transfer::{
    CancelToken, Completion, PhysicalLayout, TransferError, TransferFailure, TransferOutcome,
};
use tier_support::*;

/// Copies everything through a [`LocalMover`], then (while `lose` is set)
/// reports the first pair of every copy as failed, as if one worker of a
/// tensor-parallel group had not written its slice.
struct LossyMover {
    inner: LocalMover,
    lose: AtomicBool,
}

impl TierMover for LossyMover {
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
        let first = pairs.first().copied();
        let outcome = self.inner.copy(src, dst, pairs.clone(), cancel).wait();
        let (Some(lost), true) = (first, self.lose.load(Ordering::SeqCst)) else {
            return Completion::ready(outcome);
        };
        Completion::ready(Err(Box::new(TransferFailure {
            error: TransferError::InvalidRequest("worker 1 did not answer".into()),
            completed: pairs.iter().copied().filter(|&p| p != lost).collect(),
            failed: vec![lost],
            culprit: None,
        })))
    }

    fn local_layout(&self, tier: Tier) -> Option<&PhysicalLayout> {
        self.inner.local_layout(tier)
    }
}

fn lossy_engine(dir: &std::path::Path) -> (TierEngine, Arc<LossyMover>) {
    let layouts = TierLayouts {
        g1: host(16),
        g2: Some(host(16)),
        g3: Some(disk(16, dir)),
    };
    let mover = Arc::new(LossyMover {
        inner: LocalMover::new(layouts, executor()).unwrap(),
        lose: AtomicBool::new(true),
    });
    let engine = TierEngine::builder_with_mover(Arc::clone(&mover) as _, BLOCK_TOKENS)
        .offload_mode(OffloadMode::WriteThrough)
        .g2_policy(TierPolicy::WriteThrough)
        .build()
        .unwrap();
    (engine, mover)
}

#[test]
fn a_pair_that_did_not_land_everywhere_is_never_registered() {
    let dir = tempdir();
    let (engine, _mover) = lossy_engine(dir.path());
    let hashes = chain(7, 4);
    drop(compute(&engine, &hashes, None));
    engine.flush();
    let g2 = engine.pool(Tier::G2).unwrap();
    // The chain's first block leads the first copy, whose first pair was
    // lost; how the worker batched the rest decides what else was.
    assert!(!g2.contains(hashes[0]), "a lost pair was registered");
    let registered = hashes.iter().filter(|h| g2.contains(**h)).count();
    assert_eq!(
        g2.counts().free,
        16 - registered,
        "a lost target did not go back to the free list"
    );
}

#[test]
fn an_onboard_that_lost_a_pair_reports_nothing_loaded() {
    let dir = tempdir();
    let (engine, mover) = lossy_engine(dir.path());
    mover.lose.store(false, Ordering::SeqCst);
    let hashes = chain(9, 3);
    drop(compute(&engine, &hashes, None));
    engine.flush();
    engine.g1().evict(usize::MAX >> 1);
    let tokens = 3 * BLOCK_TOKENS + 1;
    let m = engine
        .match_request("r", &hashes, tokens, G1Lookup::Pool)
        .unwrap();
    assert_eq!(m.g2_blocks, 3);
    mover.lose.store(true, Ordering::SeqCst);
    let free_before = engine.g1().counts().free;
    assert!(
        engine
            .onboard("r", OnboardTarget::Pool)
            .unwrap()
            .wait()
            .is_err()
    );
    assert!(!engine.g1().contains(hashes[0]));
    assert_eq!(engine.g1().counts().free, free_before, "G1 targets leaked");
    engine.release("r");
    assert_eq!(engine.live_requests(), 0);
}
