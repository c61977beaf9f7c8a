//! The engines for buffered (page-cache) files: every choice moves the same
//! bytes both ways and through a bounce pipeline, `O_DIRECT` files keep the
//! direct engine whatever the choice, the automatic choice follows the
//! machine, a file truncated under a mapping fails with an error instead of
//! a crash, and a cancelled page cache → device pipeline through the mapped
//! engine writes nothing after the cancel and returns every slot.

// kvbm-transfer's test helpers: these tests are kvbm-transfer's, kept here
// because they need this crate's fixtures.
#[path = "../../kvbm-transfer/tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_testkit::gate::{Gate, GatedBackend};
use kvbm_testkit::stand_in::{HostAsDevice, host_device_layout, pinned_stand_in_pool};
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::disk::{BufferedIo, DiskBackend, DiskConfig, EngineConfig};
use kvbm_transfer::memory::{DiskAllocator, IoMode};
use kvbm_transfer::{BouncePool, Executor, ExecutorConfig, PhysicalLayout, TransferError};
use proptest::prelude::*;

/// Every explicit choice, both store kinds of the mapped engine included.
fn choices() -> [BufferedIo; 4] {
    [
        BufferedIo::SameAsDirect,
        BufferedIo::Pread { threads: 3 },
        BufferedIo::Mapped {
            threads: 3,
            streaming: false,
        },
        BufferedIo::Mapped {
            threads: 2,
            streaming: true,
        },
    ]
}

struct Rig {
    exec: Executor,
    disk_name: (&'static str, &'static str),
    system_pool: Arc<BouncePool>,
    pinned_pool: Arc<BouncePool>,
}

/// How long a test waits for something it is owed before it fails.
const WAIT: Duration = Duration::from_secs(10);

/// A rig whose device copies pass `device` (an open gate: no wait).
fn rig(buffered: BufferedIo, device: Arc<Gate>) -> Rig {
    let disk = DiskBackend::new(&DiskConfig {
        engine: EngineConfig {
            queue_depth: 4,
            buffered,
            ..Default::default()
        },
        max_io_bytes: 8192,
    })
    .unwrap();
    let disk_name = (disk.engine_name(), disk.buffered_engine_name());
    let system_pool = BouncePool::system(4, 16384).unwrap();
    let pinned_pool = pinned_stand_in_pool(4, 16384).unwrap();
    let exec = Executor::builder()
        .backend(Arc::new(MemcpyBackend::new(2).unwrap()))
        .backend(Arc::new(disk))
        .backend(Arc::new(GatedBackend::new(
            HostAsDevice::new(1).unwrap(),
            device,
        )))
        .bounce_pool(system_pool.clone())
        .bounce_pool(pinned_pool.clone())
        .config(ExecutorConfig {
            max_blocks_per_batch: 5,
            max_batches_in_flight: 2,
            bounce_slots_per_batch: 2,
        })
        .build()
        .unwrap();
    Rig {
        exec,
        disk_name,
        system_pool,
        pinned_pool,
    }
}

fn allocator(mode: IoMode) -> DiskAllocator {
    common::disk_allocator("buffered-engines", mode)
}

/// 16 KiB blocks: 2 layers × K/V × 16 tokens × 128 × 2 bytes.
fn config(blocks: usize) -> LayoutConfig {
    LayoutConfig::new(blocks, 2, 2, 16, 128, 2).unwrap()
}

fn file_path(p: &PhysicalLayout) -> std::path::PathBuf {
    p.regions()[0]
        .file_location()
        .unwrap()
        .0
        .path()
        .to_path_buf()
}

