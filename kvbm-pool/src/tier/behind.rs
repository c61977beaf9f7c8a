//! G3 write-behind: blocks leave for the disk without anyone waiting for
//! the disk.
//!
//! In write-back mode, allocating G1 blocks evicts G1 victims that are
//! copied to G2 first, and allocating their G2 targets evicts G2 victims
//! that must reach G3 before their G2 slots are written. Written straight
//! to disk, those G3 copies would make every G1 allocation under pressure
//! wait for disk writes — an onboard from G3 among them, whose allocation
//! then takes longer than its reads.
//!
//! Instead, each block bound for G3 (a G2 victim, or a G1 victim that G2
//! refused) is copied into a free slot of the G3 staging area (host memory
//! beyond G2's pool, shared with G3 prefetch: a memory copy), its G3 target
//! is allocated and registered at once, so the books — what each tier
//! holds, what it evicts — are exactly those of a synchronous write, and
//! the disk write from the staging slot is queued. The offload worker
//! starts the queued writes, as one transfer, while no onboard runs (as it
//! does offload batches; an onboard's reads then have the disk to
//! themselves), or at once when a reader waits for one of them; the staging
//! slots return when the write has ended.
//!
//! Rules that keep every byte read the byte written:
//! - A G3 slot is read only after its last write landed: G3 prefetch and
//!   an onboard's direct G3 reads first call [`wait_readable`], which
//!   fails for a slot whose write failed (until it is written again); a
//!   match stops before such a block ([`written_prefix`]), as it would
//!   had the block never been registered.
//! - Two writes to one G3 slot never race: before a slot is written again
//!   (its block was evicted from G3, so nobody reads it), a queued write to
//!   it is dropped and a write in flight is waited for.
//! - A staging slot is reused only after its write ended.
//! - Nothing is lost at shutdown: the worker writes every queued block
//!   before it returns, and [`OffloadQueue::flush`] waits for them.
//!
//! Write-behind takes at most half of the staging area, leaving the rest to
//! prefetch; a block that finds no free slot (or an engine without a
//! staging area) is written to G3 directly, and the worker waits for it.
//!
//! [`OffloadQueue::flush`]: super::offload::OffloadQueue::flush

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use kvbm_transfer::{CancelToken, TransferError};

use super::offload::OffloadQueue;
use super::prefetch::StagingSlots;
use super::victims::{copy_victims, landed_pairs};
use super::{Shared, TierSlot};
use crate::config::Tier;
use crate::metrics::Path;
use crate::policy::Evicted;
use crate::pool::MutableBlock;
use crate::rate_limit::{RateLimit, WARN_EVERY, held_back_note};

/// One block waiting in a staging slot for its G3 write.
pub(super) struct Write {
    /// The G3 block written.
    g3: u32,
    /// What it holds.
    label: super::mover::BlockLabel,
    /// The path it counts on (G2 → G3, or G1 → G3).
    path: Path,
    /// The staging slot holding its bytes until the write ended.
    slot: StagingSlots,
}

/// Why a G3 slot's last write failed.
#[derive(Clone, Debug)]
struct WriteFailed {
    message: String,
    os_error: Option<i32>,
}

/// The write-behind queue (kept under the offload queue's lock).
#[derive(Default)]
pub(super) struct Writes {
    /// Writes not started, in order.
    queued: Vec<Write>,
    /// G3 slots of the writes in flight (one transfer at a time).
    flying: Option<HashSet<u32>>,
    /// G3 slots with a write queued or in flight.
    pending: HashSet<u32>,
    /// G3 slots whose last write failed.
    failed: HashMap<u32, WriteFailed>,
    /// Readers waiting for a write: queued writes start even while onboards
    /// run.
    wanted: usize,
}

impl Writes {
    /// Whether the worker should start the queued writes now.
    pub(super) fn ready(&self, onboards: usize) -> bool {
        self.flying.is_none() && !self.queued.is_empty() && (onboards == 0 || self.wanted > 0)
    }

