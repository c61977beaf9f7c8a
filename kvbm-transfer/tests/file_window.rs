//! The CUDA file-window route behind the executor: a buffered file's
//! windows page-locked read-only and read by the GPU's DMA, `O_DIRECT`
//! files declined (they take the bounce pipeline), windows kept between
//! jobs found again — every device byte checked against the source.
//!
//! Without a GPU each test prints `skipped: no CUDA device` and passes; with
//! `KVBM_REQUIRE_GPU=1` a missing GPU fails.
#![cfg(feature = "cuda")]

mod common;
mod cuda_common;

use std::sync::Arc;

use cuda_common::device_or_skip;
use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_transfer::cuda::file_window::{FileWindowConfig, FileWindowRoute};
use kvbm_transfer::cuda::{
    CopierConfig, CudaBackend, CudaCopier, CudaDevice, CudaRegion, DeviceBuffer, PinnedMemory,
    PinnedOptions,
};
use kvbm_transfer::disk::route::FileRoute;
use kvbm_transfer::disk::{DiskBackend, DiskConfig};
use kvbm_transfer::memory::IoMode;
use kvbm_transfer::{BouncePool, Executor, ExecutorConfig, PhysicalLayout};

struct Rig {
    exec: Executor,
    route: Arc<FileWindowRoute>,
    device: CudaDevice,
}

fn rig(device: CudaDevice, keep: u64) -> Rig {
    let copier = Arc::new(CudaCopier::new(&device, CopierConfig::for_device(&device)).unwrap());
    let route = Arc::new(
        FileWindowRoute::new(
            copier.clone(),
            FileWindowConfig {
                window_bytes: 64 << 10,
                workers: 2,
                keep_registered_bytes: keep,
                ..FileWindowConfig::default()
            },
        )
        .unwrap(),
    );
    let pinned = Arc::new(
        PinnedMemory::allocate(&device, 4 << 20, PinnedOptions::for_device(&device)).unwrap(),
    );
    let exec = Executor::builder()
        .backend(Arc::new(DiskBackend::new(&DiskConfig::default()).unwrap()))
        .backend(Arc::new(CudaBackend::new(copier)))
        .bounce_pool(BouncePool::new(pinned.region(), 64 << 10).unwrap())
        .file_route(route.clone())
        .config(ExecutorConfig {
            max_blocks_per_batch: 9,
            max_batches_in_flight: 2,
            bounce_slots_per_batch: 2,
        })
        .build()
        .unwrap();
    Rig {
        exec,
        route,
        device,
    }
}

/// 16 KiB blocks (4 KiB chunks), 40 of them.
fn layouts() -> (Layout, Layout) {
    let cfg = LayoutConfig::new(40, 2, 2, 16, 128, 2).unwrap();
    (
        Layout::new(cfg, LayoutKind::FullyContiguous).unwrap(),
        Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap(),
    )
}

/// One device buffer per region of `layout`.
fn device_buffers(device: &CudaDevice, layout: &Layout) -> Vec<Arc<DeviceBuffer>> {
    (0..layout.num_regions())
        .map(|i| {
            Arc::new(DeviceBuffer::new(device, layout.region_size(i).unwrap() as usize).unwrap())
        })
        .collect()
}

/// The bytes of every device buffer.
fn device_image(buffers: &[Arc<DeviceBuffer>]) -> Vec<Vec<u8>> {
    buffers
        .iter()
        .map(|b| {
            let mut v = vec![0u8; CudaRegion::len(&**b)];
            b.read(0, &mut v).unwrap();
            v
        })
        .collect()
}

