//! Onboarding: copying a request's matched G2/G3 blocks into G1.
//!
//! Nothing blocks here: the copies are submitted to the executor and a
//! countdown per request ([`OnboardJob`]) resolves the request's
//! completion when the last copy — and the last onboard of another request
//! it waits on — has finished. Whoever finishes last runs the finishing
//! step on its own thread.
//!
//! Sharing: when kvbm owns G1 ([`OnboardTarget::Pool`]), each block being
//! onboarded has an entry in the engine's in-flight map. A second request
//! that needs the same block does not copy it again: it waits for the
//! entry, then takes the block from the G1 pool where the first request
//! registered it — at the moment the first request finishes, while that
//! one still holds it, so G1 cannot evict it in between. It never waits
//! behind onboards it does not share. No lock is held while G1 targets are
//! allocated (in write-back mode that waits for the offload worker).
//!
//! Exclusivity in write-back mode: blocks loaded from G2 are marked for G2
//! to evict first, since G1 will write them back when it evicts them.
//!
//! Failure: a request whose own copy fails reports an error and no loaded
//! block; its G1 targets return to the free list and its holds are
//! released. A request that waited on another's failed copy fails too.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use kvbm_block::SequenceHash;
use kvbm_transfer::completion::{Completer, Completion, Outcome, completion_pair};
use kvbm_transfer::{CancelToken, TransferError, TransferOutcome};
use parking_lot::{Condvar, Mutex};

use super::requests::{OnboardClaim, Segment};
use super::{G3Onboard, RequestId, Shared, TierError};
use crate::config::Tier;
use crate::metrics::{FailureCause, Path};
use crate::pool::{ImmutableBlock, ImmutableBlocks, MutableBlock};
use crate::rate_limit::{RateLimit, WARN_EVERY, held_back_note};

/// Where onboarded blocks go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OnboardTarget {
    /// kvbm allocates the G1 blocks from its G1 pool and registers them
    /// once loaded; [`Onboarded::blocks`] holds them.
    Pool,
    /// The engine allocated these G1 block ids (one per block to load, in
    /// prefix order) and owns them; kvbm only writes their bytes.
    Blocks(Vec<u32>),
}

/// A finished onboard.
#[derive(Debug)]
pub struct Onboarded {
    /// The loaded G1 blocks, held, in prefix order ([`OnboardTarget::Pool`]
    /// only; empty for engine-given ids).
    pub blocks: ImmutableBlocks,
    /// Blocks loaded.
    pub count: usize,
}

/// The completion value (a local type so the transfer crate's completion
/// machinery can carry it).
pub(crate) struct Done(Result<Onboarded, TierError>);

impl Outcome for Done {
    fn abandoned() -> Self {
        Done(Err(TierError::Shutdown))
    }
}

/// A request's onboard in progress.
#[must_use = "wait for the onboard or poll it before using the blocks"]
pub struct OnboardHandle {
    request: RequestId,
    completion: Completion<Done>,
}

impl std::fmt::Debug for OnboardHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnboardHandle")
            .field("request", &self.request)
            .field("done", &self.completion.is_done())
            .finish()
    }
}

impl OnboardHandle {
    /// The request.
    pub fn request(&self) -> &RequestId {
        &self.request
    }

    /// Whether the onboard has finished (success or failure).
    pub fn is_done(&self) -> bool {
        self.completion.is_done()
    }

    /// Blocks until the onboard finishes.
    pub fn wait(self) -> Result<Onboarded, TierError> {
        self.completion.wait().0
    }

    /// Runs `f` with the outcome when the onboard finishes (now, if it
    /// has). `f` runs on a transfer thread: it must not block.
    pub fn on_complete(self, f: impl FnOnce(Result<Onboarded, TierError>) + Send + 'static) {
        self.completion.on_complete(move |d| f(d.0));
    }
}

/// A callback of a request waiting on another's onboard.
type Waiter = Box<dyn FnOnce() + Send>;