    /// Whether any write is queued or in flight.
    pub(super) fn busy(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Whether a write to one of `ids` is queued or in flight.
    fn pending_any(&self, ids: &[u32]) -> bool {
        !self.pending.is_empty() && ids.iter().any(|id| self.pending.contains(id))
    }

    /// Takes the queued writes; they are in flight from now on.
    pub(super) fn take(&mut self) -> Vec<Write> {
        let batch = std::mem::take(&mut self.queued);
        self.flying = Some(batch.iter().map(|w| w.g3).collect());
        batch
    }

    /// The writes in flight (to G3 slots `written`) ended; `failed[i]` says
    /// why `written[i]` did not land, if it did not.
    fn ended(&mut self, written: &[u32], failed: &[Option<WriteFailed>]) {
        for (&g3, f) in written.iter().zip(failed) {
            self.pending.remove(&g3);
            match f {
                None => self.failed.remove(&g3),
                Some(f) => self.failed.insert(g3, f.clone()),
            };
        }
        self.flying = None;
    }
}

/// Copies `victims` (blocks of `src`) to their G3 `targets` (`victims[i]`
/// into `targets[i]`). Those that get a staging slot are copied there,
/// registered in G3 and queued for the disk; the others are written and
/// registered before this returns. Runs on the offload worker.
pub(super) fn write(
    shared: &Shared,
    src: &TierSlot,
    path: Path,
    victims: &[Evicted],
    mut targets: Vec<MutableBlock>,
) {
    let Some(g3) = shared.books.g3() else {
        return;
    };
    let ids: HashSet<u32> = targets.iter().map(MutableBlock::block_id).collect();
    supersede(&shared.offload, &ids);
    let mut slots = match &shared.staging {
        Some(s) => s.take_for_writes(victims.len()),
        None => Vec::new(),
    };
    let buffered = slots.len();
    let direct = targets.split_off(buffered);
    if !direct.is_empty() {
        copy_victims(shared, src, g3, path, &victims[buffered..], direct);
    }
    if buffered == 0 {
        return;
    }
    let victims = &victims[..buffered];
    // Into the staging slots: a memory copy (a device-to-host one from G1).
    let pairs: Vec<(usize, usize)> = victims
        .iter()
        .zip(&slots)
        .map(|(v, s)| (v.id as usize, s.ids()[0] as usize))
        .collect();
    let outcome = shared
        .mover
        .copy(src.tier, Tier::G2, pairs.clone(), CancelToken::new())
        .wait();
    let (landed, cause) = landed_pairs(path, &pairs, &outcome);
    let mut complete = Vec::with_capacity(buffered);
    let mut queued = Vec::with_capacity(buffered);
    let mut failed = 0u64;
    for (((v, target), slot), ok) in victims.iter().zip(targets).zip(slots.drain(..)).zip(landed) {
        if !ok {
            failed += 1;
            continue; // target and slot dropped: both free again
        }
        let g3_id = target.block_id();
        match target.complete(v.hash, v.parent) {
            Ok(c) => {
                complete.push(c);
                queued.push(Write {
                    g3: g3_id,
                    label: (v.hash, v.parent),
                    path,
                    slot,
                });
            }
            Err(e) => tracing::warn!("cannot complete a G3 target: {e}"),
        }
    }
    shared.metrics.copy_failed(path, cause, failed);
    let n = complete.len() as u64;
    let ids: Vec<u32> = queued.iter().map(|w| w.g3).collect();
    // Pending before a match can find them: readers wait for the write.
    shared.offload.writes().pending.extend(&ids);
    if let Err(e) = g3.pool.register(complete) {
        let mut w = shared.offload.writes();
        for id in &ids {
            w.pending.remove(id);
        }
        drop(w);
        tracing::warn!("G3 targets refused by their own pool: {e}");
        shared
            .metrics
            .copy_failed(path, crate::metrics::FailureCause::Other, n);
        return;
    }
    shared.metrics.registered_ahead(n);
    shared.offload.writes().queued.extend(queued);
    shared.offload.wake();
}

/// Before G3 slots `ids` are written again: drops queued writes to them
/// (their blocks left G3) and waits for writes to them in flight.
fn supersede(q: &OffloadQueue, ids: &HashSet<u32>) {
    let mut s = q.writes();
    let (dropped, kept): (Vec<Write>, Vec<Write>) = std::mem::take(&mut s.queued)
        .into_iter()
        .partition(|w| ids.contains(&w.g3));
    s.queued = kept;
    for w in &dropped {
        s.pending.remove(&w.g3);
    }
    while s.flying.as_ref().is_some_and(|f| !f.is_disjoint(ids)) {
        s.wait();
    }
    for id in ids {
        s.failed.remove(id);
    }
    drop(s);
    // The staging slots of dropped writes return here, outside the lock.
    drop(dropped);
}

/// Starts `batch` (taken from the queue by the worker): one transfer from
/// the staging slots to G3; when it ends, the slots return and readers
/// waiting for these G3 slots wake.
pub(super) fn start(shared: &Arc<Shared>, batch: Vec<Write>) {
    let pairs: Vec<(usize, usize)> = batch
        .iter()
        .map(|w| (w.slot.ids()[0] as usize, w.g3 as usize))
        .collect();
    let labels = batch.iter().map(|w| w.label).collect();
    let started = Instant::now();
    let waker = Arc::clone(shared);
    shared
        .mover
        .copy_labelled(
            Tier::G2,
            Tier::G3,
            pairs.clone(),
            labels,
            CancelToken::new(),
        )
        .on_complete(move |outcome| {
            let took = started.elapsed();
            let ok: HashSet<(usize, usize)> = match &outcome {
                Ok(_) => pairs.iter().copied().collect(),
                Err(f) => f.completed.iter().copied().collect(),
            };
            let why = outcome.as_ref().err().map(|f| WriteFailed {
                message: f.error.to_string(),
                os_error: f.error.os_error(),
            });
            let failed: Vec<Option<WriteFailed>> = pairs
                .iter()
                .map(|p| if ok.contains(p) { None } else { why.clone() })
                .collect();
            let shared = waker;
            account(&shared, &batch, &failed, &outcome, took);
            let written: Vec<u32> = batch.iter().map(|w| w.g3).collect();
            // The staging slots return before anyone learns the write ended.
            drop(batch);
            shared.offload.writes().ended(&written, &failed);
            shared.offload.wake();
        });
}

/// Metrics of an ended write: bytes per path, failures per path.
fn account(
    shared: &Shared,
    batch: &[Write],
    failed: &[Option<WriteFailed>],
    outcome: &kvbm_transfer::TransferOutcome,
    took: std::time::Duration,
) {
    let bytes = shared.books.g3().map_or(0, |g3| g3.block_bytes);
    for path in [Path::G2ToG3, Path::G1ToG3] {
        let of_path = || batch.iter().zip(failed).filter(|(w, _)| w.path == path);
        let landed = of_path().filter(|(_, f)| f.is_none()).count() as u64;
        let lost = of_path().count() as u64 - landed;
        if landed > 0 {
            shared.metrics.copied(path, landed, landed * bytes, took);
        }
        if lost > 0
            && let Err(f) = outcome
        {
            let cause = crate::metrics::FailureCause::of(&f.error);
            static WARN: RateLimit = RateLimit::new(WARN_EVERY);
            if let Some(held_back) = WARN.check() {
                let more = held_back_note(held_back);
                tracing::warn!(?path, %cause, "G3 write failed: {f}{more}");
            }
            shared.metrics.copy_failed(path, cause, lost);
        }
    }
}

/// Blocks until no write to G3 slots `ids` is queued or in flight (asking
/// the worker to start queued ones at once); fails when the last write of
/// one of them failed: its bytes are not there.
pub(crate) fn wait_readable(shared: &Shared, ids: &[u32]) -> Result<(), TransferError> {
    let q = &shared.offload;
    let mut s = q.writes();
    if s.pending_any(ids) {
        s.wanted += 1;
        q.wake();
        while s.pending_any(ids) {
            s.wait();
        }
        s.wanted -= 1;
    }
    if s.failed.is_empty() {
        return Ok(());
    }
    match ids.iter().find_map(|id| s.failed.get(id)) {
        None => Ok(()),
        Some(f) => Err(TransferError::Remote {
            origin: "G3 write-behind".into(),
            message: format!("the block's write to G3 failed: {}", f.message),
            os_error: f.os_error,
        }),
    }
}

/// Marks the G3 slots of the reads in `outcome` that did not land (their
/// bytes failed their checksum, or the disk failed them) as unreadable
/// until they are written again, as a failed write leaves them: no match
/// finds their blocks and no read tries them again. Cancelled reads are
/// not marked. The failed pairs are `(G3 slot, destination)`.
pub(crate) fn reads_ended(shared: &Shared, outcome: &kvbm_transfer::TransferOutcome) {
    let Err(f) = outcome else {
        return;
    };
    if matches!(f.error, TransferError::Cancelled) || f.failed.is_empty() {
        return;
    }
    let why = WriteFailed {
        message: format!("its bytes could not be read back: {}", f.error),
        os_error: f.error.os_error(),
    };
    let mut s = shared.offload.writes();
    for &(g3, _) in &f.failed {
        if let Ok(id) = u32::try_from(g3) {
            s.failed.insert(id, why.clone());
        }
    }
    drop(s);
    shared.metrics.g3_unreadable(f.failed.len() as u64);
}

/// How many of `ids` (G3 blocks, in prefix order) come before the first
/// whose last write failed: a match stops there, as if G3 lacked it.
pub(crate) fn written_prefix(shared: &Shared, ids: &[u32]) -> usize {
    let s = shared.offload.writes();
    if s.failed.is_empty() {
        return ids.len();
    }
    ids.iter()
        .position(|id| s.failed.contains_key(id))
        .unwrap_or(ids.len())
}

/// Writes every queued block and waits for the writes to end (the worker
/// stopping).
pub(super) fn drain(shared: &Arc<Shared>) {
    let q = &shared.offload;
    let mut s = q.writes();
    loop {
        while s.flying.is_some() {
            s.wait();
        }
        if s.queued.is_empty() {
            return;
        }
        let batch = s.take();
        drop(s);
        start(shared, batch);
        s = q.writes();
    }
}
