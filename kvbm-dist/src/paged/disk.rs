//! G3 behind a [`PagedWorker`](super::PagedWorker)'s slots: a file of
//! slots, written by demotions and read through staging slots.
//!
//! The books in the scheduler keep G3 exclusive of G2: a block moves to
//! G3 when G2 evicts it, by the store that takes its G2 slot, so the move
//! (`demote`) must land before that store writes the slot. A load of a
//! block held in G3 reads its whole slot into a staging slot of the
//! region (one request per block), checks it there in verify mode, and
//! copies it into the engine's pages as any G2 load. Both run on a thread
//! of the worker, one job after another, and hand the job on to the
//! settling thread once its engine copies are under way.

use std::collections::HashSet;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use kvbm_transfer::PhysicalLayout;
use parking_lot::Mutex;

use super::settle::{Earlier, Pending, start};
use super::{Direction, PageCopy, Shared};
use crate::verify::block_sum;

/// Staging slots in the region for reads from G3: a load of more blocks
/// than this reads them in rounds.
pub(super) const STAGING_SLOTS: usize = 32;

/// The slot file and, in verify mode, the checksum of each slot's block.
pub(super) struct Disk {
    pub(super) file: PhysicalLayout,
    pub(super) slots: usize,
    pub(super) sums: Option<Mutex<Vec<Option<u64>>>>,
}

/// A job that moves bytes to or from G3 before its engine copies.
pub(super) struct Staged {
    pub(super) job: u64,
    pub(super) direction: Direction,
    pub(super) copies: Vec<PageCopy>,
    /// `(G2 slot, G3 slot)` of each block to move to G3 first (stores).
    pub(super) demote: Vec<(usize, usize)>,
    pub(super) started: Instant,
}

/// Runs staged jobs in order until the worker drops its sender, handing
/// each to the settling thread.
pub(super) fn stage_loop(shared: &Shared, rx: Receiver<Staged>, settle: Sender<Pending>) {
    for s in rx {
        let pending = match s.direction {
            Direction::Store => store(shared, s),
            Direction::Load => load(shared, s),
        };
        if settle.send(pending).is_err() {
            return;
        }
    }
}

/// Moves the demoted blocks to G3, then starts the store; if a move
/// failed the store is not made (its slots would lose a block G3 was
/// promised) and every copy of the job fails.
fn store(shared: &Shared, s: Staged) -> Pending {
    let mut earlier = Earlier::default();
    let (copies, transfers) = match demote(shared, &s.demote) {
        Ok(()) => {
            let transfers = start(shared, &shared.executor, Direction::Store, &s.copies);
            (s.copies, transfers)
        }
        Err(e) => {
            earlier.fail(s.copies, || e);
            (Vec::new(), Vec::new())
        }
    };
    Pending {
        job: s.job,
        direction: Direction::Store,
        copies,
        transfers,
        earlier,
        started: s.started,
    }
}

/// Moves `(G2 slot, G3 slot)` blocks to G3 and waits; their sums follow
/// them in verify mode.
pub(super) fn demote(shared: &Shared, pairs: &[(usize, usize)]) -> Result<(), String> {
    if pairs.is_empty() {
        return Ok(());
    }
    let disk = shared.disk.as_ref().ok_or("a demotion without G3")?;
    shared
        .executor
        .transfer(&shared.region, &disk.file, pairs)
        .wait()
        .map_err(|f| format!("moving {} blocks to G3: {f}", pairs.len()))?;
    if let (Some(from), Some(to)) = (&shared.sums, &disk.sums) {
        let from = from.lock();
        let mut to = to.lock();
        for &(g2, g3) in pairs {
            to[g3] = from[g2];
        }
    }
    Ok(())
}

/// Starts the job's loads from G2 slots, then reads its G3 blocks in
/// rounds through the staging slots.
fn load(shared: &Shared, s: Staged) -> Pending {
    let (on_disk, in_g2): (Vec<PageCopy>, Vec<PageCopy>) =
        s.copies.into_iter().partition(|c| c.disk);
    let transfers = start(shared, &shared.executor, Direction::Load, &in_g2);
    let mut earlier = Earlier::default();
    for round in on_disk.chunks(STAGING_SLOTS) {
        read_round(shared, round, &mut earlier);
    }
    Pending {
        job: s.job,
        direction: Direction::Load,
        copies: in_g2,
        transfers,
        earlier,
        started: s.started,
    }
}

/// Reads `round`'s G3 slots into staging slots, checks them in verify
/// mode, and copies the good ones into the engine's pages.
fn read_round(shared: &Shared, round: &[PageCopy], earlier: &mut Earlier) {
    let Some(disk) = &shared.disk else {
        return earlier.fail(round.iter().copied(), || "a load from G3 without G3".into());
    };
    let staging = |i: usize| shared.staging_slot(i);
    let pairs: Vec<(usize, usize)> = round
        .iter()
        .enumerate()
        .map(|(i, c)| (c.slot, staging(i)))
        .collect();
    let landed: HashSet<(usize, usize)> = match shared
        .executor
        .transfer(&disk.file, &shared.region, &pairs)
        .wait()
    {
        Ok(_) => pairs.iter().copied().collect(),
        Err(f) => {
            earlier
                .error
                .get_or_insert_with(|| format!("reading G3: {f}"));
            f.completed.iter().copied().collect()
        }
    };
    let mut good = Vec::with_capacity(round.len());
    for (i, c) in round.iter().enumerate() {
        if !landed.contains(&(c.slot, staging(i))) {
            earlier.failed.push(*c);
            continue;
        }
        if let Some(sums) = &disk.sums {
            let want = sums.lock()[c.slot];
            if want.is_none() || block_sum(&shared.g2[c.group], staging(i)).ok() != want {
                earlier.fail([*c], || {
                    format!(
                        "G3 slot {} failed its checksum: its bytes changed since they were stored",
                        c.slot
                    )
                });
                continue;
            }
        }
        good.push((i, *c));
    }
    for (group, (g1, g2)) in shared.g1.iter().zip(&shared.g2).enumerate() {
        let pairs: Vec<(usize, usize)> = good
            .iter()
            .filter(|(_, c)| c.group == group)
            .map(|&(i, c)| (staging(i), c.block))
            .collect();
        if pairs.is_empty() {
            continue;
        }
        match shared.executor.transfer(g2, g1, &pairs).wait() {
            Ok(report) => earlier.bytes += report.bytes,
            Err(f) => {
                let done: HashSet<(usize, usize)> = f.completed.iter().copied().collect();
                let lost = good
                    .iter()
                    .filter(|(i, c)| c.group == group && !done.contains(&(staging(*i), c.block)))
                    .map(|&(_, c)| c);
                earlier.fail(lost, || format!("copying from staging: {f}"));
            }
        }
    }
}
