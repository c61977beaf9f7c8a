//! Pinned host memory that is fast to get, and usable before it is all there.
//!
//! `cuMemHostAlloc` is slow for large sizes: the driver faults and pins
//! every page from one thread, so the caller waits for all of it before
//! using any. Here the memory is mapped with `mmap` (2 MiB aligned,
//! `MADV_HUGEPAGE` where allowed), first-touched by many threads at once
//! (bound to the GPU's NUMA node where the OS says which one), and then
//! registered with `cuMemHostRegister`, chunk by chunk: while the driver
//! registers chunk *k*, the threads already touch chunk *k+1*.
//! [`PinnedMemory::allocate_in_background`] returns as soon as the first
//! part is registered and pins the rest on a background thread;
//! [`PinnedMemory::pinned_len`] says how far it got, and copies are only
//! allowed into the pinned prefix. One thread registers: the driver takes
//! one registration at a time (threads registering parts of a chunk at once
//! spend more time inside the driver and finish no sooner; see
//! `docs/benchmarks.md`, "Pinned host memory"). [`PinnedMemory::stats`]
//! says where the time went (kvbm-bench's `pin_bench`).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;

use cudarc::driver::sys;

use super::device::CudaDevice;
use super::error::{CudaError, CudaResult};
use super::handles::HostRegistration;
use super::memory::{CudaRegion, Location, bounds};

const HUGE_PAGE: usize = 2 << 20;

/// Start and end addresses of every live host registration, sorted. A DMA
/// copy must not cross one of these (the driver refuses a copy spanning two
/// registrations), so the copy-engine paths split spans at them.
static BOUNDS: RwLock<Option<Arc<Vec<u64>>>> = RwLock::new(None);

/// A snapshot of the registration boundaries.
pub(crate) fn registration_bounds() -> Arc<Vec<u64>> {
    BOUNDS
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .unwrap_or_default()
}

fn update_bounds(f: impl FnOnce(&mut Vec<u64>)) {
    let mut guard = BOUNDS.write().unwrap_or_else(|p| p.into_inner());
    let mut v: Vec<u64> = guard.as_deref().cloned().unwrap_or_default();
    f(&mut v);
    v.sort_unstable();
    *guard = Some(Arc::new(v));
}
const PAGE: usize = 4096;

/// How [`PinnedMemory`] pins.
#[derive(Debug, Clone)]
pub struct PinnedOptions {
    /// Threads that first-touch pages (default: the CPUs available).
    pub touch_threads: usize,
    /// Ask for transparent huge pages (`MADV_HUGEPAGE`).
    pub huge_pages: bool,
    /// Bytes registered per `cuMemHostRegister` call (a multiple of 2 MiB).
    pub chunk_bytes: usize,
    /// Bind touching threads to this NUMA node (default: the GPU's).
    pub numa_node: Option<u32>,
}

impl PinnedOptions {
    /// Defaults for `device`: all CPUs, huge pages, 256 MiB chunks, the GPU's
    /// NUMA node.
    pub fn for_device(device: &CudaDevice) -> Self {
        PinnedOptions {
            touch_threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(4),
            huge_pages: true,
            chunk_bytes: 256 << 20,
            numa_node: device.numa_node(),
        }
    }
}

/// Where the time of a [`PinnedMemory`]'s pinning went, summed over its
/// chunks (touching and registering overlap, so the two can add up to
/// more than the wall time).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PinStats {
    /// Seconds spent first-touching pages (wall time of the touch phases).
    pub touch_s: f64,
    /// Seconds spent inside `cuMemHostRegister`, summed over calls.
    pub register_s: f64,
    /// Chunks registered so far.
    pub chunks: usize,
}

