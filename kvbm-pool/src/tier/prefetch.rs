//! G3 prefetch: a match's G3 blocks start moving the moment they are
//! found.
//!
//! The last `g3_staging_blocks` blocks of G2's memory are a staging area
//! outside G2's pool (nothing registers there, nothing is evicted for it;
//! up to half of it also holds blocks on their way to G3, see
//! [`super::behind`]). Before reading, prefetch waits for the writes of the
//! blocks it reads to land. When a match finds G3 blocks, [`start`] takes staging slots for them
//! (as many as are free), and submits one G3 → G2 read of those blocks:
//! sorted by their place in the file and given consecutive slots, so blocks
//! adjacent in the file become one large read. The read runs while the
//! engine allocates G1 and the onboard copies the G2 part; the onboard then
//! copies staged blocks G2 → G1 as soon as the read has landed (at once if
//! it already has) and reads any others straight from G3.
//!
//! Lifetime: a [`Prefetch`] holds its G3 blocks (so they are not evicted
//! and overwritten while read) until its read ends, and its staging slots
//! until the last holder lets go — the request's match, the onboard's
//! staged copy. A new match of the same request keeps the read when it
//! still serves it (schedulers match a waiting request at every step); a
//! request released (or matched to other blocks) before its onboard
//! cancels the read; what was not started is skipped, and slots and holds
//! return when the read has stopped. A failed or cancelled read is never
//! copied on: the onboard waiting for it fails and loads nothing.
//!
//! Offload batches wait while a read runs, as they wait for onboards.

use std::sync::Arc;
use std::time::Instant;

use kvbm_transfer::{CancelToken, TransferError, TransferOutcome};
use parking_lot::Mutex;

use super::Shared;
use super::requests::Segment;
use crate::config::Tier;
use crate::pool::ImmutableBlock;
use crate::rate_limit::{RateLimit, WARN_EVERY, held_back_note};

/// The staging area: slots `base..base + n` of G2's memory. G3 prefetch
/// reads into it; G3 write-behind ([`super::behind`]) keeps blocks on their
/// way to the disk in up to half of it.
pub(crate) struct Staging {
    base: u32,
    /// `true` for a free slot, by slot index.
    free: Mutex<Vec<bool>>,
}

impl Staging {
    /// Slots `base..base + n`.
    pub(crate) fn new(base: usize, n: usize) -> Arc<Self> {
        Arc::new(Self {
            base: base as u32,
            free: Mutex::new(vec![true; n]),
        })
    }

    /// Free slots.
    pub(crate) fn free_slots(&self) -> usize {
        self.free.lock().iter().filter(|f| **f).count()
    }

    /// Up to `n` slots for blocks on their way to G3, one per block, as
    /// long as half of the area stays free for prefetch.
    pub(super) fn take_for_writes(self: &Arc<Self>, n: usize) -> Vec<StagingSlots> {
        let spare = {
            let free = self.free.lock();
            let n_free = free.iter().filter(|f| **f).count();
            n_free.saturating_sub(free.len().div_ceil(2))
        };
        match n.min(spare) {
            0 => Vec::new(),
            n => self.take(n).split(),
        }
    }

    /// Up to `n` slots: the first run of `n` free ones if there is one (so
    /// adjacent blocks land adjacent), else the lowest free ones.
    fn take(self: &Arc<Self>, n: usize) -> StagingSlots {
        let mut free = self.free.lock();
        let mut picked: Vec<usize> = Vec::with_capacity(n);
        let mut run = 0usize;
        for (i, f) in free.iter().enumerate() {
            run = if *f { run + 1 } else { 0 };
            if run == n {
                picked.extend(i + 1 - n..=i);
                break;
            }
        }
        if picked.is_empty() {
            picked.extend(
                free.iter()
                    .enumerate()
                    .filter(|(_, f)| **f)
                    .map(|(i, _)| i)
                    .take(n),
            );
        }
        for &i in &picked {
            free[i] = false;
        }
        StagingSlots {
            staging: Arc::clone(self),
            ids: picked.into_iter().map(|i| self.base + i as u32).collect(),
        }
    }
}

/// Staging slots in use; freed when dropped.
pub(super) struct StagingSlots {
    staging: Arc<Staging>,
    ids: Vec<u32>,
}

