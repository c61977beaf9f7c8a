//! The offload queue and its worker: G1 → G2, and G2's victims → G3.
//!
//! The queue is bounded and never blocks the engine: past its bound new
//! offloads are skipped and counted. One worker thread takes batches of up
//! to `offload_batch` blocks; it sleeps on a condition variable while there
//! is nothing to do or any onboard runs (onboarding is latency-critical,
//! and both share the executor's in-flight limit), so nothing polls.
//!
//! Per batch: upgrade each queued [`WeakBlock`] (a source freed since it
//! was queued is skipped: the offload is cancelled); skip hashes G2
//! already holds or a batch in flight is copying; ask G2's admission
//! policy; allocate the admitted blocks' targets. Allocation may evict G2
//! blocks; their slots are about to be overwritten, so their bytes go to G3
//! first (victim caching). Then start the G1 → G2 copy; the batch is then
//! *in flight*, and each target is registered only once its bytes landed
//! (a failed copy registers nothing and its targets return to the free
//! list).
//!
//! Up to `offload_in_flight` batches are in flight at once: the worker
//! prepares and starts the next batch while earlier copies run, and
//! registers landed batches in the order they started. One at a time, the
//! link idles while a batch is registered and the next prepared, and beside
//! the model every batch waits alone for the SMs its staging kernel needs
//! (`docs/benchmarks.md`, "Offload through the tier engine"). A batch's
//! sources stay held, and its targets unregistered, until its copy ended;
//! write-back and G2 → G3 copies stay synchronous (their callers wait for
//! the slots they free), but for the saves of G1's free reserve, which the
//! worker runs while no onboard does (or at once when an allocation needs
//! their slots) and which hold their slots until saved.
//!
//! Write-back offers G1's victims to G2 one at a time, in eviction order,
//! each admitted against what G2 would evict at that point (as the
//! simulator does); a victim G2 refuses is offered to G3 the same way
//! (a G1 → G3 copy).

mod source;
mod worker;

use std::collections::VecDeque;
use std::sync::Arc;

use kvbm_block::SequenceHash;
use parking_lot::{Condvar, Mutex, MutexGuard};

use super::Shared;
use super::behind::{Write, Writes};
use crate::metrics::SkipReason;
use crate::policy::Evicted;
use crate::pool::{MutableBlock, WeakBlock};
pub(crate) use source::EngineGuard;
use source::Pending;
pub(crate) use worker::{batch_limit, run_worker};

/// G1 victims to save before their slots are reused, and whether that is
/// done.
struct WriteBack {
    victims: Vec<Evicted>,
    done: Arc<(Mutex<bool>, Condvar)>,
}

impl WriteBack {
    /// The victims are saved (or skipped): wakes the allocation waiting.
    fn saved(&self) {
        *self.done.0.lock() = true;
        self.done.1.notify_all();
    }
}

/// G1 victims evicted ahead of need (the free reserve) and their slots,
/// held until the victims are saved: then the slots join G1's free list.
struct Clean {
    victims: Vec<Evicted>,
    slots: Vec<MutableBlock>,
}

/// Everything under the queue's lock.
#[derive(Default)]
struct QueueState {
    items: VecDeque<Pending>,
    /// Write-back batches: they run before anything else, onboards or not.
    urgent: VecDeque<WriteBack>,
    /// Background saves of G1's reserve, not started.
    cleans: VecDeque<Clean>,
    /// G1 slots held by background saves queued or running (every save
    /// holds at least one; free once it ends); `flush` waits for them.
    cleaning_slots: usize,
    /// Allocations waiting for the background saves: they then run even
    /// while onboards do.
    clean_wanted: usize,
    /// Onboards running: the worker does not start a batch meanwhile.
    onboards: usize,
    /// Batches and write-backs the worker has taken and not finished (in
    /// flight, or being prepared); `flush` waits for them.
    working: usize,
    /// The use history's queue wants applying (the worker applies it
    /// whenever it has nothing else to do, woken or not).
    history: bool,
    /// Callers of [`OffloadQueue::wait_idle`] so far, and how many of them
    /// the worker has answered: it answers all of them whenever it finds
    /// nothing to do.
    idle_asked: u64,
    idle_answered: u64,
    shutdown: bool,
    /// G3 write-behind: blocks in staging slots on their way to the disk.
    writes: Writes,
}

/// The bounded queue, the onboard gate and the flush barrier.
#[derive(Default)]
pub(crate) struct OffloadQueue {
    state: Mutex<QueueState>,
    cv: Condvar,
}

impl OffloadQueue {
    /// The engine is dropped: nothing queued runs any more; waiting
    /// write-backs return and background saves are dropped unsaved.
    pub(crate) fn shutdown(&self) {
        let mut s = self.state.lock();
        s.shutdown = true;
        for wb in s.urgent.drain(..) {
            wb.saved();
        }
        // Not saved: the engine goes away with its G2.
        let cleans = std::mem::take(&mut s.cleans);
        let held: usize = cleans.iter().map(|c| c.slots.len()).sum();
        s.cleaning_slots = s.cleaning_slots.saturating_sub(held);
        drop(s);
        drop(cleans);
        self.cv.notify_all();
    }

