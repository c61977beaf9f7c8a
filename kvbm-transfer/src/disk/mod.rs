//! The disk backend: host memory ↔ disk files.
//!
//! It turns a job's runs into aligned positional reads or writes of at most
//! `max_io_bytes` each, hands them to an [`IoEngine`] in one batch, and
//! finishes the job when every operation has settled. Short transfers are
//! resubmitted for their remainder; `EINTR` and `EAGAIN` are retried a
//! bounded number of times; any other error stops new operations from
//! starting and fails the job with the file, offset and OS error. A failed
//! or cancelled job resolves only after nothing of it is in flight.

mod engine;
mod mapped;
mod pread;
pub mod route;
#[cfg(feature = "io-uring")]
mod uring;

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

pub use engine::{
    BufferedIo, DefaultEngine, EngineConfig, IoDir, IoEngine, IoOp, IoSink, cancelled,
};
#[cfg(feature = "cuda")]
pub(crate) use mapped::FileMap;
pub use mapped::MappedEngine;
pub use pread::PreadEngine;
#[cfg(feature = "io-uring")]
pub use uring::UringEngine;

use crate::backend::{
    BackendKind, Side, TransferBackend, TransferJob, accepted_kinds, host_disk_pair,
};
use crate::completion::{Completion, Countdown, completion_pair};
use crate::error::{Result, TransferError};
use crate::memory::{DISK_ALIGNMENT, DiskFile, MemoryKind, MemoryRegion};

/// How often one operation is retried after `EINTR`/`EAGAIN`.
const MAX_RETRIES: u32 = 8;

/// Settings for [`DiskBackend`].
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// The engine's settings.
    pub engine: EngineConfig,
    /// Largest single request; longer runs are split (a multiple of 4096).
    pub max_io_bytes: u32,
}

impl Default for DiskConfig {
    fn default() -> Self {
        DiskConfig {
            engine: EngineConfig::default(),
            max_io_bytes: 2 << 20,
        }
    }
}

/// Host ↔ disk transfers over an [`IoEngine`].
pub struct DiskBackend<E: IoEngine = DefaultEngine> {
    engine: Arc<E>,
    max_io_bytes: u32,
}

impl DiskBackend<DefaultEngine> {
    /// A backend on io_uring if available, pread/pwrite threads otherwise,
    /// with buffered files served as `config.engine.buffered` says.
    pub fn new(config: &DiskConfig) -> Result<Self> {
        Ok(Self::with_engine(
            DefaultEngine::new(&config.engine)?,
            config.max_io_bytes,
        ))
    }

    /// The name of the engine that serves buffered (page-cache) files.
    pub fn buffered_engine_name(&self) -> &'static str {
        self.engine.buffered_name()
    }

    /// Whether a separate buffered-file engine has threads running (the
    /// mapped engine starts its copy threads at its first request).
    pub fn buffered_threads_started(&self) -> bool {
        self.engine.buffered_threads_started()
    }
}

impl<E: IoEngine> DiskBackend<E> {
    /// A backend on a given engine (tests put a fault injector here).
    pub fn with_engine(engine: E, max_io_bytes: u32) -> Self {
        let max = (max_io_bytes as u64 / DISK_ALIGNMENT).max(1) * DISK_ALIGNMENT;
        DiskBackend {
            engine: Arc::new(engine),
            max_io_bytes: max as u32,
        }
    }

    /// The engine's name (`io_uring` or `pread`; for [`DefaultEngine`], the
    /// one that serves `O_DIRECT` files).
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// Registers host memory that will take part in many transfers (a
    /// pinned pool, a bounce pool) so the engine can skip per-request page
    /// pinning. Returns whether the engine uses it. Must not be called from
    /// a completion callback (the io_uring thread answers it).
    pub fn register_memory(&self, region: &MemoryRegion) -> Result<bool> {
        self.engine.register_memory(region)
    }
}

struct OpMeta {
    file: Arc<DiskFile>,
    file_offset: u64,
    addr: u64,
    len: u32,
    done: AtomicU32,
    retries: AtomicU32,
}

