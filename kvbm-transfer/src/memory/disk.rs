//! Disk files: the G3 tier's backing store.
//!
//! Files are created in a configured directory, their whole space reserved
//! up front (so later writes cannot run out of space half-way: see
//! [`super::reserve`]), opened with `O_DIRECT` where the file system
//! supports it (the page cache would only duplicate what kvbm already
//! caches in G2), and removed on drop unless asked to persist. Every
//! fallback (zeros written where there is no `fallocate`, buffered I/O
//! where there is no `O_DIRECT`) is taken with a warning, never silently.
//!
//! Every file is named `kvbm-<pid>-<n>.blocks` and locked (`flock`) while
//! in use, so the files of a process that was killed are recognisable and
//! removable by the next one ([`remove_stale_files`](super::remove_stale_files)).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::reserve::reserve;
use super::stale;
use crate::error::{Result, TransferError};

/// Alignment of disk extents, offsets and lengths, and of memory used for
/// `O_DIRECT` I/O.
pub const DISK_ALIGNMENT: u64 = 4096;

/// How a disk file is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoMode {
    /// `O_DIRECT` when the file system supports it, buffered with a warning
    /// otherwise.
    #[default]
    Auto,
    /// `O_DIRECT` or an error.
    Direct,
    /// Through the page cache.
    Buffered,
}

/// Options for [`DiskAllocator`].
#[derive(Debug, Clone, Default)]
pub struct DiskOptions {
    /// How files are opened.
    pub io_mode: IoMode,
    /// Keep files on drop (default: remove them). A file whose space could
    /// not be reserved is removed regardless.
    pub persist: bool,
}

/// Creates disk files in one directory.
#[derive(Debug, Clone)]
pub struct DiskAllocator {
    dir: PathBuf,
    options: DiskOptions,
}

static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

impl DiskAllocator {
    /// An allocator for files under `dir` (created if missing).
    pub fn new(dir: impl Into<PathBuf>, options: DiskOptions) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|source| TransferError::Alloc {
            what: format!("directory {}", dir.display()),
            source,
        })?;
        Ok(DiskAllocator { dir, options })
    }

    /// The directory files are created in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Creates a file of at least `len` bytes (rounded up to
    /// [`DISK_ALIGNMENT`]), all of them reserved on the disk: with
    /// `fallocate`, or by writing zeros where the file system has none.
    /// A disk without the room is [`TransferError::Reserve`] (naming the
    /// file, the size and the file system type), and no file is left.
    pub fn allocate(&self, len: u64) -> Result<Arc<DiskFile>> {
        self.allocate_reserving(len, false)
    }

    /// [`DiskAllocator::allocate`] through the zero-fill fallback, as on a
    /// file system without `fallocate`.
    #[cfg(test)]
    pub(crate) fn allocate_forcing_zero_fill(&self, len: u64) -> Result<Arc<DiskFile>> {
        self.allocate_reserving(len, true)
    }

    /// Creates the file `name` in the directory, of at least `len` bytes,
    /// reserved as [`DiskAllocator::allocate`] does: for a file that is
    /// found again by its name (a G3 that outlives its process). A file of
    /// that name already there is an error.
    pub fn allocate_named(&self, name: &str, len: u64) -> Result<Arc<DiskFile>> {
        let path = self.dir.join(name);
        self.allocate_at(len, false, || {
            let n = NEXT_FILE.fetch_add(1, Ordering::Relaxed);
            open_file(&path, self.options.io_mode, true)
                .map(|(file, direct)| Some((n, path.clone(), file, direct)))
        })
    }

    fn allocate_reserving(&self, len: u64, force_zero_fill: bool) -> Result<Arc<DiskFile>> {
        self.allocate_at(len, force_zero_fill, || {
            let n = NEXT_FILE.fetch_add(1, Ordering::Relaxed);
            let path = self.dir.join(stale::file_name(std::process::id(), n));
            match open_file(&path, self.options.io_mode, true) {
                Ok((file, direct)) => Ok(Some((n, path, file, direct))),
                // A file of an earlier process that had this pid: never
                // reused, the next number is taken instead.
                Err(TransferError::Alloc { source, .. })
                    if source.kind() == io::ErrorKind::AlreadyExists =>
                {
                    Ok(None)
                }
                Err(e) => Err(e),
            }
        })
    }

    /// Creates a file with `create` (retried while it returns `None`),
    /// locks it and reserves `len` bytes of it.
    fn allocate_at(
        &self,
        len: u64,
        force_zero_fill: bool,
        mut create: impl FnMut() -> Result<Option<(u64, PathBuf, File, bool)>>,
    ) -> Result<Arc<DiskFile>> {
        if len == 0 {
            return Err(TransferError::InvalidRequest(
                "cannot allocate an empty disk file".into(),
            ));
        }
        let len = len.div_ceil(DISK_ALIGNMENT) * DISK_ALIGNMENT;
        // Created and locked under the directory's shared lock, so that a
        // sweep for stale files never sees it unlocked.
        let dir_lock = stale::lock_dir(&self.dir, false);
        let (n, path, file, direct) = loop {
            if let Some(made) = create()? {
                break made;
            }
        };
        let locked = stale::try_lock(&file);
        drop(dir_lock);
        let disk = DiskFile {
            path,
            file,
            len,
            direct,
            any_alignment: self.options.io_mode == IoMode::Buffered,
            persist: AtomicBool::new(self.options.persist),
            id: n,
        };
        match locked {
            Ok(true) => {}
            Ok(false) => {
                return Err(TransferError::Alloc {
                    what: format!("file {}", disk.path.display()),
                    source: io::Error::new(
                        io::ErrorKind::WouldBlock,
                        "locked by another process right after it was created",
                    ),
                });
            }
            Err(source) => {
                return Err(TransferError::Alloc {
                    what: format!("lock on file {}", disk.path.display()),
                    source,
                });
            }
        }
        if let Err(e) = reserve(&disk.file, &disk.path, len, direct, force_zero_fill) {
            // Never leave a half-reserved file behind, persistent or not.
            disk.set_persist(false);
            return Err(e);
        }
        Ok(Arc::new(disk))
    }
}

