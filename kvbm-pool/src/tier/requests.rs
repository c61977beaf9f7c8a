//! The request table: every live request's match (its prompt's hashes,
//! the G2 and G3 blocks it holds, its G3 prefetch and its onboard), and
//! the guards of the engine-owned G1 blocks it queued for offload.
//!
//! A request enters with its match, is claimed by its onboard (which takes
//! its holds) and leaves on release. Nothing outside this file locks the
//! table: every step is a method that says what it does, and holds that
//! are dropped leave the lock first.

use std::collections::HashMap;
use std::sync::Arc;

use kvbm_block::SequenceHash;
use parking_lot::Mutex;

use super::offload::EngineGuard;
use super::onboard::OnboardJob;
use super::prefetch::Prefetch;
use super::{RequestId, TierError};
use crate::pool::ImmutableBlocks;

/// A run of consecutive matched blocks held in one kvbm tier.
pub(crate) struct Segment {
    /// `true` for G3, `false` for G2.
    pub(crate) g3: bool,
    /// The held blocks, in prefix order.
    pub(crate) blocks: ImmutableBlocks,
}

/// What the engine keeps per live request.
pub(crate) struct RequestState {
    /// The prompt's block hashes.
    hashes: Vec<SequenceHash>,
    /// Index of the first block to onboard (the G1 prefix length).
    start: usize,
    /// Held runs of G2 and G3 blocks, in prefix order.
    segments: Vec<Segment>,
    /// The onboard, once started.
    onboard: Option<Arc<OnboardJob>>,
    /// The G3 read started at match time, until the onboard takes it.
    prefetch: Option<Arc<Prefetch>>,
}

impl RequestState {
    /// A new match: the prompt's `hashes`, the G1 prefix length `start`,
    /// the held G2/G3 runs after it and their G3 prefetch.
    pub(crate) fn matched(
        hashes: Vec<SequenceHash>,
        start: usize,
        segments: Vec<Segment>,
        prefetch: Option<Arc<Prefetch>>,
    ) -> Self {
        Self {
            hashes,
            start,
            segments,
            onboard: None,
            prefetch,
        }
    }

    /// The request's onboard, if one started.
    pub(crate) fn onboard(&self) -> Option<&Arc<OnboardJob>> {
        self.onboard.as_ref()
    }
}

impl Drop for RequestState {
    /// A request forgotten before its onboard took its prefetch stops the
    /// read (its slots and holds return once the read has stopped).
    fn drop(&mut self) {
        if let Some(p) = self.prefetch.take() {
            p.cancel();
        }
    }
}

/// What an onboard takes from its request's match.
pub(crate) struct OnboardClaim {
    /// The held runs of G2 and G3 blocks, in prefix order.
    pub(crate) holds: Vec<Segment>,
    /// The hashes of the blocks to load, in prefix order.
    pub(crate) hashes: Vec<SequenceHash>,
    /// Each block's parent hash.
    pub(crate) parents: Vec<Option<SequenceHash>>,
    /// Each block's id in the tier that holds it.
    pub(crate) sources: Vec<u32>,
    /// Whether each block comes from G3 (else G2).
    pub(crate) from_g3: Vec<bool>,
    /// The match's G3 read, if one runs.
    pub(crate) prefetch: Option<Arc<Prefetch>>,
}

/// The live requests and the engine-block guards of their offloads.
#[derive(Default)]
pub(crate) struct Requests {
    table: Mutex<HashMap<RequestId, RequestState>>,
    /// Requests with engine-owned G1 blocks queued for offload.
    engine_guards: Mutex<HashMap<RequestId, Arc<EngineGuard>>>,
}

impl Requests {
    /// Whether matching `request` now would be its first match; an error
    /// when its onboard has started.
    pub(crate) fn first_match(&self, request: &RequestId) -> Result<bool, TierError> {
        match self.table.lock().get(request) {
            Some(state) if state.onboard.is_some() => {
                Err(TierError::AlreadyOnboarding(request.clone()))
            }
            Some(_) => Ok(false),
            None => Ok(true),
        }
    }

    /// The G3 read of `request`'s earlier match, taken for a new match from
    /// the same G1 prefix (`start`) when it still serves `segments`.
    pub(crate) fn take_prefetch_serving(
        &self,
        request: &RequestId,
        start: usize,
        segments: &[Segment],
    ) -> Option<Arc<Prefetch>> {
        match self.table.lock().get_mut(request) {
            Some(old) if old.onboard.is_none() && old.start == start => {
                old.prefetch.take_if(|p| p.serves(segments))
            }
            _ => None,
        }
    }

