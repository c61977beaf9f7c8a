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
//!
//! **Kept.** A G3 kept across restarts keeps a record per slot
//! ([`KeptStore`]): a slot's record is emptied before a move writes it and
//! names the block and its checksum once the move landed, so a record
//! names either nothing or bytes that were fully written. Its checksums
//! are always on (a restarted worker takes them from the records) and are
//! taken over the whole slot, as the store's layout and `python -m
//! kvbm_py.cache --verify` read it; a slot that fails its check loses its
//! record.

use std::collections::HashSet;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::memory::DiskOptions;
use parking_lot::Mutex;

use super::settle::{Earlier, Pending, start};
use super::{Direction, DiskMove, KeptFound, PageCopy, PagedDisk, Shared, layouts};
use crate::error::Result;
use crate::kept::{BlockLabel, KeptStore, Medium};
use crate::verify::block_sum;

/// Staging slots in the region for reads from G3: a load of more blocks
/// than this reads them in rounds.
pub(super) const STAGING_SLOTS: usize = 32;

/// The slot file and, in verify mode or when kept, the checksum of each
/// slot's block.
pub(super) struct Disk {
    pub(super) file: PhysicalLayout,
    pub(super) slots: usize,
    pub(super) sums: Option<Mutex<Vec<Option<u64>>>>,
    /// The slots' records, when G3 is kept across restarts.
    pub(super) kept: Option<KeptStore>,
}

/// Opens G3 as `d` says, its slots `stride` bytes apart: a file removed on
/// drop, or a kept store reopened with the blocks its records name (then
/// also returned, for the books).
pub(super) fn open(d: &PagedDisk, stride: u64, verify: bool) -> Result<(Disk, Option<KeptFound>)> {
    let Some(identity) = &d.kept else {
        let disk = Disk {
            file: layouts::slot_file(&d.dir, d.slots, stride)?,
            slots: d.slots,
            sums: verify.then(|| Mutex::new(vec![None; d.slots])),
            kept: None,
        };
        return Ok((disk, None));
    };
    let layout = layouts::whole_slots(d.slots, stride)?;
    let medium = Medium::Disk(DiskOptions::default().io_mode);
    let (store, file, recovery) = KeptStore::open_free(&d.dir, identity, layout, &medium)?;
    let (found, sums) = layouts::recovered(&store, recovery, d.slots);
    let disk = Disk {
        file,
        slots: d.slots,
        sums: Some(Mutex::new(sums)),
        kept: Some(store),
    };
    Ok((disk, Some(found)))
}

/// What the staging thread is handed, in order.
pub(super) enum Stage {
    /// A job to run.
    Job(Staged),
    /// Empty every record of a kept G3 and record nothing more (after the
    /// jobs handed before).
    ForgetKept,
}

/// A job that moves bytes to or from G3 before its engine copies.
pub(super) struct Staged {
    pub(super) job: u64,
    pub(super) direction: Direction,
    pub(super) copies: Vec<PageCopy>,
    /// The blocks to move to G3 first (stores).
    pub(super) demote: Vec<DiskMove>,
    pub(super) started: Instant,
}

/// Runs staged jobs in order until the worker drops its sender, handing
/// each to the settling thread.
pub(super) fn stage_loop(shared: &Shared, rx: Receiver<Stage>, settle: Sender<Pending>) {
    for item in rx {
        let s = match item {
            Stage::Job(s) => s,
            Stage::ForgetKept => {
                stop_kept(shared);
                continue;
            }
        };
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

/// Empties every record of a kept G3 and records nothing in it from now
/// on (logged when emptying fails: the blocks then come back after a
/// restart, each still checked).
fn stop_kept(shared: &Shared) {
    let Some(kept) = shared.disk.as_ref().and_then(|d| d.kept.as_ref()) else {
        return;
    };
    if let Err(e) = kept.stop() {
        tracing::warn!(dir = %kept.dir().display(), "G3 records not emptied: {e}");
    }
}

/// Moves blocks to G3 and waits. Their sums follow them: in verify mode
/// the sum recorded when the block was stored; for a kept G3 the sum of
/// the whole G2 slot (in verify mode only where the block still matches
/// its sum), recorded once the block landed.
pub(super) fn demote(shared: &Shared, moves: &[DiskMove]) -> Result<(), String> {
    if moves.is_empty() {
        return Ok(());
    }
    let disk = shared.disk.as_ref().ok_or("a demotion without G3")?;
    if let Some(kept) = &disk.kept {
        let slots: Vec<u32> = moves.iter().map(|m| m.to as u32).collect();
        kept.forget(&slots)
            .map_err(|e| format!("emptying {} G3 records: {e}", slots.len()))?;
    }
    let pairs: Vec<(usize, usize)> = moves.iter().map(|m| (m.from, m.to)).collect();
    let moving = shared.executor.transfer(&shared.region, &disk.file, &pairs);
    // The sums are taken while the blocks move: the G2 slots are only read
    // by the move, and nothing writes them before this returns.
    let stored: Option<Vec<Option<u64>>> = shared.sums.as_ref().map(|from| {
        let from = from.lock();
        moves.iter().map(|m| from[m.from]).collect()
    });
    let sums: Option<Vec<Option<u64>>> = match (&disk.kept, stored) {
        (None, stored) => stored,
        (Some(_), stored) => Some(
            moves
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    // In verify mode a block changed at rest in G2 is not
                    // recorded: its load fails and it is recomputed.
                    let intact = stored.as_ref().is_none_or(|s| {
                        s[i].is_some() && block_sum(&shared.g2[m.group], m.from).ok() == s[i]
                    });
                    intact
                        .then(|| block_sum(&shared.region, m.from).ok())
                        .flatten()
                })
                .collect(),
        ),
    };
    moving
        .wait()
        .map_err(|f| format!("moving {} blocks to G3: {f}", pairs.len()))?;
    let (Some(to), Some(sums)) = (&disk.sums, sums) else {
        return Ok(());
    };
    {
        let mut to = to.lock();
        for (m, &sum) in moves.iter().zip(&sums) {
            to[m.to] = sum;
        }
    }
    // Recorded on this thread, which stops the store at a reset after the
    // moves handed to it before: a move recorded before is emptied then,
    // one after records nothing.
    if let Some(kept) = disk.kept.as_ref() {
        let records: Vec<(u32, BlockLabel, u64)> = moves
            .iter()
            .zip(&sums)
            .filter_map(|(m, sum)| {
                let label = BlockLabel {
                    hash: m.key,
                    parent: None,
                };
                sum.map(|sum| (m.to as u32, label, sum))
            })
            .collect();
        // A record not written loses the block at a restart, nothing more.
        if let Err(e) = kept.commit(&records) {
            tracing::warn!(dir = %kept.dir().display(), "G3 records not written: {e}");
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
            // A kept G3 sums whole slots, an unkept one the group's block.
            let got = match disk.kept {
                Some(_) => block_sum(&shared.region, staging(i)),
                None => block_sum(&shared.g2[c.group], staging(i)),
            };
            if want.is_none() || got.ok() != want {
                if let Some(kept) = &disk.kept {
                    // Not found again after a restart either.
                    let _ = kept.forget(&[c.slot as u32]);
                }
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
