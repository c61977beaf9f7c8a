//! The CUDA backend behind the crate's [`TransferBackend`] trait.
//!
//! The executor hands over a [`TransferJob`] (region tables of
//! [`MemoryRegion`]s and a kvbm-layout run list); this turns the regions into
//! addresses the copier understands, lets [`CudaCopier`] pick (or use the
//! forced) path, and resolves the job's completion from the copier's
//! watcher thread. Pinned and device memory become [`MemoryRegion`]s through
//! [`PinnedMemory::region`] and [`DeviceBuffer::region`], which keep the
//! allocation alive for as long as any region points at it.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Weak};

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
    /// Region tables of recent jobs as the copier sees them: a tier's
    /// layout hands the same table to every job, and describing its
    /// regions anew each time costs a lone block's copy more than its
    /// planning.
    tables: Mutex<Vec<Table>>,
}

/// A job's region table (held weakly: the cache keeps no memory alive)
/// and its regions described for the copier.
struct Table {
    regions: Weak<[MemoryRegion]>,
    described: Arc<[Arc<dyn CudaRegion>]>,
}

/// Region tables [`CudaBackend`] remembers.
const TABLES: usize = 8;

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
            tables: Mutex::new(Vec::new()),
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

    /// `job`'s `side` table described for the copier, from the cache when
    /// the table was seen before. The described regions do not keep the
    /// memory alive: the copy holds the job's table for that.
    fn regions(
        &self,
        job: &TransferJob,
        side: Side,
    ) -> Result<Arc<[Arc<dyn CudaRegion>]>, TransferError> {
        let table = match side {
            Side::Source => &job.src,
            Side::Destination => &job.dst,
        };
        let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        // A live weak reference keeps its table's allocation, so an equal
        // address is the same table, never a new one in its place.
        if let Some(t) = tables
            .iter()
            .find(|t| std::ptr::addr_eq(t.regions.as_ptr(), Arc::as_ptr(table)))
        {
            return Ok(Arc::clone(&t.described));
        }
        let described: Arc<[Arc<dyn CudaRegion>]> = table
            .iter()
            .map(|r| self.describe(r))
            .collect::<Result<_, _>>()?;
        tables.retain(|t| t.regions.strong_count() > 0);
        if tables.len() >= TABLES {
            tables.remove(0);
        }
        tables.push(Table {
            regions: Arc::downgrade(table),
            described: Arc::clone(&described),
        });
        Ok(described)
    }

    fn describe(&self, r: &MemoryRegion) -> Result<Arc<dyn CudaRegion>, TransferError> {
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
        Ok(Arc::new(JobRegion::described(r, addr, location)))
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
        // The job's tables keep its memory alive until the copy completed.
        let held = (Arc::clone(&job.src), Arc::clone(&job.dst));
        match self
            .copier
            .copy_tables(Arc::clone(&job.runs), &src, &dst, opts)
        {
            Ok(done) => done.map(move |r| {
                drop(held);
                r.map_err(to_transfer_error)
            }),
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
/// owner) until the copy completes, unless made by
/// [`JobRegion::described`].
pub(crate) struct JobRegion {
    _region: Option<MemoryRegion>,
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
        JobRegion {
            _region: Some(region.clone()),
            ..Self::described(region, addr, location)
        }
    }

    /// [`JobRegion::new`] without holding the region: whoever copies it
    /// must keep the region alive until the copy completed.
    pub(crate) fn described(region: &MemoryRegion, addr: u64, location: Location) -> Self {
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
            _region: None,
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
