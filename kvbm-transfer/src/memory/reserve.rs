//! Reserving a disk file's space up front.
//!
//! A G3 file must own every byte it may later be written at: a sparse file
//! on a nearly full disk fails its writes with `ENOSPC` half-way through a
//! run, long after start-up. [`reserve`] asks the file system with
//! `fallocate`; where the file system has no `fallocate` (ext2, some
//! network and FUSE file systems: `EOPNOTSUPP`), it writes zeros over the
//! whole file in large writes instead. Either way a disk too small is
//! found at start-up and reported as [`TransferError::Reserve`], naming the
//! file, the size and the file system type. A sparse file is never the
//! fallback.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::disk::DISK_ALIGNMENT;
use crate::error::{Result, TransferError};

/// Bytes written per call when zero-filling.
const ZERO_CHUNK: usize = 8 << 20;

/// The type of a file system, as `statfs(2)` reports it (`f_type`); shown
/// by name where it is a known one, in hex otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FsType(pub u64);

impl FsType {
    /// The type of the file system holding the open file `file`; `None`
    /// where `fstatfs` fails.
    pub fn of(file: &File) -> Option<FsType> {
        let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
        // SAFETY: `file` is an open descriptor for the call's duration and
        // `st` is a writable `statfs` the call fills in.
        let rc = unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) };
        if rc != 0 {
            return None;
        }
        // SAFETY: `fstatfs` succeeded, so it initialised `st`.
        let st = unsafe { st.assume_init() };
        // `f_type` is signed on some targets; the magic numbers are not.
        Some(FsType(st.f_type as u64 & 0xffff_ffff))
    }

    /// The file system's name, where the magic number is a known one
    /// (ext2, ext3 and ext4 share one).
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0xEF53 => "ext2/ext3/ext4",
            0x0102_1994 => "tmpfs",
            0x5846_5342 => "xfs",
            0x9123_683E => "btrfs",
            0x794C_7630 => "overlayfs",
            0x6573_5546 => "fuse",
            0x6969 => "nfs",
            0x2FC1_2FC1 => "zfs",
            0xF2F5_2010 => "f2fs",
            0x4D44 => "vfat",
            0x2011_BAB0 => "exfat",
            0x8584_58F6 => "ramfs",
            0xFF53_4D42 => "cifs",
            0xFE53_4D42 => "smb2",
            0x00C3_6400 => "ceph",
            0x0102_1997 => "9p",
            _ => return None,
        })
    }
}

impl fmt::Display for FsType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "{:#x}", self.0),
        }
    }
}

/// How the space of a file was reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reserved {
    /// `fallocate` reserved it.
    Fallocate,
    /// The file system has no `fallocate`; zeros were written.
    ZeroFill,
}

/// Reserves `len` bytes (a multiple of [`DISK_ALIGNMENT`]) of `file` at
/// `path`; `direct`: `file` is open with `O_DIRECT`. `force_zero_fill`
/// skips `fallocate` (tests of the fallback on file systems that have it).
pub(crate) fn reserve(
    file: &File,
    path: &Path,
    len: u64,
    direct: bool,
    force_zero_fill: bool,
) -> Result<Reserved> {
    let failed = |method: &'static str, source: io::Error| TransferError::Reserve {
        path: path.to_path_buf(),
        len,
        fs: FsType::of(file),
        method,
        source,
    };
    if !force_zero_fill {
        let off = libc::off_t::try_from(len)
            .map_err(|_| failed("fallocate", io::Error::from_raw_os_error(libc::EFBIG)))?;
        // SAFETY: `file` is an open descriptor for the call's duration.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, off) };
        if rc == 0 {
            return Ok(Reserved::Fallocate);
        }
        let e = io::Error::last_os_error();
        if !matches!(
            e.raw_os_error(),
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
        ) {
            return Err(failed("fallocate", e));
        }
        tracing::warn!(
            path = %path.display(),
            fs = %FsType::of(file).map_or("unknown".to_string(), |t| t.to_string()),
            "the file system has no fallocate; writing zeros to reserve the space"
        );
    }
    zero_fill(file, len, direct).map_err(|e| failed("writing zeros", e))?;
    Ok(Reserved::ZeroFill)
}

/// Writes zeros over `[0, len)` of `file` in large aligned writes (valid
/// under `O_DIRECT`), then makes them durable, so that every block is
/// allocated before the call returns.
fn zero_fill(file: &File, len: u64, direct: bool) -> io::Result<()> {
    let align = DISK_ALIGNMENT as usize;
    let chunk = usize::try_from(len).map_or(ZERO_CHUNK, |l| l.min(ZERO_CHUNK));
    let buf = vec![0u8; chunk + align];
    let start = buf.as_ptr().align_offset(align);
    let zeros = &buf[start..start + chunk];
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(chunk as u64) as usize;
        file.write_all_at(&zeros[..n], off)?;
        off += n as u64;
    }
    // Buffered writes reach the disk here (and report errors deferred to
    // write-back); the page cache then lets go of the zeros.
    file.sync_data()?;
    if !direct {
        // SAFETY: `file` is an open descriptor; advice cannot harm it.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    /// Bytes the file system holds for `path` (512-byte units).
    fn allocated(path: &Path) -> u64 {
        std::fs::metadata(path).unwrap().blocks() * 512
    }

    #[test]
    fn zero_fill_fallback_allocates_every_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g3");
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        // Larger than one write, not a multiple of it.
        let len = ZERO_CHUNK as u64 * 2 + 3 * DISK_ALIGNMENT;
        let how = reserve(&file, &path, len, false, true).unwrap();
        assert_eq!(how, Reserved::ZeroFill);
        assert_eq!(file.metadata().unwrap().len(), len);
        assert!(
            allocated(&path) >= len,
            "sparse: {} of {len} bytes allocated",
            allocated(&path)
        );
        let mut back = vec![1u8; 4096];
        file.read_exact_at(&mut back, len - 4096).unwrap();
        assert!(back.iter().all(|&b| b == 0));
    }

    #[test]
    fn zero_fill_through_the_allocator_leaves_no_sparse_file() {
        let dir = tempfile::tempdir().unwrap();
        let alloc = super::super::DiskAllocator::new(dir.path(), Default::default()).unwrap();
        let f = alloc.allocate_forcing_zero_fill(1 << 20).unwrap();
        assert_eq!(f.len(), 1 << 20);
        assert!(allocated(f.path()) >= 1 << 20);
    }

    #[test]
    fn file_system_types_have_names_or_hex() {
        assert_eq!(FsType(0xEF53).to_string(), "ext2/ext3/ext4");
        assert_eq!(FsType(0x0102_1994).to_string(), "tmpfs");
        assert_eq!(FsType(0x1234).to_string(), "0x1234");
        let dir = tempfile::tempdir().unwrap();
        let f = File::create(dir.path().join("x")).unwrap();
        assert!(FsType::of(&f).is_some());
    }
}