/// A block some request is onboarding into the G1 pool; others wait on it.
pub(crate) struct Inflight {
    /// Callbacks of waiting requests; `None` once the owner finished.
    waiters: Mutex<Option<Vec<Waiter>>>,
}

impl Inflight {
    fn finish(&self) {
        let waiters = self.waiters.lock().take().unwrap_or_default();
        for w in waiters {
            w();
        }
    }

    /// Runs `f` when the owner finishes (now, if it has).
    fn wait(&self, f: Waiter) {
        let mut w = self.waiters.lock();
        match w.as_mut() {
            Some(list) => list.push(f),
            None => {
                drop(w);
                f();
            }
        }
    }
}

/// Where the copied blocks land.
enum Dst {
    Pool(Vec<MutableBlock>),
    Ids(Vec<u32>),
}

/// The request's side of the onboard, taken by the finishing step.
struct JobState {
    hashes: Vec<SequenceHash>,
    parents: Vec<Option<SequenceHash>>,
    /// Index (into `hashes`) of each block this job copies, in `dst` order.
    own: Vec<usize>,
    /// Indices whose block another request is loading.
    waited: Vec<usize>,
    /// The G1 blocks of `waited`, taken as soon as their loader finished
    /// (before it could let them go), indexed like `hashes`.
    waited_held: Vec<Option<ImmutableBlock>>,
    /// Whether each block (indexed like `hashes`) comes from G3.
    from_g3: Vec<bool>,
    dst: Dst,
    holds: Vec<Segment>,
    owned_inflight: Vec<(SequenceHash, Arc<Inflight>)>,
    error: Option<TransferError>,
    /// What made each path's copy (G2 → G1, G3 → G1) fail, if it did.
    failed: [Option<FailureCause>; 2],
    bytes: [u64; 2],
    completer: Option<Completer<Done>>,
}

/// One request's onboard: a countdown of copies and waited-on onboards.
pub(crate) struct OnboardJob {
    request: RequestId,
    pending: AtomicUsize,
    released: AtomicBool,
    cancel: CancelToken,
    /// The request's G3 prefetch read, stopped with the job.
    prefetch_cancel: Mutex<Option<CancelToken>>,
    started: Instant,
    state: Mutex<Option<JobState>>,
    done: Mutex<bool>,
    done_cv: Condvar,
    writes_engine_blocks: bool,
}

impl OnboardJob {
    fn arrive(self: &Arc<Self>, shared: &Arc<Shared>) {
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            finish(shared, self);
        }
    }

    /// A request this one waited on finished: hold the blocks it loaded
    /// now, while their loader still holds them.
    fn grab_waited(&self, shared: &Shared) {
        if let Some(state) = self.state.lock().as_mut() {
            for &i in &state.waited {
                if state.waited_held[i].is_none() {
                    let found = shared.books.g1().pool.match_prefix(&state.hashes[i..=i]);
                    state.waited_held[i] = found.get(0);
                }
            }
        }
    }

    /// Records that none of `pairs` on `path` landed, for `error`, and
    /// counts the path as arrived.
    fn fail_path(
        self: &Arc<Self>,
        shared: &Arc<Shared>,
        path: usize,
        error: TransferError,
        pairs: Vec<(usize, usize)>,
    ) {
        self.record(
            path,
            Err(Box::new(kvbm_transfer::TransferFailure {
                error,
                completed: Vec::new(),
                failed: pairs,
                culprit: None,
            })),
        );
        self.arrive(shared);
    }

    fn record(&self, path: usize, outcome: TransferOutcome) {
        if let Some(state) = self.state.lock().as_mut() {
            match outcome {
                Ok(report) => state.bytes[path] += report.bytes,
                Err(failure) => {
                    state.failed[path] = Some(FailureCause::of(&failure.error));
                    if state.error.is_none() {
                        state.error = Some(failure.error);
                    }
                }
            }
        }
    }

    fn wait_done(&self) {
        let mut d = self.done.lock();
        while !*d {
            self.done_cv.wait(&mut d);
        }
    }
}