impl StagingSlots {
    /// The slots' block ids in G2's memory.
    pub(super) fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// One holder per slot, each freeing its own.
    fn split(mut self) -> Vec<StagingSlots> {
        std::mem::take(&mut self.ids)
            .into_iter()
            .map(|id| StagingSlots {
                staging: Arc::clone(&self.staging),
                ids: vec![id],
            })
            .collect()
    }
}

impl Drop for StagingSlots {
    fn drop(&mut self) {
        let mut free = self.staging.free.lock();
        for &id in &self.ids {
            free[(id - self.staging.base) as usize] = true;
        }
    }
}

/// What runs when the read ends: its outcome.
pub(crate) type ReadWaiter = Box<dyn FnOnce(Result<(), TransferError>) + Send>;

enum State {
    /// The read is in flight; the G3 blocks it reads are held.
    Reading {
        waiter: Option<ReadWaiter>,
        _holds: Vec<ImmutableBlock>,
    },
    /// The read ended; its outcome until someone takes it.
    Read(Option<Result<(), TransferError>>),
}

/// One request's G3 read into staging slots.
pub(crate) struct Prefetch {
    cancel: CancelToken,
    /// `(index, slot)`: the block at `index` of the request's blocks to
    /// onboard (counted from the end of its G1 prefix) is read into G2
    /// block `slot`.
    staged: Vec<(usize, u32)>,
    /// The G3 block each staged block is read from, in `staged` order.
    sources: Vec<u32>,
    _slots: StagingSlots,
    state: Mutex<State>,
}

impl Prefetch {
    /// The staged blocks, `(index, slot)`.
    pub(crate) fn staged(&self) -> &[(usize, u32)] {
        &self.staged
    }

    /// Whether this read still serves a new match of the same request
    /// (`segments`, from the same G1 prefix): every staged block is the
    /// same G3 block at the same place, and the read has not failed. A
    /// scheduler that matches a waiting request again at every step then
    /// keeps one read instead of restarting it.
    pub(crate) fn serves(&self, segments: &[Segment]) -> bool {
        if self.cancel.is_cancelled() {
            return false;
        }
        if let State::Read(outcome) = &*self.state.lock()
            && !matches!(outcome, Some(Ok(())))
        {
            return false;
        }
        let mut g3_at: Vec<Option<u32>> = Vec::new();
        for seg in segments {
            let ids = seg.blocks.block_ids();
            g3_at.extend(ids.iter().map(|&id| seg.g3.then_some(id)));
        }
        self.staged
            .iter()
            .zip(&self.sources)
            .all(|(&(i, _), &g3)| g3_at.get(i).copied().flatten() == Some(g3))
    }

    /// Stops the read where it has not started.
    pub(crate) fn cancel(&self) {
        self.cancel.cancel();
    }

    /// The token that cancels the read.
    pub(crate) fn cancel_token(&self) -> &CancelToken {
        &self.cancel
    }

    /// Runs `f` with the read's outcome when it ends (now, if it has).
    /// One waiter only: the request's onboard.
    pub(crate) fn when_read(&self, f: ReadWaiter) {
        let mut s = self.state.lock();
        match &mut *s {
            State::Reading { waiter, .. } => *waiter = Some(f),
            State::Read(outcome) => {
                let outcome = outcome.take().unwrap_or(Err(TransferError::Cancelled));
                drop(s);
                f(outcome);
            }
        }
    }

    fn read_ended(&self, shared: &Shared, outcome: TransferOutcome, started: Instant) {
        shared.rates.g3.observe_outcome(&outcome, started);
        let outcome = match outcome {
            Ok(_) => Ok(()),
            Err(failure) => {
                static WARN: RateLimit = RateLimit::new(WARN_EVERY);
                if !self.cancel.is_cancelled()
                    && let Some(held_back) = WARN.check()
                {
                    let more = held_back_note(held_back);
                    tracing::warn!("G3 prefetch failed: {failure}{more}");
                }
                Err(failure.error)
            }
        };
        let mut s = self.state.lock();
        let waiter = match &mut *s {
            State::Reading { waiter, .. } => waiter.take(),
            State::Read(_) => None,
        };
        // The outcome goes to the waiter, or stays for the one to come.
        let (old, run) = match waiter {
            Some(f) => (
                std::mem::replace(&mut *s, State::Read(None)),
                Some((f, outcome)),
            ),
            None => (std::mem::replace(&mut *s, State::Read(Some(outcome))), None),
        };
        drop(s);
        shared.offload.onboard_ended();
        // The holds go here, outside the lock.
        drop(old);
        if let Some((f, outcome)) = run {
            f(outcome);
        }
    }
}