fn open_file(path: &Path, mode: IoMode, create: bool) -> Result<(File, bool)> {
    let open = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(true);
        if create {
            o.create_new(true);
        }
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(path)
    };
    let err = |source| TransferError::Alloc {
        what: format!("file {}", path.display()),
        source,
    };
    match mode {
        IoMode::Buffered => Ok((open(false).map_err(err)?, false)),
        IoMode::Direct => Ok((open(true).map_err(err)?, true)),
        IoMode::Auto => match open(true) {
            Ok(f) => Ok((f, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(path = %path.display(), "file system refuses O_DIRECT; using buffered I/O");
                Ok((open(false).map_err(err)?, false))
            }
            Err(e) => Err(err(e)),
        },
    }
}

/// A file that backs disk regions.
#[derive(Debug)]
pub struct DiskFile {
    path: PathBuf,
    file: File,
    len: u64,
    direct: bool,
    /// Opened buffered on request: host memory at any address may be read
    /// into or written from it.
    any_alignment: bool,
    persist: AtomicBool,
    id: u64,
}

impl DiskFile {
    /// Opens an existing file (kept on drop), `len` bytes of it usable,
    /// and holds its lock while open: a file another process holds is an
    /// error. Its space is not reserved: a sparse file is opened with a
    /// warning (its writes may fail with `ENOSPC` when the disk fills up).
    pub fn open(path: impl Into<PathBuf>, mode: IoMode) -> Result<Arc<DiskFile>> {
        let path = path.into();
        let (file, direct) = open_file(&path, mode, false)?;
        let lock_err = |source| TransferError::Alloc {
            what: format!("file {}", path.display()),
            source,
        };
        if !stale::try_lock(&file).map_err(lock_err)? {
            return Err(lock_err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "in use by another process (its lock is held)",
            )));
        }
        let meta = file.metadata().map_err(|source| TransferError::Alloc {
            what: format!("file {}", path.display()),
            source,
        })?;
        let len = meta.len();
        let allocated = std::os::unix::fs::MetadataExt::blocks(&meta).saturating_mul(512);
        if allocated < len {
            tracing::warn!(
                path = %path.display(),
                allocated,
                len,
                "the file is sparse: writes into its holes may fail with ENOSPC"
            );
        }
        let id = NEXT_FILE.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(DiskFile {
            path,
            file,
            len,
            direct,
            any_alignment: mode == IoMode::Buffered,
            persist: AtomicBool::new(true),
            id,
        }))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Usable length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when the file has no usable bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the file is open with `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Whether requests on this file may use any offset, length and host
    /// address: only for files opened with [`IoMode::Buffered`] (an
    /// [`IoMode::Auto`] file keeps `O_DIRECT`'s rules even where it fell
    /// back to buffered I/O, so behaviour does not depend on the file
    /// system).
    pub fn takes_any_alignment(&self) -> bool {
        self.any_alignment
    }

    /// The raw file descriptor (valid while `self` lives).
    pub fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// A process-unique id for this file.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Keep (true) or remove (false) the file when it is dropped.
    pub fn set_persist(&self, persist: bool) {
        self.persist.store(persist, Ordering::Relaxed);
    }
}

impl Drop for DiskFile {
    fn drop(&mut self) {
        if !self.persist.load(Ordering::Relaxed)
            && let Err(e) = std::fs::remove_file(&self.path)
        {
            tracing::warn!(path = %self.path.display(), error = %e, "could not remove disk file");
        }
    }
}