pub(crate) fn start(
    shared: &Arc<Shared>,
    request: RequestId,
    target: OnboardTarget,
) -> Result<OnboardHandle, TierError> {
    let job = Arc::new(OnboardJob {
        request: request.clone(),
        // One count held by this function until everything is submitted.
        pending: AtomicUsize::new(1),
        released: AtomicBool::new(false),
        cancel: CancelToken::new(),
        prefetch_cancel: Mutex::new(None),
        started: Instant::now(),
        writes_engine_blocks: matches!(target, OnboardTarget::Blocks(_)),
        state: Mutex::new(None),
        done: Mutex::new(false),
        done_cv: Condvar::new(),
    });

    // Claim the request's holds. No lock is held past this: G1
    // allocation below may wait for the offload worker, whose copies
    // complete on threads that also finish onboards.
    let given = match &target {
        OnboardTarget::Blocks(ids) => Some(ids.len()),
        OnboardTarget::Pool => None,
    };
    let OnboardClaim {
        holds,
        hashes,
        parents,
        sources,
        from_g3,
        prefetch,
    } = shared.requests.claim_for_onboard(&request, &job, given)?;
    if let Some(p) = &prefetch {
        *job.prefetch_cancel.lock() = Some(p.cancel_token().clone());
    }
    let n = hashes.len();

    // Which blocks this request copies, which it waits for.
    let mut own = Vec::with_capacity(n);
    let mut waited = Vec::new();
    let mut deps: Vec<Arc<Inflight>> = Vec::new();
    let mut owned_inflight = Vec::new();
    match &target {
        OnboardTarget::Blocks(_) => own.extend(0..n),
        OnboardTarget::Pool => {
            let mut inflight = shared.inflight.lock();
            let mut seen_deps = HashSet::new();
            for (i, h) in hashes.iter().enumerate() {
                match inflight.get(h) {
                    Some(entry) => {
                        waited.push(i);
                        if seen_deps.insert(Arc::as_ptr(entry) as usize) {
                            deps.push(Arc::clone(entry));
                        }
                    }
                    None => {
                        own.push(i);
                        let entry = Arc::new(Inflight {
                            waiters: Mutex::new(Some(Vec::new())),
                        });
                        inflight.insert(*h, Arc::clone(&entry));
                        owned_inflight.push((*h, entry));
                    }
                }
            }
        }
    }
    let dst = match target {
        OnboardTarget::Blocks(ids) => Dst::Ids(ids),
        OnboardTarget::Pool => match shared.g1_saves.allocate(shared, own.len(), false) {
            Ok(blocks) => Dst::Pool(blocks),
            Err(e) => {
                undo_start(shared, &job, holds, prefetch, owned_inflight);
                return Err(e);
            }
        },
    };
    let dst_ids: Vec<u32> = match &dst {
        Dst::Pool(b) => b.iter().map(MutableBlock::block_id).collect(),
        Dst::Ids(ids) => ids.clone(),
    };
    // Staged blocks come from their staging slot once the read landed.
    let mut slot_of: Vec<Option<u32>> = vec![None; n];
    if let Some(p) = &prefetch {
        for &(i, slot) in p.staged() {
            if i < n {
                slot_of[i] = Some(slot);
            }
        }
    }
    let mut g2_pairs = Vec::new();
    let mut g3_pairs = Vec::new();
    let mut staged_pairs = Vec::new();
    for (k, &i) in own.iter().enumerate() {
        let d = dst_ids[k] as usize;
        match (from_g3[i], slot_of[i]) {
            (true, Some(slot)) => staged_pairs.push((slot as usize, d)),
            (true, None) => g3_pairs.push((sources[i] as usize, d)),
            (false, _) => g2_pairs.push((sources[i] as usize, d)),
        }
    }
    // A prefetch none of whose blocks this request copies is not waited for.
    let prefetch = match prefetch {
        Some(p) if staged_pairs.is_empty() => {
            p.cancel();
            None
        }
        p => p,
    };
    // Direct G3 reads start once the blocks' writes to G3 have landed
    // (write-behind); a failed write fails the read.
    let mut g3_ready = match g3_pairs.is_empty() {
        true => Ok(()),
        false => {
            let ids: Vec<u32> = g3_pairs.iter().map(|&(s, _)| s as u32).collect();
            super::behind::wait_readable(shared, &ids)
        }
    };
    let (completer, completion) = completion_pair::<Done>();
    let transfers = usize::from(!g2_pairs.is_empty())
        + usize::from(!g3_pairs.is_empty())
        + usize::from(prefetch.is_some());
    *job.state.lock() = Some(JobState {
        waited_held: (0..hashes.len()).map(|_| None).collect(),
        hashes,
        parents,
        own,
        waited,
        from_g3,
        dst,
        holds,
        owned_inflight,
        error: None,
        failed: [None; 2],
        bytes: [0; 2],
        completer: Some(completer),
    });
    job.pending
        .fetch_add(transfers + deps.len(), Ordering::AcqRel);

    let active = shared.offload.onboard_started();
    shared.metrics.onboards_in_flight(active);
    for dep in deps {
        let (shared2, job2) = (Arc::clone(shared), Arc::clone(&job));
        dep.wait(Box::new(move || {
            job2.grab_waited(&shared2);
            job2.arrive(&shared2);
        }));
    }
    let paths = [
        (0usize, shared.books.g2(), g2_pairs),
        (1usize, shared.books.g3(), g3_pairs),
    ];
    for (path, tier, pairs) in paths {
        if pairs.is_empty() {
            continue;
        }
        let (shared2, job2) = (Arc::clone(shared), Arc::clone(&job));
        let submitted = Instant::now();
        if path == 1
            && let Err(error) = std::mem::replace(&mut g3_ready, Ok(()))
        {
            job2.fail_path(&shared2, path, error, pairs);
            continue;
        }
        match tier {
            Some(tier) => shared
                .mover
                .copy(tier.tier, Tier::G1, pairs, job.cancel.clone())
                .on_complete(move |outcome| {
                    let rate = if path == 0 {
                        &shared2.rates.g2
                    } else {
                        &shared2.rates.g3
                    };
                    rate.observe_outcome(&outcome, submitted);
                    if path == 1 {
                        super::behind::reads_ended(&shared2, &outcome);
                    }
                    job2.record(path, outcome);
                    job2.arrive(&shared2);
                }),
            // Blocks held in a tier the engine lacks cannot exist.
            None => {
                let error = TransferError::InvalidRequest("no such tier".into());
                job2.fail_path(&shared2, path, error, pairs);
            }
        }
    }
    if let Some(p) = prefetch {
        copy_staged(shared, &job, p, staged_pairs);
    }
    job.arrive(shared);
    Ok(OnboardHandle {
        request,
        completion,
    })
}

