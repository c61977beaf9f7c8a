//! Page cache → GPU with no CPU copy: the device's DMA reads page-locked
//! windows of a buffered file's mapping.
//!
//! The bounce pipeline for a page-cached file copies every byte on the CPU
//! (page cache → pinned slot) and then DMAs it (slot → device). The copy
//! and the DMA share DRAM bandwidth, so the pair moves well below what the
//! DMA alone moves (`docs/benchmarks.md`, "Disk to GPU: bounce pipeline and
//! file-window route"). The page cache is host memory already:
//! [`FileWindowRoute`] maps the file read-only, page-locks one window of
//! the mapping at a time with `cuMemHostRegister(READ_ONLY | DEVICEMAP)`,
//! has the copy engines read the window straight into the device layout
//! (through [`CudaCopier`], whichever path it picks), and unregisters the
//! window when its DMA is done. Each byte crosses DRAM once, read by the
//! DMA.
//!
//! Registration is not free, and it cannot overlap the DMA: page-locking
//! and releasing pages are fast on their own, but a DMA running while
//! another thread registers windows slows to a fraction of its rate
//! (with the drivers and kernels tried so far). A window registered for
//! one copy therefore costs register + DMA + unregister in sequence, and a
//! cold file moves slower than through the bounce pipeline, though for a
//! fraction of its CPU time. Windows that stay registered cost only their
//! DMA (the pinned-memory rate):
//! [`FileWindowConfig::keep_registered_bytes`] keeps up to that many bytes
//! of fixed file windows registered between jobs, least recently used
//! released first. Windows go through a few worker threads; at most
//! `workers × window_bytes` plus the kept bytes are page-locked at once.
//!
//! Read-only pins of file pages are what Linux allows long-term (from 6.5
//! it refuses long-term *writable* pins of most file-backed pages, and the
//! driver reports a registration without the read-only flag as
//! `CUDA_ERROR_INVALID_VALUE`, on ext4 and tmpfs alike). Before a file
//! system's first job the route page-locks one page of the file; if the
//! driver or kernel refuses, the refusal is logged once and remembered,
//! and every job on that file system is declined (the executor then takes
//! the bounce pipeline). A registration refused in the middle of a job
//! fails that job (naming the file and range) and declines later ones.
//! Bytes written to the file later (through `pwrite`, into the same page
//! cache pages) are what a kept window's next copy reads; a file
//! truncated while kept would leave the window reading the old pages.
//! Kept windows of a closed file are released when the next window copy
//! ends, and all of them when the route is dropped.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use cudarc::driver::sys::{self, CUdevice_attribute};
use parking_lot::Mutex;

use super::backend::{JobRegion, to_transfer_error};
use super::copier::{CopyOptions, CopyPath, CudaCopier};
use super::device::CudaDevice;
use super::error::CudaError;
use super::handles::HostRegistration;
use super::memory::{CudaRegion, Location};
use crate::backend::{Side, TransferJob};
use crate::completion::{CancelToken, Completion, Countdown, completion_pair};
use crate::disk::FileMap;
use crate::disk::route::{
    FileRoute, FileWindow, RouteFacts, RouteRefusal, plan_fixed_windows, plan_windows,
    route_refusal,
};
use crate::error::TransferError;
use crate::memory::{DiskFile, MemoryKind};
use crate::pool::WorkerPool;

/// Settings of a [`FileWindowRoute`].
#[derive(Debug, Clone)]
pub struct FileWindowConfig {
    /// Bytes of file page-locked per window (rounded to pages).
    pub window_bytes: u64,
    /// A run more than this past a window's end starts a new window.
    pub max_gap: u64,
    /// Worker threads; each holds one window registered at a time.
    pub workers: usize,
    /// Force the copier's path for the windows' copies; `None` lets it
    /// choose.
    pub path: Option<CopyPath>,
    /// Keep up to this many bytes of windows registered between jobs
    /// (least recently used released first). 0: every window is released
    /// after its copy. Kept windows are fixed `window_bytes` slices of the
    /// file, so a later job over the same bytes finds them registered and
    /// costs only its DMA; they are page-locked page cache, which the
    /// kernel cannot reclaim while kept.
    pub keep_registered_bytes: u64,
}

impl Default for FileWindowConfig {
    fn default() -> Self {
        FileWindowConfig {
            window_bytes: 64 << 20,
            max_gap: 2 << 20,
            workers: 2,
            path: None,
            keep_registered_bytes: 0,
        }
    }
}

