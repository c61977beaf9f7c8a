//! The offload queue and its worker: G1 → G2, and G2's victims → G3.
//!
//! The queue is bounded and never blocks the engine: past its bound new
//! offloads are skipped and counted. One worker thread takes batches of up
//! to `offload_batch` blocks; it sleeps on a condition variable while the
//! queue is empty or any onboard runs (onboarding is latency-critical, and
//! both share the executor's in-flight limit), so nothing polls.
//!
//! Per batch: upgrade each queued [`WeakBlock`] (a source freed since it
//! was queued is skipped: the offload is cancelled); skip hashes G2
//! already holds; ask G2's admission policy; allocate the admitted blocks'
//! targets. Allocation may evict G2 blocks; their slots are about to be
//! overwritten, so their bytes go to G3 first (victim caching). Then copy
//! G1 → G2 and register each target only once its bytes landed; a failed
//! copy registers nothing and its targets return to the free list.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvbm_block::SequenceHash;
use kvbm_transfer::CancelToken;
use parking_lot::{Condvar, Mutex};

use super::{Shared, TierPolicy, TierSlot};
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
    },
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

#[derive(Default)]
struct QueueState {
    items: VecDeque<Pending>,
    /// Write-back batches: they run before anything else, onboards or not.
    urgent: VecDeque<WriteBack>,
    /// Onboards running: the worker does not start a batch meanwhile.
    onboards: usize,
    /// The worker is processing a batch.
    busy: bool,
    shutdown: bool,
}

/// The bounded queue, the onboard gate and the flush barrier.
#[derive(Default)]
pub(crate) struct OffloadQueue {
    state: Mutex<QueueState>,
    cv: Condvar,
}

