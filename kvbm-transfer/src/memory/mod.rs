//! Memory regions: one description for every place bytes can live.
//!
//! A [`MemoryRegion`] is an address range (system, pinned or device memory —
//! device pointers are plain `u64` addresses) or a byte range of a disk file,
//! with its [`MemoryKind`]. Backends only ever see regions; allocators make
//! them and keep the memory alive through the region's owner handle, so a
//! region can never outlive what it points at.
//!
//! Pinned and device memory are provided by the CUDA backend; without it,
//! asking for them is an error value ([`TransferError::MemoryUnavailable`]).

mod disk;
mod engine;
mod reserve;
mod stale;
mod system;

use std::any::Any;
use std::fmt;
use std::sync::Arc;

pub use disk::{DISK_ALIGNMENT, DiskAllocator, DiskFile, DiskOptions, IoMode};
pub use engine::{EngineKvCache, EngineTensor};
pub use reserve::FsType;
pub use stale::{
    FILE_EXTENSION, FILE_PREFIX, file_owner, process_alive, remove_stale_files, try_lock_exclusive,
};
pub use system::{HugePages, SystemAllocator, SystemBuffer};

use crate::error::{Result, TransferError};

/// Allocates `len` bytes of `kind` memory with default settings.
///
/// System memory is always available. Pinned and device memory are provided
/// by the CUDA backend (feature `cuda`); without it, asking for them is
/// [`TransferError::MemoryUnavailable`], never a panic. Disk regions come
/// from a [`DiskAllocator`], which needs a directory.
pub fn allocate(kind: MemoryKind, len: u64) -> Result<MemoryRegion> {
    match kind {
        MemoryKind::System => Ok(SystemAllocator::new().allocate(len)?.region()),
        MemoryKind::Pinned | MemoryKind::Device(_) => Err(TransferError::MemoryUnavailable {
            kind,
            reason: "pinned and device memory come with the CUDA backend (feature `cuda`)",
        }),
        MemoryKind::Disk => Err(TransferError::MemoryUnavailable {
            kind,
            reason: "disk regions are allocated by a DiskAllocator in a configured directory",
        }),
    }
}

/// Where a region lives. Transfer strategies are chosen by the kinds of the
/// source and destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary (pageable) host memory.
    System,
    /// Page-locked host memory, DMA-capable.
    Pinned,
    /// GPU memory of the given CUDA device ordinal.
    Device(u32),
    /// A byte range of a file on local disk.
    Disk,
}

impl MemoryKind {
    /// True for memory the CPU can read and write through a pointer
    /// (`System` and `Pinned`).
    pub fn is_host(self) -> bool {
        matches!(self, MemoryKind::System | MemoryKind::Pinned)
    }
}

/// The start of a region: an address, or an offset in a file.
#[derive(Clone)]
pub enum Location {
    /// An address in host or device address space.
    Address(u64),
    /// A byte offset within a disk file.
    File {
        /// The backing file.
        file: Arc<DiskFile>,
        /// Where the region starts in the file.
        offset: u64,
    },
}

impl fmt::Debug for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Address(a) => write!(f, "Address({a:#x})"),
            Location::File { file, offset } => {
                write!(f, "File({}, offset {offset})", file.path().display())
            }
        }
    }
}

/// Keeps the memory behind a region alive.
pub type Owner = Arc<dyn Any + Send + Sync>;

/// A contiguous range of memory or of a file, of one kind.
///
/// Cloning is cheap and shares the owner: the memory stays valid while any
/// clone exists.
#[derive(Clone)]
pub struct MemoryRegion {
    location: Location,
    len: u64,
    kind: MemoryKind,
    owner: Option<Owner>,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("location", &self.location)
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish()
    }
}

impl MemoryRegion {
    /// Describes memory that somebody else owns (an engine's KV tensors, a
    /// CUDA allocation) by address.
    ///
    /// `owner`, when given, is kept alive as long as the region.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be valid memory of `kind`, readable and
    /// writable, for as long as this region or any clone of it exists (the
    /// `owner` may guarantee that), and nothing else may access the bytes a
    /// transfer touches while it runs. `kind` must not be `Disk`.
    pub unsafe fn from_raw(addr: u64, len: u64, kind: MemoryKind, owner: Option<Owner>) -> Self {
        debug_assert!(kind != MemoryKind::Disk, "disk regions are made from files");
        MemoryRegion {
            location: Location::Address(addr),
            len,
            kind,
            owner,
        }
    }

    /// A region covering `[offset, offset + len)` of a disk file.
    pub fn file(file: Arc<DiskFile>, offset: u64, len: u64) -> Result<Self> {
        let end = offset.checked_add(len);
        if end.is_none_or(|e| e > file.len()) {
            return Err(TransferError::InvalidRequest(format!(
                "file region [{offset}, +{len}) exceeds {} ({} bytes)",
                file.path().display(),
                file.len()
            )));
        }
        Ok(MemoryRegion {
            location: Location::File { file, offset },
            len,
            kind: MemoryKind::Disk,
            owner: None,
        })
    }

    /// The region's kind.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where it starts.
    pub fn location(&self) -> &Location {
        &self.location
    }

    /// The start address, for address-backed regions.
    pub fn addr(&self) -> Option<u64> {
        match self.location {
            Location::Address(a) => Some(a),
            Location::File { .. } => None,
        }
    }

    /// The file and start offset, for disk regions.
    pub fn file_location(&self) -> Option<(&Arc<DiskFile>, u64)> {
        match &self.location {
            Location::File { file, offset } => Some((file, *offset)),
            Location::Address(_) => None,
        }
    }

    /// The owner handle that keeps the memory alive, if any.
    pub fn owner(&self) -> Option<&Owner> {
        self.owner.as_ref()
    }

    /// A sub-range `[offset, offset + len)` of this region, sharing its owner.
    pub fn slice(&self, offset: u64, len: u64) -> Result<Self> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(TransferError::InvalidRequest(format!(
                "slice [{offset}, +{len}) exceeds a region of {} bytes",
                self.len
            )));
        }
        let location = match &self.location {
            Location::Address(a) => Location::Address(a + offset),
            Location::File { file, offset: o } => Location::File {
                file: file.clone(),
                offset: o + offset,
            },
        };
        Ok(MemoryRegion {
            location,
            len,
            kind: self.kind,
            owner: self.owner.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_memory_kinds_are_errors() {
        assert_eq!(allocate(MemoryKind::System, 8192).unwrap().len(), 8192);
        for kind in [MemoryKind::Pinned, MemoryKind::Device(0), MemoryKind::Disk] {
            assert!(matches!(
                allocate(kind, 4096),
                Err(TransferError::MemoryUnavailable { .. })
            ));
        }
        assert!(allocate(MemoryKind::System, 0).is_err());
    }

    #[test]
    fn slices_stay_inside_and_share_the_owner() {
        let r = allocate(MemoryKind::System, 3 * 4096).unwrap();
        let s = r.slice(4096, 4096).unwrap();
        assert_eq!(s.addr(), r.addr().map(|a| a + 4096));
        assert!(s.owner().is_some());
        assert!(r.slice(8192, 4097).is_err());
        assert!(r.slice(u64::MAX, 2).is_err());
    }
}
