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

/// One of the engines, as the router holds it.
enum Engine {
    #[cfg(feature = "io-uring")]
    Uring(super::uring::UringEngine),
    Pread(super::pread::PreadEngine),
    Mapped(super::mapped::MappedEngine),
}

impl Engine {
    fn get(&self) -> &dyn IoEngine {
        match self {
            #[cfg(feature = "io-uring")]
            Engine::Uring(e) => e,
            Engine::Pread(e) => e,
            Engine::Mapped(e) => e,
        }
    }
}

/// The engine production uses: io_uring where available (feature
/// `io-uring`), the pread/pwrite thread pool otherwise, for `O_DIRECT`
/// files; and for buffered files the engine [`EngineConfig::buffered`]
/// names, by default chosen from the machine ([`BufferedIo::resolve`]).
pub struct DefaultEngine {
    direct: Engine,
    /// `None`: buffered files go to the direct engine too.
    buffered: Option<Engine>,
}

/// How requests on buffered files (served from the page cache) are run.
///
/// A buffered read is a CPU copy, not device work, so the engine that
/// suits `O_DIRECT` files (io_uring: the device does the copy, one thread
/// keeps the queue full) is not the one that suits them: they want copy
/// threads sized to the machine, and stores that do not drag the
/// destination through the CPU caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BufferedIo {
    /// Chosen from the CPUs this process may use ([`BufferedIo::resolve`]).
    #[default]
    Auto,
    /// The same engine as `O_DIRECT` files.
    SameAsDirect,
    /// `pread`/`pwrite` on this many worker threads.
    Pread {
        /// Worker threads.
        threads: usize,
    },
    /// Reads copied out of a shared mapping of the file on this many
    /// worker threads; writes through `pwrite` (see [`MappedEngine`]).
    ///
    /// [`MappedEngine`]: super::MappedEngine
    Mapped {
        /// Worker threads.
        threads: usize,
        /// Non-temporal stores (skip the caches) for the copies.
        streaming: bool,
    },
}

/// Below this many CPUs buffered requests stay on the direct engine: with
/// so few cores, parallel page-cache copies compete for the same CPUs and
/// move no more bytes than one thread, while each hand-off between threads
/// costs CPU time.
const BUFFERED_THREADS_MIN_CPUS: usize = 4;

/// At most this many copy threads by default: a few threads keep pace with
/// the GPU's DMA, and more flood DRAM, so that the DMA of a bounce
/// pipeline, which reads the same memory, loses arbitration and starves
/// (measured in `docs/benchmarks.md`, "Disk to GPU: bounce pipeline and
/// file-window route").
const BUFFERED_MAX_THREADS: usize = 8;

impl BufferedIo {
    /// The concrete choice for a process that may use `cpus` CPUs: below
    /// four CPUs, the direct engine (copies inline, one at a time);
    /// otherwise mapped copies with non-temporal stores on half the CPUs
    /// (at least 2, at most 8) — the other half is left to the other hop
    /// of a pipeline and to its completion threads.
    pub fn resolve(self, cpus: usize) -> BufferedIo {
        match self {
            BufferedIo::Auto if cpus < BUFFERED_THREADS_MIN_CPUS => BufferedIo::SameAsDirect,
            BufferedIo::Auto => BufferedIo::Mapped {
                threads: (cpus / 2).clamp(2, BUFFERED_MAX_THREADS),
                streaming: true,
            },
            other => other,
        }
    }
}

/// Settings for the disk engines.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Operations in flight at once (io_uring queue depth, or pread threads).
    pub queue_depth: u32,
    /// Use the pread/pwrite pool even when io_uring is available.
    pub force_pread: bool,
    /// How requests on buffered files are run.
    pub buffered: BufferedIo,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            queue_depth: 16,
            force_pread: false,
            buffered: BufferedIo::Auto,
        }
    }
}

impl DefaultEngine {
    /// Starts io_uring if possible, else the pread pool (with a warning),
    /// and the buffered-file engine the configuration resolves to.
    pub fn new(config: &EngineConfig) -> Result<Self> {
        let direct = Self::direct(config)?;
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let buffered = match config.buffered.resolve(cpus) {
            BufferedIo::Auto | BufferedIo::SameAsDirect => None,
            BufferedIo::Pread { threads } => {
                Some(Engine::Pread(super::pread::PreadEngine::new(threads)?))
            }
            BufferedIo::Mapped { threads, streaming } => Some(Engine::Mapped(
                super::mapped::MappedEngine::new(threads, streaming)?,
            )),
        };
        Ok(DefaultEngine { direct, buffered })
    }

    fn direct(config: &EngineConfig) -> Result<Engine> {
        #[cfg(feature = "io-uring")]
        if !config.force_pread {
            match super::uring::UringEngine::new(config.queue_depth) {
                Ok(e) => return Ok(Engine::Uring(e)),
                Err(e) => {
                    tracing::warn!(error = %e, "io_uring unavailable; using pread/pwrite threads")
                }
            }
        }
        Ok(Engine::Pread(super::pread::PreadEngine::new(
            config.queue_depth as usize,
        )?))
    }

    /// The name of the engine that serves buffered files.
    pub fn buffered_name(&self) -> &'static str {
        self.buffered.as_ref().unwrap_or(&self.direct).get().name()
    }

    /// Whether a separate buffered-file engine has threads running: the
    /// mapped engine starts them at its first request, a pread pool at
    /// once; `false` when buffered files share the direct engine.
    pub fn buffered_threads_started(&self) -> bool {
        match &self.buffered {
            None => false,
            Some(Engine::Mapped(m)) => m.started(),
            Some(_) => true,
        }
    }
}

impl IoEngine for DefaultEngine {
    /// The name of the engine that serves `O_DIRECT` files.
    fn name(&self) -> &'static str {
        self.direct.get().name()
    }

    fn submit(&self, ops: Vec<IoOp>) {
        let Some(buffered) = &self.buffered else {
            return self.direct.get().submit(ops);
        };
        let (direct, page_cache): (Vec<_>, Vec<_>) =
            ops.into_iter().partition(|op| op.file.is_direct());
        if !direct.is_empty() {
            self.direct.get().submit(direct);
        }
        if !page_cache.is_empty() {
            buffered.get().submit(page_cache);
        }
    }

    fn register_memory(&self, region: &MemoryRegion) -> Result<bool> {
        let mut used = self.direct.get().register_memory(region)?;
        if let Some(b) = &self.buffered {
            used |= b.get().register_memory(region)?;
        }
        Ok(used)
    }
}
