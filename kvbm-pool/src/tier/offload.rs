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

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvbm_block::SequenceHash;
use kvbm_transfer::{CancelToken, TransferOutcome};
use parking_lot::{Condvar, Mutex};

use super::Shared;
use super::behind::{self, Write, Writes};
use super::victims::{
    admitted, allocate_up_to, landed_pairs, register_landed, save_g1_victims, spill_to_g3,
};
use crate::metrics::{Path, SkipReason};
use crate::policy::Evicted;
use crate::pool::{ImmutableBlock, MutableBlock, WeakBlock};

struct Pending {
    source: Source,
    parent: Option<SequenceHash>,
}

/// Where a queued offload reads from.
enum Source {
    /// A block of kvbm's G1 pool, held only weakly until its copy starts.
    Pool(WeakBlock),
    /// A block the engine owns, valid until its request is released.
    Engine {
        id: u32,
        hash: SequenceHash,
        guard: Arc<EngineGuard>,
        /// Counts the block as queued until the worker has dealt with it.
        _queued: Queued,
    },
}

/// One engine block waiting in the offload queue, counted on its guard
/// from enqueue until the worker started its copy or skipped it (or the
/// queue dropped it).
struct Queued(Arc<EngineGuard>);

impl Queued {
    fn new(guard: &Arc<EngineGuard>) -> Self {
        guard.state.lock().queued += 1;
        Queued(Arc::clone(guard))
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        let mut s = self.0.state.lock();
        s.queued = s.queued.saturating_sub(1);
        if s.queued == 0 {
            self.0.cv.notify_all();
        }
    }
}

impl Source {
    fn hash(&self) -> SequenceHash {
        match self {
            Source::Pool(w) => w.sequence_hash(),
            Source::Engine { hash, .. } => *hash,
        }
    }
}

/// What keeps a source's bytes valid while they are copied.
enum Hold {
    Block { _block: ImmutableBlock },
    Engine(Arc<EngineGuard>),
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Hold::Engine(g) = self {
            g.copy_ended();
        }
    }
}

#[derive(Default)]
struct GuardState {
    released: bool,
    copying: usize,
    /// Blocks still in the queue.
    queued: usize,
}

/// Engine-owned G1 blocks of one request queued for offload: the request's
/// release waits for copies in progress and cancels the others.
#[derive(Default)]
pub(crate) struct EngineGuard {
    state: Mutex<GuardState>,
    cv: Condvar,
}

impl EngineGuard {
    fn copy_started(&self) -> bool {
        let mut s = self.state.lock();
        if s.released {
            return false;
        }
        s.copying += 1;
        true
    }

    fn copy_ended(&self) {
        let mut s = self.state.lock();
        s.copying = s.copying.saturating_sub(1);
        if s.copying == 0 {
            self.cv.notify_all();
        }
    }

    /// Waits up to `timeout` until none of the request's blocks is queued
    /// or being copied; true when that is so.
    pub(crate) fn wait_idle(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut s = self.state.lock();
        while s.queued > 0 || s.copying > 0 {
            if self.cv.wait_until(&mut s, deadline).timed_out() {
                return s.queued == 0 && s.copying == 0;
            }
        }
        true
    }

    /// No copy starts after this returns, and none is running.
    pub(crate) fn release(&self) {
        let mut s = self.state.lock();
        s.released = true;
        while s.copying > 0 {
            self.cv.wait(&mut s);
        }
    }
}

/// G1 victims to save before their slots are reused, and whether that is
/// done.
struct WriteBack {
    victims: Vec<Evicted>,
    done: Arc<(Mutex<bool>, Condvar)>,
}

/// G1 victims evicted ahead of need (the free reserve) and their slots,
/// held until the victims are saved: then the slots join G1's free list.
struct Clean {
    victims: Vec<Evicted>,
    slots: Vec<MutableBlock>,
}

#[derive(Default)]
pub(super) struct QueueState {
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
    pub(super) writes: Writes,
}

/// The bounded queue, the onboard gate and the flush barrier.
#[derive(Default)]
pub(crate) struct OffloadQueue {
    pub(super) state: Mutex<QueueState>,
    pub(super) cv: Condvar,
}