/// Page-locked host memory registered with one device, released on drop.
pub struct PinnedMemory {
    inner: Arc<Inner>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

struct Inner {
    device: CudaDevice,
    /// A caller's host buffer this memory pins in place (its bytes are
    /// kept); `None`: an anonymous mapping of our own.
    backing: Option<Arc<crate::memory::SystemBuffer>>,
    /// What mmap returned (before aligning), for munmap.
    raw: usize,
    ptr: *mut u8,
    len: usize,
    map_len: usize,
    opts: PinnedOptions,
    /// Bytes from the start that are registered (a prefix).
    pinned: AtomicUsize,
    /// Registered chunks, unregistered on drop (before the unmapping).
    chunks: Mutex<Vec<HostRegistration>>,
    stop: AtomicBool,
    failure: Mutex<Option<CudaError>>,
    progress: Condvar,
    progress_lock: Mutex<()>,
    stats: Mutex<PinStats>,
}

// SAFETY: `ptr` is a private anonymous mapping owned by `Inner`, or a
// caller's buffer `Inner` holds; all access to its bytes goes through
// raw-pointer copies, and bookkeeping is atomic or behind mutexes.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl std::fmt::Debug for PinnedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedMemory")
            .field("ptr", &self.inner.ptr)
            .field("len", &self.inner.len)
            .field("pinned", &self.pinned_len())
            .finish()
    }
}

impl PinnedMemory {
    /// Maps and pins `len` bytes; returns when all are pinned.
    pub fn allocate(device: &CudaDevice, len: usize, opts: PinnedOptions) -> CudaResult<Self> {
        let inner = Arc::new(Inner::map(device, len, opts)?);
        inner.pin_range(0, len)?;
        Ok(PinnedMemory {
            inner,
            worker: Mutex::new(None),
        })
    }

    /// Pins `buffer` in place, keeping its bytes (a host tier mapped from a
    /// file that outlives the process, found again after a restart);
    /// returns when all of it is pinned. The pinned memory keeps the buffer
    /// alive.
    pub fn register(
        device: &CudaDevice,
        buffer: Arc<crate::memory::SystemBuffer>,
        opts: PinnedOptions,
    ) -> CudaResult<Self> {
        let inner = Arc::new(Inner::over(device, buffer, opts)?);
        inner.pin_range(0, inner.len)?;
        Ok(PinnedMemory {
            inner,
            worker: Mutex::new(None),
        })
    }

    /// Maps `len` bytes, pins the first `first_bytes` before returning and
    /// the rest on a background thread. Copies may use the pinned prefix
    /// ([`PinnedMemory::pinned_len`]) at once.
    pub fn allocate_in_background(
        device: &CudaDevice,
        len: usize,
        first_bytes: usize,
        opts: PinnedOptions,
    ) -> CudaResult<Self> {
        let inner = Arc::new(Inner::map(device, len, opts)?);
        let first = round_up(first_bytes.min(len), inner.opts.chunk_bytes).min(len);
        inner.pin_range(0, first)?;
        let worker = if first < len {
            let bg = Arc::clone(&inner);
            let handle = std::thread::Builder::new()
                .name("kvbm-pin".into())
                .spawn(move || {
                    if let Err(e) = bg.pin_range(first, bg.len) {
                        *lock(&bg.failure) = Some(e);
                        bg.notify();
                    }
                })
                .map_err(|e| CudaError::Os {
                    call: "thread spawn",
                    source: Arc::new(e),
                })?;
            Some(handle)
        } else {
            None
        };
        Ok(PinnedMemory {
            inner,
            worker: Mutex::new(worker),
        })
    }

    /// Total bytes mapped (pinned or still being pinned).
    pub fn capacity(&self) -> usize {
        self.inner.len
    }

    /// Bytes from the start that are pinned and usable by copies.
    pub fn pinned_len(&self) -> usize {
        self.inner.pinned.load(Ordering::Acquire)
    }

    /// Where the pinning time went so far (touch vs registration).
    pub fn stats(&self) -> PinStats {
        *lock(&self.inner.stats)
    }

    /// Blocks until at least `bytes` are pinned (or pinning failed).
    pub fn wait_pinned(&self, bytes: usize) -> CudaResult<()> {
        let bytes = bytes.min(self.inner.len);
        let mut guard = lock(&self.inner.progress_lock);
        loop {
            if let Some(e) = lock(&self.inner.failure).clone() {
                return Err(e);
            }
            if self.pinned_len() >= bytes {
                return Ok(());
            }
            guard = self
                .inner
                .progress
                .wait(guard)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// The host address of byte 0.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.ptr
    }

    /// Copies `data` into the memory at `offset` (CPU copy).
    pub fn write(&self, offset: usize, data: &[u8]) -> CudaResult<()> {
        bounds(offset, data.len(), self.inner.len)?;
        // SAFETY: bounds-checked against the mapping; the source is a valid
        // slice that cannot overlap our private mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.inner.ptr.add(offset), data.len())
        };
        Ok(())
    }

