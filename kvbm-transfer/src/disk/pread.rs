//! The pread/pwrite engine: blocking positional I/O on worker threads.
//!
//! Used where io_uring is unavailable (seccomp-filtered containers, the
//! `io-uring` feature off), and on request for buffered files. One syscall
//! per operation.

use std::io;

use super::engine::{IoDir, IoEngine, IoOp, cancelled};
use crate::error::{Result, TransferError};
use crate::pool::WorkerPool;

/// Positional I/O on a pool of blocking threads.
pub struct PreadEngine {
    pool: WorkerPool,
}

impl PreadEngine {
    /// An engine with `threads` workers.
    pub fn new(threads: usize) -> Result<Self> {
        let pool =
            WorkerPool::new("kvbm-pread", threads).map_err(|source| TransferError::Alloc {
                what: "pread worker threads".into(),
                source,
            })?;
        Ok(PreadEngine { pool })
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }
}

/// One blocking `pread`/`pwrite` for `op`.
pub(super) fn positional_io(op: &IoOp) -> io::Result<usize> {
    let fd = op.file.raw_fd();
    let len = op.len as usize;
    let off = op.file_offset as libc::off_t;
    let rc = match op.dir {
        // SAFETY: the submitter guarantees `[addr, addr + len)` is valid,
        // writable memory reserved for this operation; `fd` stays open
        // because `op` holds the file.
        IoDir::Read => unsafe { libc::pread(fd, op.addr as *mut libc::c_void, len, off) },
        // SAFETY: as above, the memory is valid and readable.
        IoDir::Write => unsafe { libc::pwrite(fd, op.addr as *const libc::c_void, len, off) },
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as usize)
    }
}

impl IoEngine for PreadEngine {
    fn name(&self) -> &'static str {
        "pread"
    }

    fn submit(&self, ops: Vec<IoOp>) {
        for op in ops {
            self.pool.spawn(move || {
                let result = if op.sink.wanted() {
                    positional_io(&op)
                } else {
                    Err(cancelled())
                };
                op.sink.complete(op.token, result);
            });
        }
    }
}