/// Writes random blocks to a new `mode` file, onboards `pairs` to the
/// device, and checks every device byte. `None` if the file system
/// refuses `O_DIRECT`.
fn onboard(r: &Rig, mode: IoMode, pairs: &[(usize, usize)], seed: u64) -> Option<()> {
    let (file_l, dev_l) = layouts();
    let file =
        PhysicalLayout::allocate_disk(file_l.clone(), &common::disk_allocator("file-window", mode))
            .ok()?;
    let src = common::host(file_l.clone());
    common::fill(&src, seed);
    let all: Vec<_> = (0..40).map(|i| (i, i)).collect();
    r.exec.transfer(&src, &file, &all).wait().unwrap();
    let buffers = device_buffers(&r.device, &dev_l);
    let before: Vec<Vec<u8>> = buffers
        .iter()
        .map(|b| {
            let v = cuda_common::random_bytes(CudaRegion::len(&**b), seed ^ 0xff);
            b.write(0, &v).unwrap();
            v
        })
        .collect();
    let dev =
        PhysicalLayout::new(dev_l.clone(), buffers.iter().map(|b| b.region()).collect()).unwrap();
    let report = r.exec.transfer(&file, &dev, pairs).wait().unwrap();
    assert_eq!(report.blocks, pairs.len());
    let after = device_image(&buffers);
    common::assert_copied(
        src.layout(),
        &common::snapshot(&src),
        &dev_l,
        &before,
        &after,
        pairs,
    );
    Some(())
}

fn scattered() -> Vec<(usize, usize)> {
    (0..40).step_by(3).map(|s| (s, 39 - s)).collect()
}

#[test]
fn buffered_files_go_through_registered_windows() {
    let Some(device) = device_or_skip() else {
        return;
    };
    let r = rig(device, 0);
    onboard(&r, IoMode::Buffered, &scattered(), 1).unwrap();
    let all: Vec<_> = (0..40).map(|i| (i, (i * 7) % 40)).collect();
    onboard(&r, IoMode::Buffered, &all, 2).unwrap();
    let s = r.route.stats();
    assert!(s.windows >= 2, "{s:?}");
    assert_eq!(s.kept_hits, 0);
}

#[test]
fn o_direct_files_are_declined_and_still_land() {
    let Some(device) = device_or_skip() else {
        return;
    };
    let r = rig(device, 0);
    if onboard(&r, IoMode::Direct, &scattered(), 3).is_some() {
        assert_eq!(
            r.route.stats().windows,
            0,
            "an O_DIRECT file took the route"
        );
    }
}

#[test]
fn kept_windows_are_found_again() {
    let Some(device) = device_or_skip() else {
        return;
    };
    let r = rig(device, 1 << 20);
    let (file_l, dev_l) = layouts();
    let file = PhysicalLayout::allocate_disk(
        file_l.clone(),
        &common::disk_allocator("file-window", IoMode::Buffered),
    )
    .unwrap();
    let src = common::host(file_l.clone());
    common::fill(&src, 5);
    let all: Vec<_> = (0..40).map(|i| (i, i)).collect();
    r.exec.transfer(&src, &file, &all).wait().unwrap();
    let buffers = device_buffers(&r.device, &dev_l);
    let dev =
        PhysicalLayout::new(dev_l.clone(), buffers.iter().map(|b| b.region()).collect()).unwrap();
    r.exec.transfer(&file, &dev, &all).wait().unwrap();
    // (Batches of 9 blocks share 4-block windows, so the first transfer
    // may already find some of its windows kept by an earlier batch.)
    let first = r.route.stats();
    assert!(first.windows > 0);
    // New bytes written to the file after its windows were registered
    // reach the device through the same registrations: every window of
    // the second transfer is found kept, none registered anew.
    common::fill(&src, 6);
    r.exec.transfer(&src, &file, &all).wait().unwrap();
    r.exec.transfer(&file, &dev, &all).wait().unwrap();
    let second = r.route.stats();
    assert_eq!(
        second.kept_hits - first.kept_hits,
        second.windows - first.windows,
        "{first:?} -> {second:?}"
    );
    assert_eq!(second.registered_bytes, first.registered_bytes);
    let after = device_image(&buffers);
    // Every chunk is in `all`, so this checks the whole device image.
    common::assert_copied(
        src.layout(),
        &common::snapshot(&src),
        &dev_l,
        &after,
        &after,
        &all,
    );
    // The route declines nothing it can serve.
    let job_file = file.regions()[0].file_location().unwrap().0.clone();
    assert_eq!(r.route.registration_refusal(&job_file), None);
    assert_eq!(r.route.name(), "file-window");
}
