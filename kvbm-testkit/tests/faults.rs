//! Faults injected under the disk backend (kvbm-testkit's FaultyEngine):
//! no hang, a clear error naming block and path, no leaked bounce slots,
//! and no block reported landed that did not.

// kvbm-transfer's test helpers: these tests are kvbm-transfer's, kept here
// because they need this crate's fixtures.
#[path = "../../kvbm-transfer/tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_testkit::fault::{Fault, FaultControl, FaultRule, FaultyEngine};
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::disk::{DefaultEngine, DiskBackend, EngineConfig, IoDir};
use kvbm_transfer::memory::IoMode;
use kvbm_transfer::{BouncePool, Executor, ExecutorConfig, PhysicalLayout, TransferError};
use proptest::prelude::*;

const BLOCKS: usize = 16;

struct Rig {
    exec: Executor,
    control: Arc<FaultControl>,
    pool: Arc<BouncePool>,
}

fn rig(rules: Vec<FaultRule>, batch: usize, force_pread: bool) -> Rig {
    let mut engine = FaultyEngine::new(
        DefaultEngine::new(&EngineConfig {
            queue_depth: 4,
            force_pread,
            ..Default::default()
        })
        .unwrap(),
    );
    for r in rules {
        engine = engine.with(r);
    }
    let control = engine.control();
    let disk = DiskBackend::with_engine(engine, 16384);
    let pool = BouncePool::system(3, 32768).unwrap();
    let exec = Executor::builder()
        .backend(Arc::new(MemcpyBackend::new(1).unwrap()))
        .backend(Arc::new(disk))
        .bounce_pool(pool.clone())
        .config(ExecutorConfig {
            max_blocks_per_batch: batch,
            max_batches_in_flight: 2,
            bounce_slots_per_batch: 2,
        })
        .build()
        .unwrap();
    Rig {
        exec,
        control,
        pool,
    }
}

/// A healthy executor to check what really is on disk.
fn healthy() -> Executor {
    rig(Vec::new(), 4, false).exec
}

fn layouts() -> (Layout, Layout) {
    let cfg = LayoutConfig::new(BLOCKS, 2, 2, 16, 128, 2).unwrap(); // 16 KiB blocks
    (
        Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap(),
        Layout::new(cfg, LayoutKind::FullyContiguous).unwrap(),
    )
}

fn disk(layout: Layout) -> PhysicalLayout {
    let a = common::disk_allocator("", IoMode::Auto);
    PhysicalLayout::allocate_disk(layout, &a).unwrap()
}

fn all() -> Vec<(usize, usize)> {
    (0..BLOCKS).map(|i| (i, i)).collect()
}

/// Blocks reported landed on `disk` must hold the source's bytes.
fn check_landed(
    host_l: &Layout,
    src: &PhysicalLayout,
    disk: &PhysicalLayout,
    landed: &[(usize, usize)],
) {
    let back = common::host(host_l.clone());
    let pairs: Vec<_> = landed.iter().map(|&(_, d)| (d, d)).collect();
    healthy().transfer(disk, &back, &pairs).wait().unwrap();
    common::assert_blocks_match(
        host_l,
        &common::snapshot(src),
        host_l,
        &common::snapshot(&back),
        landed,
    );
}

#[test]
fn eio_on_one_block_names_block_and_path() {
    let (host_l, disk_l) = layouts();
    let block_bytes = disk_l.config().block_bytes();
    // Block 5's extent in the FullyContiguous file.
    let r = rig(
        vec![FaultRule::always(Fault::Errno(libc::EIO)).on_range(5 * block_bytes..6 * block_bytes)],
        4,
        false,
    );
    let src = common::host(host_l.clone());
    common::fill(&src, 1);
    let d = disk(disk_l);
    let path = d.regions()[0]
        .file_location()
        .unwrap()
        .0
        .path()
        .display()
        .to_string();
    let f = r.exec.transfer(&src, &d, &all()).wait().unwrap_err();
    let msg = f.to_string();
    assert!(matches!(f.error, TransferError::Io { .. }), "{msg}");
    assert_eq!(f.culprit, Some((5, 5)), "{msg}");
    assert!(
        msg.contains("block 5 -> 5") && msg.contains(&path) && msg.contains("Input/output error"),
        "{msg}"
    );
    assert!(f.failed.contains(&(5, 5)) && !f.completed.contains(&(5, 5)));
    assert_eq!(f.completed.len() + f.failed.len(), BLOCKS);
    check_landed(&host_l, &src, &d, &f.completed);
}

