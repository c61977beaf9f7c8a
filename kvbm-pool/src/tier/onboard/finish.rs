//! The finishing step of an onboard: runs once, on whichever thread
//! arrived last. It registers the loaded G1 blocks, lets requests waiting
//! on them look, counts the outcome, hands write-back what it must give
//! back to G2, and resolves the request's completion.

use std::sync::Arc;

use kvbm_block::SequenceHash;

use super::job::{Dst, JobState, OnboardJob};
use super::{Done, Onboarded};
use crate::metrics::Path;
use crate::pool::{ImmutableBlock, ImmutableBlocks, MutableBlock};
use crate::rate_limit::{RateLimit, WARN_EVERY, held_back_note};
use crate::tier::{G3Onboard, OffloadMode, Shared, TierError};

/// The finishing step: runs once, on whichever thread arrived last.
pub(super) fn finish(shared: &Arc<Shared>, job: &Arc<OnboardJob>) {
    let Some(mut state) = job.take_state() else {
        return;
    };
    let completer = state.completer.take();
    let dst = std::mem::replace(&mut state.dst, Dst::Ids(Vec::new()));
    let waited_held = std::mem::take(&mut state.waited_held);
    let result = match (state.error.take(), dst) {
        (Some(source), _) => {
            drop(waited_held);
            Err(TierError::Onboard {
                request: job.request().clone(),
                source,
            })
        }
        (None, Dst::Ids(_)) => Ok(Onboarded {
            blocks: ImmutableBlocks::empty(),
            count: state.hashes.len(),
        }),
        (None, Dst::Pool(targets)) => register_loaded(shared, &state, waited_held, targets)
            .ok_or_else(|| TierError::SharedOnboardFailed(job.request().clone())),
    };
    // The owner's blocks are in G1 (or failed): let waiting requests look.
    shared.inflight.end(&state.owned_inflight);
    let loaded_ok = result.is_ok();
    let (result, keep_alive) = match result {
        Ok(done) => succeeded(shared, job, &state, done),
        Err(e) => (failed(shared, job, &state, e), None),
    };
    if loaded_ok && !job.writes_engine_blocks() {
        give_back_when_evicted(shared, &state);
    }
    let JobState {
        holds,
        owned_inflight,
        ..
    } = state;
    drop(holds);
    job.mark_done();
    for (_, entry) in owned_inflight {
        entry.finish();
    }
    drop(keep_alive);
    if let Some(c) = completer {
        c.complete(Done(result));
    }
    // Last: a flush waits for it, so nothing the job held is still held
    // (a released request's loaded blocks, its G1 targets) once it returns.
    let left = shared.offload.onboard_ended();
    shared.metrics.onboards_in_flight(left);
}

/// Blocks the job copied from G2 and from G3.
fn copied(state: &JobState) -> [u64; 2] {
    let g3 = state.own.iter().filter(|&&i| state.from_g3[i]).count() as u64;
    [state.own.len() as u64 - g3, g3]
}

/// Counts a loaded onboard (and, with [`G3Onboard::KeepG2Copy`], queues
/// the blocks from G3 for G2). A request released meanwhile gets
/// [`TierError::Released`]; its blocks are returned to be held until
/// waiting requests have taken their share.
fn succeeded(
    shared: &Shared,
    job: &OnboardJob,
    state: &JobState,
    done: Onboarded,
) -> (Result<Onboarded, TierError>, Option<Onboarded>) {
    let took = job.elapsed();
    let [g2_count, g3_count] = copied(state);
    if g2_count > 0 {
        shared
            .metrics
            .copied(Path::G2ToG1, g2_count, state.bytes[0], took);
    }
    if g3_count > 0 {
        shared
            .metrics
            .copied(Path::G3ToG1, g3_count, state.bytes[1], took);
        if shared.config.g3_onboard == G3Onboard::KeepG2Copy {
            keep_g2_copies(shared, &done, state);
        }
    }
    if job.is_released() {
        (Err(TierError::Released(job.request().clone())), Some(done))
    } else {
        (Ok(done), None)
    }
}

/// Counts a failed onboard (per path, by what failed it) and warns.
fn failed(
    shared: &Shared,
    job: &OnboardJob,
    state: &JobState,
    e: TierError,
) -> Result<Onboarded, TierError> {
    let [g2_count, g3_count] = copied(state);
    let counts = [(Path::G2ToG1, g2_count), (Path::G3ToG1, g3_count)];
    for (cause, (path, blocks)) in state.failed.into_iter().zip(counts) {
        if let Some(cause) = cause {
            shared.metrics.copy_failed(path, cause, blocks);
        }
    }
    shared.metrics.onboard_failed();
    static WARN: RateLimit = RateLimit::new(WARN_EVERY);
    if let Some(held_back) = WARN.check() {
        let more = held_back_note(held_back);
        let request = job.request();
        tracing::warn!(%request, "onboard failed: {e}{more}");
    }
    Err(e)
}

/// Write-back gives blocks loaded into kvbm's G1 pool back to G2 when G1
/// evicts them, so the G2 and G3 copies of what was just loaded go first
/// meanwhile (the tiers stay exclusive). Blocks written into the engine's
/// own G1 are never given back: their copies keep their rank.
fn give_back_when_evicted(shared: &Shared, state: &JobState) {
    if shared.config.offload_mode != OffloadMode::WriteBack {
        return;
    }
    let (own, hashes, from_g3) = (&state.own, &state.hashes, &state.from_g3);
    shared
        .g1_saves
        .save_when_evicted(own.iter().map(|&i| hashes[i]));
    let from = |g3: bool| own.iter().filter(move |&&i| from_g3[i] == g3);
    // With `KeepG2Copy` the G3 blocks go to G2 as well: their G3 copies go
    // first, and the new G2 copies keep their rank.
    shared.books.demote_loaded(
        from(false).map(|&i| hashes[i]),
        from(true).map(|&i| hashes[i]),
    );
}

/// Completes and registers the loaded G1 blocks and collects, in prefix
/// order, the ones other requests loaded.
fn register_loaded(
    shared: &Shared,
    state: &JobState,
    mut waited_held: Vec<Option<ImmutableBlock>>,
    targets: Vec<MutableBlock>,
) -> Option<Onboarded> {
    let (hashes, parents): (&[SequenceHash], &[Option<SequenceHash>]) =
        (&state.hashes, &state.parents);
    let mut complete = Vec::with_capacity(targets.len());
    for (t, &i) in targets.into_iter().zip(&state.own) {
        // Pool blocks track no tokens, so completing cannot fail; if it
        // did, the block is dropped (freed) and the request fails.
        complete.push(t.complete(hashes[i], parents[i]).ok()?);
    }
    let g1 = &shared.books.g1().pool;
    let registered = g1.register(complete).ok()?;
    let mut slots: Vec<Option<ImmutableBlock>> = (0..hashes.len()).map(|_| None).collect();
    for (k, &i) in state.own.iter().enumerate() {
        slots[i] = registered.get(k);
    }
    drop(registered);
    for &i in &state.waited {
        slots[i] = match waited_held[i].take() {
            Some(b) => Some(b),
            None => g1.match_prefix(&hashes[i..=i]).get(0),
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
fn keep_g2_copies(shared: &Shared, done: &Onboarded, state: &JobState) {
    let items: Vec<_> = state
        .own
        .iter()
        .filter(|&&i| state.from_g3[i])
        .filter_map(|&i| {
            done.blocks
                .get(i)
                .map(|b| (b.downgrade(), state.parents[i]))
        })
        .collect();
    crate::tier::offload::enqueue(shared, items);
}
