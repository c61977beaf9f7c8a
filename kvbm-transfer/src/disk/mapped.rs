//! The mapped engine: reads of page-cached files copied out of a mapping.
//!
//! A read of a buffered file is a CPU copy out of the page cache, and in a
//! bounce pipeline (page cache → pinned slot → GPU) that copy shares DRAM
//! with the device's DMA read of the slots. Three things decide how fast
//! the pair runs together (measured in `docs/benchmarks.md`, "Disk to GPU:
//! bounce pipeline and file-window route"), and this engine owns all three
//! instead of leaving them to the kernel's `copy_to_user`:
//!
//! - **Copy threads sized to the machine.** One thread's copy waits on
//!   memory latency, so the hop needs several; but past about half the
//!   cores the copies flood DRAM, the DMA loses arbitration (each chunk's
//!   DMA takes many times as long) and the pipeline falls far below the two
//!   hops run one after the other. The default
//!   ([`BufferedIo::resolve`](super::BufferedIo::resolve)) takes half.
//! - **Prefetch across page boundaries.** The page cache is 4 KiB pages
//!   scattered in physical memory; the hardware prefetcher stops at each
//!   boundary, so the copy prefetches the source 4 KiB ahead into L2.
//! - **Where the stores go.** Non-temporal stores (the default) write
//!   each destination line without reading it first (no read for
//!   ownership), so each destination byte crosses the memory bus once
//!   rather than twice and a read of a page-cached file into host memory
//!   runs faster than with ordinary stores. In
//!   a bounce pipeline ordinary stores keep the few, reused slots in the
//!   last-level cache, where the device's read finds them, and the copy
//!   then slows down hardly at all while the DMA runs; but it starts
//!   slower, and the pipeline as a whole usually moves more with
//!   non-temporal stores. [`MappedEngine::new`] takes either.
//!
//! One read-only shared mapping per buffered file is kept while the file
//! lives (dropped files are unmapped at the next submission). Before each
//! copy the range is faulted in with `MADV_POPULATE_READ`, which reports a
//! failed read-in (an I/O error, a truncated file) as an error instead of a
//! `SIGBUS`; any such failure, and every write, goes through plain
//! `pread`/`pwrite`, which report the OS error the usual way. A page
//! reclaimed between the populate and the copy is read in again by the
//! fault itself, and only an I/O error at that exact moment would still
//! raise `SIGBUS` — for files the page cache already holds, the case this
//! engine is for, it does not happen.
//!
//! `O_DIRECT` files never come here: the engine router sends them to
//! io_uring, where the device does the copy.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::Mutex;

use super::engine::{IoDir, IoEngine, IoOp, cancelled};
use super::pread::positional_io;
use crate::error::Result;
use crate::memory::DiskFile;
use crate::pool::WorkerPool;

/// One file's read-only shared mapping (also what the CUDA file-window
/// route page-locks windows of).
pub(crate) struct FileMap {
    addr: usize,
    len: usize,
    /// Dropped files are unmapped at the next submission.
    file: Weak<DiskFile>,
}

impl FileMap {
    /// Maps all of `file` read-only and shared.
    pub(crate) fn new(file: &Arc<DiskFile>) -> io::Result<Self> {
        let len = file.len() as usize;
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: a fresh read-only shared mapping of a descriptor the
        // `DiskFile` keeps open; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(FileMap {
            addr: p as usize,
            len,
            file: Arc::downgrade(file),
        })
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl FileMap {
    /// Address of the file's byte 0.
    pub(crate) fn addr(&self) -> usize {
        self.addr
    }

    /// Bytes mapped (the file's length).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the file is still open somewhere.
    pub(crate) fn file_alive(&self) -> bool {
        self.file.strong_count() > 0
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made; no copy uses it any
        // more, since copies hold an `Arc<FileMap>`.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

struct Shared {
    maps: Mutex<HashMap<u64, Arc<FileMap>>>,
    streaming: bool,
    /// Cleared when the kernel refuses `MADV_POPULATE_READ` (before 5.14):
    /// without it a failed read-in would be a `SIGBUS`, so every read then
    /// goes through `pread`.
    populate_works: AtomicBool,
}

impl Shared {
    fn map(&self, file: &Arc<DiskFile>) -> Option<Arc<FileMap>> {
        if let Some(m) = self.maps.lock().get(&file.id()) {
            return Some(m.clone());
        }
        // Mapping is a syscall but no I/O (pages are faulted in per
        // request); two workers racing here map twice and keep one.
        match FileMap::new(file) {
            Ok(m) => Some(
                self.maps
                    .lock()
                    .entry(file.id())
                    .or_insert_with(|| Arc::new(m))
                    .clone(),
            ),
            Err(e) => {
                tracing::debug!(error = %e, path = %file.path().display(), "mapping failed; using pread");
                None
            }
        }
    }

    /// Reads `op` by copying out of the file's mapping; `None` when the
    /// request has to go through `pread` instead.
    fn mapped_read(&self, op: &IoOp) -> Option<usize> {
        if !self.populate_works.load(Ordering::Relaxed) || op.file.is_direct() {
            return None;
        }
        let map = self.map(&op.file)?;
        let (off, len) = (op.file_offset as usize, op.len as usize);
        if off.checked_add(len)? > map.len {
            return None;
        }
        let src = map.addr + off;
        // SAFETY: advice on a range inside our live mapping; it only faults
        // pages in (reading them from disk if needed) and reports failure.
        let rc = unsafe { libc::madvise(src as *mut libc::c_void, len, libc::MADV_POPULATE_READ) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) {
                tracing::warn!("MADV_POPULATE_READ unsupported; buffered reads use pread");
                self.populate_works.store(false, Ordering::Relaxed);
            }
            return None;
        }
        // SAFETY: the source range lies inside the live mapping (checked
        // above) and is populated; the destination is the caller's buffer,
        // valid and reserved for this operation (`IoEngine::submit`), and a
        // shared file mapping never overlaps it.
        unsafe { copy_out(src as *const u8, op.addr as *mut u8, len, self.streaming) };
        Some(len)
    }

    fn prune(&self) {
        self.maps.lock().retain(|_, m| m.file.strong_count() > 0);
    }
}

/// Buffered-file I/O on worker threads: reads copied out of a mapping of
/// the file, writes through `pwrite`.
///
/// The threads start at the first submission, not with the engine: every
/// disk backend on a machine of 4 or more CPUs has this engine, and most
/// never see a buffered file.
pub struct MappedEngine {
    shared: Arc<Shared>,
    threads: usize,
    /// `None` inside when the threads could not be started: requests then
    /// run on the submitting thread.
    pool: OnceLock<Option<WorkerPool>>,
}

impl MappedEngine {
    /// An engine with `threads` copy workers (started on first use);
    /// `streaming` selects non-temporal stores for the copies (for large
    /// destinations not read again soon; ordinary stores suit bounce
    /// slots).
    pub fn new(threads: usize, streaming: bool) -> Result<Self> {
        Ok(MappedEngine {
            shared: Arc::new(Shared {
                maps: Mutex::new(HashMap::new()),
                streaming,
                populate_works: AtomicBool::new(true),
            }),
            threads: threads.max(1),
            pool: OnceLock::new(),
        })
    }

    /// Number of copy workers.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Whether the copy workers have been started (by a first request).
    pub fn started(&self) -> bool {
        self.pool.get().is_some()
    }

    fn pool(&self) -> Option<&WorkerPool> {
        self.pool
            .get_or_init(|| match WorkerPool::new("kvbm-mapped", self.threads) {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!(error = %e, "mapped-copy worker threads could not start; buffered requests run on the submitting thread");
                    None
                }
            })
            .as_ref()
    }
}