struct DiskJob<E: IoEngine> {
    dir: IoDir,
    ops: Vec<OpMeta>,
    parts: Countdown,
    job: TransferJob,
    engine: Arc<E>,
    this: std::sync::Weak<DiskJob<E>>,
}

impl<E: IoEngine> DiskJob<E> {
    fn op(&self, i: usize, offset_in_op: u32) -> Option<IoOp> {
        let m = &self.ops[i];
        let sink: Arc<dyn IoSink> = self.this.upgrade()?;
        Some(IoOp {
            dir: self.dir,
            file: m.file.clone(),
            file_offset: m.file_offset + offset_in_op as u64,
            addr: m.addr + offset_in_op as u64,
            len: m.len - offset_in_op,
            token: i as u64,
            sink,
        })
    }

    fn io_error(&self, i: usize, source: io::Error) -> TransferError {
        let m = &self.ops[i];
        TransferError::Io {
            path: m.file.path().to_path_buf(),
            offset: m.file_offset,
            len: m.len as u64,
            source,
        }
    }
}

impl<E: IoEngine> IoSink for DiskJob<E> {
    fn wanted(&self) -> bool {
        !self.parts.failed() && !self.job.cancel.is_cancelled()
    }

    fn complete(&self, token: u64, result: io::Result<usize>) {
        let i = token as usize;
        let m = &self.ops[i];
        match result {
            Ok(n) if n > 0 => {
                let done = m.done.fetch_add(n as u32, Ordering::AcqRel) + n as u32;
                if done >= m.len {
                    return self.parts.settle();
                }
                // A short transfer: move the rest, unless the job stopped.
                if self.wanted()
                    && let Some(op) = self.op(i, done)
                {
                    return self.engine.submit(vec![op]);
                }
                if !self.parts.failed() {
                    self.parts.fail(TransferError::Cancelled);
                }
                self.parts.settle()
            }
            Ok(_) => {
                let kind = if self.dir == IoDir::Read {
                    io::ErrorKind::UnexpectedEof
                } else {
                    io::ErrorKind::WriteZero
                };
                self.parts.fail(self.io_error(
                    i,
                    io::Error::new(kind, "no progress: the file ends before the request"),
                ));
                self.parts.settle()
            }
            Err(e) if e.raw_os_error() == Some(libc::ECANCELED) && !self.parts.failed() => {
                self.parts.fail(TransferError::Cancelled);
                self.parts.settle()
            }
            Err(e) if e.raw_os_error() == Some(libc::ECANCELED) => self.parts.settle(),
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN))
                    && m.retries.fetch_add(1, Ordering::AcqRel) < MAX_RETRIES
                    && self.wanted() =>
            {
                match self.op(i, m.done.load(Ordering::Acquire)) {
                    Some(op) => self.engine.submit(vec![op]),
                    None => self.parts.settle(),
                }
            }
            Err(e) => {
                self.parts.fail(self.io_error(i, e));
                self.parts.settle()
            }
        }
    }
}

fn check_aligned(what: &'static str, value: u64, file: &DiskFile) -> Result<()> {
    if !value.is_multiple_of(DISK_ALIGNMENT) {
        return Err(TransferError::Misaligned {
            alignment: DISK_ALIGNMENT,
            what,
            value,
            path: file.path().to_path_buf(),
        });
    }
    Ok(())
}

/// One run of a host ↔ disk job seen from the disk: where in which file,
/// which host address, how many bytes. Every backend that moves host ↔
/// file bytes (io_uring, pread, NIXL's POSIX plugin) starts from these.
pub(crate) struct DiskExtent {
    /// The file.
    pub(crate) file: Arc<DiskFile>,
    /// Byte offset in the file.
    pub(crate) file_offset: u64,
    /// Host address of the first byte.
    pub(crate) addr: u64,
    /// Bytes.
    pub(crate) len: u64,
}

