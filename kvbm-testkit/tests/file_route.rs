//! The executor's one-hop file route, without a GPU: a stand-in route
//! (page-cache windows read with `pread`, the "device" host memory labelled
//! `Device(0)`) built on the same choice ([`route_refusal`]) and window
//! planner ([`plan_windows`]) as the CUDA file-window route. Buffered
//! files go through the route; `O_DIRECT` files, a refused registration,
//! another device and the device → file direction take the bounce
//! pipeline; either way every byte lands where the pairs say.

// kvbm-transfer's test helpers: these tests are kvbm-transfer's, kept here
// because they need this crate's fixtures.
#[path = "../../kvbm-transfer/tests/common/mod.rs"]
mod common;

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_testkit::stand_in::{HostAsDevice, host_device_layout, pinned_stand_in_pool};
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::disk::route::{
    FileRoute, RouteFacts, RouteRefusal, plan_windows, route_refusal,
};
use kvbm_transfer::disk::{DiskBackend, DiskConfig};
use kvbm_transfer::memory::IoMode;
use kvbm_transfer::{
    Completion, Executor, ExecutorConfig, MemoryKind, PhysicalLayout, Side, TransferError,
    TransferJob,
};

/// Reads each window of the job with one `pread` into a buffer, then
/// scatters its runs: what the CUDA route does with a registered window
/// and the copy engines.
struct PreadRoute {
    window: u64,
    refused: Option<String>,
    jobs: AtomicUsize,
    windows: AtomicUsize,
}

impl PreadRoute {
    fn new(window: u64, refused: Option<&str>) -> Arc<Self> {
        Arc::new(PreadRoute {
            window,
            refused: refused.map(str::to_string),
            jobs: AtomicUsize::new(0),
            windows: AtomicUsize::new(0),
        })
    }
}

impl FileRoute for PreadRoute {
    fn name(&self) -> &'static str {
        "pread-window"
    }

    fn refusal(&self, job: &TransferJob) -> Option<RouteRefusal> {
        let kind = |side| job.kind(side).unwrap_or(MemoryKind::System);
        route_refusal(RouteFacts {
            src: kind(Side::Source),
            dst: kind(Side::Destination),
            serves_dst: MemoryKind::Device(0),
            direct_source: job
                .regions(Side::Source)
                .iter()
                .any(|r| r.file_location().is_some_and(|(f, _)| f.is_direct())),
            registration: self.refused.as_deref(),
        })
    }

    fn submit(&self, job: TransferJob) -> Completion {
        self.jobs.fetch_add(1, Ordering::Relaxed);
        let result = (|| {
            let windows = plan_windows(&job, self.window, 16384)?;
            let dst = job.address_table(Side::Destination)?;
            for w in windows {
                self.windows.fetch_add(1, Ordering::Relaxed);
                let mut buf = vec![0u8; w.len as usize];
                let file = std::fs::File::open(w.file.path()).unwrap();
                let n = file.read_at(&mut buf, w.start).unwrap();
                for r in &w.runs {
                    let from = r.src_offset as usize;
                    assert!(from + r.len as usize <= n.max(from), "window past the file");
                    // SAFETY: the destination region is a live host
                    // allocation labelled Device(0); the job's bounds
                    // were checked by `plan_windows`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            buf[from..].as_ptr(),
                            (dst[r.dst_region as usize] + r.dst_offset) as *mut u8,
                            r.len as usize,
                        )
                    };
                }
            }
            Ok::<(), TransferError>(())
        })();
        Completion::ready(result)
    }
}

/// 16 KiB blocks: 2 layers × K/V × 16 tokens × 128 × 2 bytes (4 KiB chunks).
fn config(blocks: usize) -> LayoutConfig {
    LayoutConfig::new(blocks, 2, 2, 16, 128, 2).unwrap()
}

fn executor(route: Arc<PreadRoute>) -> Executor {
    Executor::builder()
        .backend(Arc::new(MemcpyBackend::new(1).unwrap()))
        .backend(Arc::new(DiskBackend::new(&DiskConfig::default()).unwrap()))
        .backend(Arc::new(HostAsDevice::new(1).unwrap()))
        .bounce_pool(pinned_stand_in_pool(4, 32768).unwrap())
        .file_route(route)
        .config(ExecutorConfig {
            max_blocks_per_batch: 7,
            max_batches_in_flight: 2,
            bounce_slots_per_batch: 2,
        })
        .build()
        .unwrap()
}

