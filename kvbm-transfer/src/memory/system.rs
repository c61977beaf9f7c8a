//! System (pageable host) memory: page-aligned anonymous mappings.
//!
//! Anonymous `mmap` gives page alignment (so buffers can serve O_DIRECT disk
//! I/O) and a way to ask for huge pages, which cut TLB misses on large KV
//! pools and make pinning cheaper later.

use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};

use super::{MemoryKind, MemoryRegion};
use crate::error::{Result, TransferError};

/// Whether to back allocations with huge pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugePages {
    /// Normal 4 KiB pages.
    #[default]
    Off,
    /// Ask for transparent huge pages (`madvise(MADV_HUGEPAGE)`); the kernel
    /// may or may not honour it.
    Transparent,
    /// Explicit 2 MiB huge pages (`MAP_HUGETLB`); falls back to transparent
    /// huge pages with a warning when the system has none reserved.
    Explicit,
}

/// Allocates page-aligned system memory.
#[derive(Debug, Clone, Default)]
pub struct SystemAllocator {
    huge_pages: HugePages,
    populate: bool,
}

impl SystemAllocator {
    /// An allocator with 4 KiB pages that does not pre-fault.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the huge-page policy.
    pub fn huge_pages(mut self, policy: HugePages) -> Self {
        self.huge_pages = policy;
        self
    }

    /// Pre-faults every page at allocation (`MAP_POPULATE`), so the first
    /// transfer does not pay for page faults.
    pub fn populate(mut self, yes: bool) -> Self {
        self.populate = yes;
        self
    }

    /// Allocates `len` bytes, zero-filled, page-aligned.
    pub fn allocate(&self, len: u64) -> Result<Arc<SystemBuffer>> {
        let size = usize::try_from(len)
            .ok()
            .filter(|&s| s > 0)
            .ok_or_else(|| {
                TransferError::InvalidRequest(format!(
                    "cannot allocate {len} bytes of system memory"
                ))
            })?;
        let alloc_err = |source| TransferError::Alloc {
            what: format!("{size} bytes of system memory"),
            source,
        };
        let mut opts = MmapOptions::new();
        opts.len(size);
        // Pre-faulting at map time would pick small pages before the
        // huge-page advice is given; with huge pages, populate afterwards.
        if self.populate && self.huge_pages == HugePages::Off {
            opts.populate();
        }
        let map = match self.huge_pages {
            HugePages::Explicit => {
                let mut huge = opts.clone();
                huge.huge(None);
                match huge.map_anon() {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!(error = %e, "explicit huge pages unavailable; using transparent huge pages");
                        let m = opts.map_anon().map_err(alloc_err)?;
                        advise_huge(&m);
                        m
                    }
                }
            }
            HugePages::Transparent => {
                let m = opts.map_anon().map_err(alloc_err)?;
                advise_huge(&m);
                m
            }
            HugePages::Off => opts.map_anon().map_err(alloc_err)?,
        };
        if self.populate && self.huge_pages != HugePages::Off {
            populate_write(&map);
        }
        Ok(Arc::new(SystemBuffer { map }))
    }
}

impl SystemBuffer {
    /// Maps the first `len` bytes of `file` shared (`MAP_SHARED`): what is
    /// written through the buffer is the file's, so a file in a
    /// memory-backed file system (`/dev/shm`) keeps host memory past the
    /// process. The file must be at least `len` bytes long. Pages are
    /// faulted in on first use (pinning touches them from many threads at
    /// once).
    pub fn map_shared(file: &std::fs::File, len: u64) -> Result<Arc<SystemBuffer>> {
        let size = usize::try_from(len)
            .ok()
            .filter(|&s| s > 0)
            .ok_or_else(|| {
                TransferError::InvalidRequest(format!("cannot map {len} bytes of a file"))
            })?;
        let file_len = file
            .metadata()
            .map_err(|source| TransferError::Alloc {
                what: "the length of a file to map".into(),
                source,
            })?
            .len();
        if file_len < len {
            return Err(TransferError::InvalidRequest(format!(
                "a file of {file_len} bytes cannot back {len} bytes of memory"
            )));
        }
        // SAFETY: the mapping is shared with the file by design; the caller
        // owns the file (a store holding its directory's lock), so no other
        // process writes it while this mapping lives, and every access to
        // the bytes goes through transfers and the unsafe views below.
        let map = unsafe { MmapOptions::new().len(size).map_mut(file) }.map_err(|source| {
            TransferError::Alloc {
                what: format!("a shared mapping of {size} bytes"),
                source,
            }
        })?;
        advise_huge_quietly(&map);
        Ok(Arc::new(SystemBuffer { map }))
    }
}

/// Asks for huge pages where the file system allows it (a `/dev/shm`
/// mounted `huge=advise`), saying nothing where it does not.
fn advise_huge_quietly(map: &MmapMut) {
    let _ = map.advise(memmap2::Advice::HugePage);
}

/// Faults every page in for writing (`MADV_POPULATE_WRITE`, Linux 5.14+),
/// or by touching one byte per page where the kernel lacks it.
fn populate_write(map: &MmapMut) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    // SAFETY: the range is exactly our live mapping; the advice only faults
    // pages in and does not change their contents.
    let rc = unsafe {
        libc::madvise(
            map.as_ptr() as *mut libc::c_void,
            map.len(),
            MADV_POPULATE_WRITE,
        )
    };
    if rc != 0 {
        let base = map.as_ptr() as *mut u8;
        for off in (0..map.len()).step_by(4096) {
            // SAFETY: `off < len`; the mapping is fresh, zeroed, writable and
            // not yet shared, so writing a zero is unobservable.
            unsafe { base.add(off).write_volatile(0) };
        }
    }
}

fn advise_huge(map: &MmapMut) {
    if let Err(e) = map.advise(memmap2::Advice::HugePage) {
        tracing::warn!(error = %e, "madvise(MADV_HUGEPAGE) refused");
    }
}

/// A page-aligned block of system memory. Dropping the last handle (and the
/// last region made from it) unmaps it.
#[derive(Debug)]
pub struct SystemBuffer {
    map: MmapMut,
}

impl SystemBuffer {
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Always false: empty buffers are refused at allocation.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Its start address.
    pub fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    /// A region covering the whole buffer; it keeps the buffer alive.
    pub fn region(self: &Arc<Self>) -> MemoryRegion {
        // SAFETY: the mapping is valid, readable and writable for its whole
        // length, and the region holds an `Arc` to it, so it stays mapped as
        // long as the region (or any clone) exists.
        unsafe {
            MemoryRegion::from_raw(
                self.addr(),
                self.len(),
                MemoryKind::System,
                Some(self.clone()),
            )
        }
    }

    /// Views the bytes.
    ///
    /// # Safety
    /// No transfer may be writing this buffer while the slice is alive.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is valid for `len` bytes; the caller promises
        // no concurrent writer.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr(), self.map.len()) }
    }

    /// Views the bytes mutably.
    ///
    /// # Safety
    /// No transfer may be reading or writing this buffer, and no other slice
    /// of it may be alive, while the returned slice is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: the mapping is valid and writable for `len` bytes; the
        // caller promises exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr() as *mut u8, self.map.len()) }
    }
}
