//! Copies that failed during a replay: counted apart from the policy's
//! skips, by path and OS error, and summed up in one line the user cannot
//! miss.
//!
//! A failed offload leaves its block out of the tier it was going to (a
//! later request misses it); a failed onboard is served by computing the
//! blocks again, so neither is ever counted as a hit. Either makes the
//! hit rates describe a degraded run, which is why the binary exits
//! non-zero after one unless told the failures are expected.

use std::sync::Arc;

use kvbm_pool::metrics::TierStats;
use kvbm_testkit::fault::{Fault, FaultRule, FaultyEngine};
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::disk::{DefaultEngine, DiskBackend, DiskConfig, IoDir};
use kvbm_transfer::{BouncePool, Executor, ExecutorConfig};
use serde::Serialize;

use super::engine::PATHS;
use crate::error::Result;

/// Blocks whose copy failed on one path for one cause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FailureRow {
    /// `G2->G3` etc.
    pub path: &'static str,
    /// The OS error (`ENOSPC`, `EIO`, ...; a worker's comes with its
    /// ack), or `other` where the failure carried none.
    pub errno: String,
    /// Blocks that did not land.
    pub blocks: u64,
}

/// The failure rows of `stats`, in path order.
pub(crate) fn rows(stats: &TierStats) -> Vec<FailureRow> {
    stats
        .copy_failures
        .iter()
        .map(|f| FailureRow {
            path: PATHS[f.path as usize],
            errno: f.cause.label().into_owned(),
            blocks: f.blocks,
        })
        .collect()
}

/// The counters of several engines (one per restart of a replay) added
/// up, their copy failures merged by path and cause.
pub(crate) fn merged(all: &[TierStats]) -> TierStats {
    let mut out = TierStats::default();
    for s in all {
        let add = |a: &mut [u64], b: &[u64]| a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        add(&mut out.blocks, &s.blocks);
        add(&mut out.bytes, &s.bytes);
        add(&mut out.transfers, &s.transfers);
        add(&mut out.transfer_nanos, &s.transfer_nanos);
        add(&mut out.skipped, &s.skipped);
        add(&mut out.hits, &s.hits);
        for f in &s.copy_failures {
            match out
                .copy_failures
                .iter_mut()
                .find(|g| g.path == f.path && g.cause == f.cause)
            {
                Some(g) => g.blocks += f.blocks,
                None => out.copy_failures.push(*f),
            }
        }
        out.onboard_failures += s.onboard_failures;
        out.requests += s.requests;
        out.lookups += s.lookups;
        out.queue_depth += s.queue_depth;
        out.g3_recovered += s.g3_recovered;
        out.g3_rejected += s.g3_rejected;
        out.g3_unreadable += s.g3_unreadable;
    }
    out.copy_failures.sort_by_key(|f| f.path);
    out
}

/// One line saying what failed, or `None` when nothing did.
pub(crate) fn summary(
    offload_failures: u64,
    onboard_failures: u64,
    failed_onboards: usize,
    rows: &[FailureRow],
) -> Option<String> {
    if offload_failures == 0 && onboard_failures == 0 && failed_onboards == 0 {
        return None;
    }
    let by: Vec<String> = rows
        .iter()
        .map(|r| format!("{} {} x{}", r.path, r.errno, r.blocks))
        .collect();
    Some(format!(
        "copies failed during the replay: {offload_failures} blocks failed to offload and {onboard_failures} to onboard ({}); {failed_onboards} onboards failed and were computed again. \
         Failed blocks count as misses, never as hits, but the hit rates describe a degraded run",
        by.join(", ")
    ))
}

/// Faults injected under G3's disk backend, for tests of how a replay
/// reports failed copies (none by default, and in every real run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct G3Faults {
    /// G3 writes fail with `ENOSPC` once this many have succeeded: a disk
    /// that fills up mid-run.
    pub enospc_after_writes: Option<u64>,
    /// G3 reads fail with `EIO` once this many have succeeded.
    pub eio_after_reads: Option<u64>,
}

impl G3Faults {
    /// Whether any fault is asked for.
    pub fn any(&self) -> bool {
        self.enospc_after_writes.is_some() || self.eio_after_reads.is_some()
    }
}

/// A host executor whose G3 operations fail as `faults` says.
pub(crate) fn faulty_executor(memcpy_threads: usize, faults: G3Faults) -> Result<Executor> {
    let rule = |errno, dir, after: u64| {
        FaultRule::always(Fault::Errno(errno))
            .on_dir(dir)
            .after(usize::try_from(after).unwrap_or(usize::MAX))
    };
    let config = DiskConfig::default();
    let mut io = FaultyEngine::new(DefaultEngine::new(&config.engine)?);
    if let Some(n) = faults.enospc_after_writes {
        io = io.with(rule(libc::ENOSPC, IoDir::Write, n));
    }
    if let Some(n) = faults.eio_after_reads {
        io = io.with(rule(libc::EIO, IoDir::Read, n));
    }
    let disk = DiskBackend::with_engine(io, config.max_io_bytes);
    // The bounce pool of `ExecutorSpec::host().disk(true)`, for the pairs
    // that go through host memory on their way to or from the file.
    let bounce = BouncePool::system(4, 4 << 20)?;
    disk.register_memory(bounce.region())?;
    Ok(Executor::builder()
        .backend(Arc::new(MemcpyBackend::new(memcpy_threads)?))
        .backend(Arc::new(disk))
        .bounce_pool(bounce)
        .config(ExecutorConfig::default())
        .build()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_failure_no_summary() {
        assert_eq!(summary(0, 0, 0, &[]), None);
        let rows = [FailureRow {
            path: "G2->G3",
            errno: "ENOSPC".into(),
            blocks: 7,
        }];
        let s = summary(7, 0, 0, &rows).unwrap();
        assert!(s.contains("7 blocks failed to offload"), "{s}");
        assert!(s.contains("G2->G3 ENOSPC x7"), "{s}");
    }
}