/// Copies staged blocks (`(slot, G1 block)` pairs) into G1 once `p`'s read
/// has landed; a failed or cancelled read fails the job instead. Counts as
/// one of the job's transfers (G3 → G1 bytes).
fn copy_staged(
    shared: &Arc<Shared>,
    job: &Arc<OnboardJob>,
    p: Arc<super::prefetch::Prefetch>,
    pairs: Vec<(usize, usize)>,
) {
    let (shared2, job2, keep) = (Arc::clone(shared), Arc::clone(job), Arc::clone(&p));
    p.when_read(Box::new(move |read| {
        let read = match read {
            Ok(()) if job2.cancel.is_cancelled() => Err(TransferError::Cancelled),
            r => r,
        };
        match read {
            Ok(()) => {
                let (shared3, job3) = (Arc::clone(&shared2), Arc::clone(&job2));
                let submitted = Instant::now();
                shared2
                    .mover
                    .copy(Tier::G2, Tier::G1, pairs, job2.cancel.clone())
                    .on_complete(move |outcome| {
                        // The slots stay ours until the copy has ended.
                        drop(keep);
                        shared3.rates.g2.observe_outcome(&outcome, submitted);
                        job3.record(1, outcome);
                        job3.arrive(&shared3);
                    });
            }
            Err(error) => {
                drop(keep);
                job2.fail_path(&shared2, 1, error, pairs);
            }
        }
    }));
}

