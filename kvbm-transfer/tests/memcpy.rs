//! Host → host transfers through the executor's memcpy backend.

mod common;

use std::sync::Arc;

use kvbm_layout::strategies::copy_case;
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::{Executor, ExecutorConfig};
use proptest::prelude::*;

fn executor(batch: usize, in_flight: usize) -> Executor {
    Executor::builder()
        .backend(Arc::new(MemcpyBackend::new(2).unwrap()))
        .config(ExecutorConfig {
            max_blocks_per_batch: batch,
            max_batches_in_flight: in_flight,
            ..Default::default()
        })
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn every_byte_lands_and_nothing_else_changes(
        (src, dst, pairs) in copy_case(),
        batch in 1usize..4,
        seed in any::<u64>(),
    ) {
        let exec = executor(batch, 2);
        let s = common::host(src.clone());
        let d = common::host(dst.clone());
        common::fill(&s, seed);
        common::fill(&d, seed ^ 0xdead_beef);
        let (src_snap, before) = (common::snapshot(&s), common::snapshot(&d));
        let report = exec.transfer(&s, &d, &pairs).wait().unwrap();
        prop_assert_eq!(report.blocks, pairs.len());
        prop_assert_eq!(report.bytes, pairs.len() as u64 * src.config().block_bytes());
        common::assert_copied(&src, &src_snap, &dst, &before, &common::snapshot(&d), &pairs);
    }
}

#[test]
fn many_concurrent_transfers_share_one_in_flight_slot() {
    let exec = executor(1, 1);
    let cfg = kvbm_layout::LayoutConfig::new(16, 2, 2, 4, 64, 2).unwrap();
    let src = kvbm_layout::Layout::new(
        cfg,
        kvbm_layout::LayoutKind::LayerSeparate(kvbm_layout::BlockOrder::OuterFirst),
    )
    .unwrap();
    let dst = kvbm_layout::Layout::new(cfg, kvbm_layout::LayoutKind::FullyContiguous).unwrap();
    let s = common::host(src.clone());
    common::fill(&s, 7);
    let dsts: Vec<_> = (0..8).map(|_| common::host(dst.clone())).collect();
    let snap = common::snapshot(&s);
    let pairs: Vec<_> = (0..16).map(|b| (b, 15 - b)).collect();
    let handles: Vec<_> = dsts.iter().map(|d| exec.transfer(&s, d, &pairs)).collect();
    let outcomes = futures::executor::block_on(futures::future::join_all(handles));
    for (d, o) in dsts.iter().zip(outcomes) {
        assert_eq!(o.unwrap().blocks, 16);
        common::assert_blocks_match(&src, &snap, &dst, &common::snapshot(d), &pairs);
    }
}

#[test]
fn bad_requests_are_errors_not_panics() {
    let exec = executor(4, 2);
    let cfg = kvbm_layout::LayoutConfig::new(4, 1, 2, 4, 8, 2).unwrap();
    let other = kvbm_layout::LayoutConfig::new(4, 2, 2, 4, 8, 2).unwrap();
    let l = |c| kvbm_layout::Layout::new(c, kvbm_layout::LayoutKind::FullyContiguous).unwrap();
    let (a, b, c) = (
        common::host(l(cfg)),
        common::host(l(cfg)),
        common::host(l(other)),
    );
    let f = exec.transfer(&a, &b, &[(0, 1), (2, 1)]).wait().unwrap_err();
    assert!(f.to_string().contains("appears twice"), "{f}");
    assert!(f.completed.is_empty());
    assert!(exec.transfer(&a, &b, &[(4, 0)]).wait().is_err());
    assert!(exec.transfer(&a, &c, &[(0, 0)]).wait().is_err());
    assert_eq!(exec.transfer(&a, &b, &[]).wait().unwrap().blocks, 0);
}