    /// Wakes the worker to apply the use history's queue of recorded
    /// requests, off the thread that matches requests.
    pub(crate) fn apply_history(&self) {
        self.state.lock().history = true;
        self.cv.notify_all();
    }

    /// Whether the engine is shutting down (nothing queued runs any more).
    pub(crate) fn is_shut_down(&self) -> bool {
        self.state.lock().shutdown
    }

    /// Hands G1's victims to the worker and waits until they are saved (or
    /// skipped): their slots may then be overwritten.
    pub(crate) fn write_back(&self, victims: Vec<Evicted>) {
        let done = Arc::new((Mutex::new(false), Condvar::new()));
        {
            let mut s = self.state.lock();
            if s.shutdown {
                return;
            }
            s.urgent.push_back(WriteBack {
                victims,
                done: Arc::clone(&done),
            });
        }
        self.cv.notify_all();
        let mut d = done.0.lock();
        while !*d {
            done.1.wait(&mut d);
        }
    }

    /// Hands G1's victims evicted ahead of need, and their held slots, to
    /// the worker, which saves the victims when no onboard runs (or an
    /// allocation waits for them) and then frees the slots.
    pub(crate) fn clean(&self, victims: Vec<Evicted>, slots: Vec<MutableBlock>) {
        let mut s = self.state.lock();
        if s.shutdown || slots.is_empty() {
            return;
        }
        s.cleaning_slots += slots.len();
        s.cleans.push_back(Clean { victims, slots });
        drop(s);
        self.cv.notify_all();
    }

    /// G1 slots held by background saves not ended yet (they will be free).
    pub(crate) fn cleaning_slots(&self) -> usize {
        self.state.lock().cleaning_slots
    }

    /// Waits until the background saves handed over so far have ended
    /// (their slots are free).
    pub(crate) fn wait_cleaned(&self) {
        let mut s = self.state.lock();
        if s.cleaning_slots == 0 {
            return;
        }
        s.clean_wanted += 1;
        self.cv.notify_all();
        while !s.shutdown && s.cleaning_slots > 0 {
            self.cv.wait(&mut s);
        }
        s.clean_wanted -= 1;
    }

    /// Waits until the worker has looked at the queue after this call and
    /// found nothing it can do now (or the engine shuts down).
    pub(crate) fn wait_idle(&self) {
        let mut s = self.state.lock();
        s.idle_asked += 1;
        let asked = s.idle_asked;
        // Wakes the worker: a sleeping worker has nothing to do, but it
        // answers only when it looks again.
        self.cv.notify_all();
        while !s.shutdown && s.idle_answered < asked {
            self.cv.wait(&mut s);
        }
    }

    /// Waits until every queued offload, write-back, background save and G3
    /// write has run, and every onboard in flight has ended.
    pub(crate) fn flush(&self) {
        let mut s = self.state.lock();
        while !s.shutdown
            && (s.working > 0
                || s.cleaning_slots > 0
                || s.onboards > 0
                || !s.items.is_empty()
                || s.writes.busy())
        {
            self.cv.wait(&mut s);
        }
    }

    /// An onboard starts: offload batches wait until it ends.
    pub(crate) fn onboard_started(&self) -> usize {
        let mut s = self.state.lock();
        s.onboards += 1;
        s.onboards
    }

    /// An onboard ended.
    pub(crate) fn onboard_ended(&self) -> usize {
        let mut s = self.state.lock();
        s.onboards = s.onboards.saturating_sub(1);
        let left = s.onboards;
        drop(s);
        if left == 0 {
            self.cv.notify_all();
        }
        left
    }
}

/// Queues registered G1 pool blocks (with their parents' hashes) for
/// offload to G2; past the queue's bound they are skipped and counted.
pub(crate) fn enqueue(
    shared: &Shared,
    blocks: impl IntoIterator<Item = (WeakBlock, Option<SequenceHash>)>,
) {
    enqueue_sources(
        shared,
        blocks
            .into_iter()
            .map(|(b, parent)| Pending::pool(b, parent)),
    );
}

/// Queues engine-owned G1 blocks `(id, hash, parent)` under `guard`.
pub(crate) fn enqueue_engine(
    shared: &Shared,
    guard: &Arc<EngineGuard>,
    blocks: &[(u32, SequenceHash, Option<SequenceHash>)],
) {
    enqueue_sources(
        shared,
        blocks
            .iter()
            .map(|&(id, hash, parent)| Pending::engine(id, hash, parent, guard)),
    );
}

fn enqueue_sources(shared: &Shared, blocks: impl Iterator<Item = Pending>) {
    let q = &shared.offload;
    let limit = shared.config.offload_queue;
    let mut dropped = 0u64;
    let mut s = q.state.lock();
    for p in blocks {
        if s.items.len() >= limit || s.shutdown {
            dropped += 1;
        } else {
            s.items.push_back(p);
        }
    }
    shared.metrics.queue_depth(s.items.len());
    drop(s);
    q.cv.notify_all();
    shared.metrics.skipped(SkipReason::QueueFull, dropped);
}

