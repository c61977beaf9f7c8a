//! Pinned host memory grown in the background: the pinned prefix never runs
//! ahead of the registrations, every byte of it is usable by copies, and
//! the pinning statistics count what was done.
//!
//! Without a GPU each test prints `skipped: no CUDA device` and passes; with
//! `KVBM_REQUIRE_GPU=1` a missing GPU fails.

mod cuda_common;

use std::sync::Arc;

use cuda_common::{device_or_skip, random_bytes};
use kvbm_transfer::cuda::{
    CopierConfig, CopyOptions, CopyRun, CudaCopier, CudaRegion, DeviceBuffer, PinnedMemory,
    PinnedOptions,
};

type Regions = Vec<Arc<dyn CudaRegion>>;

/// Copies `data` from the device into `mem` at `offset` and reads it back.
fn copy_into(copier: &CudaCopier, gpu: &Arc<DeviceBuffer>, mem: &Arc<PinnedMemory>, offset: usize) {
    let data = random_bytes(4096, offset as u64);
    gpu.write(0, &data).unwrap();
    let run = CopyRun {
        src_region: 0,
        src_offset: 0,
        dst_region: 0,
        dst_offset: offset as u64,
        len: 4096,
    };
    let (src, dst): (Regions, Regions) = (vec![gpu.clone()], vec![mem.clone()]);
    copier
        .copy(&[run], &src, &dst, CopyOptions::default())
        .unwrap()
        .wait()
        .unwrap();
    let mut out = vec![0u8; 4096];
    mem.read(offset, &mut out).unwrap();
    assert_eq!(out, data, "bytes at {offset}");
}

#[test]
fn every_chunk_is_registered_and_counted() {
    let Some(dev) = device_or_skip() else { return };
    let copier = CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap();
    let gpu = Arc::new(DeviceBuffer::new(&dev, 4096).unwrap());
    // 8 MiB chunks, the last one 12 KiB.
    let opts = PinnedOptions {
        chunk_bytes: 8 << 20,
        ..PinnedOptions::for_device(&dev)
    };
    let len = (40 << 20) + 12288;
    let mem = PinnedMemory::allocate_in_background(&dev, len, 8 << 20, opts).unwrap();
    assert!(mem.pinned_len() >= 8 << 20, "first part pinned");
    mem.wait_pinned(len).unwrap();
    assert_eq!(mem.pinned_len(), len);
    let st = mem.stats();
    assert_eq!(st.chunks, 6, "registrations");
    assert!(st.register_s > 0.0 && st.touch_s > 0.0, "{st:?}");
    let mem = Arc::new(mem);
    // First and last page, and pages on both sides of a chunk boundary.
    for offset in [0, (8 << 20) - 4096, 8 << 20, len - 4096] {
        copy_into(&copier, &gpu, &mem, offset);
    }
}

#[test]
fn the_pinned_prefix_never_runs_ahead() {
    // While the background thread registers chunk after chunk, every byte
    // the prefix covers must already be usable by a copy.
    let Some(dev) = device_or_skip() else { return };
    let copier = CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap();
    let gpu = Arc::new(DeviceBuffer::new(&dev, 4096).unwrap());
    let opts = PinnedOptions {
        chunk_bytes: 4 << 20,
        ..PinnedOptions::for_device(&dev)
    };
    let len = 256 << 20;
    let mem = Arc::new(PinnedMemory::allocate_in_background(&dev, len, 2 << 20, opts).unwrap());
    let mut checked = 0;
    loop {
        let pinned = mem.pinned_len();
        if pinned >= 4096 {
            copy_into(&copier, &gpu, &mem, pinned - 4096);
            checked += 1;
        }
        if pinned == len {
            break;
        }
    }
    assert!(checked > 0);
}