/// One request, on whichever thread runs it.
fn run_op(shared: &Shared, op: IoOp) {
    let result = if !op.sink.wanted() {
        Err(cancelled())
    } else if op.dir == IoDir::Read {
        match shared.mapped_read(&op) {
            Some(n) => Ok(n),
            None => positional_io(&op),
        }
    } else {
        positional_io(&op)
    };
    op.sink.complete(op.token, result);
}

impl IoEngine for MappedEngine {
    fn name(&self) -> &'static str {
        "mapped"
    }

    fn submit(&self, ops: Vec<IoOp>) {
        self.shared.prune();
        let Some(pool) = self.pool() else {
            for op in ops {
                run_op(&self.shared, op);
            }
            return;
        };
        for op in ops {
            let shared = self.shared.clone();
            pool.spawn(move || run_op(&shared, op));
        }
    }
}

/// How far ahead of the loads the copy prefetches the source, into L2.
/// The page cache is 4 KiB pages scattered in physical memory, and the
/// hardware prefetcher stops at every page boundary, so without help each
/// thread's copy waits on memory latency. A whole page ahead reaches past
/// the boundary the hardware stops at, and L2 holds a page without
/// evicting the lines being copied from L1; the memcpy backend's short
/// prefetch into L1 does neither and copied page-cache data no faster than
/// no software prefetch at all.
const PREFETCH_AHEAD: usize = 4096;

/// Copies `len` bytes out of a file mapping: 64 bytes per step, the
/// source prefetched [`PREFETCH_AHEAD`] into L2, the destination written
/// with non-temporal stores when `streaming` (followed by a store fence),
/// ordinary stores otherwise.
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes, not overlapping.
unsafe fn copy_out(src: *const u8, dst: *mut u8, len: usize, streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{
            __m128i, _MM_HINT_T1, _mm_loadu_si128, _mm_prefetch, _mm_sfence, _mm_storeu_si128,
            _mm_stream_si128,
        };
        // Non-temporal stores need 16-byte aligned addresses; disk I/O
        // buffers are 4 KiB aligned, but stay correct for any address.
        let streaming = streaming && dst.align_offset(16) == 0;
        let mut off = 0;
        while off + 64 <= len {
            // SAFETY: 64 bytes at `off` are inside both ranges; prefetching
            // past the end of the source never faults; stream stores go to
            // 16-byte aligned addresses (checked above).
            unsafe {
                let s = src.add(off);
                _mm_prefetch::<_MM_HINT_T1>(s.wrapping_add(PREFETCH_AHEAD).cast::<i8>());
                let v = [
                    _mm_loadu_si128(s.cast::<__m128i>()),
                    _mm_loadu_si128(s.add(16).cast::<__m128i>()),
                    _mm_loadu_si128(s.add(32).cast::<__m128i>()),
                    _mm_loadu_si128(s.add(48).cast::<__m128i>()),
                ];
                let d = dst.add(off).cast::<__m128i>();
                for (i, x) in v.into_iter().enumerate() {
                    if streaming {
                        _mm_stream_si128(d.add(i), x);
                    } else {
                        _mm_storeu_si128(d.add(i), x);
                    }
                }
            }
            off += 64;
        }
        // SAFETY: the remaining `len - off < 64` bytes are in both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), len - off) };
        if streaming {
            // SAFETY: `sfence` has no preconditions (SSE is baseline on
            // x86_64); it orders the stream stores before the completion.
            unsafe { _mm_sfence() };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = streaming;
        // SAFETY: forwarded from the caller.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    }
}