/// What the worker does next.
enum Step {
    /// The oldest batch in flight landed: register it.
    Land,
    /// Save G1's victims (write-back mode).
    WriteBack(WriteBack),
    /// Save G1's victims evicted ahead of need, then free their slots.
    Clean(Clean),
    /// Prepare and start a batch.
    Start(Vec<Pending>),
    /// Apply the use history's queue.
    History,
    /// Start the queued G3 writes.
    Write(Vec<Write>),
    /// The engine is dropped.
    Stop,
}

/// What the worker asks of the queue to choose its next step.
struct WorkerView<'a> {
    /// Whether the oldest batch in flight landed (asked again after every
    /// wake-up: a copy lands on another thread).
    front_landed: &'a dyn Fn() -> bool,
    /// Whether another batch may be put in flight.
    room: bool,
}

impl OffloadQueue {
    /// The worker's next step, in order of precedence; sleeps while there
    /// is none, answering [`Self::wait_idle`] callers first.
    fn next_step(&self, shared: &Shared, view: WorkerView<'_>) -> Step {
        let mut s = self.state.lock();
        loop {
            if s.shutdown {
                return Step::Stop;
            }
            if (view.front_landed)() {
                return Step::Land;
            }
            if let Some(wb) = s.urgent.pop_front() {
                s.working += 1;
                return Step::WriteBack(wb);
            }
            if (s.onboards == 0 || s.clean_wanted > 0)
                && let Some(c) = s.cleans.pop_front()
            {
                return Step::Clean(c);
            }
            if s.writes.ready(s.onboards) {
                return Step::Write(s.writes.take());
            }
            if view.room && s.onboards == 0 && !s.items.is_empty() {
                let n = worker::batch_limit(shared).min(s.items.len());
                s.working += 1;
                let batch = s.items.drain(..n).collect();
                shared.metrics.queue_depth(s.items.len());
                return Step::Start(batch);
            }
            if std::mem::take(&mut s.history) || shared.books.pending_uses() > 0 {
                return Step::History;
            }
            // Nothing to do: answer whoever waits for that.
            if s.idle_answered < s.idle_asked {
                s.idle_answered = s.idle_asked;
                self.cv.notify_all();
            }
            self.cv.wait(&mut s);
        }
    }

    /// The worker finished a batch or a write-back.
    fn finished(&self) {
        let mut s = self.state.lock();
        s.working = s.working.saturating_sub(1);
        drop(s);
        self.cv.notify_all();
    }

    /// A background save ended: its `held` G1 slots are free.
    fn cleaned(&self, held: usize) {
        let mut s = self.state.lock();
        s.cleaning_slots = s.cleaning_slots.saturating_sub(held);
        drop(s);
        self.cv.notify_all();
    }

    /// Blocks until `landed` says a batch's copy ended (its completion
    /// wakes the worker through [`Self::wake_worker`]).
    fn wait_landed(&self, landed: impl Fn() -> bool) {
        let mut s = self.state.lock();
        while !landed() {
            self.cv.wait(&mut s);
        }
    }

    /// Wakes the worker after a copy's outcome was stored. Taking the
    /// queue's lock orders this with the worker's check of the outcome
    /// before it sleeps: the wake-up cannot be missed.
    fn wake_worker(&self) {
        drop(self.state.lock());
        self.cv.notify_all();
    }

    /// The worker stops: what is still queued is dropped (returns how
    /// many blocks) and nothing counts as in progress any more.
    fn worker_stopped(&self) -> usize {
        let mut s = self.state.lock();
        let left = s.items.len();
        s.items.clear();
        s.working = 0;
        drop(s);
        self.cv.notify_all();
        left
    }

    /// The write-behind queue, under the offload queue's lock (the worker
    /// starts queued writes as it starts batches, so both share a lock and
    /// a condition variable).
    pub(super) fn writes(&self) -> WritesGuard<'_> {
        WritesGuard {
            queue: self,
            state: self.state.lock(),
        }
    }

    /// Wakes the worker and every waiter on the queue (after a change made
    /// through [`Self::writes`]).
    pub(super) fn wake(&self) {
        self.cv.notify_all();
    }
}

/// The write-behind queue, locked: derefs to [`Writes`]; [`Self::wait`]
/// sleeps until the queue changes.
pub(super) struct WritesGuard<'a> {
    queue: &'a OffloadQueue,
    state: MutexGuard<'a, QueueState>,
}

impl WritesGuard<'_> {
    /// Releases the lock until the queue is woken, then takes it again.
    pub(super) fn wait(&mut self) {
        self.queue.cv.wait(&mut self.state);
    }
}

impl std::ops::Deref for WritesGuard<'_> {
    type Target = Writes;

    fn deref(&self) -> &Writes {
        &self.state.writes
    }
}

impl std::ops::DerefMut for WritesGuard<'_> {
    fn deref_mut(&mut self) -> &mut Writes {
        &mut self.state.writes
    }
}