/// Starts reading the G3 blocks of `segments` (a match's runs, in prefix
/// order) into free staging slots; `None` when there is no staging area,
/// no G3 block or no free slot.
pub(crate) fn start(shared: &Arc<Shared>, segments: &[Segment]) -> Option<Arc<Prefetch>> {
    let staging = shared.staging.as_ref()?;
    let mut found: Vec<(usize, u32, ImmutableBlock)> = Vec::new();
    let mut at = 0usize;
    for seg in segments {
        if seg.g3 {
            found.extend((0..seg.blocks.len()).filter_map(|k| {
                let b = seg.blocks.get(k)?;
                Some((at + k, b.block_id(), b))
            }));
        }
        at += seg.blocks.len();
    }
    if found.is_empty() {
        return None;
    }
    // Blocks whose write to G3 has not landed are read once it has; one
    // whose write failed is left to the onboard, which then fails.
    let g3_ids: Vec<u32> = found.iter().map(|&(_, g3, _)| g3).collect();
    if super::behind::wait_readable(shared, &g3_ids).is_err() {
        return None;
    }
    let slots = staging.take(found.len());
    if slots.ids.is_empty() {
        return None;
    }
    // The first blocks of the prefix get the slots; in file order, so that
    // adjacent blocks are one read.
    found.truncate(slots.ids.len());
    found.sort_by_key(|&(_, g3, _)| g3);
    let pairs: Vec<(usize, usize)> = found
        .iter()
        .zip(&slots.ids)
        .map(|(&(_, g3, _), &slot)| (g3 as usize, slot as usize))
        .collect();
    let staged = found
        .iter()
        .zip(&slots.ids)
        .map(|(&(i, ..), &slot)| (i, slot))
        .collect();
    let sources = found.iter().map(|&(_, g3, _)| g3).collect();
    let holds = found.into_iter().map(|(.., b)| b).collect();
    let prefetch = Arc::new(Prefetch {
        cancel: CancelToken::new(),
        staged,
        sources,
        _slots: slots,
        state: Mutex::new(State::Reading {
            waiter: None,
            _holds: holds,
        }),
    });
    shared.offload.onboard_started();
    let started = Instant::now();
    let (shared2, p2) = (Arc::clone(shared), Arc::clone(&prefetch));
    shared
        .mover
        .copy(Tier::G3, Tier::G2, pairs, prefetch.cancel.clone())
        .on_complete(move |outcome| {
            super::behind::reads_ended(&shared2, &outcome);
            p2.read_ended(&shared2, outcome, started)
        });
    Some(prefetch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_come_as_one_run_when_they_can_and_return_when_dropped() {
        let s = Staging::new(100, 8);
        let a = s.take(3);
        assert_eq!(a.ids, [100, 101, 102]);
        let b = s.take(2);
        assert_eq!(b.ids, [103, 104]);
        drop(a);
        // A run of 3 fits before b.
        assert_eq!(s.take(3).ids, [100, 101, 102]);
        // No run of 4 is free: the lowest free slots.
        let c = s.take(4);
        assert_eq!(c.ids, [100, 101, 102, 105]);
        drop(b);
        drop(c);
        assert_eq!(s.free_slots(), 8);
        let all = s.take(20);
        assert_eq!(all.ids.len(), 8);
        assert!(s.take(1).ids.is_empty());
    }

    #[test]
    fn writes_take_one_slot_each_and_leave_half_to_prefetch() {
        let s = Staging::new(10, 8);
        let mut w = s.take_for_writes(6);
        assert_eq!(w.len(), 4, "half of the area stays free");
        assert!(w.iter().all(|slot| slot.ids().len() == 1));
        assert!(s.take_for_writes(1).is_empty());
        let p = s.take(2);
        drop(w.pop());
        // A write slot came back, but prefetch holds two: 3 of 8 are free,
        // less than half, so writes get none.
        assert_eq!(s.free_slots(), 3);
        assert!(s.take_for_writes(1).is_empty());
        drop(p);
        assert_eq!(s.take_for_writes(8).len(), 1);
    }
}
