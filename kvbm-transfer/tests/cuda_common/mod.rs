//! Shared by the CUDA tests and kvbm-bench's `cuda_bench` (which includes
//! this file by its path): the GPU gate, random data, and a small stand-in
//! for kvbm-layout's FullyContiguous / LayerSeparate address math and copy
//! planner.
#![allow(dead_code)]

use kvbm_transfer::cuda::{CopyRun, CudaDevice, Probe, probe};

/// Opens device 0, or prints the skip line and returns `None`. With
/// `KVBM_REQUIRE_GPU=1` a missing GPU is a failure.
pub fn device_or_skip() -> Option<CudaDevice> {
    match probe() {
        Probe::Devices(_) => Some(CudaDevice::open(0).expect("a probed device opens")),
        other => {
            assert!(
                std::env::var("KVBM_REQUIRE_GPU").as_deref() != Ok("1"),
                "KVBM_REQUIRE_GPU=1 but no CUDA device ({other:?})"
            );
            println!("skipped: no CUDA device");
            None
        }
    }
}

/// Deterministic non-zero pseudo-random bytes (xorshift64*).
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Layout kinds, as kvbm-layout names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// One region: `[block][layer][outer][run]`.
    FullyContiguous,
    /// One region per layer, outer-first: `[outer][block][run]` (vLLM).
    LayerSeparate,
}

/// A KV layout: `blocks × layers × outer` runs of `run_bytes`.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub kind: Kind,
    pub blocks: usize,
    pub layers: usize,
    pub outer: usize,
    pub run_bytes: usize,
}

impl Layout {
    /// Byte size of each region.
    pub fn region_sizes(&self) -> Vec<usize> {
        match self.kind {
            Kind::FullyContiguous => vec![self.blocks * self.layers * self.outer * self.run_bytes],
            Kind::LayerSeparate => vec![self.outer * self.blocks * self.run_bytes; self.layers],
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.layers * self.outer * self.run_bytes
    }

    /// Region and offset of the run (block, layer, outer).
    pub fn at(&self, block: usize, layer: usize, outer: usize) -> (u32, u64) {
        match self.kind {
            Kind::FullyContiguous => (
                0,
                (((block * self.layers + layer) * self.outer + outer) * self.run_bytes) as u64,
            ),
            Kind::LayerSeparate => (
                layer as u32,
                ((outer * self.blocks + block) * self.run_bytes) as u64,
            ),
        }
    }
}

/// The minimal run list copying blocks `pairs[i].0` of `src` to blocks
/// `pairs[i].1` of `dst` (runs merged where both sides are contiguous).
pub fn plan(src: &Layout, dst: &Layout, pairs: &[(usize, usize)]) -> Vec<CopyRun> {
    let mut runs: Vec<CopyRun> = Vec::new();
    for &(sb, db) in pairs {
        for l in 0..src.layers {
            for o in 0..src.outer {
                let (sr, so) = src.at(sb, l, o);
                let (dr, d) = dst.at(db, l, o);
                let len = src.run_bytes as u64;
                if let Some(p) = runs.last_mut()
                    && p.src_region == sr
                    && p.dst_region == dr
                    && p.src_offset + p.len == so
                    && p.dst_offset + p.len == d
                {
                    p.len += len;
                    continue;
                }
                runs.push(CopyRun {
                    src_region: sr,
                    src_offset: so,
                    dst_region: dr,
                    dst_offset: d,
                    len,
                });
            }
        }
    }
    runs
}

/// `n` distinct block ids out of `0..pool`, shuffled (non-consecutive in
/// general).
pub fn random_blocks(n: usize, pool: usize, seed: u64) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..pool).collect();
    let mut x = seed | 1;
    for i in (1..pool).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ids.swap(i, (x % (i as u64 + 1)) as usize);
    }
    ids.truncate(n);
    ids
}

/// A window of a device buffer as its own region, as an engine's layer
/// tensors carved out of one allocation are.
pub struct DeviceWindow {
    pub buf: std::sync::Arc<kvbm_transfer::cuda::DeviceBuffer>,
    pub offset: usize,
    pub len: usize,
}

impl kvbm_transfer::cuda::CudaRegion for DeviceWindow {
    fn device_ptr(&self) -> u64 {
        self.buf.ptr() + self.offset as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> kvbm_transfer::cuda::Location {
        kvbm_transfer::cuda::Location::Device
    }
    fn allocation(&self) -> Option<(u64, u64)> {
        kvbm_transfer::cuda::CudaRegion::allocation(&*self.buf)
    }
}

/// One device allocation holding every region of `sizes` back to back, and
/// the regions as windows of it.
pub fn packed_device_regions(
    dev: &CudaDevice,
    sizes: &[usize],
) -> (
    std::sync::Arc<kvbm_transfer::cuda::DeviceBuffer>,
    Vec<std::sync::Arc<dyn kvbm_transfer::cuda::CudaRegion>>,
) {
    let buf = std::sync::Arc::new(
        kvbm_transfer::cuda::DeviceBuffer::new(dev, sizes.iter().sum()).expect("device buffer"),
    );
    let mut offset = 0;
    let regions = sizes
        .iter()
        .map(|&len| {
            let w = DeviceWindow {
                buf: buf.clone(),
                offset,
                len,
            };
            offset += len;
            std::sync::Arc::new(w) as std::sync::Arc<dyn kvbm_transfer::cuda::CudaRegion>
        })
        .collect();
    (buf, regions)
}
