//! A GPU G1 for the replay (feature `cuda`): the engine-shaped layout in
//! device memory, G2 in pinned host memory, and an executor with the CUDA
//! backend next to memcpy and the disk backend (G3 → G1 goes through a
//! pinned bounce pool).

use std::sync::Arc;

use kvbm_layout::Layout;
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::cuda::{
    CopierConfig, CopyPath, CudaBackend, CudaCopier, CudaDevice, DeviceBuffer, PinnedMemory,
    PinnedOptions, Probe, probe,
};
use kvbm_transfer::{
    BouncePool, DiskBackend, DiskConfig, Executor, ExecutorConfig, MemoryRegion, PhysicalLayout,
};

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
        let buffers = (0..layout.num_regions())
            .map(|r| {
                Ok(Arc::new(
                    DeviceBuffer::new(device, layout.region_size(r)? as usize).map_err(cuda_err)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let regions = buffers.iter().map(DeviceBuffer::region).collect();
        Ok(DeviceTier {
            physical: PhysicalLayout::new(layout, regions)?,
            buffers,
        })
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
    let len = layout.region_size(0)? as usize;
    let pinned = Arc::new(
        PinnedMemory::allocate(device, len, PinnedOptions::for_device(device)).map_err(cuda_err)?,
    );
    let region: MemoryRegion = pinned.region();
    Ok(PhysicalLayout::new(layout, vec![region])?)
}

/// An executor with memcpy, disk and CUDA backends, a system bounce pool
/// (disk ↔ disk) and a pinned one (disk ↔ device).
pub fn executor(device: &CudaDevice, memcpy_threads: usize) -> Result<Executor> {
    Ok(executor_with_backend(device, memcpy_threads, None, CopierConfig::default())?.0)
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
    const SLOTS: usize = 8;
    const SLOT_BYTES: u64 = 4 << 20;
    let disk = DiskBackend::new(&DiskConfig::default())?;
    let system = BouncePool::system(4, SLOT_BYTES)?;
    disk.register_memory(system.region())?;
    let pinned = Arc::new(
        PinnedMemory::allocate(
            device,
            SLOTS * SLOT_BYTES as usize,
            PinnedOptions::for_device(device),
        )
        .map_err(cuda_err)?,
    );
    let pinned_pool = BouncePool::new(pinned.region(), SLOT_BYTES)?;
    disk.register_memory(pinned_pool.region())?;
    let copier = Arc::new(CudaCopier::new(device, copier).map_err(cuda_err)?);
    let cuda = match path {
        Some(p) => CudaBackend::new(copier).with_path(p),
        None => CudaBackend::new(copier),
    };
    let cuda = Arc::new(cuda);
    let executor = Executor::builder()
        .backend(Arc::new(MemcpyBackend::new(memcpy_threads)?))
        .backend(Arc::new(disk))
        .backend(Arc::clone(&cuda) as Arc<dyn kvbm_transfer::TransferBackend>)
        .bounce_pool(system)
        .bounce_pool(pinned_pool)
        .config(ExecutorConfig::default())
        .build()?;
    Ok((executor, cuda))
}
