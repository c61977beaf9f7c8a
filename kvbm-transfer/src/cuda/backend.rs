//! The CUDA backend behind the crate's [`TransferBackend`] trait.
//!
//! The executor hands over a [`TransferJob`] (region tables of
//! [`MemoryRegion`]s and a kvbm-layout run list); this turns the regions into
//! addresses the copier understands, lets [`CudaCopier`] pick (or use the
//! forced) path, and resolves the job's completion from the copier's
//! watcher thread. Pinned and device memory become [`MemoryRegion`]s through
//! [`PinnedMemory::region`] and [`DeviceBuffer::region`], which keep the
//! allocation alive for as long as any region points at it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use super::copier::{CopyOptions, CopyPath, CudaCopier, GpuLoad};
use super::error::CudaError;
use super::memory::{CudaRegion, DeviceBuffer, ExternalDeviceMemory, Location};
use super::pinned::PinnedMemory;
use crate::backend::{BackendKind, Side, TransferBackend, TransferJob};
use crate::completion::Completion;
use crate::error::TransferError;
use crate::memory::{MemoryKind, MemoryRegion};

/// Moves pinned ↔ device and device ↔ device jobs on one GPU.
pub struct CudaBackend {
    copier: Arc<CudaCopier>,
    ordinal: u32,
    load: AtomicU8,
    forced: Option<CopyPath>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("load", &self.gpu_load())
            .field("forced", &self.forced)
            .finish()
    }
}

impl CudaBackend {
    /// A backend submitting through `copier`; the GPU starts out `Idle`.
    pub fn new(copier: Arc<CudaCopier>) -> Self {
        CudaBackend {
            ordinal: copier.device().ordinal() as u32,
            copier,
            load: AtomicU8::new(0),
            forced: None,
        }
    }

    /// The copier jobs go through (its configuration; diagnostics).
    pub fn copier(&self) -> &Arc<CudaCopier> {
        &self.copier
    }

    /// Forces one path for every job (benchmarks, or a caller that measured
    /// its own workload).
    pub fn with_path(mut self, path: CopyPath) -> Self {
        self.forced = Some(path);
        self
    }

    /// Tells the backend whether the model is running: `Busy` keeps copies
    /// off the SMs where it can. Takes effect for jobs submitted afterwards.
    pub fn set_gpu_load(&self, load: GpuLoad) {
        self.load
            .store(u8::from(load == GpuLoad::Busy), Ordering::Relaxed);
    }

    /// The load last declared with [`CudaBackend::set_gpu_load`].
    pub fn gpu_load(&self) -> GpuLoad {
        if self.load.load(Ordering::Relaxed) == 1 {
            GpuLoad::Busy
        } else {
            GpuLoad::Idle
        }
    }

    fn regions(
        &self,
        job: &TransferJob,
        side: Side,
    ) -> Result<Vec<Arc<dyn CudaRegion>>, TransferError> {
        job.regions(side)
            .iter()
            .map(|r| {
                let location = match r.kind() {
                    MemoryKind::Pinned => Location::PinnedHost,
                    MemoryKind::Device(o) if o == self.ordinal => Location::Device,
                    other => {
                        return Err(TransferError::InvalidRequest(format!(
                            "the CUDA backend of device {} cannot address {other:?} memory",
                            self.ordinal
                        )));
                    }
                };
                let addr = r.addr().ok_or_else(|| {
                    TransferError::InvalidRequest("a file region reached the CUDA backend".into())
                })?;
                Ok(Arc::new(JobRegion::new(r, addr, location)) as Arc<dyn CudaRegion>)
            })
            .collect()
    }
}

impl TransferBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn supports(&self, src: MemoryKind, dst: MemoryKind) -> bool {
        let me = MemoryKind::Device(self.ordinal);
        matches!((src, dst), (MemoryKind::Pinned, d) if d == me)
            || matches!((src, dst), (s, MemoryKind::Pinned) if s == me)
            || (src == me && dst == me)
    }

    fn submit(&self, job: TransferJob) -> Completion {
        if job.cancel.is_cancelled() {
            return Completion::ready(Err(TransferError::Cancelled));
        }
        // No pass over the plan here: the copier checks every run before
        // its bytes move (a staged copy as its chunks are planned).
        let (src, dst) = match (
            self.regions(&job, Side::Source),
            self.regions(&job, Side::Destination),
        ) {
            (Ok(s), Ok(d)) => (s, d),
            (Err(e), _) | (_, Err(e)) => return Completion::ready(Err(e)),
        };
        let opts = CopyOptions {
            path: self.forced,
            load: self.gpu_load(),
        };
        match self
            .copier
            .copy_shared(Arc::clone(&job.runs), &src, &dst, opts)
        {
            Ok(done) => done.map(|r| r.map_err(to_transfer_error)),
            Err(e) => Completion::ready(Err(to_transfer_error(e))),
        }
    }
}