impl OffloadQueue {
    pub(crate) fn shutdown(&self) {
        let mut s = self.state.lock();
        s.shutdown = true;
        for wb in s.urgent.drain(..) {
            *wb.done.0.lock() = true;
            wb.done.1.notify_all();
        }
        drop(s);
        self.cv.notify_all();
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

    pub(crate) fn flush(&self) {
        let mut s = self.state.lock();
        while !s.shutdown && (s.busy || !s.items.is_empty()) {
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

pub(crate) fn run_worker(shared: &Arc<Shared>) {
    let q = &shared.offload;
    loop {
        let batch: Vec<Pending> = {
            let mut s = q.state.lock();
            while !s.shutdown && s.urgent.is_empty() && (s.items.is_empty() || s.onboards > 0) {
                q.cv.wait(&mut s);
            }
            if !s.shutdown
                && let Some(wb) = s.urgent.pop_front()
            {
                s.busy = true;
                drop(s);
                save_g1_victims(shared, wb.victims);
                *wb.done.0.lock() = true;
                wb.done.1.notify_all();
                q.state.lock().busy = false;
                q.cv.notify_all();
                continue;
            }
            if s.shutdown {
                let left = s.items.len() as u64;
                s.items.clear();
                drop(s);
                q.cv.notify_all();
                shared.metrics.skipped(SkipReason::SourceGone, left);
                return;
            }
            let n = batch_limit(shared).min(s.items.len());
            s.busy = true;
            let batch = s.items.drain(..n).collect();
            shared.metrics.queue_depth(s.items.len());
            batch
        };
        let _span = tracing::debug_span!("offload_batch", blocks = batch.len()).entered();
        offload_batch(shared, batch);
        q.state.lock().busy = false;
        q.cv.notify_all();
    }
}

/// Blocks per batch: the configured size, and never more than a quarter
/// of G2, so that one batch cannot evict blocks it just stored.
fn batch_limit(shared: &Shared) -> usize {
    let g2 = shared.g2.as_ref().map_or(usize::MAX, |t| t.pool.capacity());
    shared.config.offload_batch.min((g2 / 4).max(1))
}

fn admitted(shared: &Shared, tier: &TierSlot, policy: TierPolicy, hash: SequenceHash) -> bool {
    match policy {
        TierPolicy::WriteThrough => true,
        TierPolicy::MinUses(n) => shared.history.lock().uses(hash) >= n,
        TierPolicy::ReuseScore => tier.pool.admit(hash),
    }
}

/// The victims `tier` should receive: those it does not hold yet and its
/// admission policy accepts; the others are counted as skipped.
fn admit_victims(
    shared: &Shared,
    tier: &TierSlot,
    policy: TierPolicy,
    victims: Vec<Evicted>,
) -> Vec<Evicted> {
    let mut keep = Vec::with_capacity(victims.len());
    let (mut present, mut refused) = (0u64, 0u64);
    for v in victims {
        if tier.pool.contains(v.hash) {
            present += 1;
        } else if !admitted(shared, tier, policy, v.hash) {
            refused += 1;
        } else {
            keep.push(v);
        }
    }
    shared.metrics.skipped(SkipReason::Present, present);
    shared.metrics.skipped(SkipReason::NotAdmitted, refused);
    keep
}

/// Up to `n` target blocks: all of them, or as many as the pool can give.
/// Blocks that found no target are counted as skipped (tier full).
fn allocate_up_to(shared: &Shared, tier: &TierSlot, n: usize) -> Vec<MutableBlock> {
    let targets = allocate_or_fewer(tier, n);
    shared
        .metrics
        .skipped(SkipReason::TierFull, (n - targets.len()) as u64);
    targets
}

fn allocate_or_fewer(tier: &TierSlot, n: usize) -> Vec<MutableBlock> {
    match tier.pool.allocate(n) {
        Ok(b) => b,
        Err(crate::PoolError::Exhausted {
            free, evictable, ..
        }) => {
            let can = (free + evictable).min(n);
            if can == 0 {
                return Vec::new();
            }
            tier.pool.allocate(can).unwrap_or_default()
        }
        Err(_) => Vec::new(),
    }
}

fn offload_batch(shared: &Shared, batch: Vec<Pending>) {
    let Some(g2) = shared.g2.as_ref() else {
        shared
            .metrics
            .skipped(SkipReason::NoTier, batch.len() as u64);
        return;
    };
    let mut seen = HashSet::with_capacity(batch.len());
    // (source block id, hash, parent, what keeps the source valid)
    let mut sources: Vec<(u32, SequenceHash, Option<SequenceHash>, Hold)> =
        Vec::with_capacity(batch.len());
    let (mut gone, mut present, mut refused) = (0u64, 0u64, 0u64);
    for p in batch {
        let hash = p.source.hash();
        if !seen.insert(hash) || g2.pool.contains(hash) {
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
        return;
    }
    let targets = allocate_up_to(shared, g2, sources.len());
    sources.truncate(targets.len());
    // Blocks evicted to make room still hold their bytes: save them first.
    let victims = std::mem::take(&mut *shared.g2_victims.lock());
    spill_to_g3(shared, g2, victims);
    if targets.is_empty() {
        return;
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
    copy_and_register(
        shared,
        &shared.g1,
        g2,
        Path::G1ToG2,
        &pairs,
        targets,
        &items,
    );
    drop(sources);
}

/// Write-back: copies G1's victims (whose slots nobody writes until this
/// returns) to G2, through G2's admission.
fn save_g1_victims(shared: &Shared, victims: Vec<Evicted>) {
    let Some(g2) = shared.g2.as_ref() else {
        shared
            .metrics
            .skipped(SkipReason::NoTier, victims.len() as u64);
        return;
    };
    let keep = admit_victims(shared, g2, shared.config.g2_policy, victims);
    for part in keep.chunks(batch_limit(shared)) {
        let targets = allocate_up_to(shared, g2, part.len());
        let part = &part[..targets.len()];
        let g2_victims = std::mem::take(&mut *shared.g2_victims.lock());
        spill_to_g3(shared, g2, g2_victims);
        copy_victims(shared, &shared.g1, g2, Path::G1ToG2, part, targets);
    }
}

/// Copies G2's victims to G3 (those G3 admits and does not hold yet).
fn spill_to_g3(shared: &Shared, g2: &TierSlot, victims: Vec<Evicted>) {
    let Some(g3) = shared.g3.as_ref() else {
        return;
    };
    if victims.is_empty() {
        return;
    }
    let mut keep = admit_victims(shared, g3, shared.config.g3_policy, victims);
    if keep.is_empty() {
        return;
    }
    let targets = allocate_up_to(shared, g3, keep.len());
    keep.truncate(targets.len());
    copy_victims(shared, g2, g3, Path::G2ToG3, &keep, targets);
}

/// Copies evicted blocks (`victims[i]` into `targets[i]`) and registers
/// each target whose bytes landed.
fn copy_victims(
    shared: &Shared,
    src: &TierSlot,
    dst: &TierSlot,
    path: Path,
    victims: &[Evicted],
    targets: Vec<MutableBlock>,
) {
    let pairs: Vec<(usize, usize)> = victims
        .iter()
        .zip(&targets)
        .map(|(v, t)| (v.id as usize, t.block_id() as usize))
        .collect();
    let items: Vec<_> = victims.iter().map(|v| (v.hash, v.parent)).collect();
    copy_and_register(shared, src, dst, path, &pairs, targets, &items);
}

/// Copies `pairs` from `src` to `dst` and registers each target whose
/// bytes landed under its `(hash, parent)`; the others go back to the free
/// list.
fn copy_and_register(
    shared: &Shared,
    src: &TierSlot,
    dst: &TierSlot,
    path: Path,
    pairs: &[(usize, usize)],
    targets: Vec<MutableBlock>,
    items: &[(SequenceHash, Option<SequenceHash>)],
) {
    let started = Instant::now();
    let outcome = shared
        .mover
        .copy(src.tier, dst.tier, pairs.to_vec(), CancelToken::new())
        .wait();
    let landed: Vec<bool> = match &outcome {
        Ok(_) => vec![true; pairs.len()],
        Err(failure) => {
            tracing::warn!(?path, "offload copy failed: {failure}");
            let ok: HashSet<(usize, usize)> = failure.completed.iter().copied().collect();
            pairs.iter().map(|p| ok.contains(p)).collect()
        }
    };
    let mut complete = Vec::with_capacity(targets.len());
    let mut failed = 0u64;
    for ((target, &(hash, parent)), ok) in targets.into_iter().zip(items).zip(&landed) {
        if !ok {
            failed += 1;
            continue; // dropped: back to the free list
        }
        match target.complete(hash, parent) {
            Ok(c) => complete.push(c),
            Err(e) => {
                tracing::warn!("cannot complete an offload target: {e}");
                failed += 1;
            }
        }
    }
    let n = complete.len() as u64;
    // Registered and released at once: cached, evictable, matchable.
    if let Err(e) = dst.pool.register(complete) {
        tracing::warn!("offload targets refused by their own pool: {e}");
        failed += n;
    } else {
        shared
            .metrics
            .copied(path, n, n * dst.block_bytes, started.elapsed());
    }
    shared.metrics.skipped(SkipReason::CopyFailed, failed);
}
