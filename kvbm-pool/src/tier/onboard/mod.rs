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
//!
//! The parts: this file starts an onboard (claims the request's match,
//! allocates G1 targets) and releases requests; [`copy`] plans and submits
//! the copies that move the bytes; [`job`] is the countdown; [`inflight`]
//! the table of blocks being onboarded, shared between requests;
//! [`finish`] the finishing step.

mod copy;
mod finish;
mod inflight;
mod job;

use std::sync::Arc;

use kvbm_block::SequenceHash;
use kvbm_transfer::completion::{Completion, Outcome, completion_pair};

use super::requests::OnboardClaim;
use super::{RequestId, Shared, TierError};
use crate::pool::ImmutableBlocks;
use copy::CopyPlan;
pub(crate) use inflight::Inflights;
use inflight::{Inflight, Sharing};
pub(crate) use job::OnboardJob;
use job::{Dst, JobState};

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

/// Starts copying `request`'s matched G2/G3 blocks into G1 (see
/// [`super::TierEngine::onboard`]).
pub(crate) fn start(
    shared: &Arc<Shared>,
    request: RequestId,
    target: OnboardTarget,
) -> Result<OnboardHandle, TierError> {
    let job = OnboardJob::new(request.clone(), &target);
    // Claim the request's holds. No lock is held past this: G1
    // allocation below may wait for the offload worker, whose copies
    // complete on threads that also finish onboards.
    let given = match &target {
        OnboardTarget::Blocks(ids) => Some(ids.len()),
        OnboardTarget::Pool => None,
    };
    let claim = shared.requests.claim_for_onboard(&request, &job, given)?;
    if let Some(p) = &claim.prefetch {
        job.stop_with(p.cancel_token().clone());
    }
    // Which blocks this request copies, which it waits for.
    let sharing = match &target {
        OnboardTarget::Blocks(_) => Sharing::alone(claim.hashes.len()),
        OnboardTarget::Pool => shared.inflight.claim(&claim.hashes),
    };
    let dst = match target {
        OnboardTarget::Blocks(ids) => Dst::Ids(ids),
        OnboardTarget::Pool => match shared.g1_saves.allocate(shared, sharing.own.len(), false) {
            Ok(blocks) => Dst::Pool(blocks),
            Err(e) => {
                undo_start(shared, &job, claim, sharing.owned);
                return Err(e);
            }
        },
    };
    let completion = launch(shared, &job, claim, sharing, dst);
    job.arrive(shared);
    Ok(OnboardHandle {
        request,
        completion,
    })
}

/// Plans and submits the job's copies into `dst`, and has it wait for the
/// onboards it shares blocks with; returns the request's completion.
fn launch(
    shared: &Arc<Shared>,
    job: &Arc<OnboardJob>,
    claim: OnboardClaim,
    sharing: Sharing,
    dst: Dst,
) -> Completion<Done> {
    let OnboardClaim {
        holds,
        hashes,
        parents,
        sources,
        from_g3,
        prefetch,
    } = claim;
    let plan = CopyPlan::new(
        &sharing.own,
        &dst.ids(),
        &from_g3,
        &sources,
        prefetch.as_deref(),
    );
    // A prefetch none of whose blocks this request copies is not waited for.
    let prefetch = match prefetch {
        Some(p) if !plan.uses_staging() => {
            p.cancel();
            None
        }
        p => p,
    };
    // Direct G3 reads start once the blocks' writes to G3 have landed
    // (write-behind); a failed write fails the read.
    let g3_ready = plan.g3_ready(shared);
    let (completer, completion) = completion_pair::<Done>();
    let Sharing {
        own,
        waited,
        deps,
        owned,
    } = sharing;
    let state = JobState {
        waited_held: (0..hashes.len()).map(|_| None).collect(),
        hashes,
        parents,
        own,
        waited,
        from_g3,
        dst,
        holds,
        owned_inflight: owned,
        error: None,
        failed: [None; 2],
        bytes: [0; 2],
        completer: Some(completer),
    };
    job.begin(state, plan.transfers(prefetch.is_some()) + deps.len());
    let active = shared.offload.onboard_started();
    shared.metrics.onboards_in_flight(active);
    for dep in deps {
        let (shared2, job2) = (Arc::clone(shared), Arc::clone(job));
        dep.wait(Box::new(move || {
            job2.grab_waited(&shared2);
            job2.arrive(&shared2);
        }));
    }
    plan.submit(shared, job, g3_ready, prefetch);
    completion
}

/// A start that could not allocate its G1 targets: the in-flight entries
/// it claimed are dropped (requests waiting on them find no block and
/// fail), and the request gets its holds back.
fn undo_start(
    shared: &Shared,
    job: &Arc<OnboardJob>,
    claim: OnboardClaim,
    owned_inflight: Vec<(SequenceHash, Arc<Inflight>)>,
) {
    shared.inflight.end(&owned_inflight);
    shared
        .requests
        .unclaim(job.request(), job, claim.holds, claim.prefetch);
    job.mark_done();
    for (_, entry) in owned_inflight {
        entry.finish();
    }
}

/// Forgets `request` and drops everything it holds (see
/// [`super::TierEngine::release`]); `false` if it was unknown.
pub(crate) fn release(shared: &Shared, request: &RequestId) -> bool {
    let guard = shared.requests.take_engine_guard(request);
    if let Some(g) = &guard {
        g.release();
    }
    let Some(state) = shared.requests.remove(request) else {
        return guard.is_some();
    };
    if let Some(job) = state.onboard() {
        job.release();
    }
    drop(state);
    true
}
