//! How a job of a [`PagedWorker`](super::PagedWorker) ends: its copies
//! are waited for, checked against the slots' checksums with checksums on
//! (summed on the GPU for device pages, `g1_sums.rs`), the pages of a
//! failed load are wiped, and a [`JobReport`] is filed.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::time::Instant;

use kvbm_pool::rate_limit::{RateLimit, held_back_note};
use kvbm_transfer::{Executor, TransferHandle};
use parking_lot::Mutex;

use super::g1_sums::G1Sums;
use super::{Direction, JobReport, PageCopy, Shared};
use crate::kept::BlockLabel;
use crate::verify::{DeviceSums, block_sum};

/// At most one warning every few seconds that the GPU could not sum a
/// job's blocks.
static GPU_SUMS_FAILED: RateLimit = RateLimit::new(kvbm_pool::rate_limit::WARN_EVERY);

/// What a job's earlier steps (demotions, reads from G3) left: the bytes
/// that reached the engine's pages, the copies that failed, and the
/// first error.
#[derive(Debug, Default)]
pub(super) struct Earlier {
    pub(super) bytes: u64,
    pub(super) failed: Vec<PageCopy>,
    pub(super) error: Option<String>,
}

impl Earlier {
    pub(super) fn fail(
        &mut self,
        copies: impl IntoIterator<Item = PageCopy>,
        error: impl FnOnce() -> String,
    ) {
        let before = self.failed.len();
        self.failed.extend(copies);
        if self.failed.len() > before {
            self.error.get_or_insert_with(error);
        }
    }
}

/// A job whose copies between G1 and the slots are in flight.
pub(super) struct Pending {
    pub(super) job: u64,
    pub(super) direction: Direction,
    /// The copies between G1 and G2 slots.
    pub(super) copies: Vec<PageCopy>,
    /// One transfer per group the copies touch, with that group's index.
    pub(super) transfers: Vec<(usize, TransferHandle)>,
    pub(super) earlier: Earlier,
    pub(super) started: Instant,
}

/// Starts every group's share of `copies` between G1 and the G2 slots.
pub(super) fn start(
    shared: &Shared,
    executor: &Executor,
    direction: Direction,
    copies: &[PageCopy],
) -> Vec<(usize, TransferHandle)> {
    let mut transfers = Vec::new();
    for (group, (g1, g2)) in shared.g1.iter().zip(&shared.g2).enumerate() {
        let pairs: Vec<(usize, usize)> = copies
            .iter()
            .filter(|c| c.group == group)
            .map(|c| match direction {
                Direction::Store => (c.block, c.slot),
                Direction::Load => (c.slot, c.block),
            })
            .collect();
        if pairs.is_empty() {
            continue;
        }
        let handle = match direction {
            Direction::Store => executor.transfer(g1, g2, &pairs),
            Direction::Load => executor.transfer(g2, g1, &pairs),
        };
        transfers.push((group, handle));
    }
    transfers
}

/// Settles jobs in the order they arrive until every sender is gone.
pub(super) fn settle_loop(shared: &Shared, rx: Receiver<Pending>) {
    for pending in rx {
        let report = settle(shared, pending);
        let mut r = shared.reports.lock();
        r.in_flight.remove(&report.job);
        r.due.remove(&report.job);
        r.done.push(report);
        shared.settled.notify_all();
        drop(r);
        shared.filed.fetch_add(1, Ordering::Release);
    }
}

fn settle(shared: &Shared, p: Pending) -> JobReport {
    let Earlier {
        mut bytes,
        failed: failed_earlier,
        mut error,
    } = p.earlier;
    // With checksums on and the pages on a GPU, the G1 blocks are summed
    // there: a store's sources while its copies run (the engine leaves
    // them alone until the job ends), a load's destinations once they
    // landed.
    let gpu = shared
        .sums
        .as_ref()
        .and(shared.g1_sums.as_ref())
        .map(|device| (device, G1Sums::prepare(device, &shared.g1, &p.copies)));
    let take = |gpu: &Option<(&DeviceSums, Result<G1Sums, String>)>| {
        gpu.as_ref().map(|(device, prepared)| {
            prepared
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|g| g.take(device))
        })
    };
    let early = match p.direction {
        Direction::Store => take(&gpu),
        Direction::Load => None,
    };
    // This job's copies between G1 and G2 that failed (judged below with
    // no regard to the earlier steps' slots, which are G3's).
    let mut failed = Vec::new();
    for (group, handle) in p.transfers {
        match handle.wait() {
            Ok(report) => bytes += report.bytes,
            Err(f) => {
                error.get_or_insert_with(|| f.to_string());
                let landed: HashSet<(usize, usize)> = f.completed.iter().copied().collect();
                failed.extend(p.copies.iter().filter(|c| {
                    let pair = match p.direction {
                        Direction::Store => (c.block, c.slot),
                        Direction::Load => (c.slot, c.block),
                    };
                    c.group == group && !landed.contains(&pair)
                }));
            }
        }
    }
    if let Some(sums) = &shared.sums {
        let on_gpu = match p.direction {
            Direction::Store => early,
            Direction::Load => take(&gpu),
        };
        judge(
            shared,
            sums,
            p.direction,
            &p.copies,
            on_gpu,
            &mut failed,
            &mut error,
        );
    }
    if p.direction == Direction::Store {
        record(shared, &p.copies, &failed, &mut error);
    }
    failed.extend(failed_earlier);
    if p.direction == Direction::Load && !failed.is_empty() {
        wipe(shared, &failed, &mut error);
    }
    JobReport {
        job: p.job,
        direction: p.direction,
        bytes,
        seconds: p.started.elapsed().as_secs_f64(),
        failed,
        error,
    }
}