/// Cumulative counters of a route (for benchmarks and diagnosis).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileWindowStats {
    /// Windows moved.
    pub windows: u64,
    /// Bytes page-locked.
    pub registered_bytes: u64,
    /// Nanoseconds in `cuMemHostRegister`, summed over workers.
    pub register_ns: u64,
    /// Nanoseconds from submitting a window's copy to its completion.
    pub dma_ns: u64,
    /// Nanoseconds in `cuMemHostUnregister`.
    pub unregister_ns: u64,
    /// Windows found still registered from an earlier job.
    pub kept_hits: u64,
}

#[derive(Default)]
struct Counters {
    kept_hits: AtomicU64,
    windows: AtomicU64,
    registered_bytes: AtomicU64,
    register_ns: AtomicU64,
    dma_ns: AtomicU64,
    unregister_ns: AtomicU64,
}

struct Shared {
    copier: Arc<CudaCopier>,
    device: CudaDevice,
    config: FileWindowConfig,
    /// Why no job can take the route at all (device without read-only
    /// registration, or host pointers that are not device pointers).
    unusable: Option<String>,
    maps: Mutex<HashMap<u64, Arc<FileMap>>>,
    /// Per file system (`st_dev`): `None` if a page was page-locked, else
    /// the driver's refusal.
    verdicts: Mutex<HashMap<u64, Option<String>>>,
    counters: Counters,
    logged_refusal: AtomicBool,
    kept: Mutex<Kept>,
}

/// Windows kept registered between jobs, by (file id, window start).
#[derive(Default)]
struct Kept {
    windows: HashMap<(u64, u64), Arc<KeptWindow>>,
    bytes: u64,
    clock: u64,
}

/// A registered window of a file mapping. Field order matters: the
/// registration is released before the mapping it lies in.
struct KeptWindow {
    reg: Registration,
    len: u64,
    map: Arc<FileMap>,
    last_used: AtomicU64,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Kept registrations are released with the device's context current.
        let _ = self.device.bind();
        self.kept.lock().windows.clear();
    }
}

/// Buffered file → device memory with no CPU copy (see the module docs).
pub struct FileWindowRoute {
    shared: Arc<Shared>,
    pool: WorkerPool,
}

impl std::fmt::Debug for FileWindowRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileWindowRoute")
            .field("config", &self.shared.config)
            .field("unusable", &self.shared.unusable)
            .finish()
    }
}

impl FileWindowRoute {
    /// A route into `copier`'s device. It is built even where the device
    /// cannot take read-only registrations; it then declines every job,
    /// saying why.
    pub fn new(copier: Arc<CudaCopier>, config: FileWindowConfig) -> Result<Self, CudaError> {
        let device = copier.device().clone();
        let read_only = device
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED)
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute", e.0))?;
        let unusable = if read_only == 0 {
            Some("the device does not support read-only host registration".to_string())
        } else if !device.inner.host_ptr_is_device_ptr {
            Some("the device cannot use host pointers of registered memory".to_string())
        } else {
            None
        };
        let pool =
            WorkerPool::new("kvbm-fwin", config.workers.max(1)).map_err(|e| CudaError::Os {
                call: "thread spawn",
                source: Arc::new(e),
            })?;
        Ok(FileWindowRoute {
            shared: Arc::new(Shared {
                copier,
                device,
                config,
                unusable,
                maps: Mutex::new(HashMap::new()),
                verdicts: Mutex::new(HashMap::new()),
                counters: Counters::default(),
                logged_refusal: AtomicBool::new(false),
                kept: Mutex::new(Kept::default()),
            }),
            pool,
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &FileWindowConfig {
        &self.shared.config
    }

    /// The counters so far.
    pub fn stats(&self) -> FileWindowStats {
        let c = &self.shared.counters;
        FileWindowStats {
            windows: c.windows.load(Ordering::Relaxed),
            registered_bytes: c.registered_bytes.load(Ordering::Relaxed),
            register_ns: c.register_ns.load(Ordering::Relaxed),
            dma_ns: c.dma_ns.load(Ordering::Relaxed),
            unregister_ns: c.unregister_ns.load(Ordering::Relaxed),
            kept_hits: c.kept_hits.load(Ordering::Relaxed),
        }
    }

    /// Whether `file`'s file system lets the driver page-lock its pages
    /// (probed once per file system with one page): `None` if it does,
    /// else the refusal.
    pub fn registration_refusal(&self, file: &Arc<DiskFile>) -> Option<String> {
        self.shared.verdict(file)
    }
}

impl Shared {
    fn map(&self, file: &Arc<DiskFile>) -> Result<Arc<FileMap>, TransferError> {
        let mut maps = self.maps.lock();
        maps.retain(|_, m| m.file_alive());
        if let Some(m) = maps.get(&file.id()) {
            return Ok(m.clone());
        }
        let m = Arc::new(FileMap::new(file).map_err(|e| TransferError::Io {
            path: file.path().to_path_buf(),
            offset: 0,
            len: file.len(),
            source: e,
        })?);
        maps.insert(file.id(), m.clone());
        Ok(m)
    }

    fn verdict(&self, file: &Arc<DiskFile>) -> Option<String> {
        if let Some(u) = &self.unusable {
            return Some(u.clone());
        }
        let dev = file_system_id(file);
        // Held across the probe: two first jobs on one file must not
        // register its first page twice (the second would be refused).
        let mut verdicts = self.verdicts.lock();
        if let Some(v) = dev.and_then(|d| verdicts.get(&d).cloned()) {
            return v;
        }
        let verdict = self.probe(file).err();
        if let Some(reason) = &verdict
            && !self.logged_refusal.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                path = %file.path().display(),
                %reason,
                "page-locking a buffered file for the GPU's DMA was refused; page cache -> GPU takes the bounce pipeline"
            );
        }
        if let Some(d) = dev {
            verdicts.insert(d, verdict.clone());
        }
        verdict
    }

