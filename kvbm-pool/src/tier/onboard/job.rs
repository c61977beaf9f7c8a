//! One request's onboard: a countdown of its copies and of the onboards of
//! other requests it waits on, and what the finishing step takes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvbm_block::SequenceHash;
use kvbm_transfer::completion::Completer;
use kvbm_transfer::{CancelToken, TransferError, TransferOutcome};
use parking_lot::{Condvar, Mutex};

use super::inflight::Inflight;
use super::{Done, OnboardTarget};
use crate::metrics::FailureCause;
use crate::pool::{ImmutableBlock, MutableBlock};
use crate::tier::requests::Segment;
use crate::tier::{RequestId, Shared};

/// Where the copied blocks land.
pub(super) enum Dst {
    /// G1 blocks kvbm allocated, registered once loaded.
    Pool(Vec<MutableBlock>),
    /// G1 block ids the engine gave.
    Ids(Vec<u32>),
}

impl Dst {
    /// The G1 block ids, in copy order.
    pub(super) fn ids(&self) -> Vec<u32> {
        match self {
            Dst::Pool(b) => b.iter().map(MutableBlock::block_id).collect(),
            Dst::Ids(ids) => ids.clone(),
        }
    }
}

/// The request's side of the onboard, taken by the finishing step.
pub(super) struct JobState {
    /// The hashes of the blocks to load, in prefix order.
    pub(super) hashes: Vec<SequenceHash>,
    /// Each block's parent hash.
    pub(super) parents: Vec<Option<SequenceHash>>,
    /// Index (into `hashes`) of each block this job copies, in `dst` order.
    pub(super) own: Vec<usize>,
    /// Indices whose block another request is loading.
    pub(super) waited: Vec<usize>,
    /// The G1 blocks of `waited`, taken as soon as their loader finished
    /// (before it could let them go), indexed like `hashes`.
    pub(super) waited_held: Vec<Option<ImmutableBlock>>,
    /// Whether each block (indexed like `hashes`) comes from G3.
    pub(super) from_g3: Vec<bool>,
    /// Where this job's copies land.
    pub(super) dst: Dst,
    /// The request's held G2/G3 blocks, released when the job finishes.
    pub(super) holds: Vec<Segment>,
    /// The in-flight entries of the blocks this job copies.
    pub(super) owned_inflight: Vec<(SequenceHash, Arc<Inflight>)>,
    /// The first copy error, if any.
    pub(super) error: Option<TransferError>,
    /// What made each path's copy (G2 → G1, G3 → G1) fail, if it did.
    pub(super) failed: [Option<FailureCause>; 2],
    /// Bytes each path (G2 → G1, G3 → G1) moved.
    pub(super) bytes: [u64; 2],
    /// Resolves the request's completion.
    pub(super) completer: Option<Completer<Done>>,
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
    /// A job for `request` loading into `target`, counting one arrival for
    /// its starter (given once everything is submitted).
    pub(super) fn new(request: RequestId, target: &OnboardTarget) -> Arc<Self> {
        Arc::new(OnboardJob {
            request,
            pending: AtomicUsize::new(1),
            released: AtomicBool::new(false),
            cancel: CancelToken::new(),
            prefetch_cancel: Mutex::new(None),
            started: Instant::now(),
            writes_engine_blocks: matches!(target, OnboardTarget::Blocks(_)),
            state: Mutex::new(None),
            done: Mutex::new(false),
            done_cv: Condvar::new(),
        })
    }

    /// The request.
    pub(super) fn request(&self) -> &RequestId {
        &self.request
    }

    /// Time since the job started.
    pub(super) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The token that cancels the job's copies.
    pub(super) fn cancel_token(&self) -> &CancelToken {
        &self.cancel
    }

    /// Whether the job writes into engine-given G1 blocks.
    pub(super) fn writes_engine_blocks(&self) -> bool {
        self.writes_engine_blocks
    }

    /// Whether the request was released before the job finished.
    pub(super) fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Stops the request's G3 prefetch read with the job.
    pub(super) fn stop_with(&self, prefetch: CancelToken) {
        *self.prefetch_cancel.lock() = Some(prefetch);
    }

    /// Hands the job its state and counts `arrivals` more (copies and
    /// waited-on onboards) before it finishes.
    pub(super) fn begin(&self, state: JobState, arrivals: usize) {
        *self.state.lock() = Some(state);
        self.pending.fetch_add(arrivals, Ordering::AcqRel);
    }

    /// Takes the job's state: once, for the finishing step.
    pub(super) fn take_state(&self) -> Option<JobState> {
        self.state.lock().take()
    }

    /// Counts one arrival; the last runs the finishing step.
    pub(super) fn arrive(self: &Arc<Self>, shared: &Arc<Shared>) {
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            super::finish::finish(shared, self);
        }
    }

    /// A request this one waited on finished: hold the blocks it loaded
    /// now, while their loader still holds them.
    pub(super) fn grab_waited(&self, shared: &Shared) {
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
    pub(super) fn fail_path(
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

    /// Records the outcome of a copy on `path` (0: G2 → G1, 1: G3 → G1).
    pub(super) fn record(&self, path: usize, outcome: TransferOutcome) {
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

    /// No more bytes of this job land: wakes a release waiting for that.
    pub(super) fn mark_done(&self) {
        *self.done.lock() = true;
        self.done_cv.notify_all();
    }

    /// The request is released. When the job writes into engine-given
    /// blocks, stops its copies and its prefetch and waits until no more
    /// bytes can land there (the engine may reuse them at once).
    pub(super) fn release(&self) {
        self.released.store(true, Ordering::Release);
        if self.writes_engine_blocks {
            self.cancel.cancel();
            if let Some(c) = self.prefetch_cancel.lock().as_ref() {
                c.cancel();
            }
            self.wait_done();
        }
    }

    fn wait_done(&self) {
        let mut d = self.done.lock();
        while !*d {
            self.done_cv.wait(&mut d);
        }
    }
}
