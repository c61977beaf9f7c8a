//! Block checksums taken on the GPU equal the host's, on every layout kind,
//! on chunks at every alignment (16-, 8- and 1-byte) and on chunks summed
//! in several pieces, and change with the bytes.
//!
//! Without a GPU each test prints `skipped: no CUDA device` and passes; with
//! `KVBM_REQUIRE_GPU=1` a missing GPU fails.

mod cuda_common;

use std::sync::Arc;

use cuda_common::{device_or_skip, random_bytes};
use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_transfer::checksum::BlockChecksum;
use kvbm_transfer::cuda::{CudaDevice, DeviceBuffer, DeviceChecksums};
use kvbm_transfer::{MemoryRegion, PhysicalLayout};

/// `layout` in device memory filled with random bytes, and the host image
/// of each region.
fn placed(
    dev: &CudaDevice,
    layout: Layout,
    seed: u64,
) -> (PhysicalLayout, Vec<Vec<u8>>, Vec<Arc<DeviceBuffer>>) {
    let mut regions: Vec<MemoryRegion> = Vec::new();
    let mut images = Vec::new();
    let mut buffers = Vec::new();
    for r in 0..layout.num_regions() {
        let size = layout.region_size(r).unwrap() as usize;
        let data = random_bytes(size, seed + r as u64);
        let b = Arc::new(DeviceBuffer::new(dev, size).unwrap());
        b.write(0, &data).unwrap();
        regions.push(b.region());
        images.push(data);
        buffers.push(b);
    }
    (
        PhysicalLayout::new(layout, regions).unwrap(),
        images,
        buffers,
    )
}

/// The host checksum of `block`, read from the region images.
fn host_sum(layout: &Layout, images: &[Vec<u8>], block: usize) -> u64 {
    let c = *layout.config();
    let mut sum = BlockChecksum::new();
    for layer in 0..c.num_layers() {
        for outer in 0..c.outer_dim() {
            let chunk = layout.chunk(block, layer, outer).unwrap();
            let at = chunk.offset as usize;
            sum.update(&images[chunk.region][at..at + chunk.len as usize]);
        }
    }
    sum.digest()
}

/// Layouts whose chunks are 16-byte aligned (bf16 pages), 8-byte aligned
/// and unaligned (odd chunk lengths back to back), small and large.
fn layouts() -> Vec<Layout> {
    let cfg = |blocks, layers, outer, page, inner, dtype| {
        LayoutConfig::new(blocks, layers, outer, page, inner, dtype).unwrap()
    };
    vec![
        Layout::new(cfg(24, 4, 2, 16, 128, 2), LayoutKind::FullyContiguous).unwrap(),
        Layout::new(
            cfg(24, 3, 2, 16, 64, 2),
            LayoutKind::LayerSeparate(BlockOrder::OuterFirst),
        )
        .unwrap(),
        Layout::new(
            cfg(16, 2, 1, 3, 8, 1),
            LayoutKind::LayerSeparate(BlockOrder::BlockFirst),
        )
        .unwrap(),
        Layout::new(cfg(16, 3, 2, 3, 5, 1), LayoutKind::FullyContiguous).unwrap(),
        // Chunks the GPU sums in pieces: 64 KiB ones, and odd 8,481-byte
        // ones back to back (pieces at every alignment, a partial last
        // word).
        Layout::new(cfg(6, 2, 2, 256, 128, 2), LayoutKind::FullyContiguous).unwrap(),
        Layout::new(cfg(6, 2, 2, 33, 257, 1), LayoutKind::FullyContiguous).unwrap(),
    ]
}

#[test]
fn device_sums_equal_host_sums() {
    let Some(dev) = device_or_skip() else { return };
    let sums = DeviceChecksums::new(&dev).unwrap();
    for (i, layout) in layouts().into_iter().enumerate() {
        let (phys, images, _keep) = placed(&dev, layout.clone(), 100 * i as u64 + 1);
        let n = layout.config().num_blocks();
        // Every block, in a scrambled order with one block twice.
        let mut blocks: Vec<usize> = (0..n).rev().collect();
        blocks.push(blocks[n / 2]);
        let got = sums.block_sums(&phys, &blocks).unwrap();
        let want: Vec<u64> = blocks
            .iter()
            .map(|&b| host_sum(&layout, &images, b))
            .collect();
        assert_eq!(got, want, "layout {i}: {layout:?}");
    }
}

#[test]
fn a_changed_byte_changes_the_device_sum() {
    let Some(dev) = device_or_skip() else { return };
    let sums = DeviceChecksums::new(&dev).unwrap();
    let layout = layouts().remove(0);
    let (phys, mut images, buffers) = placed(&dev, layout.clone(), 7);
    let before = sums.block_sums(&phys, &[5]).unwrap();
    let chunk = layout.chunk(5, 2, 1).unwrap();
    let at = chunk.offset as usize + 77;
    images[chunk.region][at] ^= 0x40;
    buffers[chunk.region]
        .write(at, &images[chunk.region][at..at + 1])
        .unwrap();
    let after = sums.block_sums(&phys, &[5]).unwrap();
    assert_ne!(before, after);
    assert_eq!(after[0], host_sum(&layout, &images, 5));
}

#[test]
fn host_memory_is_refused() {
    let Some(dev) = device_or_skip() else { return };
    let sums = DeviceChecksums::new(&dev).unwrap();
    let layout = layouts().remove(0);
    let host =
        PhysicalLayout::allocate_system(layout, &kvbm_transfer::memory::SystemAllocator::new())
            .unwrap();
    assert!(sums.block_sums(&host, &[0]).is_err());
}