/// A start that could not allocate its G1 targets: the in-flight entries
/// it claimed are dropped (requests waiting on them find no block and
/// fail), and the request gets its holds back.
fn undo_start(
    shared: &Shared,
    job: &Arc<OnboardJob>,
    holds: Vec<Segment>,
    prefetch: Option<Arc<super::prefetch::Prefetch>>,
    owned_inflight: Vec<(SequenceHash, Arc<Inflight>)>,
) {
    {
        let mut inflight = shared.inflight.lock();
        for (h, entry) in &owned_inflight {
            if inflight.get(h).is_some_and(|e| Arc::ptr_eq(e, entry)) {
                inflight.remove(h);
            }
        }
    }
    shared.requests.unclaim(&job.request, job, holds, prefetch);
    *job.done.lock() = true;
    job.done_cv.notify_all();
    for (_, entry) in owned_inflight {
        entry.finish();
    }
}

/// The finishing step: runs once, on whichever thread arrived last.
fn finish(shared: &Arc<Shared>, job: &Arc<OnboardJob>) {
    let Some(state) = job.state.lock().take() else {
        return;
    };
    let JobState {
        hashes,
        parents,
        own,
        waited,
        waited_held,
        from_g3,
        dst,
        holds,
        owned_inflight,
        error,
        failed,
        bytes,
        completer,
    } = state;
    let request = job.request.clone();
    let n = hashes.len();
    let result: Result<Onboarded, TierError> = match (error, dst) {
        (Some(source), _) => Err(TierError::Onboard {
            request: request.clone(),
            source,
        }),
        (None, Dst::Ids(_)) => Ok(Onboarded {
            blocks: ImmutableBlocks::empty(),
            count: n,
        }),
        (None, Dst::Pool(targets)) => register_loaded(
            shared,
            &hashes,
            &parents,
            &own,
            &waited,
            waited_held,
            targets,
        )
        .ok_or_else(|| TierError::SharedOnboardFailed(request.clone())),
    };
    // The owner's blocks are in G1 (or failed): let waiting requests look.
    {
        let mut inflight = shared.inflight.lock();
        for (h, entry) in &owned_inflight {
            if inflight.get(h).is_some_and(|e| Arc::ptr_eq(e, entry)) {
                inflight.remove(h);
            }
        }
    }
    let took = job.started.elapsed();
    let g3_count = own.iter().filter(|&&i| from_g3[i]).count() as u64;
    let g2_count = own.len() as u64 - g3_count;
    let loaded_ok = result.is_ok();
    let mut keep_alive: Option<Onboarded> = None;
    let result = match result {
        Ok(done) => {
            if g2_count > 0 {
                shared
                    .metrics
                    .copied(Path::G2ToG1, g2_count, bytes[0], took);
            }
            if g3_count > 0 {
                shared
                    .metrics
                    .copied(Path::G3ToG1, g3_count, bytes[1], took);
                if shared.config.g3_onboard == G3Onboard::KeepG2Copy {
                    keep_g2_copies(shared, &done, &own, &from_g3, &parents);
                }
            }
            if job.released.load(Ordering::Acquire) {
                // Held until waiting requests have taken their share.
                keep_alive = Some(done);
                Err(TierError::Released(request.clone()))
            } else {
                Ok(done)
            }
        }
        Err(e) => {
            let counts = [(Path::G2ToG1, g2_count), (Path::G3ToG1, g3_count)];
            for (cause, (path, blocks)) in failed.into_iter().zip(counts) {
                if let Some(cause) = cause {
                    shared.metrics.copy_failed(path, cause, blocks);
                }
            }
            shared.metrics.onboard_failed();
            static WARN: RateLimit = RateLimit::new(WARN_EVERY);
            if let Some(held_back) = WARN.check() {
                let more = held_back_note(held_back);
                tracing::warn!(%request, "onboard failed: {e}{more}");
            }
            Err(e)
        }
    };
    // Write-back gives blocks loaded into kvbm's G1 pool back to G2 when
    // G1 evicts them, so the G2 and G3 copies of what was just loaded go
    // first meanwhile (the tiers stay exclusive). Blocks written into the
    // engine's own G1 are never given back: their copies keep their rank.
    if loaded_ok
        && !job.writes_engine_blocks
        && shared.config.offload_mode == super::OffloadMode::WriteBack
    {
        shared
            .g1_saves
            .save_when_evicted(own.iter().map(|&i| hashes[i]));
        let from_g3 = &from_g3;
        let from = |g3: bool| own.iter().filter(move |&&i| from_g3[i] == g3);
        // With `KeepG2Copy` the G3 blocks go to G2 as well: their G3 copies
        // go first, and the new G2 copies keep their rank.
        shared.books.demote_loaded(
            from(false).map(|&i| hashes[i]),
            from(true).map(|&i| hashes[i]),
        );
    }
    drop(holds);
    let left = shared.offload.onboard_ended();
    shared.metrics.onboards_in_flight(left);
    {
        *job.done.lock() = true;
        job.done_cv.notify_all();
    }
    for (_, entry) in owned_inflight {
        entry.finish();
    }
    drop(keep_alive);
    if let Some(c) = completer {
        c.complete(Done(result));
    }
}