    /// Copies bytes at `offset` into `out` (CPU copy).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> CudaResult<()> {
        bounds(offset, out.len(), self.inner.len)?;
        // SAFETY: as in `write`, in the other direction.
        unsafe {
            std::ptr::copy_nonoverlapping(self.inner.ptr.add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }
}

impl CudaRegion for PinnedMemory {
    fn device_ptr(&self) -> u64 {
        // The device checked CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM at map
        // time, so the host address is the device address.
        self.inner.ptr as u64
    }
    fn len(&self) -> usize {
        self.pinned_len()
    }
    fn location(&self) -> Location {
        Location::PinnedHost
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        if let Some(handle) = lock(&self.worker).take() {
            let _ = handle.join();
        }
    }
}

impl Inner {
    fn map(device: &CudaDevice, len: usize, opts: PinnedOptions) -> CudaResult<Self> {
        if len == 0 {
            return Err(CudaError::Pinning {
                bytes: 0,
                reason: "zero-length allocation".into(),
            });
        }
        if !device.inner.host_ptr_is_device_ptr {
            return Err(CudaError::Pinning {
                bytes: len,
                reason: "the device cannot use host pointers of registered memory".into(),
            });
        }
        let map_len = round_up(len, HUGE_PAGE) + HUGE_PAGE;
        // SAFETY: anonymous private mapping with no address hint; the result
        // is checked against MAP_FAILED.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            let err = std::io::Error::last_os_error();
            return Err(CudaError::Pinning {
                bytes: len,
                reason: format!("mmap of {map_len} bytes: {err}"),
            });
        }
        // Align the start to 2 MiB so huge pages can back it; the slack stays
        // mapped and is unmapped with the rest on drop.
        let start = round_up(raw as usize, HUGE_PAGE);
        let ptr = start as *mut u8;
        if opts.huge_pages {
            // SAFETY: the range lies inside the mapping just created; madvise
            // only changes paging policy. Failure (THP disabled) is harmless.
            unsafe {
                libc::madvise(
                    ptr.cast::<c_void>(),
                    round_up(len, HUGE_PAGE),
                    libc::MADV_HUGEPAGE,
                )
            };
        }
        Ok(Inner::new(
            device,
            None,
            (raw as usize, map_len),
            ptr,
            len,
            opts,
        ))
    }

    /// Memory at `ptr` of `len` bytes, nothing pinned yet: our mapping
    /// (`raw`, `map_len` as mmap gave them) or a caller's `backing`.
    fn new(
        device: &CudaDevice,
        backing: Option<Arc<crate::memory::SystemBuffer>>,
        (raw, map_len): (usize, usize),
        ptr: *mut u8,
        len: usize,
        opts: PinnedOptions,
    ) -> Self {
        Inner {
            device: device.clone(),
            backing,
            raw,
            ptr,
            len,
            map_len,
            opts: PinnedOptions {
                chunk_bytes: round_up(opts.chunk_bytes.max(HUGE_PAGE), HUGE_PAGE),
                touch_threads: opts.touch_threads.max(1),
                ..opts
            },
            pinned: AtomicUsize::new(0),
            chunks: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            failure: Mutex::new(None),
            progress: Condvar::new(),
            progress_lock: Mutex::new(()),
            stats: Mutex::new(PinStats::default()),
        }
    }

    /// Pins `buffer` where it is (see [`PinnedMemory::register`]).
    fn over(
        device: &CudaDevice,
        buffer: Arc<crate::memory::SystemBuffer>,
        opts: PinnedOptions,
    ) -> CudaResult<Self> {
        if !device.inner.host_ptr_is_device_ptr {
            return Err(CudaError::Pinning {
                bytes: buffer.len() as usize,
                reason: "the device cannot use host pointers of registered memory".into(),
            });
        }
        let (ptr, len) = (buffer.addr() as *mut u8, buffer.len() as usize);
        Ok(Inner::new(device, Some(buffer), (0, 0), ptr, len, opts))
    }

    fn notify(&self) {
        let _guard = lock(&self.progress_lock);
        self.progress.notify_all();
    }

