//! The pluggable transfer-backend system.
//!
//! A backend moves bytes described by a [`TransferJob`]: two region tables
//! (source and destination) and a list of [`CopyRun`]s from kvbm-layout's
//! copy planner, each naming a source region and offset, a destination
//! region and offset, and a length. The backend receives the whole run list at once, so
//! it can batch (one io_uring submission, one `cuMemcpyBatchAsync`, one copy
//! kernel over `&[CopyRun]` with [`TransferJob::address_table`] as the base
//! address tables) instead of paying per-run overhead.
//!
//! # Adding a backend
//! 1. Implement [`TransferBackend`]: [`TransferBackend::supports`] says which
//!    (source kind, destination kind) pairs it moves; [`TransferBackend::submit`]
//!    starts the job and returns a [`Completion`] at once. Signal completion
//!    from wherever the work finishes (a worker thread, an io_uring completion
//!    thread, a CUDA host-function callback on the stream) by calling
//!    [`Completer::complete`](crate::Completer::complete) — never by polling.
//!    Check [`TransferJob::cancel`] between units of work and resolve with
//!    [`TransferError::Cancelled`] once everything already started has
//!    settled.
//! 2. Give it a [`BackendKind`] (add a variant if it is a new kind) and add
//!    rows to [`STRATEGY_TABLE`](crate::strategy::STRATEGY_TABLE) naming it.
//! 3. Register an instance with
//!    `ExecutorBuilder::backend` (the executor module).
//!
//! Nothing else changes: the executor picks strategies from the table and
//! drives every backend through this trait.

pub mod memcpy;

use std::sync::Arc;

use crate::completion::{CancelToken, Completion};
use crate::error::{Result, TransferError};
use crate::memory::{MemoryKind, MemoryRegion};

pub use kvbm_layout::CopyRun;

/// Names a backend in the strategy table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BackendKind {
    /// CPU `memcpy` between host regions, split over a small thread pool.
    Memcpy,
    /// Host ↔ disk file I/O (io_uring, or a pread/pwrite thread pool).
    Disk,
    /// CUDA copies to, from and between device memory (feature `cuda`).
    Cuda,
}

/// One unit of work for a backend: copy every run from the source regions to
/// the destination regions.
#[derive(Debug, Clone)]
pub struct TransferJob {
    /// Source region table; `CopyRun::src_region` indexes it.
    pub src: Arc<[MemoryRegion]>,
    /// Destination region table; `CopyRun::dst_region` indexes it.
    pub dst: Arc<[MemoryRegion]>,
    /// What to copy.
    pub runs: Arc<[CopyRun]>,
    /// Set when the caller cancels.
    pub cancel: CancelToken,
}

/// Which side of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The source regions.
    Source,
    /// The destination regions.
    Destination,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Source => "source",
            Side::Destination => "destination",
        }
    }
}

impl TransferJob {
    /// Builds a job.
    pub fn new(
        src: Arc<[MemoryRegion]>,
        dst: Arc<[MemoryRegion]>,
        runs: Arc<[CopyRun]>,
        cancel: CancelToken,
    ) -> Self {
        TransferJob {
            src,
            dst,
            runs,
            cancel,
        }
    }

    /// The region table of one side.
    pub fn regions(&self, side: Side) -> &[MemoryRegion] {
        match side {
            Side::Source => &self.src,
            Side::Destination => &self.dst,
        }
    }

    /// The single memory kind of one side, or an error if the side mixes
    /// kinds or is empty.
    pub fn kind(&self, side: Side) -> Result<MemoryKind> {
        let regions = self.regions(side);
        let first = regions
            .first()
            .ok_or_else(|| {
                TransferError::InvalidRequest(format!("{} region table is empty", side.name()))
            })?
            .kind();
        if regions.iter().any(|r| r.kind() != first) {
            return Err(TransferError::InvalidRequest(format!(
                "{} regions mix memory kinds",
                side.name()
            )));
        }
        Ok(first)
    }

    /// Base addresses of one side's regions, indexed like the region table —
    /// what a copy kernel needs next to the run list. Errors for disk regions.
    pub fn address_table(&self, side: Side) -> Result<Vec<u64>> {
        self.regions(side)
            .iter()
            .map(|r| {
                r.addr().ok_or_else(|| {
                    TransferError::InvalidRequest(format!(
                        "{} region is a file, not an address",
                        side.name()
                    ))
                })
            })
            .collect()
    }

    /// Total bytes the runs move.
    pub fn total_bytes(&self) -> u64 {
        self.runs.iter().map(|r| r.len).sum()
    }

    /// Checks that every run lies inside its source and destination regions.
    /// Backends call this before touching memory.
    pub fn validate_bounds(&self) -> Result<()> {
        for run in self.runs.iter() {
            check_run(
                &self.src,
                Side::Source,
                run.src_region,
                run.src_offset,
                run.len,
            )?;
            check_run(
                &self.dst,
                Side::Destination,
                run.dst_region,
                run.dst_offset,
                run.len,
            )?;
        }
        Ok(())
    }
}

fn check_run(
    regions: &[MemoryRegion],
    side: Side,
    region: u32,
    offset: u64,
    len: u64,
) -> Result<()> {
    let region_len = regions.get(region as usize).map(|r| r.len());
    match region_len {
        Some(rl) if offset.checked_add(len).is_some_and(|end| end <= rl) => Ok(()),
        _ => Err(TransferError::OutOfBounds {
            side: side.name(),
            region,
            offset,
            len,
            region_len: region_len.unwrap_or(0),
        }),
    }
}

/// The job's (source, destination) memory kinds, or the error a backend
/// returns for a job it cannot move: the first check of every `submit`.
pub(crate) fn accepted_kinds(
    backend: &(impl TransferBackend + ?Sized),
    job: &TransferJob,
) -> Result<(MemoryKind, MemoryKind)> {
    let (src, dst) = (job.kind(Side::Source)?, job.kind(Side::Destination)?);
    if !backend.supports(src, dst) {
        return Err(TransferError::BackendMismatch {
            backend: backend.name(),
            src,
            dst,
        });
    }
    Ok((src, dst))
}

/// Whether `src → dst` is host memory ↔ a disk file, either way: what the
/// disk backends move.
pub(crate) fn host_disk_pair(src: MemoryKind, dst: MemoryKind) -> bool {
    (src.is_host() && dst == MemoryKind::Disk) || (src == MemoryKind::Disk && dst.is_host())
}

/// A way of moving bytes between kinds of memory.
///
/// See the [module documentation](self) for how to add one.
pub trait TransferBackend: Send + Sync + 'static {
    /// A short name for logs and errors.
    fn name(&self) -> &'static str;

    /// Which entry of the strategy table this backend fills.
    fn kind(&self) -> BackendKind;

    /// Whether this backend moves bytes from `src` to `dst` memory.
    fn supports(&self, src: MemoryKind, dst: MemoryKind) -> bool;

    /// Starts the job and returns at once. The completion resolves to
    /// `Ok(())` only when every byte of every run has landed; on failure or
    /// cancellation it resolves to the error once nothing of the job is
    /// still in flight.
    fn submit(&self, job: TransferJob) -> Completion;

    /// Prepares long-lived memory for fast transfers: the disk backend makes
    /// host memory an io_uring fixed buffer; a CUDA backend may page-lock it.
    /// The backend keeps `region` alive while it relies on the registration.
    /// Returns whether the backend made use of it; the default ignores it.
    fn register_memory(&self, region: &MemoryRegion) -> Result<bool> {
        let _ = region;
        Ok(false)
    }
}
