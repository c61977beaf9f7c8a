//! Executors assembled from the memory they move between.
//!
//! An [`Executor`] needs one backend per pair of memory kinds it serves
//! and bounce pools for the pairs no backend joins directly. Which follow
//! from the tiers: host tiers need memcpy; a disk tier needs the disk
//! backend and, for disk ↔ disk, a system bounce pool; a G1 on a GPU needs
//! the CUDA backend (a copier sized from the device) and a pinned bounce
//! pool so disk ↔ device goes through page-locked memory in two hops.
//! [`ExecutorSpec`] says which of these a set of tiers needs;
//! [`ExecutorSpec::build`] assembles them.

use std::sync::Arc;

use crate::backend::memcpy::MemcpyBackend;
use crate::bounce::BouncePool;
use crate::disk::{DiskBackend, DiskConfig};
use crate::error::Result;
use crate::executor::{Executor, ExecutorConfig};

/// Bytes of one bounce slot: disk requests of this size reach the disk's
/// sequential rate, and a slot holds the chunks of most blocks whole.
const BOUNCE_SLOT_BYTES: u64 = 4 << 20;
/// Slots of the system bounce pool (disk ↔ disk: G2 victims copied on).
const SYSTEM_BOUNCE_SLOTS: usize = 4;
/// Slots of the pinned bounce pool (disk ↔ device: G3 onboards and
/// offloads that skip G2), enough for two batches double-buffered.
#[cfg(feature = "cuda")]
const PINNED_BOUNCE_SLOTS: usize = 8;
/// Memcpy threads at most: host copies are memory-bound, and a few threads
/// saturate a socket's bandwidth.
const MAX_MEMCPY_THREADS: usize = 4;

/// What an executor must serve: the tiers' memory, described by what
/// matters to the choice of backends.
#[derive(Debug, Clone)]
pub struct ExecutorSpec {
    disk: bool,
    #[cfg(feature = "cuda")]
    device: Option<crate::cuda::CudaDevice>,
    #[cfg(feature = "cuda")]
    copier: Option<crate::cuda::CopierConfig>,
    #[cfg(feature = "cuda")]
    path: Option<crate::cuda::CopyPath>,
    memcpy_threads: usize,
    config: ExecutorConfig,
}

impl Default for ExecutorSpec {
    fn default() -> Self {
        Self::host()
    }
}

impl ExecutorSpec {
    /// Tiers in host memory only (G1 standing in on the host, G2).
    pub fn host() -> Self {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        ExecutorSpec {
            disk: false,
            #[cfg(feature = "cuda")]
            device: None,
            #[cfg(feature = "cuda")]
            copier: None,
            #[cfg(feature = "cuda")]
            path: None,
            memcpy_threads: cpus.clamp(1, MAX_MEMCPY_THREADS),
            config: ExecutorConfig::default(),
        }
    }

    /// G1 on `device`: adds the CUDA backend and, with a disk tier, a
    /// pinned bounce pool for disk ↔ device.
    #[cfg(feature = "cuda")]
    pub fn device(device: crate::cuda::CudaDevice) -> Self {
        ExecutorSpec {
            device: Some(device),
            ..Self::host()
        }
    }

    /// The GPU copier's settings (default: sized from the device,
    /// [`crate::cuda::CopierConfig::for_device`]).
    #[cfg(feature = "cuda")]
    pub fn copier(mut self, config: crate::cuda::CopierConfig) -> Self {
        self.copier = Some(config);
        self
    }

    /// Diagnostics: every GPU copy takes `path` instead of the one the
    /// copier would choose (to measure one path against another).
    #[cfg(all(feature = "cuda", feature = "diagnostics"))]
    pub fn copy_path(mut self, path: crate::cuda::CopyPath) -> Self {
        self.path = Some(path);
        self
    }

    /// Whether a disk tier takes part (adds the disk backend, io_uring
    /// where the kernel allows, and bounce pools for its two-hop pairs).
    pub fn disk(mut self, yes: bool) -> Self {
        self.disk = yes;
        self
    }

    /// Threads of the memcpy backend (default: the CPUs available, at most
    /// four).
    pub fn memcpy_threads(mut self, threads: usize) -> Self {
        self.memcpy_threads = threads.max(1);
        self
    }

    /// Batching and concurrency limits of the executor.
    pub fn config(mut self, config: ExecutorConfig) -> Self {
        self.config = config;
        self
    }