#[test]
fn the_automatic_choice_follows_the_machine() {
    assert_eq!(BufferedIo::Auto.resolve(1), BufferedIo::SameAsDirect);
    assert_eq!(BufferedIo::Auto.resolve(3), BufferedIo::SameAsDirect);
    let mapped = |threads| BufferedIo::Mapped {
        threads,
        streaming: true,
    };
    assert_eq!(BufferedIo::Auto.resolve(4), mapped(2));
    assert_eq!(BufferedIo::Auto.resolve(10), mapped(5));
    assert_eq!(BufferedIo::Auto.resolve(16), mapped(8));
    assert_eq!(BufferedIo::Auto.resolve(128), mapped(8));
    for c in choices() {
        assert_eq!(c.resolve(2), c, "an explicit choice is kept");
        assert_eq!(c.resolve(64), c, "an explicit choice is kept");
    }
    // The engine a backend runs is the one the choice names.
    let names: Vec<_> = choices()
        .into_iter()
        .map(|c| rig(c, Gate::opened()).disk_name.1)
        .collect();
    let direct = rig(BufferedIo::SameAsDirect, Gate::opened()).disk_name.0;
    assert_eq!(names, [direct, "pread", "mapped", "mapped"]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    /// Host → buffered file → buffered file (through system bounce slots)
    /// → device (through pinned bounce slots) → host, on every engine:
    /// each block ends where the pairs say, byte for byte.
    #[test]
    fn every_engine_moves_the_same_bytes(
        perm in Just((0..24usize).collect::<Vec<_>>()).prop_shuffle(),
        seed in any::<u64>(),
    ) {
        let cfg = config(24);
        let host_l = Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap();
        let disk_l = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
        let all: Vec<_> = (0..24).map(|i| (i, i)).collect();
        let pairs: Vec<_> = perm.iter().enumerate().map(|(s, &d)| (s, d)).collect();
        for choice in choices() {
            let r = rig(choice, Gate::opened());
            let files = allocator(IoMode::Buffered);
            let (a, b) = (
                PhysicalLayout::allocate_disk(disk_l.clone(), &files).unwrap(),
                PhysicalLayout::allocate_disk(disk_l.clone(), &files).unwrap(),
            );
            let src = common::host(host_l.clone());
            common::fill(&src, seed);
            r.exec.transfer(&src, &a, &all).wait().unwrap();
            r.exec.transfer(&a, &b, &pairs).wait().unwrap();
            let dev = host_device_layout(host_l.clone(), false).unwrap();
            r.exec.transfer(&b, &dev, &all).wait().unwrap();
            let back = common::host(host_l.clone());
            common::read_back_and_check(&r.exec, &dev, &all, &back, &src, &pairs);
            prop_assert_eq!(r.system_pool.available(), r.system_pool.capacity());
            prop_assert_eq!(r.pinned_pool.available(), r.pinned_pool.capacity());
        }
    }
}

#[test]
fn o_direct_files_keep_the_direct_engine() {
    // With the mapped engine for buffered files, a file opened O_DIRECT
    // (where the file system allows it) still round-trips, through the
    // direct engine; a buffered one through the mapped engine.
    let r = rig(
        BufferedIo::Mapped {
            threads: 2,
            streaming: false,
        },
        Gate::opened(),
    );
    let cfg = config(12);
    let layout = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let all: Vec<_> = (0..12).map(|i| (i, i)).collect();
    for mode in [IoMode::Auto, IoMode::Buffered] {
        let disk = PhysicalLayout::allocate_disk(layout.clone(), &allocator(mode)).unwrap();
        let src = common::host(layout.clone());
        common::fill(&src, 9);
        r.exec.transfer(&src, &disk, &all).wait().unwrap();
        let back = common::host(layout.clone());
        common::read_back_and_check(&r.exec, &disk, &all, &back, &src, &all);
    }
}

#[test]
fn a_file_truncated_under_its_mapping_fails_cleanly() {
    let r = rig(
        BufferedIo::Mapped {
            threads: 2,
            streaming: false,
        },
        Gate::opened(),
    );
    let cfg = config(8);
    let layout = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let disk = PhysicalLayout::allocate_disk(layout.clone(), &allocator(IoMode::Buffered)).unwrap();
    let src = common::host(layout.clone());
    common::fill(&src, 3);
    let all: Vec<_> = (0..8).map(|i| (i, i)).collect();
    r.exec.transfer(&src, &disk, &all).wait().unwrap();
    // A first read maps the whole file.
    let back = common::host(layout.clone());
    r.exec.transfer(&disk, &back, &all).wait().unwrap();
    // Someone else cuts the file to 3.5 blocks; the mapping still spans 8.
    let path = file_path(&disk);
    let block = cfg.block_bytes();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(block * 7 / 2)
        .unwrap();
    let back = common::host(layout.clone());
    let failure = r.exec.transfer(&disk, &back, &all).wait().unwrap_err();
    match &failure.error {
        TransferError::Io { path: p, .. } => assert_eq!(p, &path),
        e => panic!("expected an I/O error naming the file, got {e}"),
    }
    assert!(
        failure.failed.iter().any(|&(s, _)| s == 7),
        "a block past the end cannot have landed: {failure}"
    );
    assert!(
        failure.completed.iter().all(|&(s, _)| s < 3),
        "only whole blocks before the cut can land: {failure}"
    );
    common::assert_blocks_match(
        &layout,
        &common::snapshot(&src),
        &layout,
        &common::snapshot(&back),
        &failure.completed,
    );
}

#[test]
fn cancelling_a_mapped_page_cache_to_device_pipeline() {
    // The device's copies (hop 2) wait at a gate: two chunks land, then
    // the cancel comes with chunks read and held before the device.
    let device = Gate::closed();
    let r = rig(
        BufferedIo::Mapped {
            threads: 2,
            streaming: false,
        },
        device.clone(),
    );
    let cfg = config(40);
    let host_l = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let dev_l = Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap();
    let disk = PhysicalLayout::allocate_disk(host_l.clone(), &allocator(IoMode::Buffered)).unwrap();
    let src = common::host(host_l.clone());
    common::fill(&src, 11);
    let all: Vec<_> = (0..40).map(|i| (i, i)).collect();
    r.exec.transfer(&src, &disk, &all).wait().unwrap();
    let dev = host_device_layout(dev_l.clone(), false).unwrap();
    let handle = r.exec.transfer(&disk, &dev, &all);
    device.allow(2);
    device
        .wait_until(WAIT, |c| c.delivered == 2 && c.held() >= 2)
        .expect("two chunks landed and more waiting for the device");
    handle.request_cancel();
    // What the device had seen when the transfer resolved.
    let (tx, rx) = std::sync::mpsc::channel();
    let seen = device.clone();
    handle.into_completion().on_complete(move |outcome| {
        let _ = tx.send((outcome, seen.counts()));
    });
    // Let the held chunks through one at a time, each to its end, until
    // the transfer resolves (it may only once none is left). A chunk read
    // before the cancel can reach the gate after those held there went
    // through, so the gate is watched until then, not emptied once.
    let deadline = std::time::Instant::now() + WAIT;
    let (outcome, device_then) = loop {
        if let Ok(resolved) = rx.recv_timeout(Duration::from_millis(10)) {
            break resolved;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the transfer resolves"
        );
        if device.counts().held() > 0 {
            device.allow(1);
            device
                .wait_until(WAIT, |c| c.delivered == c.passed)
                .expect("a chunk let through ends");
        }
    };
    let failure = outcome.expect_err("a cancelled transfer fails");
    assert!(
        matches!(failure.error, TransferError::Cancelled),
        "{failure}"
    );
    assert_eq!(failure.completed.len() + failure.failed.len(), 40);
    assert!(!failure.failed.is_empty(), "{failure}");
    // It resolved with no device copy in flight or waiting, and none has
    // started since: nothing reaches the device after the cancel.
    assert_eq!(
        device_then.running() + device_then.held(),
        0,
        "{device_then:?}"
    );
    assert_eq!(r.pinned_pool.available(), r.pinned_pool.capacity());
    let after_cancel = common::snapshot(&dev);
    common::assert_blocks_match(
        &host_l,
        &common::snapshot(&src),
        &dev_l,
        &after_cancel,
        &failure.completed,
    );
    assert_eq!(
        device.counts().arrived,
        device_then.arrived,
        "a device copy started after the cancel"
    );
}

#[test]
fn mapped_copy_threads_start_at_the_first_buffered_request() {
    let disk = Arc::new(
        DiskBackend::new(&DiskConfig {
            engine: EngineConfig {
                queue_depth: 4,
                buffered: BufferedIo::Mapped {
                    threads: 2,
                    streaming: true,
                },
                ..Default::default()
            },
            max_io_bytes: 8192,
        })
        .unwrap(),
    );
    assert_eq!(disk.buffered_engine_name(), "mapped");
    assert!(
        !disk.buffered_threads_started(),
        "no threads before any request"
    );
    let exec = Executor::builder().backend(disk.clone()).build().unwrap();
    let layout = Layout::new(config(4), LayoutKind::FullyContiguous).unwrap();
    let all: Vec<_> = (0..4).map(|i| (i, i)).collect();
    let src = common::host(layout.clone());
    common::fill(&src, 3);
    // An O_DIRECT file (where the file system allows it) never reaches the
    // mapped engine.
    let direct = PhysicalLayout::allocate_disk(layout.clone(), &allocator(IoMode::Direct));
    if let Ok(direct) = direct {
        exec.transfer(&src, &direct, &all).wait().unwrap();
        let back = common::host(layout.clone());
        exec.transfer(&direct, &back, &all).wait().unwrap();
        assert!(
            !disk.buffered_threads_started(),
            "O_DIRECT I/O started them"
        );
    }
    let buffered =
        PhysicalLayout::allocate_disk(layout.clone(), &allocator(IoMode::Buffered)).unwrap();
    exec.transfer(&src, &buffered, &all).wait().unwrap();
    let back = common::host(layout.clone());
    common::read_back_and_check(&exec, &buffered, &all, &back, &src, &all);
    assert!(disk.buffered_threads_started());
    // The automatic choice on a small machine has no separate engine.
    let auto = DiskBackend::new(&DiskConfig::default()).unwrap();
    assert!(!auto.buffered_threads_started());
}
