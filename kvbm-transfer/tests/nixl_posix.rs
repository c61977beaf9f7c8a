//! Host ↔ disk through NIXL's POSIX plugin, driven by the executor with the
//! NIXL backend registered in the disk slot.

mod common;

use std::sync::Arc;

use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::memory::{DiskAllocator, IoMode, SystemAllocator};
use kvbm_transfer::nixl::runtime_or_skip as nixl_or_skip;
use kvbm_transfer::nixl::{NixlDiskBackend, NixlDiskConfig, PosixIo};
use kvbm_transfer::{
    BackendKind, BouncePool, CancelToken, CopyRun, Executor, ExecutorConfig, MemoryKind,
    PhysicalLayout, Strategy, TransferBackend, TransferError, TransferJob,
};

fn backend(io: PosixIo, max_io_bytes: u32) -> Arc<NixlDiskBackend> {
    Arc::new(NixlDiskBackend::new(&NixlDiskConfig { io, max_io_bytes }).unwrap())
}

fn executor(disk: Arc<NixlDiskBackend>, batch: usize) -> Executor {
    Executor::builder()
        .backend(Arc::new(MemcpyBackend::new(2).unwrap()))
        .backend(disk)
        .bounce_pool(BouncePool::system(4, 1 << 20).unwrap())
        .config(ExecutorConfig {
            max_blocks_per_batch: batch,
            max_batches_in_flight: 3,
            ..Default::default()
        })
        .build()
        .unwrap()
}

fn alloc() -> DiskAllocator {
    common::disk_allocator("", IoMode::Auto)
}

/// `blocks` blocks of 2 layers x K/V x 16 tokens x `inner` bf16 values
/// (4 KiB chunks at `inner` = 128).
fn config(blocks: usize, inner: usize) -> LayoutConfig {
    LayoutConfig::new(blocks, 2, 2, 16, inner, 2).unwrap()
}

fn round_trip(io: PosixIo, max_io_bytes: u32, inner: usize, batch: usize) {
    let exec = executor(backend(io, max_io_bytes), batch);
    assert_eq!(
        exec.strategy(MemoryKind::System, MemoryKind::Disk).unwrap(),
        Strategy::Direct(BackendKind::Disk)
    );
    let cfg = config(24, inner);
    let src =
        common::host(Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap());
    common::fill(&src, 0x5eed ^ inner as u64);
    let disk = PhysicalLayout::allocate_disk(
        Layout::new(cfg, LayoutKind::FullyContiguous).unwrap(),
        &alloc(),
    )
    .unwrap();
    // Non-consecutive ids on every side.
    let out: Vec<(usize, usize)> =
        vec![(3, 9), (17, 2), (5, 14), (11, 6), (0, 20), (22, 1), (8, 23)];
    let report = exec.transfer(&src, &disk, &out).wait().unwrap();
    assert_eq!(report.blocks, out.len());
    assert_eq!(report.bytes, out.len() as u64 * cfg.block_bytes());

    let back =
        common::host(Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::BlockFirst)).unwrap());
    common::fill(&back, 99);
    let before = common::snapshot(&back);
    let inward: Vec<(usize, usize)> = vec![
        (9, 12),
        (2, 0),
        (14, 7),
        (6, 19),
        (20, 4),
        (1, 15),
        (23, 10),
    ];
    exec.transfer(&disk, &back, &inward).wait().unwrap();
    // Source block s went to disk block d, which came back to host block b.
    let end_to_end: Vec<(usize, usize)> = out
        .iter()
        .map(|&(s, d)| (s, inward.iter().find(|&&(x, _)| x == d).unwrap().1))
        .collect();
    common::assert_copied(
        src.layout(),
        &common::snapshot(&src),
        back.layout(),
        &before,
        &common::snapshot(&back),
        &end_to_end,
    );
}

#[test]
fn host_disk_host_round_trip_through_the_executor() {
    if !nixl_or_skip("host_disk_host_round_trip_through_the_executor") {
        return;
    }
    round_trip(PosixIo::Aio, 2 << 20, 128, 4);
}

#[test]
fn long_runs_are_split_and_every_io_interface_works() {
    if !nixl_or_skip("long_runs_are_split_and_every_io_interface_works") {
        return;
    }
    // 16 KiB chunks in requests of at most 4 KiB.
    for io in [PosixIo::Aio, PosixIo::Uring, PosixIo::PosixAio] {
        round_trip(io, 4 << 10, 512, 3);
    }
}

#[test]
fn disk_to_disk_runs_both_hops_on_nixl() {
    if !nixl_or_skip("disk_to_disk_runs_both_hops_on_nixl") {
        return;
    }
    let exec = executor(backend(PosixIo::Aio, 2 << 20), 4);
    let cfg = config(10, 128);
    let fc = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let src = common::host(fc.clone());
    common::fill(&src, 7);
    let a = PhysicalLayout::allocate_disk(fc.clone(), &alloc()).unwrap();
    let b = PhysicalLayout::allocate_disk(fc.clone(), &alloc()).unwrap();
    let all: Vec<(usize, usize)> = (0..10).map(|i| (i, i)).collect();
    exec.transfer(&src, &a, &all).wait().unwrap();
    exec.transfer(&a, &b, &[(1, 8), (4, 0), (9, 3)])
        .wait()
        .unwrap();
    let back = common::host(fc);
    common::fill(&back, 8);
    exec.transfer(&b, &back, &all).wait().unwrap();
    common::assert_blocks_match(
        src.layout(),
        &common::snapshot(&src),
        back.layout(),
        &common::snapshot(&back),
        &[(1, 8), (4, 0), (9, 3)],
    );
}