    /// Assembles the executor.
    pub fn build(&self) -> Result<Executor> {
        Ok(self.build_parts()?.executor)
    }

    /// Assembles the executor and returns its parts a caller may want to
    /// talk to later (the CUDA backend, to say whether the model is
    /// running).
    pub fn build_parts(&self) -> Result<AssembledExecutor> {
        let mut builder = Executor::builder()
            .backend(Arc::new(MemcpyBackend::new(self.memcpy_threads)?))
            .config(self.config.clone());
        let disk = if self.disk {
            let disk = Arc::new(DiskBackend::new(&DiskConfig::default())?);
            let system = BouncePool::system(SYSTEM_BOUNCE_SLOTS, BOUNCE_SLOT_BYTES)?;
            disk.register_memory(system.region())?;
            builder = builder
                .backend(Arc::clone(&disk) as Arc<dyn crate::TransferBackend>)
                .bounce_pool(system);
            Some(disk)
        } else {
            None
        };
        #[cfg(feature = "cuda")]
        let cuda = match &self.device {
            Some(device) => {
                let copier = self
                    .copier
                    .clone()
                    .unwrap_or_else(|| crate::cuda::CopierConfig::for_device(device));
                let (b, cuda) = with_cuda(builder, device, copier, self.path, disk.as_deref())?;
                builder = b;
                Some(cuda)
            }
            None => None,
        };
        let _ = disk;
        Ok(AssembledExecutor {
            executor: builder.build()?,
            #[cfg(feature = "cuda")]
            cuda,
        })
    }
}

/// An assembled executor and the backends a caller may still address.
pub struct AssembledExecutor {
    /// The executor.
    pub executor: Executor,
    /// The CUDA backend, when G1 is on a device (to tell it whether the
    /// model is running: [`crate::cuda::CudaBackend::set_gpu_load`]).
    #[cfg(feature = "cuda")]
    pub cuda: Option<Arc<crate::cuda::CudaBackend>>,
}

impl std::fmt::Debug for AssembledExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AssembledExecutor").finish_non_exhaustive()
    }
}

/// Adds the CUDA backend for `device` (`path`, when given, forced on
/// every copy) and, with a disk backend, a pinned
/// bounce pool registered with it.
#[cfg(feature = "cuda")]
fn with_cuda(
    mut builder: crate::executor::ExecutorBuilder,
    device: &crate::cuda::CudaDevice,
    copier: crate::cuda::CopierConfig,
    path: Option<crate::cuda::CopyPath>,
    disk: Option<&DiskBackend>,
) -> Result<(
    crate::executor::ExecutorBuilder,
    Arc<crate::cuda::CudaBackend>,
)> {
    use crate::cuda::backend::to_transfer_error;
    use crate::cuda::{CudaBackend, CudaCopier, PinnedMemory, PinnedOptions};
    if let Some(disk) = disk {
        let pinned = Arc::new(
            PinnedMemory::allocate(
                device,
                PINNED_BOUNCE_SLOTS * BOUNCE_SLOT_BYTES as usize,
                PinnedOptions::for_device(device),
            )
            .map_err(to_transfer_error)?,
        );
        let pool = BouncePool::new(pinned.region(), BOUNCE_SLOT_BYTES)?;
        disk.register_memory(pool.region())?;
        builder = builder.bounce_pool(pool);
    }
    let copier = Arc::new(CudaCopier::new(device, copier).map_err(to_transfer_error)?);
    let cuda = Arc::new(match path {
        Some(path) => CudaBackend::new(copier).with_path(path),
        None => CudaBackend::new(copier),
    });
    builder = builder.backend(Arc::clone(&cuda) as Arc<dyn crate::TransferBackend>);
    Ok((builder, cuda))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryKind;
    use crate::strategy::Strategy;

    #[test]
    fn host_tiers_get_memcpy_and_disk_tiers_get_the_disk_paths() {
        let host = ExecutorSpec::host().build().expect("host executor");
        assert!(matches!(
            host.strategy(MemoryKind::System, MemoryKind::System),
            Ok(Strategy::Direct(_))
        ));
        assert!(host.strategy(MemoryKind::System, MemoryKind::Disk).is_err());
        let disk = ExecutorSpec::host()
            .disk(true)
            .build()
            .expect("disk executor");
        assert!(disk.strategy(MemoryKind::System, MemoryKind::Disk).is_ok());
        assert!(disk.strategy(MemoryKind::Disk, MemoryKind::Disk).is_ok());
    }
}
