//! The crate's error type.
//!
//! One enum for the whole data path so that a failure travels unchanged from
//! the backend that saw it, through the executor, to the caller — with the
//! path, offset and blocks that make it actionable.

use std::io;
use std::path::PathBuf;

use crate::memory::{FsType, MemoryKind};

/// Everything that can go wrong while allocating memory or moving bytes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// No strategy in the table moves bytes between these two kinds of memory
    /// with the backends this executor has.
    #[error("no transfer strategy from {src:?} to {dst:?} with the registered backends")]
    UnsupportedPair {
        /// Source memory kind.
        src: MemoryKind,
        /// Destination memory kind.
        dst: MemoryKind,
    },
    /// A backend was handed memory it cannot move.
    #[error("backend {backend} cannot move {src:?} -> {dst:?}")]
    BackendMismatch {
        /// The backend's name.
        backend: &'static str,
        /// Source memory kind.
        src: MemoryKind,
        /// Destination memory kind.
        dst: MemoryKind,
    },
    /// This kind of memory needs a feature or device that is not available
    /// (pinned and device memory come with the CUDA backend).
    #[error("{kind:?} memory is not available: {reason}")]
    MemoryUnavailable {
        /// The kind that was asked for.
        kind: MemoryKind,
        /// Why it is unavailable.
        reason: &'static str,
    },
    /// A copy run reaches outside its region.
    #[error(
        "copy run out of bounds: region {region} of the {side} side is {region_len} bytes, run wants [{offset}, {offset}+{len})"
    )]
    OutOfBounds {
        /// `"source"` or `"destination"`.
        side: &'static str,
        /// Region index.
        region: u32,
        /// Offset within the region.
        offset: u64,
        /// Run length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// A disk request is not aligned: disk blocks occupy aligned extents.
    #[error(
        "disk request not aligned to {alignment} bytes: {what} = {value:#x} (file {path})",
        path = path.display()
    )]
    Misaligned {
        /// Required alignment in bytes.
        alignment: u64,
        /// Which quantity is misaligned (file offset, length, memory address).
        what: &'static str,
        /// Its value.
        value: u64,
        /// The file concerned.
        path: PathBuf,
    },
    /// An I/O error on a disk file.
    #[error("I/O error on {path} at offset {offset} ({len} bytes): {source}", path = path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// File offset of the failed request.
        offset: u64,
        /// Length of the failed request.
        len: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Creating, sizing or opening a backing file or mapping failed.
    #[error("allocation failed for {what}: {source}")]
    Alloc {
        /// What was being allocated.
        what: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A disk file's space could not be reserved up front (the disk is too
    /// small, or the file system refused): the file was not kept.
    #[error(
        "cannot reserve {len} bytes ({mib:.1} MiB) for {path} on file system {fs} ({method}): {source}",
        path = path.display(),
        mib = *len as f64 / (1u64 << 20) as f64,
        fs = fs.map_or_else(|| "of unknown type".to_string(), |t| t.to_string())
    )]
    Reserve {
        /// The file.
        path: PathBuf,
        /// Bytes asked for.
        len: u64,
        /// The file system holding it, where `fstatfs` could tell.
        fs: Option<FsType>,
        /// How the space was being reserved (`"fallocate"`, `"writing zeros"`).
        method: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A physical layout's regions do not match its layout.
    #[error("physical layout mismatch: {0}")]
    LayoutMismatch(String),
    /// The layout planner refused the request.
    #[error("copy planning failed: {0}")]
    Plan(#[from] kvbm_layout::LayoutError),
    /// A request is malformed (duplicate destination blocks, zero sizes...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The transfer was cancelled before it finished.
    #[error("transfer cancelled")]
    Cancelled,
    /// The worker that owned this completion went away without resolving it.
    #[error("transfer abandoned: the worker that owned it stopped ({0})")]
    Abandoned(&'static str),
    /// A copy that another process ran failed there (a worker of a
    /// distributed instance): its error as text, and the OS error number it
    /// saw where there was one.
    #[error("{origin}: {message}")]
    Remote {
        /// Who ran the copy (e.g. `kvbm-dist rank 1`).
        origin: String,
        /// The error as that process reported it.
        message: String,
        /// The OS error number behind it (`libc::ENOSPC`...), if any.
        os_error: Option<i32>,
    },
    /// A backend-specific failure (CUDA driver errors and the like).
    #[error("{backend}: {message}")]
    Backend {
        /// The backend's name.
        backend: &'static str,
        /// What went wrong.
        message: String,
    },
}

impl TransferError {
    /// The OS error number behind this error (`libc::ENOSPC`, `libc::EIO`,
    /// ...) where it came from a system call on a file or an allocation;
    /// `None` for every other failure.
    pub fn os_error(&self) -> Option<i32> {
        match self {
            TransferError::Io { source, .. }
            | TransferError::Alloc { source, .. }
            | TransferError::Reserve { source, .. } => source.raw_os_error(),
            TransferError::Remote { os_error, .. } => *os_error,
            _ => None,
        }
    }
}

/// Shorthand for results in this crate.
pub type Result<T, E = TransferError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_error_is_the_errno_where_there_is_one() {
        let io = TransferError::Io {
            path: "/g3".into(),
            offset: 0,
            len: 4096,
            source: io::Error::from_raw_os_error(libc::ENOSPC),
        };
        assert_eq!(io.os_error(), Some(libc::ENOSPC));
        let remote = TransferError::Remote {
            origin: "kvbm-dist rank 1".into(),
            message: "I/O error".into(),
            os_error: Some(libc::EIO),
        };
        assert_eq!(remote.os_error(), Some(libc::EIO));
        assert_eq!(remote.to_string(), "kvbm-dist rank 1: I/O error");
        let text = TransferError::Io {
            path: "/g3".into(),
            offset: 0,
            len: 4096,
            source: io::Error::new(io::ErrorKind::WriteZero, "wrote nothing"),
        };
        assert_eq!(text.os_error(), None);
        assert_eq!(TransferError::Cancelled.os_error(), None);
    }
}