    /// Touches and registers `[from, to)`, chunk by chunk, touching the next
    /// chunk while the current one registers.
    fn pin_range(&self, from: usize, to: usize) -> CudaResult<()> {
        self.device.bind()?;
        let chunk = self.opts.chunk_bytes;
        let mut chunks = Vec::new();
        let mut at = from;
        while at < to {
            let end = (at + chunk).min(to);
            chunks.push((at, end));
            at = end;
        }
        let Some(&first) = chunks.first() else {
            return Ok(());
        };
        self.touch(first.0, first.1);
        for i in 0..chunks.len() {
            if self.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            let (a, b) = chunks[i];
            let next = chunks.get(i + 1).copied();
            let result = std::thread::scope(|s| {
                let toucher = next.map(|(na, nb)| s.spawn(move || self.touch(na, nb)));
                let r = self.register(a, b);
                if let Some(t) = toucher {
                    let _ = t.join();
                }
                r
            });
            result?;
            self.pinned.store(b, Ordering::Release);
            self.notify();
        }
        Ok(())
    }

    fn register(&self, a: usize, b: usize) -> CudaResult<()> {
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        let started = std::time::Instant::now();
        // SAFETY: [a, b) lies inside our mapping, registered once (chunks
        // do not overlap), and the mapping outlives the registration: Drop
        // unregisters every chunk before munmap.
        let reg =
            unsafe { HostRegistration::new(&self.device, self.ptr as usize + a, b - a, flags) };
        {
            let mut st = lock(&self.stats);
            st.register_s += started.elapsed().as_secs_f64();
            st.chunks += usize::from(reg.is_ok());
        }
        let reg = reg.map_err(|err| CudaError::Pinning {
            bytes: b - a,
            reason: err.to_string(),
        })?;
        lock(&self.chunks).push(reg);
        let base = self.ptr as u64;
        update_bounds(|v| v.extend([base + a as u64, base + b as u64]));
        Ok(())
    }

    /// Writes one byte per 4 KiB page of `[a, b)` from several threads.
    fn touch(&self, a: usize, b: usize) {
        let started = std::time::Instant::now();
        let threads = self.opts.touch_threads;
        let per = round_up((b - a).div_ceil(threads), HUGE_PAGE);
        let cpus = self.opts.numa_node.and_then(node_cpus);
        let base = self.ptr as usize;
        let keep = self.backing.is_some();
        std::thread::scope(|s| {
            let mut start = a;
            while start < b {
                let end = (start + per).min(b);
                let cpus = cpus.clone();
                s.spawn(move || {
                    if let Some(cpus) = cpus {
                        bind_to_cpus(&cpus);
                    }
                    let mut off = start;
                    while off < end {
                        let p = (base + off) as *mut u8;
                        // SAFETY: `off` lies in [a, b), inside our mapping
                        // (or the caller's buffer, which we hold); nobody
                        // copies through it before it is pinned. A caller's
                        // byte is written back as read, so its contents
                        // stay.
                        unsafe { p.write_volatile(if keep { p.read_volatile() } else { 0 }) };
                        off += PAGE;
                    }
                });
                start = end;
            }
        });
        lock(&self.stats).touch_s += started.elapsed().as_secs_f64();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let chunks = std::mem::take(&mut *lock(&self.chunks));
        update_bounds(|v| {
            for r in &chunks {
                for edge in [r.addr() as u64, (r.addr() + r.len()) as u64] {
                    if let Some(i) = v.iter().position(|&x| x == edge) {
                        v.swap_remove(i);
                    }
                }
            }
        });
        // Unregistered before the mapping goes; no copy holds the memory
        // any more (copies hold an Arc).
        drop(chunks);
        if self.backing.is_none() {
            // SAFETY: `raw`/`map_len` are exactly what mmap returned in `map`.
            unsafe { libc::munmap(self.raw as *mut c_void, self.map_len) };
        }
    }
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The CPUs of NUMA node `node`, from sysfs (`0-15,32-47`).
fn node_cpus(node: u32) -> Option<Vec<usize>> {
    let list =
        std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist")).ok()?;
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((lo, hi)) => cpus.extend(lo.parse::<usize>().ok()?..=hi.parse::<usize>().ok()?),
            None => cpus.push(part.parse().ok()?),
        }
    }
    (!cpus.is_empty()).then_some(cpus)
}

fn bind_to_cpus(cpus: &[usize]) {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes inside it for indices
    // below CPU_SETSIZE, which we check; sched_setaffinity(0) affects only
    // the calling thread and its failure is harmless.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}
