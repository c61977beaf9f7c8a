//! A GPU G1 for the replay (feature `cuda`): the engine-shaped layout in
//! device memory that the bench fills and checks, G2 in pinned host
//! memory, and the library's executor for a device G1 (`ExecutorSpec`).

use std::sync::Arc;

use kvbm_layout::Layout;
use kvbm_transfer::cuda::{
    CopierConfig, CopyPath, CudaBackend, CudaDevice, DeviceBuffer, Probe, probe,
};
use kvbm_transfer::{Executor, ExecutorSpec, PhysicalLayout};

use super::super::error::{BenchError, Result};
use super::super::host_view::Mismatch;
use super::super::pattern::{check_chunk, fill_chunk};

fn cuda_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Cuda(e.to_string())
}

/// Device 0, when there is one.
pub fn device() -> Option<CudaDevice> {
    match probe() {
        Probe::Devices(_) => CudaDevice::open(0).ok(),
        _ => None,
    }
}

/// Device `ordinal`, when it exists.
pub fn device_at(ordinal: usize) -> Option<CudaDevice> {
    match probe() {
        Probe::Devices(n) if ordinal < n => CudaDevice::open(ordinal).ok(),
        _ => None,
    }
}

/// G1 in device memory, one buffer per layout region.
#[derive(Clone)]
pub struct DeviceTier {
    physical: PhysicalLayout,
    buffers: Vec<Arc<DeviceBuffer>>,
}

impl DeviceTier {
    /// Allocates device memory for every region of `layout`.
    pub fn allocate(device: &CudaDevice, layout: Layout) -> Result<Self> {
        let physical = PhysicalLayout::allocate_device(layout, device)?;
        let buffers = physical
            .regions()
            .iter()
            .map(|r| {
                r.owner()
                    .cloned()
                    .and_then(|o| o.downcast::<DeviceBuffer>().ok())
                    .ok_or_else(|| BenchError::Cuda("a G1 region without its buffer".into()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DeviceTier { physical, buffers })
    }

    /// The physical layout, for the engine.
    pub fn physical(&self) -> &PhysicalLayout {
        &self.physical
    }

    /// Writes block `block`'s pattern for `hash` (one copy per chunk).
    pub fn fill(&self, block: usize, hash: u64) -> Result<()> {
        let layout = self.physical.layout();
        let cfg = layout.config();
        let mut buf = vec![0u8; cfg.chunk_bytes() as usize];
        for layer in 0..cfg.num_layers() {
            for outer in 0..cfg.outer_dim() {
                let c = layout.chunk(block, layer, outer)?;
                fill_chunk(&mut buf, hash, layer, outer);
                self.buffers[c.region]
                    .write(c.offset as usize, &buf)
                    .map_err(cuda_err)?;
            }
        }
        Ok(())
    }

    /// Writes the pattern of `hash_of(b)` into every block `b`, one device
    /// write per region (block by block would be one small copy per chunk).
    pub fn fill_all(&self, hash_of: impl Fn(usize) -> u64) -> Result<()> {
        let layout = self.physical.layout();
        let cfg = *layout.config();
        for (r, buffer) in self.buffers.iter().enumerate() {
            let mut buf = vec![0u8; layout.region_size(r)? as usize];
            for block in 0..cfg.num_blocks() {
                for layer in 0..cfg.num_layers() {
                    for outer in 0..cfg.outer_dim() {
                        let c = layout.chunk(block, layer, outer)?;
                        if c.region == r {
                            let at = c.offset as usize;
                            let chunk = &mut buf[at..at + c.len as usize];
                            fill_chunk(chunk, hash_of(block), layer, outer);
                        }
                    }
                }
            }
            buffer.write(0, &buf).map_err(cuda_err)?;
        }
        Ok(())
    }

    /// Checks block `block` against the pattern of `hash`.
    pub fn check(&self, block: usize, hash: u64) -> Result<Option<Mismatch>> {
        let layout = self.physical.layout();
        let cfg = layout.config();
        let mut buf = vec![0u8; cfg.chunk_bytes() as usize];
        for layer in 0..cfg.num_layers() {
            for outer in 0..cfg.outer_dim() {
                let c = layout.chunk(block, layer, outer)?;
                self.buffers[c.region]
                    .read(c.offset as usize, &mut buf)
                    .map_err(cuda_err)?;
                if let Some(offset) = check_chunk(&buf, hash, layer, outer) {
                    return Ok(Some(Mismatch {
                        layer,
                        outer,
                        offset,
                    }));
                }
            }
        }
        Ok(None)
    }
}

/// A pinned-host layout (G2 next to a GPU G1).
pub fn pinned_layout(device: &CudaDevice, layout: Layout) -> Result<PhysicalLayout> {
    Ok(PhysicalLayout::allocate_pinned(layout, device)?)
}

/// The library's executor for a G1 on `device` beside a disk tier, with
/// `memcpy_threads` memcpy threads.
pub fn executor(device: &CudaDevice, memcpy_threads: usize) -> Result<Executor> {
    Ok(ExecutorSpec::device(device.clone())
        .memcpy_threads(memcpy_threads)
        .disk(true)
        .build()?)
}

/// [`executor`] with a copier of `copier`'s configuration and, with
/// `path`, one copy path forced; and a handle on its CUDA backend (to tell
/// it whether the model is running: [`CudaBackend::set_gpu_load`]).
pub fn executor_with_backend(
    device: &CudaDevice,
    memcpy_threads: usize,
    path: Option<CopyPath>,
    copier: CopierConfig,
) -> Result<(Executor, Arc<CudaBackend>)> {
    let mut spec = ExecutorSpec::device(device.clone())
        .memcpy_threads(memcpy_threads)
        .disk(true)
        .copier(copier);
    if let Some(p) = path {
        spec = spec.copy_path(p);
    }
    let parts = spec.build_parts()?;
    let cuda = parts
        .cuda
        .ok_or_else(|| BenchError::Cuda("the executor has no CUDA backend".into()))?;
    Ok((parts.executor, cuda))
}