/// Overwrites the pages a failed load wrote with zeros (from the zero
/// slot), so bytes that failed their check never stay where the engine
/// might read them: a request recomputed after a failed load may reuse
/// those blocks, and a partly filled block is read whole by attention
/// kernels that mask, not skip, the tokens beyond its end.
fn wipe(shared: &Shared, failed: &[PageCopy], error: &mut Option<String>) {
    for (group, (g1, g2)) in shared.g1.iter().zip(&shared.g2).enumerate() {
        let pairs: Vec<(usize, usize)> = failed
            .iter()
            .filter(|c| c.group == group)
            .map(|c| (shared.zero_slot(), c.block))
            .collect();
        if pairs.is_empty() {
            continue;
        }
        if let Err(f) = shared.executor.transfer(g2, g1, &pairs).wait() {
            tracing::error!("kvbm: wiping the pages of a failed load failed: {f}");
            error.get_or_insert_with(|| format!("wiping a failed load's pages: {f}"));
        }
    }
}

/// A kept G2: names each stored block that landed, with the sum `judge`
/// took, in its slot's record (emptied before the store started), unless
/// the tier stopped keeping.
fn record(shared: &Shared, copies: &[PageCopy], failed: &[PageCopy], error: &mut Option<String>) {
    let (Some(kept), Some(sums)) = (&shared.host_kept, &shared.sums) else {
        return;
    };
    let broken: HashSet<usize> = failed.iter().map(|c| c.slot).collect();
    let sums = sums.lock();
    let landed: Vec<(u32, BlockLabel, u64)> = copies
        .iter()
        .filter(|c| !broken.contains(&c.slot))
        .filter_map(|c| {
            let (key, sum) = (c.key?, sums[c.slot]?);
            let label = BlockLabel {
                hash: key,
                parent: None,
            };
            Some((c.slot as u32, label, sum))
        })
        .collect();
    drop(sums);
    // After a reset the store records nothing (`KeptStore::stop`).
    if let Err(e) = kept.commit(&landed) {
        // The records stay empty: the blocks are served now, not after a
        // restart.
        tracing::warn!(dir = %kept.dir().display(), "G2 records not written: {e}");
        error.get_or_insert_with(|| format!("writing {} G2 records: {e}", landed.len()));
    }
}

/// With checksums on: records the sum of each stored block for its slot,
/// and checks each loaded block against its slot's sum once the load
/// ended (a slot is not written while a load reads it: the books hold
/// it), so bytes that changed at rest in host memory are never served.
/// `on_gpu` holds the sums of the copies' G1 blocks where the GPU took
/// them (indexed like `copies`); otherwise the host sums the slots.
fn judge(
    shared: &Shared,
    sums: &Mutex<Vec<Option<u64>>>,
    direction: Direction,
    copies: &[PageCopy],
    on_gpu: Option<Result<Vec<u64>, String>>,
    failed: &mut Vec<PageCopy>,
    error: &mut Option<String>,
) {
    let on_gpu = match on_gpu {
        Some(Ok(taken)) => Some(taken),
        Some(Err(e)) => {
            if let Some(held_back) = GPU_SUMS_FAILED.check() {
                tracing::warn!(
                    "kvbm: the GPU could not sum a job's blocks ({e}); the host sums its slots{}",
                    held_back_note(held_back)
                );
            }
            None
        }
        None => None,
    };
    let broken: HashSet<(usize, usize)> = failed.iter().map(|c| (c.group, c.slot)).collect();
    for (i, c) in copies.iter().enumerate() {
        if broken.contains(&(c.group, c.slot)) {
            if direction == Direction::Store {
                sums.lock()[c.slot] = None;
            }
            continue;
        }
        let got = match &on_gpu {
            Some(taken) => Ok(taken[i]),
            None => block_sum(&shared.g2[c.group], c.slot),
        };
        match direction {
            Direction::Store => sums.lock()[c.slot] = got.ok(),
            Direction::Load => {
                let want = sums.lock()[c.slot];
                if got.ok() != want || want.is_none() {
                    failed.push(*c);
                    error.get_or_insert_with(|| {
                        format!(
                            "block {} loaded from slot {} failed its checksum: \
                             its bytes are not those stored",
                            c.block, c.slot
                        )
                    });
                }
            }
        }
    }
}