/// Completes and registers the loaded G1 blocks and collects, in prefix
/// order, the ones other requests loaded.
fn register_loaded(
    shared: &Shared,
    hashes: &[SequenceHash],
    parents: &[Option<SequenceHash>],
    own: &[usize],
    waited: &[usize],
    mut waited_held: Vec<Option<ImmutableBlock>>,
    targets: Vec<MutableBlock>,
) -> Option<Onboarded> {
    let mut complete = Vec::with_capacity(targets.len());
    for (t, &i) in targets.into_iter().zip(own) {
        // Pool blocks track no tokens, so completing cannot fail; if it
        // did, the block is dropped (freed) and the request fails.
        complete.push(t.complete(hashes[i], parents[i]).ok()?);
    }
    let registered = shared.books.g1().pool.register(complete).ok()?;
    let mut slots: Vec<Option<ImmutableBlock>> = (0..hashes.len()).map(|_| None).collect();
    for (k, &i) in own.iter().enumerate() {
        slots[i] = registered.get(k);
    }
    drop(registered);
    for &i in waited {
        slots[i] = match waited_held[i].take() {
            Some(b) => Some(b),
            None => shared.books.g1().pool.match_prefix(&hashes[i..=i]).get(0),
        };
    }
    let mut blocks = ImmutableBlocks::empty();
    for b in slots {
        blocks.push(b?).ok()?;
    }
    let count = blocks.len();
    Some(Onboarded { blocks, count })
}

/// Queues the blocks that came from G3 for offload to G2.
fn keep_g2_copies(
    shared: &Shared,
    done: &Onboarded,
    own: &[usize],
    from_g3: &[bool],
    parents: &[Option<SequenceHash>],
) {
    let items: Vec<_> = own
        .iter()
        .filter(|&&i| from_g3[i])
        .filter_map(|&i| done.blocks.get(i).map(|b| (b.downgrade(), parents[i])))
        .collect();
    super::offload::enqueue(shared, items);
}

pub(crate) fn release(shared: &Shared, request: &RequestId) -> bool {
    let guard = shared.requests.take_engine_guard(request);
    if let Some(g) = &guard {
        g.release();
    }
    let Some(state) = shared.requests.remove(request) else {
        return guard.is_some();
    };
    if let Some(job) = state.onboard() {
        job.released.store(true, Ordering::Release);
        if job.writes_engine_blocks {
            // The engine may reuse its blocks once we return: stop writing.
            job.cancel.cancel();
            if let Some(c) = job.prefetch_cancel.lock().as_ref() {
                c.cancel();
            }
            job.wait_done();
        }
    }
    drop(state);
    true
}
