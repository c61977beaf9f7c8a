//! The use history as the engine and its tiers' policies share it: a
//! [`UseHistory`] behind a lock, and a queue of requests whose uses are
//! recorded but not applied yet.
//!
//! Recording a request updates the history's table once per prompt block,
//! which is too much work for the thread that matches requests (a
//! scheduler asks for every waiting request, every step).
//! [`SharedHistory::record_later`] only appends the request's hashes to
//! the queue; the queue is applied, oldest request first, by whoever next
//! takes the history's lock ([`SharedHistory::lock`] applies it before it
//! returns) or by a background thread calling
//! [`SharedHistory::apply_pending`]. Every reader therefore sees every use
//! recorded before it asked, in the order recorded: the decisions are
//! those of a history that records at once, whenever the queue is applied.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use kvbm_block::SequenceHash;
use parking_lot::{Mutex, MutexGuard};

use super::use_history::UseHistory;

/// Blocks the queue holds at most (8 bytes each): a request that would
/// leave more queued applies the queue (and itself) at once, so a history
/// whose queue nobody else applies keeps bounded memory.
pub const MAX_PENDING_BLOCKS: usize = 1 << 18;

/// Requests recorded and not applied yet, their hashes end to end.
#[derive(Debug, Default)]
struct Pending {
    hashes: Vec<SequenceHash>,
    /// Where each request's hashes end in `hashes`.
    ends: Vec<usize>,
}

impl Pending {
    fn clear(&mut self) {
        self.hashes.clear();
        self.ends.clear();
    }
}

#[derive(Debug)]
struct Inner {
    history: Mutex<UseHistory>,
    pending: Mutex<Pending>,
    /// Blocks in `pending` (0 lets [`SharedHistory::lock`] skip its lock).
    queued: AtomicUsize,
    /// Whether a request was recorded: the first one is applied at once,
    /// so that the history's request rate starts at its time.
    started: AtomicBool,
    /// An emptied queue kept for reuse (its allocation), taken while the
    /// history's lock is held.
    spare: Mutex<Pending>,
}

/// A [`UseHistory`] shared by the tier engine, which records requests, and
/// the policies of its tiers, which read it. Cloning shares it.
#[derive(Debug, Clone)]
pub struct SharedHistory(Arc<Inner>);

impl SharedHistory {
    /// Shares `history`.
    pub fn new(history: UseHistory) -> Self {
        Self(Arc::new(Inner {
            history: Mutex::new(history),
            pending: Mutex::default(),
            queued: AtomicUsize::new(0),
            started: AtomicBool::new(false),
            spare: Mutex::default(),
        }))
    }

    /// The history, with every request recorded so far applied.
    pub fn lock(&self) -> MutexGuard<'_, UseHistory> {
        let mut history = self.0.history.lock();
        if self.0.queued.load(Ordering::Acquire) > 0 {
            self.apply_locked(&mut history);
        }
        history
    }

    /// Applies the requests recorded so far (what [`lock`](Self::lock)
    /// does first): for a background thread, so that the next reader finds
    /// little left to apply.
    pub fn apply_pending(&self) {
        drop(self.lock());
    }

    /// Blocks recorded and not applied yet.
    pub fn pending_blocks(&self) -> usize {
        self.0.queued.load(Ordering::Acquire)
    }

    /// Records one request carrying `hashes` (its prompt's blocks, in
    /// order), as [`UseHistory::record_request`] does, but applied later:
    /// before the next reader reads. Returns the blocks queued now (a
    /// background thread applying the queue may want waking when they
    /// reach some amount); 0 when the request was applied at once (the
    /// first request, or one that would leave more than
    /// [`MAX_PENDING_BLOCKS`] queued).
    pub fn record_later(&self, hashes: &[SequenceHash]) -> usize {
        if !self.0.started.load(Ordering::Acquire)
            || self.0.queued.load(Ordering::Acquire) + hashes.len() > MAX_PENDING_BLOCKS
        {
            let mut history = self.lock();
            history.record_request(hashes);
            self.0.started.store(true, Ordering::Release);
            return 0;
        }
        let mut pending = self.0.pending.lock();
        pending.hashes.extend_from_slice(hashes);
        let end = pending.hashes.len();
        pending.ends.push(end);
        self.0.queued.store(end, Ordering::Release);
        end
    }

    /// Applies the queue to `history` (whose lock the caller holds), oldest
    /// request first.
    fn apply_locked(&self, history: &mut UseHistory) {
        // The queue is swapped for an empty one, so recording goes on while
        // it is applied.
        let mut batch = std::mem::take(&mut *self.0.spare.lock());
        {
            let mut pending = self.0.pending.lock();
            std::mem::swap(&mut *pending, &mut batch);
            self.0.queued.store(0, Ordering::Release);
        }
        let mut from = 0;
        for &end in &batch.ends {
            history.record_request(&batch.hashes[from..end]);
            from = end;
        }
        batch.clear();
        *self.0.spare.lock() = batch;
    }
}

impl From<UseHistory> for SharedHistory {
    fn from(history: UseHistory) -> Self {
        Self::new(history)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u64) -> SequenceHash {
        SequenceHash(x)
    }

    #[test]
    fn readers_see_every_request_recorded_before_them() {
        let shared = SharedHistory::new(UseHistory::new(100));
        assert_eq!(
            shared.record_later(&[h(1), h(2)]),
            0,
            "the first applies at once"
        );
        assert_eq!(shared.pending_blocks(), 0);
        assert_eq!(shared.record_later(&[h(1)]), 1);
        assert_eq!(shared.record_later(&[h(1), h(3)]), 3);
        assert_eq!(shared.pending_blocks(), 3);
        let u = shared.lock();
        assert_eq!(u.now(), 3);
        assert_eq!((u.uses(h(1)), u.uses(h(2)), u.uses(h(3))), (3, 1, 1));
        drop(u);
        assert_eq!(shared.pending_blocks(), 0);
    }

    #[test]
    fn the_queue_stays_bounded() {
        let shared = SharedHistory::new(UseHistory::new(1 << 20));
        let block: Vec<SequenceHash> = (0..4096).map(h).collect();
        for _ in 0..100 {
            shared.record_later(&block);
            assert!(shared.pending_blocks() <= MAX_PENDING_BLOCKS);
        }
        assert_eq!(shared.lock().uses(h(7)), 100);
    }
}