/// The runs of `job` as disk extents, `reads` = disk → host. Bounds and
/// the disk alignment (file offset, length and host address) are checked
/// here, so a misaligned request fails before any I/O with an error that
/// names the alignment and the file.
pub(crate) fn disk_extents(job: &TransferJob, reads: bool) -> Result<Vec<DiskExtent>> {
    job.validate_bounds()?;
    let (disk_side, mem_side) = if reads {
        (Side::Source, Side::Destination)
    } else {
        (Side::Destination, Side::Source)
    };
    let mem = job.address_table(mem_side)?;
    let disks = job.regions(disk_side);
    let mut out = Vec::with_capacity(job.runs.len());
    for run in job.runs.iter() {
        let (disk_region, disk_off, mem_region, mem_off) = if reads {
            (
                run.src_region,
                run.src_offset,
                run.dst_region,
                run.dst_offset,
            )
        } else {
            (
                run.dst_region,
                run.dst_offset,
                run.src_region,
                run.src_offset,
            )
        };
        let Some((file, base)) = disks[disk_region as usize].file_location() else {
            return Err(TransferError::InvalidRequest(
                "disk side region is not a file".into(),
            ));
        };
        let file_offset = base + disk_off;
        let addr = mem[mem_region as usize] + mem_off;
        // O_DIRECT needs every offset, length and address aligned; a file
        // opened buffered on request takes any.
        if !file.takes_any_alignment() {
            check_aligned("file offset", file_offset, file)?;
            check_aligned("length", run.len, file)?;
            check_aligned("memory address", addr, file)?;
        }
        out.push(DiskExtent {
            file: Arc::clone(file),
            file_offset,
            addr,
            len: run.len,
        });
    }
    Ok(out)
}

impl<E: IoEngine> DiskBackend<E> {
    fn plan_ops(&self, job: &TransferJob, dir: IoDir) -> Result<Vec<OpMeta>> {
        let mut ops = Vec::new();
        for e in disk_extents(job, dir == IoDir::Read)? {
            let mut off = 0;
            while off < e.len {
                let len = (e.len - off).min(self.max_io_bytes as u64) as u32;
                ops.push(OpMeta {
                    file: Arc::clone(&e.file),
                    file_offset: e.file_offset + off,
                    addr: e.addr + off,
                    len,
                    done: AtomicU32::new(0),
                    retries: AtomicU32::new(0),
                });
                off += len as u64;
            }
        }
        Ok(ops)
    }
}

impl<E: IoEngine> TransferBackend for DiskBackend<E> {
    fn name(&self) -> &'static str {
        "disk"
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Disk
    }

    fn supports(&self, src: MemoryKind, dst: MemoryKind) -> bool {
        host_disk_pair(src, dst)
    }

    fn register_memory(&self, region: &MemoryRegion) -> Result<bool> {
        self.engine.register_memory(region)
    }

    fn submit(&self, job: TransferJob) -> Completion {
        let _span =
            tracing::trace_span!("disk", runs = job.runs.len(), engine = self.engine.name())
                .entered();
        let dst = match accepted_kinds(self, &job) {
            Ok((_, dst)) => dst,
            Err(e) => return Completion::ready(Err(e)),
        };
        let dir = if dst == MemoryKind::Disk {
            IoDir::Write
        } else {
            IoDir::Read
        };
        let ops = match self.plan_ops(&job, dir) {
            Ok(ops) => ops,
            Err(e) => return Completion::ready(Err(e)),
        };
        if ops.is_empty() {
            return Completion::ready(Ok(()));
        }
        if job.cancel.is_cancelled() {
            return Completion::ready(Err(TransferError::Cancelled));
        }
        let (completer, completion) = completion_pair();
        let n = ops.len();
        let state = Arc::new_cyclic(|this| DiskJob {
            dir,
            ops,
            parts: Countdown::new(n, completer),
            job,
            engine: self.engine.clone(),
            this: this.clone(),
        });
        let batch: Vec<IoOp> = (0..n).filter_map(|i| state.op(i, 0)).collect();
        self.engine.submit(batch);
        completion
    }
}
