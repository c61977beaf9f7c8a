//! The offload worker: one thread that takes the queue's steps in order —
//! registering landed batches, G1 write-backs, background saves of G1's
//! reserve, G3 writes, new batches, the use history — and keeps up to
//! `offload_in_flight` G1 → G2 batches in flight.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvbm_block::SequenceHash;
use kvbm_transfer::{CancelToken, TransferOutcome};
use parking_lot::Mutex;

use super::source::{Hold, Pending};
use super::{Clean, Step, WorkerView, WriteBack};
use crate::metrics::{Path, SkipReason};
use crate::pool::MutableBlock;
use crate::tier::behind;
use crate::tier::victims::{
    admitted, allocate_up_to, landed_pairs, register_landed, save_g1_victims, spill_to_g3,
};
use crate::tier::{Shared, TierSlot};

/// Runs the offload worker until the engine is dropped.
pub(crate) fn run_worker(shared: &Arc<Shared>) {
    let mut worker = Worker {
        shared,
        limit: shared.config.offload_in_flight.max(1),
        flights: VecDeque::new(),
        flying: HashSet::new(),
    };
    loop {
        let flights = &worker.flights;
        let view = WorkerView {
            front_landed: &|| flights.front().is_some_and(Flight::landed),
            room: flights.len() < worker.limit,
        };
        let step = shared.offload.next_step(shared, view);
        if !worker.run(step) {
            return;
        }
    }
}

/// The worker's own state: the batches in flight.
struct Worker<'a> {
    shared: &'a Arc<Shared>,
    /// Batches in flight at most.
    limit: usize,
    /// The batches in flight, oldest first.
    flights: VecDeque<Flight>,
    /// Hashes the batches in flight are copying to G2 (not registered yet).
    flying: HashSet<SequenceHash>,
}

impl Worker<'_> {
    /// Takes `step`; `false` once the worker has stopped.
    fn run(&mut self, step: Step) -> bool {
        let (shared, q) = (self.shared, &self.shared.offload);
        match step {
            Step::Land => {
                if let Some(f) = self.flights.pop_front() {
                    f.register(shared, &mut self.flying);
                }
                q.finished();
            }
            Step::WriteBack(wb) => self.write_back(wb),
            Step::Clean(c) => self.clean(c),
            Step::History => shared.books.apply_uses(),
            Step::Write(batch) => behind::start(shared, batch),
            Step::Start(batch) => self.start(batch),
            Step::Stop => {
                self.stop();
                return false;
            }
        }
        true
    }

    /// Saves G1's victims; the allocation waiting for them goes on.
    fn write_back(&mut self, mut wb: WriteBack) {
        let victims = std::mem::take(&mut wb.victims);
        save_g1_victims(self.shared, victims, &self.flying);
        wb.saved();
        self.shared.offload.finished();
    }

    /// Saves G1's victims evicted ahead of need, then frees their slots.
    fn clean(&mut self, c: Clean) {
        save_g1_victims(self.shared, c.victims, &self.flying);
        let held = c.slots.len();
        drop(c.slots);
        self.shared.offload.cleaned(held);
    }

    /// Prepares and starts a batch.
    fn start(&mut self, batch: Vec<Pending>) {
        let _span = tracing::debug_span!("offload_batch", blocks = batch.len()).entered();
        match start_batch(self.shared, batch, &self.flying) {
            Some(f) => {
                self.flying.extend(f.items.iter().map(|&(hash, _)| hash));
                self.flights.push_back(f);
            }
            None => self.shared.offload.finished(),
        }
    }

    /// The engine is dropped: sources stay held until their copies ended;
    /// what landed is registered (the pools outlive the worker's return),
    /// blocks registered in G3 get their bytes, and what is still queued
    /// is skipped.
    fn stop(&mut self) {
        let (shared, q) = (self.shared, &self.shared.offload);
        for f in std::mem::take(&mut self.flights) {
            q.wait_landed(|| f.landed());
            f.register(shared, &mut self.flying);
        }
        behind::drain(shared);
        let left = q.worker_stopped() as u64;
        shared.metrics.skipped(SkipReason::SourceGone, left);
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

/// A source whose copy may start: `(block id, hash, parent, what keeps
/// the source valid)`.
type Source = (u32, SequenceHash, Option<SequenceHash>, Hold);

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
    let mut sources = hold_sources(shared, g2, batch, flying);
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
    Some(Flight::start(shared, g2, sources, targets))
}

/// The sources of `batch` to copy, held: skipped (and counted) are
/// hashes G2 holds or a batch in flight copies, blocks G2's admission
/// refuses, and sources gone since they were queued.
fn hold_sources(
    shared: &Shared,
    g2: &TierSlot,
    batch: Vec<Pending>,
    flying: &HashSet<SequenceHash>,
) -> Vec<Source> {
    let mut seen = HashSet::with_capacity(batch.len());
    let mut sources = Vec::with_capacity(batch.len());
    let (mut gone, mut present, mut refused) = (0u64, 0u64, 0u64);
    for p in batch {
        let hash = p.hash();
        if !seen.insert(hash) || flying.contains(&hash) || g2.pool.contains(hash) {
            present += 1;
            continue;
        }
        if !admitted(shared, g2, shared.config.g2_policy, hash) {
            refused += 1;
            continue;
        }
        let parent = p.parent();
        match p.hold() {
            Some((id, hold)) => sources.push((id, hash, parent, hold)),
            None => gone += 1,
        }
    }
    shared.metrics.skipped(SkipReason::SourceGone, gone);
    shared.metrics.skipped(SkipReason::Present, present);
    shared.metrics.skipped(SkipReason::NotAdmitted, refused);
    sources
}

impl Flight {
    /// Starts copying `sources[i]` into `targets[i]` (G1 → G2); the copy's
    /// completion stores its outcome and wakes the worker.
    fn start(
        shared: &Arc<Shared>,
        g2: &TierSlot,
        sources: Vec<Source>,
        targets: Vec<MutableBlock>,
    ) -> Flight {
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
                waker.offload.wake_worker();
            });
        Flight {
            outcome,
            started,
            pairs,
            targets,
            items,
            holds,
        }
    }
}
