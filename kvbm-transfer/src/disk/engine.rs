//! The I/O engine seam under the disk backend.
//!
//! An [`IoEngine`] performs single positional reads and writes between a
//! disk file and memory and reports, per operation, how many bytes moved or
//! the OS error — nothing more. Everything that makes a transfer correct
//! (alignment checks, splitting, resubmitting short transfers, retrying
//! `EINTR`/`EAGAIN`, naming the failed block) lives above it in the disk
//! backend, so a fault-injecting engine placed between the two exercises
//! exactly the code production runs. Production uses [`DefaultEngine`]
//! through a generic parameter, so the seam costs nothing there.

use std::io;
use std::sync::Arc;

use crate::error::Result;
use crate::memory::{DiskFile, MemoryRegion};

/// Direction of one operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoDir {
    /// File → memory.
    Read,
    /// Memory → file.
    Write,
}

/// Receives the results of operations.
pub trait IoSink: Send + Sync {
    /// Called exactly once per submitted operation, on an engine thread,
    /// with the bytes moved or the error. Must not block.
    fn complete(&self, token: u64, result: io::Result<usize>);

    /// Whether operations not yet started should still run. When false the
    /// engine completes them with `ECANCELED` without doing I/O.
    fn wanted(&self) -> bool;
}

/// One positional read or write.
#[derive(Clone)]
pub struct IoOp {
    /// Direction.
    pub dir: IoDir,
    /// The file (kept open while the operation is queued or in flight).
    pub file: Arc<DiskFile>,
    /// Byte offset in the file.
    pub file_offset: u64,
    /// Memory address of the buffer.
    pub addr: u64,
    /// Bytes to move.
    pub len: u32,
    /// Opaque to the engine; handed back to the sink.
    pub token: u64,
    /// Where the result goes.
    pub sink: Arc<dyn IoSink>,
}

/// The result the engine reports for an operation it skipped because its
/// sink no longer wanted it.
pub fn cancelled() -> io::Error {
    io::Error::from_raw_os_error(libc::ECANCELED)
}

/// Performs positional I/O.
pub trait IoEngine: Send + Sync + 'static {
    /// A short name for logs.
    fn name(&self) -> &'static str;

    /// Queues operations; each one's sink is called when it finishes. The
    /// caller guarantees every `[addr, addr + len)` is valid memory that
    /// stays alive and untouched by others until its completion.
    fn submit(&self, ops: Vec<IoOp>);

    /// Registers host memory for faster I/O (io_uring fixed buffers); the
    /// engine keeps `region` alive while registered. Returns whether the
    /// engine uses the registration.
    fn register_memory(&self, region: &MemoryRegion) -> Result<bool> {
        let _ = region;
        Ok(false)
    }
}

/// The engine production uses: io_uring where available (feature
/// `io-uring`), the pread/pwrite thread pool otherwise.
pub enum DefaultEngine {
    /// io_uring.
    #[cfg(feature = "io-uring")]
    Uring(super::uring::UringEngine),
    /// pread/pwrite worker threads.
    Pread(super::pread::PreadEngine),
}

/// Settings for the disk engines.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Operations in flight at once (io_uring queue depth, or pread threads).
    pub queue_depth: u32,
    /// Use the pread/pwrite pool even when io_uring is available.
    pub force_pread: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            queue_depth: 16,
            force_pread: false,
        }
    }
}

impl DefaultEngine {
    /// Starts io_uring if possible, else the pread pool (with a warning).
    pub fn new(config: &EngineConfig) -> Result<Self> {
        #[cfg(feature = "io-uring")]
        if !config.force_pread {
            match super::uring::UringEngine::new(config.queue_depth) {
                Ok(e) => return Ok(DefaultEngine::Uring(e)),
                Err(e) => {
                    tracing::warn!(error = %e, "io_uring unavailable; using pread/pwrite threads")
                }
            }
        }
        Ok(DefaultEngine::Pread(super::pread::PreadEngine::new(
            config.queue_depth as usize,
        )?))
    }
}

impl IoEngine for DefaultEngine {
    fn name(&self) -> &'static str {
        match self {
            #[cfg(feature = "io-uring")]
            DefaultEngine::Uring(e) => e.name(),
            DefaultEngine::Pread(e) => e.name(),
        }
    }

    fn submit(&self, ops: Vec<IoOp>) {
        match self {
            #[cfg(feature = "io-uring")]
            DefaultEngine::Uring(e) => e.submit(ops),
            DefaultEngine::Pread(e) => e.submit(ops),
        }
    }

    fn register_memory(&self, region: &MemoryRegion) -> Result<bool> {
        match self {
            #[cfg(feature = "io-uring")]
            DefaultEngine::Uring(e) => e.register_memory(region),
            DefaultEngine::Pread(e) => e.register_memory(region),
        }
    }
}