fn job_with(file_offset: u64, mem_offset: u64, len: u64) -> (TransferJob, PhysicalLayout) {
    let cfg = config(4, 128);
    let disk = PhysicalLayout::allocate_disk(
        Layout::new(cfg, LayoutKind::FullyContiguous).unwrap(),
        &alloc(),
    )
    .unwrap();
    let mem = SystemAllocator::new().allocate(1 << 20).unwrap().region();
    let job = TransferJob::new(
        vec![mem].into(),
        disk.regions().clone(),
        vec![CopyRun {
            src_region: 0,
            src_offset: mem_offset,
            dst_region: 0,
            dst_offset: file_offset,
            len,
        }]
        .into(),
        CancelToken::new(),
    );
    (job, disk)
}

#[test]
fn misaligned_requests_are_refused_before_nixl_sees_them() {
    if !nixl_or_skip("misaligned_requests_are_refused_before_nixl_sees_them") {
        return;
    }
    let b = backend(PosixIo::Aio, 2 << 20);
    for (file_offset, mem_offset, len, what) in [
        (512, 0, 4096, "file offset"),
        (0, 0, 4000, "length"),
        (0, 100, 4096, "memory address"),
    ] {
        let (job, _disk) = job_with(file_offset, mem_offset, len);
        match b.submit(job).wait() {
            Err(TransferError::Misaligned {
                what: w,
                alignment: 4096,
                ..
            }) => assert_eq!(w, what),
            other => panic!("{what}: expected Misaligned, got {other:?}"),
        }
    }
    // The aligned request goes through.
    let (job, _disk) = job_with(8192, 4096, 8192);
    b.submit(job).wait().unwrap();
}

#[test]
fn out_of_range_and_wrong_kinds_are_errors() {
    if !nixl_or_skip("out_of_range_and_wrong_kinds_are_errors") {
        return;
    }
    let b = backend(PosixIo::Aio, 2 << 20);
    let (job, _disk) = job_with(1 << 30, 0, 4096);
    assert!(matches!(
        b.submit(job).wait(),
        Err(TransferError::OutOfBounds { .. })
    ));
    let mem = SystemAllocator::new().allocate(8192).unwrap().region();
    let job = TransferJob::new(
        vec![mem.clone()].into(),
        vec![mem].into(),
        vec![].into(),
        CancelToken::new(),
    );
    assert!(matches!(
        b.submit(job).wait(),
        Err(TransferError::BackendMismatch { .. })
    ));
}

#[test]
fn a_failed_request_fails_its_batch_and_the_others_land() {
    if !nixl_or_skip("a_failed_request_fails_its_batch_and_the_others_land") {
        return;
    }
    // One block per batch; the file is cut short under the backend, so
    // reads of blocks past the cut come back short and NIXL fails them.
    let exec = executor(backend(PosixIo::Aio, 2 << 20), 1);
    let cfg = config(8, 128);
    let fc = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let src = common::host(fc.clone());
    common::fill(&src, 21);
    let disk = PhysicalLayout::allocate_disk(fc.clone(), &alloc()).unwrap();
    let all: Vec<(usize, usize)> = (0..8).map(|i| (i, i)).collect();
    exec.transfer(&src, &disk, &all).wait().unwrap();
    let path = disk.regions()[0]
        .file_location()
        .unwrap()
        .0
        .path()
        .to_path_buf();
    let keep = 4 * cfg.block_bytes();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(keep)
        .unwrap();

    let back = common::host(fc);
    common::fill(&back, 22);
    // The first batch starts before anything can fail; a good batch after
    // a failing one may land or be dropped once the failure is known.
    let pairs = [(1, 1), (6, 0), (2, 3), (7, 2)];
    let failure = exec.transfer(&disk, &back, &pairs).wait().unwrap_err();
    assert!(
        matches!(
            failure.error,
            TransferError::Backend {
                backend: "nixl",
                ..
            }
        ),
        "{failure}"
    );
    let landed = failure.completed.clone();
    assert!(landed.contains(&(1, 1)), "{failure}");
    for bad in [(6, 0), (7, 2)] {
        assert!(failure.failed.contains(&bad), "{failure}");
    }
    let mut every: Vec<_> = landed.iter().chain(&failure.failed).copied().collect();
    every.sort_unstable();
    assert_eq!(
        every,
        vec![(1, 1), (2, 3), (6, 0), (7, 2)],
        "each pair reported once"
    );
    // What landed is right.
    common::assert_blocks_match(
        src.layout(),
        &common::snapshot(&src),
        back.layout(),
        &common::snapshot(&back),
        &landed,
    );
}