/// CUDA errors as the crate's transfer errors.
pub fn to_transfer_error(e: CudaError) -> TransferError {
    match e {
        CudaError::InvalidCopy(m) => TransferError::InvalidRequest(m),
        CudaError::OutOfBounds {
            side,
            region,
            offset,
            len,
            region_len,
            ..
        } => TransferError::OutOfBounds {
            side,
            region,
            offset,
            len,
            region_len: region_len.unwrap_or(0),
        },
        other => TransferError::Backend {
            backend: "cuda",
            message: other.to_string(),
        },
    }
}

/// A job's region as the copier sees it; holds the region (and so its
/// owner) until the copy completes.
pub(crate) struct JobRegion {
    _region: MemoryRegion,
    addr: u64,
    len: usize,
    location: Location,
    allocation: Option<(u64, u64)>,
}

impl JobRegion {
    /// `region` (at `addr`, in `location`) for a copy; it keeps the region
    /// alive, and knows its allocation where the region's owner is memory
    /// this module made or wrapped.
    pub(crate) fn new(region: &MemoryRegion, addr: u64, location: Location) -> Self {
        let owner = region.owner();
        let allocation = owner
            .and_then(|o| o.downcast_ref::<DeviceBuffer>())
            .and_then(CudaRegion::allocation)
            .or_else(|| {
                owner
                    .and_then(|o| o.downcast_ref::<ExternalDeviceMemory>())
                    .and_then(CudaRegion::allocation)
            });
        JobRegion {
            _region: region.clone(),
            addr,
            len: region.len() as usize,
            location,
            allocation,
        }
    }
}

impl CudaRegion for JobRegion {
    fn device_ptr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> Location {
        self.location
    }
    fn allocation(&self) -> Option<(u64, u64)> {
        self.allocation
    }
}

impl PinnedMemory {
    /// The pinned prefix as a [`MemoryRegion`] of kind `Pinned`; the region
    /// keeps this memory alive.
    pub fn region(self: &Arc<Self>) -> MemoryRegion {
        let len = self.pinned_len() as u64;
        // SAFETY: the range is registered pinned memory inside our mapping,
        // and the region's owner (an Arc of self) keeps it mapped and
        // registered for as long as the region lives.
        unsafe {
            MemoryRegion::from_raw(
                self.as_ptr() as u64,
                len,
                MemoryKind::Pinned,
                Some(Arc::clone(self) as crate::memory::Owner),
            )
        }
    }
}

impl DeviceBuffer {
    /// The buffer as a [`MemoryRegion`] of kind `Device(ordinal)`; the region
    /// keeps the buffer alive.
    pub fn region(self: &Arc<Self>) -> MemoryRegion {
        // SAFETY: the allocation is `len` bytes of device memory, kept alive
        // by the owner Arc for as long as the region lives.
        unsafe {
            MemoryRegion::from_raw(
                self.ptr(),
                CudaRegion::len(&**self) as u64,
                MemoryKind::Device(self.device_ordinal() as u32),
                Some(Arc::clone(self) as crate::memory::Owner),
            )
        }
    }
}

impl ExternalDeviceMemory {
    /// The wrapped memory as a [`MemoryRegion`] of kind `Device(ordinal)`.
    /// The region does not own the memory: its owner (the engine) must keep
    /// it allocated, as promised to [`ExternalDeviceMemory::wrap`].
    pub fn region(self: &Arc<Self>) -> MemoryRegion {
        // SAFETY: `wrap` checked that the range is device memory and its
        // caller promised it stays allocated while any region exists.
        unsafe {
            MemoryRegion::from_raw(
                self.device_ptr(),
                CudaRegion::len(&**self) as u64,
                MemoryKind::Device(self.device_ordinal() as u32),
                Some(Arc::clone(self) as crate::memory::Owner),
            )
        }
    }
}