impl OffloadQueue {
    pub(crate) fn shutdown(&self) {
        let mut s = self.state.lock();
        s.shutdown = true;
        for wb in s.urgent.drain(..) {
            *wb.done.0.lock() = true;
            wb.done.1.notify_all();
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
    /// write has run.
    pub(crate) fn flush(&self) {
        let mut s = self.state.lock();
        while !s.shutdown
            && (s.working > 0 || s.cleaning_slots > 0 || !s.items.is_empty() || s.writes.busy())
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

pub(crate) fn enqueue(
    shared: &Shared,
    blocks: impl IntoIterator<Item = (WeakBlock, Option<SequenceHash>)>,
) {
    enqueue_sources(
        shared,
        blocks.into_iter().map(|(b, parent)| Pending {
            source: Source::Pool(b),
            parent,
        }),
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
        blocks.iter().map(|&(id, hash, parent)| Pending {
            source: Source::Engine {
                id,
                hash,
                guard: Arc::clone(guard),
                _queued: Queued::new(guard),
            },
            parent,
        }),
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

pub(crate) fn run_worker(shared: &Arc<Shared>) {
    let q = &shared.offload;
    let limit = shared.config.offload_in_flight.max(1);
    let mut flights: VecDeque<Flight> = VecDeque::new();
    // Hashes the batches in flight are copying to G2 (not registered yet).
    let mut flying: HashSet<SequenceHash> = HashSet::new();
    loop {
        let step = {
            let mut s = q.state.lock();
            loop {
                if s.shutdown {
                    break Step::Stop;
                }
                if flights.front().is_some_and(Flight::landed) {
                    break Step::Land;
                }
                if let Some(wb) = s.urgent.pop_front() {
                    s.working += 1;
                    break Step::WriteBack(wb);
                }
                if (s.onboards == 0 || s.clean_wanted > 0)
                    && let Some(c) = s.cleans.pop_front()
                {
                    break Step::Clean(c);
                }
                if s.writes.ready(s.onboards) {
                    break Step::Write(s.writes.take());
                }
                if flights.len() < limit && s.onboards == 0 && !s.items.is_empty() {
                    let n = batch_limit(shared).min(s.items.len());
                    s.working += 1;
                    let batch = s.items.drain(..n).collect();
                    shared.metrics.queue_depth(s.items.len());
                    break Step::Start(batch);
                }
                if std::mem::take(&mut s.history) || shared.books.pending_uses() > 0 {
                    break Step::History;
                }
                // Nothing to do: answer whoever waits for that.
                if s.idle_answered < s.idle_asked {
                    s.idle_answered = s.idle_asked;
                    q.cv.notify_all();
                }
                q.cv.wait(&mut s);
            }
        };
        match step {
            Step::Land => {
                if let Some(f) = flights.pop_front() {
                    f.register(shared, &mut flying);
                }
                q.finished();
            }
            Step::WriteBack(wb) => {
                save_g1_victims(shared, wb.victims, &flying);
                *wb.done.0.lock() = true;
                wb.done.1.notify_all();
                q.finished();
            }
            Step::Clean(c) => {
                save_g1_victims(shared, c.victims, &flying);
                let held = c.slots.len();
                drop(c.slots);
                let mut s = q.state.lock();
                s.cleaning_slots = s.cleaning_slots.saturating_sub(held);
                drop(s);
                q.cv.notify_all();
            }
            Step::History => shared.books.apply_uses(),
            Step::Write(batch) => behind::start(shared, batch),
            Step::Start(batch) => {
                let _span = tracing::debug_span!("offload_batch", blocks = batch.len()).entered();
                match start_batch(shared, batch, &flying) {
                    Some(f) => {
                        flying.extend(f.items.iter().map(|&(hash, _)| hash));
                        flights.push_back(f);
                    }
                    None => q.finished(),
                }
            }
            Step::Stop => {
                // Sources stay held until their copies ended; what landed
                // is registered (the pools outlive the worker's return).
                for f in std::mem::take(&mut flights) {
                    q.wait_landed(&f);
                    f.register(shared, &mut flying);
                }
                // Blocks registered in G3 get their bytes.
                behind::drain(shared);
                let mut s = q.state.lock();
                let left = s.items.len() as u64;
                s.items.clear();
                s.working = 0;
                drop(s);
                q.cv.notify_all();
                shared.metrics.skipped(SkipReason::SourceGone, left);
                return;
            }
        }
    }
}

impl OffloadQueue {
    /// The worker finished a batch or a write-back.
    fn finished(&self) {
        let mut s = self.state.lock();
        s.working = s.working.saturating_sub(1);
        drop(s);
        self.cv.notify_all();
    }

    /// Blocks until `flight`'s copy ended.
    fn wait_landed(&self, flight: &Flight) {
        let mut s = self.state.lock();
        while !flight.landed() {
            self.cv.wait(&mut s);
        }
    }
}

/// A batch whose G1 → G2 copy was started: its targets are registered
/// once the copy's outcome is in.
struct Flight {
    /// The copy's outcome and when it came, set by its completion.
    outcome: Arc<Mutex<Option<(TransferOutcome, Instant)>>>,
    started: Instant,
    pairs: Vec<(usize, usize)>,
    targets: Vec<MutableBlock>,
    items: Vec<(SequenceHash, Option<SequenceHash>)>,
    /// Keeps every source's bytes valid until the copy ended.
    holds: Vec<Hold>,
}

impl Flight {
    fn landed(&self) -> bool {
        self.outcome.lock().is_some()
    }

    /// Registers the targets whose bytes landed (the copy has ended).
    fn register(self, shared: &Shared, flying: &mut HashSet<SequenceHash>) {
        for (hash, _) in &self.items {
            flying.remove(hash);
        }
        let Some((outcome, ended)) = self.outcome.lock().take() else {
            // Unreachable: the worker registers only landed flights. Were
            // it not so, dropping the targets frees them unregistered.
            return;
        };
        if let Some(g2) = shared.books.g2() {
            let took = ended.saturating_duration_since(self.started);
            let (landed, cause) = landed_pairs(Path::G1ToG2, &self.pairs, &outcome);
            register_landed(
                shared,
                g2,
                Path::G1ToG2,
                self.targets,
                &self.items,
                (&landed, cause),
                took,
            );
        }
        drop(self.holds);
    }
}

/// Blocks per batch: the configured size, raised for small blocks until a
/// batch moves `offload_batch_bytes`, and never more than a quarter of G1
/// or of G2 for all batches in flight together: a batch cannot evict G2
/// blocks the one before it just stored, and the G1 sources held by copies
/// in flight leave G1 room to allocate.
pub(crate) fn batch_limit(shared: &Shared) -> usize {
    let config = &shared.config;
    let g2 = shared.books.g2().map_or(usize::MAX, |t| t.pool.capacity());
    let smaller = g2.min(shared.books.g1().pool.capacity());
    let quarter = smaller / 4 / config.offload_in_flight.max(1);
    let by_bytes = match shared.books.g1().block_bytes {
        0 => 0,
        b => usize::try_from(config.offload_batch_bytes.div_ceil(b)).unwrap_or(usize::MAX),
    };
    config.offload_batch.max(by_bytes).min(quarter.max(1))
}

/// Prepares `batch` and starts its G1 → G2 copy; `None` when nothing of
/// it is to be copied. `flying`: hashes of batches in flight.
fn start_batch(
    shared: &Arc<Shared>,
    batch: Vec<Pending>,
    flying: &HashSet<SequenceHash>,
) -> Option<Flight> {
    let Some(g2) = shared.books.g2() else {
        shared
            .metrics
            .skipped(SkipReason::NoTier, batch.len() as u64);
        return None;
    };
    let mut seen = HashSet::with_capacity(batch.len());
    // (source block id, hash, parent, what keeps the source valid)
    let mut sources: Vec<(u32, SequenceHash, Option<SequenceHash>, Hold)> =
        Vec::with_capacity(batch.len());
    let (mut gone, mut present, mut refused) = (0u64, 0u64, 0u64);
    for p in batch {
        let hash = p.source.hash();
        if !seen.insert(hash) || flying.contains(&hash) || g2.pool.contains(hash) {
            present += 1;
            continue;
        }
        if !admitted(shared, g2, shared.config.g2_policy, hash) {
            refused += 1;
            continue;
        }
        let held = match p.source {
            Source::Pool(w) => w
                .upgrade()
                .map(|b| (b.block_id(), Hold::Block { _block: b })),
            Source::Engine { id, guard, .. } => {
                guard.copy_started().then(|| (id, Hold::Engine(guard)))
            }
        };
        match held {
            Some((id, hold)) => sources.push((id, hash, p.parent, hold)),
            None => gone += 1,
        }
    }
    shared.metrics.skipped(SkipReason::SourceGone, gone);
    shared.metrics.skipped(SkipReason::Present, present);
    shared.metrics.skipped(SkipReason::NotAdmitted, refused);
    if sources.is_empty() {
        return None;
    }
    let targets = allocate_up_to(shared, g2, sources.len());
    sources.truncate(targets.len());
    // Blocks evicted to make room still hold their bytes: save them first.
    let victims = shared.books.take_g2_victims();
    spill_to_g3(shared, g2, victims);
    if targets.is_empty() {
        return None;
    }
    let items: Vec<(SequenceHash, Option<SequenceHash>)> = sources
        .iter()
        .map(|&(_, hash, parent, _)| (hash, parent))
        .collect();
    let pairs: Vec<(usize, usize)> = sources
        .iter()
        .zip(&targets)
        .map(|((id, ..), t)| (*id as usize, t.block_id() as usize))
        .collect();
    let holds = sources.into_iter().map(|(.., hold)| hold).collect();
    let outcome = Arc::new(Mutex::new(None));
    let started = Instant::now();
    let (slot, waker) = (Arc::clone(&outcome), Arc::clone(shared));
    shared
        .mover
        .copy_labelled(
            shared.books.g1().tier,
            g2.tier,
            pairs.clone(),
            items.clone(),
            CancelToken::new(),
        )
        .on_complete(move |result| {
            *slot.lock() = Some((result, Instant::now()));
            // Taking the queue's lock orders this with the worker's check
            // of `landed` before it sleeps: the wake-up cannot be missed.
            drop(waker.offload.state.lock());
            waker.offload.cv.notify_all();
        });
    Some(Flight {
        outcome,
        started,
        pairs,
        targets,
        items,
        holds,
    })
}