    /// Records `request`'s match, replacing an earlier one (whose holds
    /// are dropped after the lock is released); an error when its onboard
    /// started meanwhile.
    pub(crate) fn insert(&self, request: RequestId, state: RequestState) -> Result<(), TierError> {
        let mut table = self.table.lock();
        if table.get(&request).is_some_and(|s| s.onboard.is_some()) {
            return Err(TierError::AlreadyOnboarding(request));
        }
        let old = table.insert(request, state);
        drop(table);
        drop(old);
        Ok(())
    }

    /// Claims `request`'s match for its onboard `job`: takes its holds and
    /// prefetch and marks it onboarding. `given`: the number of engine G1
    /// blocks to load into, which must match the blocks held.
    pub(crate) fn claim_for_onboard(
        &self,
        request: &RequestId,
        job: &Arc<OnboardJob>,
        given: Option<usize>,
    ) -> Result<OnboardClaim, TierError> {
        let mut table = self.table.lock();
        let Some(state) = table.get_mut(request) else {
            return Err(TierError::UnknownRequest(request.clone()));
        };
        if state.onboard.is_some() {
            return Err(TierError::AlreadyOnboarding(request.clone()));
        }
        let mut from_g3 = Vec::new();
        let mut sources = Vec::new();
        for seg in &state.segments {
            from_g3.extend(std::iter::repeat_n(seg.g3, seg.blocks.len()));
            sources.extend_from_slice(seg.blocks.block_ids());
        }
        let n = sources.len();
        if let Some(given) = given
            && given != n
        {
            return Err(TierError::DestinationMismatch {
                request: request.clone(),
                expected: n,
                given,
            });
        }
        let range = state.start..state.start + n;
        let hashes = state.hashes[range.clone()].to_vec();
        let parents = range
            .map(|i| i.checked_sub(1).map(|p| state.hashes[p]))
            .collect();
        state.onboard = Some(Arc::clone(job));
        Ok(OnboardClaim {
            holds: std::mem::take(&mut state.segments),
            hashes,
            parents,
            sources,
            from_g3,
            prefetch: state.prefetch.take(),
        })
    }

    /// Gives an onboard `job` that could not start its holds and prefetch
    /// back; when the request is gone (or onboards anew) they are dropped
    /// and the read stopped.
    pub(crate) fn unclaim(
        &self,
        request: &RequestId,
        job: &Arc<OnboardJob>,
        holds: Vec<Segment>,
        prefetch: Option<Arc<Prefetch>>,
    ) {
        let mut table = self.table.lock();
        match table.get_mut(request) {
            Some(state) if state.onboard.as_ref().is_some_and(|j| Arc::ptr_eq(j, job)) => {
                state.segments = holds;
                state.prefetch = prefetch;
                state.onboard = None;
            }
            _ => {
                drop(holds);
                if let Some(p) = prefetch {
                    p.cancel();
                }
            }
        }
    }

    /// Forgets `request`, returning what it kept (dropped by the caller,
    /// outside the lock).
    pub(crate) fn remove(&self, request: &RequestId) -> Option<RequestState> {
        self.table.lock().remove(request)
    }

    /// The prompt's hashes of `request`, as matched.
    pub(crate) fn hashes(&self, request: &RequestId) -> Option<Vec<SequenceHash>> {
        self.table.lock().get(request).map(|s| s.hashes.clone())
    }

    /// Requests known (matched and not released).
    pub(crate) fn len(&self) -> usize {
        self.table.lock().len()
    }

    /// The guard of `request`'s engine-owned G1 blocks queued for offload,
    /// made on first use.
    pub(crate) fn engine_guard(&self, request: RequestId) -> Arc<EngineGuard> {
        Arc::clone(self.engine_guards.lock().entry(request).or_default())
    }

    /// The guard of `request`'s engine-owned blocks, if it queued any.
    pub(crate) fn find_engine_guard(&self, request: &RequestId) -> Option<Arc<EngineGuard>> {
        self.engine_guards.lock().get(request).cloned()
    }

    /// Takes the guard of `request`'s engine-owned blocks, if it queued
    /// any.
    pub(crate) fn take_engine_guard(&self, request: &RequestId) -> Option<Arc<EngineGuard>> {
        self.engine_guards.lock().remove(request)
    }
}