/// Writes a random host layout to a new file (`mode`), moves it to the
/// stand-in device through `exec` with `pairs`, and checks the device.
fn onboard(exec: &Executor, mode: IoMode, pairs: &[(usize, usize)], seed: u64) -> bool {
    let cfg = config(32);
    let file_l = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let dev_l = Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap();
    let files = common::disk_allocator("file-route", mode);
    let Ok(file) = PhysicalLayout::allocate_disk(file_l.clone(), &files) else {
        return false; // O_DIRECT refused by this file system
    };
    let src = common::host(file_l.clone());
    common::fill(&src, seed);
    let all: Vec<_> = (0..32).map(|i| (i, i)).collect();
    exec.transfer(&src, &file, &all).wait().unwrap();
    let dev = host_device_layout(dev_l.clone(), true).unwrap();
    let before = common::snapshot(&dev);
    let report = exec.transfer(&file, &dev, pairs).wait().unwrap();
    assert_eq!(report.blocks, pairs.len());
    common::assert_copied(
        src.layout(),
        &common::snapshot(&src),
        &dev_l,
        &before,
        &common::snapshot(&dev),
        pairs,
    );
    true
}

fn scattered_pairs() -> Vec<(usize, usize)> {
    // Every third block, into reversed places: windows with gaps.
    (0..32).step_by(3).map(|s| (s, 31 - s)).collect()
}

#[test]
fn buffered_files_take_the_route_and_land_every_byte() {
    let route = PreadRoute::new(3 * 16384, None);
    let exec = executor(route.clone());
    let pairs = scattered_pairs();
    assert!(onboard(&exec, IoMode::Buffered, &pairs, 1));
    // 11 pairs in batches of 7: two jobs, both through the route.
    assert_eq!(route.jobs.load(Ordering::Relaxed), 2);
    assert!(route.windows.load(Ordering::Relaxed) >= 2);
    let all: Vec<_> = (0..32).map(|i| (i, 31 - i)).collect();
    assert!(onboard(&exec, IoMode::Buffered, &all, 2));
}

#[test]
fn o_direct_files_and_refused_registration_take_the_bounce_pipeline() {
    let route = PreadRoute::new(1 << 20, None);
    let exec = executor(route.clone());
    if onboard(&exec, IoMode::Direct, &scattered_pairs(), 3) {
        assert_eq!(
            route.jobs.load(Ordering::Relaxed),
            0,
            "an O_DIRECT file took the route"
        );
    }
    let refused = PreadRoute::new(1 << 20, Some("CUDA_ERROR_INVALID_VALUE"));
    let exec = executor(refused.clone());
    assert!(onboard(&exec, IoMode::Buffered, &scattered_pairs(), 4));
    assert_eq!(refused.jobs.load(Ordering::Relaxed), 0);
}

#[test]
fn the_other_direction_and_other_pairs_never_reach_the_route() {
    let route = PreadRoute::new(1 << 20, None);
    let exec = executor(route.clone());
    let cfg = config(8);
    let file_l = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let dev_l = Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap();
    let all: Vec<_> = (0..8).map(|i| (i, i)).collect();
    let dev = host_device_layout(dev_l.clone(), true).unwrap();
    common::fill(&dev, 5);
    let file = PhysicalLayout::allocate_disk(
        file_l.clone(),
        &common::disk_allocator("file-route", IoMode::Buffered),
    )
    .unwrap();
    // Device → file (offload), host → file, file → host: not the route's.
    exec.transfer(&dev, &file, &all).wait().unwrap();
    let host = common::host(file_l.clone());
    exec.transfer(&file, &host, &all).wait().unwrap();
    exec.transfer(&host, &file, &all).wait().unwrap();
    assert_eq!(route.jobs.load(Ordering::Relaxed), 0);
    // And what went out through the bounce pipeline comes back through
    // the route byte for byte.
    let back = host_device_layout(dev_l.clone(), true).unwrap();
    exec.transfer(&file, &back, &all).wait().unwrap();
    assert_eq!(route.jobs.load(Ordering::Relaxed), 2);
    assert_eq!(common::snapshot(&dev), common::snapshot(&back));
}

#[test]
fn the_choice_in_order() {
    let dev = MemoryKind::Device(0);
    let facts = |src, dst, direct, refused| RouteFacts {
        src,
        dst,
        serves_dst: dev,
        direct_source: direct,
        registration: refused,
    };
    assert_eq!(
        route_refusal(facts(MemoryKind::Disk, dev, false, None)),
        None
    );
    assert_eq!(
        route_refusal(facts(dev, MemoryKind::Disk, false, None)),
        Some(RouteRefusal::Pair {
            src: dev,
            dst: MemoryKind::Disk
        })
    );
    assert_eq!(
        route_refusal(facts(MemoryKind::Disk, dev, true, Some("x"))),
        Some(RouteRefusal::DirectFile)
    );
    assert!(matches!(
        route_refusal(facts(MemoryKind::Disk, dev, false, Some("x"))),
        Some(RouteRefusal::Registration(_))
    ));
}