#[test]
fn enospc_fails_the_write_and_is_reported() {
    let (host_l, disk_l) = layouts();
    let r = rig(
        vec![FaultRule::always(Fault::Errno(libc::ENOSPC)).after(10)],
        2,
        true,
    );
    let src = common::host(host_l.clone());
    common::fill(&src, 2);
    let d = disk(disk_l);
    let f = r.exec.transfer(&src, &d, &all()).wait().unwrap_err();
    assert!(f.to_string().contains("No space left"), "{f}");
    assert!(!f.failed.is_empty());
    check_landed(&host_l, &src, &d, &f.completed);
}

#[test]
fn short_transfers_eintr_eagain_and_delays_are_recovered() {
    let (host_l, disk_l) = layouts();
    let rules = vec![
        FaultRule::always(Fault::Short(4096)).times(12),
        FaultRule::always(Fault::Errno(libc::EINTR))
            .after(3)
            .times(3),
        FaultRule::always(Fault::Errno(libc::EAGAIN))
            .after(5)
            .times(3),
        FaultRule::always(Fault::Delay(Duration::from_millis(2)))
            .after(2)
            .times(10),
    ];
    for force_pread in [false, true] {
        let r = rig(rules.clone(), 3, force_pread);
        let src = common::host(host_l.clone());
        common::fill(&src, 3);
        let d = disk(disk_l.clone());
        r.exec.transfer(&src, &d, &all()).wait().unwrap();
        let back = common::host(host_l.clone());
        let before = common::snapshot(&back);
        r.exec.transfer(&d, &back, &all()).wait().unwrap();
        assert!(
            r.control.injected() >= 20,
            "only {} faults fired",
            r.control.injected()
        );
        common::assert_copied(
            &host_l,
            &common::snapshot(&src),
            &host_l,
            &before,
            &common::snapshot(&back),
            &all(),
        );
    }
}

#[test]
fn unaligned_short_read_under_o_direct_fails_cleanly() {
    let (host_l, disk_l) = layouts();
    let r = rig(
        vec![FaultRule::always(Fault::Short(0)).on_dir(IoDir::Read)],
        4,
        false,
    );
    let src = common::host(host_l.clone());
    let d = disk(disk_l);
    r.exec.transfer(&src, &d, &all()).wait().unwrap();
    // Short(0) keeps one byte per read: the remainder is misaligned for
    // O_DIRECT, so the read must fail rather than report success.
    let back = common::host(host_l);
    let f = r.exec.transfer(&d, &back, &all()).wait().unwrap_err();
    assert!(f.completed.is_empty(), "{f}");
}

#[test]
fn vanishing_disk_mid_two_hop_does_not_hang_or_leak_slots() {
    let (host_l, disk_l) = layouts();
    let r = rig(
        vec![FaultRule::always(Fault::Delay(Duration::from_millis(1)))],
        2,
        false,
    );
    let src = common::host(host_l.clone());
    common::fill(&src, 4);
    let (a, b) = (disk(disk_l.clone()), disk(disk_l.clone()));
    r.exec.transfer(&src, &a, &all()).wait().unwrap();
    r.control.vanish_after(9);
    let f = r.exec.transfer(&a, &b, &all()).wait().unwrap_err();
    assert!(f.to_string().contains("No such device"), "{f}");
    assert!(!f.failed.is_empty());
    assert_eq!(r.pool.available(), r.pool.capacity(), "bounce slots leaked");
    check_landed(&host_l, &src, &b, &f.completed);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10))]
    /// Whatever fails, a transfer reports success only if every byte
    /// landed, and every block it reports landed did.
    #[test]
    fn failures_never_report_unlanded_blocks(
        errno in prop::sample::select(vec![libc::EIO, libc::ENOSPC, libc::EINTR, libc::EAGAIN]),
        after in 0usize..40,
        times in 1usize..20,
        batch in 1usize..6,
        two_hop in any::<bool>(),
    ) {
        let (host_l, disk_l) = layouts();
        let r = rig(vec![FaultRule::always(Fault::Errno(errno)).after(after).times(times)], batch, false);
        let src = common::host(host_l.clone());
        common::fill(&src, after as u64);
        let (a, b) = (disk(disk_l.clone()), disk(disk_l.clone()));
        let target = if two_hop {
            healthy().transfer(&src, &a, &all()).wait().unwrap();
            r.exec.transfer(&a, &b, &all()).wait().map(|_| ()).map_err(|f| f.completed.clone())
                .map(|()| all()).unwrap_or_else(|c| c)
        } else {
            r.exec.transfer(&src, &b, &all()).wait().map(|_| all()).unwrap_or_else(|f| f.completed.clone())
        };
        prop_assert_eq!(r.pool.available(), r.pool.capacity());
        check_landed(&host_l, &src, &b, &target);
    }
}