    /// Page-locks and releases one page of `file`.
    fn probe(&self, file: &Arc<DiskFile>) -> Result<(), String> {
        let map = self.map(file).map_err(|e| e.to_string())?;
        self.device.bind().map_err(|e| e.to_string())?;
        let len = map.len().min(4096);
        // SAFETY: the first `len` bytes of the mapping, which `map` keeps
        // alive until after the registration is dropped below.
        let reg = unsafe { register_read_only(&self.device, map.addr(), len) }
            .map_err(|e| e.to_string())?;
        drop(reg);
        Ok(())
    }

    /// Page-locks `w`, copies its runs into `dst`, waits, releases it.
    fn move_window(
        &self,
        w: &FileWindow,
        dst: &[Arc<dyn CudaRegion>],
    ) -> Result<(), TransferError> {
        let map = self.map(&w.file)?;
        let mapped = (map.len() as u64).div_ceil(4096) * 4096;
        if w.start.checked_add(w.len).is_none_or(|end| end > mapped) {
            return Err(TransferError::InvalidRequest(format!(
                "window {}+{} outside the {} bytes of {}",
                w.start,
                w.len,
                map.len(),
                w.file.path().display()
            )));
        }
        self.device.bind().map_err(to_transfer_error)?;
        let keep = self.config.keep_registered_bytes > 0;
        let t0 = Instant::now();
        let reg = if keep {
            // SAFETY: the window was checked to lie inside the mapping.
            Held::Kept(unsafe { self.kept_window(w, &map)? })
        } else {
            // SAFETY: the window was checked to lie inside the mapping,
            // which `map` keeps alive until after `reg` is dropped below.
            Held::Own(unsafe { self.register(w, map.addr() + w.start as usize)? })
        };
        let addr = reg.addr();
        let t1 = Instant::now();
        let window: Arc<dyn CudaRegion> = Arc::new(WindowRegion {
            addr: addr as u64,
            len: w.len as usize,
        });
        let moved = self
            .copier
            .copy(
                &w.runs,
                &[window],
                dst,
                CopyOptions {
                    path: self.config.path,
                    ..CopyOptions::default()
                },
            )
            .and_then(|done| done.wait());
        let t2 = Instant::now();
        // The copy has completed or failed with nothing in flight (the
        // copier drains its lane on an enqueue error): the device no longer
        // reads the window, which may be released now.
        drop(reg);
        if keep {
            self.evict(self.config.keep_registered_bytes);
        }
        let t3 = Instant::now();
        let c = &self.counters;
        let ns = |a: Instant, b: Instant| (b - a).as_nanos() as u64;
        c.windows.fetch_add(1, Ordering::Relaxed);
        c.register_ns.fetch_add(ns(t0, t1), Ordering::Relaxed);
        c.dma_ns.fetch_add(ns(t1, t2), Ordering::Relaxed);
        c.unregister_ns.fetch_add(ns(t2, t3), Ordering::Relaxed);
        drop(map);
        moved.map_err(to_transfer_error)
    }

    /// Page-locks `[addr, addr + w.len)`; a refusal is remembered for the
    /// file's file system (later jobs there take the bounce pipeline).
    ///
    /// # Safety
    /// `[addr, addr + w.len)` must lie inside a live read-only mapping of
    /// the file that outlives the registration.
    unsafe fn register(&self, w: &FileWindow, addr: usize) -> Result<Registration, TransferError> {
        // SAFETY: the caller's promise.
        let reg =
            unsafe { register_read_only(&self.device, addr, w.len as usize) }.map_err(|e| {
                if let Some(dev) = file_system_id(&w.file) {
                    self.verdicts.lock().insert(dev, Some(e.to_string()));
                }
                TransferError::Backend {
                    backend: "file-window",
                    message: format!(
                        "page-locking {} bytes {}+{} refused: {e}",
                        w.file.path().display(),
                        w.start,
                        w.len
                    ),
                }
            })?;
        self.counters
            .registered_bytes
            .fetch_add(w.len, Ordering::Relaxed);
        Ok(reg)
    }

    /// The kept registration of `w` (a fixed window), registering it if
    /// it is not kept yet. The lock is held while registering, so two
    /// workers never register one range twice.
    ///
    /// # Safety
    /// `w` must lie inside `map`.
    unsafe fn kept_window(
        &self,
        w: &FileWindow,
        map: &Arc<FileMap>,
    ) -> Result<Arc<KeptWindow>, TransferError> {
        let mut kept = self.kept.lock();
        kept.clock += 1;
        let now = kept.clock;
        if let Some(k) = kept.windows.get(&(w.file.id(), w.start)) {
            k.last_used.store(now, Ordering::Relaxed);
            self.counters.kept_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(k.clone());
        }
        // SAFETY: the window lies inside the mapping (the caller's promise);
        // the kept window holds `map` and drops the registration first
        // (field order).
        let reg = unsafe { self.register(w, map.addr() + w.start as usize)? };
        let k = Arc::new(KeptWindow {
            reg,
            len: w.len,
            map: map.clone(),
            last_used: AtomicU64::new(now),
        });
        kept.windows.insert((w.file.id(), w.start), k.clone());
        kept.bytes += w.len;
        Ok(k)
    }

    /// Releases kept windows no copy uses, those of closed files first,
    /// then the least recently used, until at most `budget` bytes are kept.
    fn evict(&self, budget: u64) {
        let mut kept = self.kept.lock();
        let dead: Vec<(u64, u64)> = kept
            .windows
            .iter()
            .filter(|(_, k)| !k.map.file_alive() && Arc::strong_count(k) == 1)
            .map(|(key, _)| *key)
            .collect();
        for key in dead {
            if let Some(k) = kept.windows.remove(&key) {
                kept.bytes -= k.len;
            }
        }
        while kept.bytes > budget {
            let Some(key) = kept
                .windows
                .iter()
                .filter(|(_, k)| Arc::strong_count(k) == 1)
                .min_by_key(|(_, k)| k.last_used.load(Ordering::Relaxed))
                .map(|(key, _)| *key)
            else {
                break;
            };
            if let Some(k) = kept.windows.remove(&key) {
                kept.bytes -= k.len;
            }
        }
    }

    fn device_regions(&self, job: &TransferJob) -> Result<Vec<Arc<dyn CudaRegion>>, TransferError> {
        let me = MemoryKind::Device(self.device.ordinal() as u32);
        job.regions(Side::Destination)
            .iter()
            .map(|r| {
                let addr = r.addr().filter(|_| r.kind() == me).ok_or_else(|| {
                    TransferError::InvalidRequest(format!(
                        "the file-window route writes {me:?} memory, not {:?}",
                        r.kind()
                    ))
                })?;
                Ok(Arc::new(JobRegion::new(r, addr, Location::Device)) as Arc<dyn CudaRegion>)
            })
            .collect()
    }
}

/// The file system a file lives on (`st_dev`).
fn file_system_id(file: &DiskFile) -> Option<u64> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: `raw_fd` is open while `file` lives; fstat fills `st`.
    let rc = unsafe { libc::fstat(file.raw_fd(), st.as_mut_ptr()) };
    // SAFETY: fstat succeeded, so `st` is initialised.
    (rc == 0).then(|| unsafe { st.assume_init() }.st_dev)
}

/// A page-locked range of a file mapping, released on drop.
type Registration = HostRegistration;

/// Page-locks `[addr, addr + len)` of a file mapping for the GPU to read.
///
/// # Safety
/// The range must lie inside a live read-only mapping that outlives the
/// registration.
unsafe fn register_read_only(
    device: &CudaDevice,
    addr: usize,
    len: usize,
) -> Result<Registration, CudaError> {
    let flags = sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: the caller's promise; the read-only flag matches the
    // mapping's protection.
    unsafe { HostRegistration::new(device, addr, len, flags) }
}

/// The registration a window's copy runs under.
enum Held {
    /// Registered for this copy only; released when dropped.
    Own(Registration),
    /// Kept between jobs; released by eviction.
    Kept(Arc<KeptWindow>),
}

impl Held {
    /// The window's first byte.
    fn addr(&self) -> usize {
        match self {
            Held::Own(r) => r.addr(),
            Held::Kept(k) => k.reg.addr(),
        }
    }
}

/// A registered file window as the copier sees it.
struct WindowRegion {
    addr: u64,
    len: usize,
}

impl CudaRegion for WindowRegion {
    fn device_ptr(&self) -> u64 {
        // The route refuses devices that cannot use host pointers of
        // registered memory, so the host address is the device address.
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> Location {
        Location::PinnedHost
    }
}

/// One job's windows in flight.
struct WindowJob {
    dst: Vec<Arc<dyn CudaRegion>>,
    cancel: CancelToken,
    parts: Countdown,
}

impl WindowJob {
    fn wanted(&self) -> bool {
        !self.parts.failed() && !self.cancel.is_cancelled()
    }
}

impl FileRoute for FileWindowRoute {
    fn name(&self) -> &'static str {
        "file-window"
    }

    fn refusal(&self, job: &TransferJob) -> Option<RouteRefusal> {
        let kind = |side| job.kind(side).unwrap_or(MemoryKind::System);
        let files: Vec<&Arc<DiskFile>> = job
            .regions(Side::Source)
            .iter()
            .filter_map(|r| r.file_location().map(|(f, _)| f))
            .collect();
        let mut facts = RouteFacts {
            src: kind(Side::Source),
            dst: kind(Side::Destination),
            serves_dst: MemoryKind::Device(self.shared.device.ordinal() as u32),
            direct_source: files.iter().any(|f| f.is_direct()),
            registration: None,
        };
        if let Some(r) = route_refusal(facts) {
            return Some(r);
        }
        let refused = files.iter().find_map(|f| self.shared.verdict(f));
        facts.registration = refused.as_deref();
        route_refusal(facts)
    }

    fn submit(&self, job: TransferJob) -> Completion {
        if job.cancel.is_cancelled() {
            return Completion::ready(Err(TransferError::Cancelled));
        }
        let cfg = &self.shared.config;
        let planned = if cfg.keep_registered_bytes > 0 {
            plan_fixed_windows(&job, cfg.window_bytes)
        } else {
            plan_windows(&job, cfg.window_bytes, cfg.max_gap)
        };
        let windows = match planned {
            Ok(w) => w,
            Err(e) => return Completion::ready(Err(e)),
        };
        if windows.is_empty() {
            return Completion::ready(Ok(()));
        }
        let dst = match self.shared.device_regions(&job) {
            Ok(d) => d,
            Err(e) => return Completion::ready(Err(e)),
        };
        let _span = tracing::debug_span!("file_window", windows = windows.len()).entered();
        let (completer, completion) = completion_pair();
        let state = Arc::new(WindowJob {
            dst,
            cancel: job.cancel.clone(),
            parts: Countdown::new(windows.len(), completer),
        });
        for w in windows {
            let (shared, state) = (self.shared.clone(), state.clone());
            self.pool.spawn(move || {
                let r = if state.wanted() {
                    shared.move_window(&w, &state.dst)
                } else {
                    Err(TransferError::Cancelled)
                };
                if let Err(e) = r {
                    state.parts.fail(e);
                }
                state.parts.settle();
            });
        }
        completion
    }
}
