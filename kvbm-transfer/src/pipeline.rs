//! Two-hop transfers through bounce buffers, as a real pipeline.
//!
//! The job's runs are cut into chunks that each fit one bounce slot. Chunk
//! k goes source → slot with the first backend (hop 1), then slot →
//! destination with the second (hop 2). Up to `max_slots` chunks are in the
//! pipe at once, so while hop 2 moves chunk k, hop 1 is already moving
//! chunk k+1. Hop 2 is started strictly in chunk order.
//!
//! Everything is driven by completion callbacks: a hop finishing, or a slot
//! coming back to the pool, advances the state machine; no thread waits on
//! a hop. On failure or cancellation no new hop starts, the slots of chunks
//! waiting for hop 2 go straight back to the pool, and the job resolves
//! only when no hop is in flight — so once the caller sees the result,
//! nothing more reaches the destination and every slot is back.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::backend::{CopyRun, TransferBackend, TransferJob};
#[cfg(feature = "diagnostics")]
use crate::bounce::trace::{ChunkTrace, TraceEvent};
use crate::bounce::{BouncePool, BounceSlot};
use crate::completion::{Completer, Completion, completion_pair};
use crate::error::TransferError;

struct Chunk {
    hop1: Arc<[CopyRun]>,
    hop2: Arc<[CopyRun]>,
}

/// Cuts the runs into chunks of at most `slot_bytes`, packing pieces
/// back to back in the slot. Pieces that continue the previous piece of
/// the same hop on both of its sides are merged into it: a slot is
/// contiguous, so hop 1 of a block-contiguous source (a disk file) becomes
/// one request per chunk instead of one per run of the destination's
/// layout, and hop 2 likewise for a contiguous destination.
fn chunk_runs(runs: &[CopyRun], slot_bytes: u64) -> Vec<Chunk> {
    let mut chunks = Vec::new();
    let (mut hop1, mut hop2) = (Vec::new(), Vec::new());
    let mut fill = 0u64;
    for run in runs {
        let mut done = 0;
        while done < run.len {
            let len = (run.len - done).min(slot_bytes - fill);
            push_merged(
                &mut hop1,
                CopyRun {
                    src_region: run.src_region,
                    src_offset: run.src_offset + done,
                    dst_region: 0,
                    dst_offset: fill,
                    len,
                },
            );
            push_merged(
                &mut hop2,
                CopyRun {
                    src_region: 0,
                    src_offset: fill,
                    dst_region: run.dst_region,
                    dst_offset: run.dst_offset + done,
                    len,
                },
            );
            fill += len;
            done += len;
            if fill == slot_bytes {
                chunks.push(Chunk {
                    hop1: std::mem::take(&mut hop1).into(),
                    hop2: std::mem::take(&mut hop2).into(),
                });
                fill = 0;
            }
        }
    }
    if !hop1.is_empty() {
        chunks.push(Chunk {
            hop1: hop1.into(),
            hop2: hop2.into(),
        });
    }
    chunks
}

/// Appends `run`, or grows the last run when `run` continues it on both
/// sides.
fn push_merged(runs: &mut Vec<CopyRun>, run: CopyRun) {
    if let Some(last) = runs.last_mut()
        && continues(last, &run)
    {
        last.len += run.len;
        return;
    }
    runs.push(run);
}

/// Whether `next` starts where `prev` ends, in source and destination.
fn continues(prev: &CopyRun, next: &CopyRun) -> bool {
    prev.src_region == next.src_region
        && prev.dst_region == next.dst_region
        && prev.src_offset + prev.len == next.src_offset
        && prev.dst_offset + prev.len == next.dst_offset
}

#[derive(Default)]
struct State {
    next_hop1: usize,
    next_hop2: usize,
    /// Chunks through hop 1, waiting for their turn at hop 2.
    ready: BTreeMap<usize, BounceSlot>,
    /// Slots held, in hop 1, waiting or in hop 2.
    slots_held: usize,
    hops_in_flight: usize,
    waiting_for_slot: bool,
    hop2_done: usize,
    error: Option<TransferError>,
    finished: bool,
}

enum Action {
    Hop1(usize, BounceSlot),
    Hop2(usize, BounceSlot),
    /// Ask the pool for a slot for this chunk.
    AskSlot(usize),
    Finish(Result<(), TransferError>),
}

struct Pipeline {
    job: TransferJob,
    chunks: Vec<Chunk>,
    first: Arc<dyn TransferBackend>,
    second: Arc<dyn TransferBackend>,
    pool: Arc<BouncePool>,
    max_slots: usize,
    state: Mutex<State>,
    completer: Mutex<Option<Completer>>,
    this: Weak<Pipeline>,
    /// Where to record chunk events, and this pipeline's id in it.
    #[cfg(feature = "diagnostics")]
    trace: Option<(Arc<ChunkTrace>, u32)>,
}

/// What two-hop pipelines record chunk events into: a chunk trace, if
/// any, with feature `diagnostics`; nothing without.
#[cfg(feature = "diagnostics")]
pub(crate) type TraceSink = Option<Arc<ChunkTrace>>;
/// What two-hop pipelines record chunk events into: nothing without
/// feature `diagnostics`.
#[cfg(not(feature = "diagnostics"))]
#[derive(Clone, Default)]
pub(crate) struct TraceSink;

/// Records a chunk event into the pipeline's trace (feature
/// `diagnostics`; without it, nothing is recorded).
macro_rules! note {
    ($p:expr, $chunk:expr, $slot:expr, $event:ident) => {
        #[cfg(feature = "diagnostics")]
        $p.note($chunk, $slot, TraceEvent::$event);
        #[cfg(not(feature = "diagnostics"))]
        let _: (usize, Option<&BounceSlot>) = ($chunk, $slot);
    };
}

/// Runs `job` as source → bounce (with `first`) → destination (with
/// `second`), holding at most `max_slots` slots of `pool` at a time, and
/// recording chunk events into `trace` if given.
pub(crate) fn two_hop(
    job: TransferJob,
    first: Arc<dyn TransferBackend>,
    second: Arc<dyn TransferBackend>,
    pool: Arc<BouncePool>,
    max_slots: usize,
    trace: TraceSink,
) -> Completion {
    #[cfg(not(feature = "diagnostics"))]
    let TraceSink = trace;
    if let Err(e) = job.validate_bounds() {
        return Completion::ready(Err(e));
    }
    let chunks = chunk_runs(&job.runs, pool.slot_bytes());
    if chunks.is_empty() {
        return Completion::ready(Ok(()));
    }
    let (completer, completion) = completion_pair();
    let p = Arc::new_cyclic(|this| Pipeline {
        job,
        chunks,
        first,
        second,
        pool,
        max_slots: max_slots.max(1),
        state: Mutex::new(State::default()),
        completer: Mutex::new(Some(completer)),
        this: this.clone(),
        #[cfg(feature = "diagnostics")]
        trace: trace.map(|t| {
            let id = t.new_pipeline();
            (t, id)
        }),
    });
    note!(p, p.chunks.len(), None, PipelineStart);
    p.pump(Vec::new());
    completion
}

impl Pipeline {
    #[cfg(feature = "diagnostics")]
    fn note(&self, chunk: usize, slot: Option<&BounceSlot>, event: TraceEvent) {
        if let Some((trace, id)) = &self.trace {
            trace.record(*id, chunk, slot.map(BounceSlot::index), event);
        }
    }

    fn stopped(&self, st: &mut State) -> bool {
        if st.error.is_none() && self.job.cancel.is_cancelled() {
            st.error = Some(TransferError::Cancelled);
        }
        st.error.is_some()
    }

    /// Decides what can happen next and does it. `release` are slots to
    /// return once the lock is dropped.
    fn pump(&self, mut release: Vec<BounceSlot>) {
        let mut actions = Vec::new();
        {
            let mut st = self.state.lock();
            if st.finished {
                drop(st);
                drop(release);
                return;
            }
            let stopped = self.stopped(&mut st);
            if stopped {
                let ready = std::mem::take(&mut st.ready);
                st.slots_held -= ready.len();
                release.extend(ready.into_values());
            } else {
                while let Some(slot) = {
                    let k = st.next_hop2;
                    st.ready.remove(&k)
                } {
                    // Noted here, in the order hop 2s are decided: two
                    // threads' pumps may submit theirs the other way round.
                    note!(self, st.next_hop2, Some(&slot), Hop2Start);
                    actions.push(Action::Hop2(st.next_hop2, slot));
                    st.next_hop2 += 1;
                    st.hops_in_flight += 1;
                }
                if !st.waiting_for_slot
                    && st.next_hop1 < self.chunks.len()
                    && st.slots_held < self.max_slots
                {
                    st.waiting_for_slot = true;
                    actions.push(Action::AskSlot(st.next_hop1));
                }
            }
            let all_done = st.hop2_done == self.chunks.len();
            if all_done || (stopped && st.hops_in_flight == 0) {
                st.finished = true;
                let result = if all_done {
                    Ok(())
                } else {
                    Err(st.error.take().unwrap_or(TransferError::Cancelled))
                };
                actions.push(Action::Finish(result));
            }
        }
        drop(release);
        for a in actions {
            self.act(a);
        }
    }

    fn act(&self, action: Action) {
        let Some(me) = self.this.upgrade() else {
            return;
        };
        match action {
            Action::AskSlot(k) => {
                note!(self, k, None, SlotAsked);
                self.pool.acquire(move |slot| me.slot_arrived(slot));
            }
            Action::Hop1(k, slot) => {
                note!(self, k, Some(&slot), Hop1Start);
                let job = TransferJob::new(
                    self.job.src.clone(),
                    vec![slot.region()].into(),
                    self.chunks[k].hop1.clone(),
                    self.job.cancel.clone(),
                );
                self.first
                    .submit(job)
                    .on_complete(move |r| me.hop1_done(k, slot, r));
            }
            Action::Hop2(k, slot) => {
                let job = TransferJob::new(
                    vec![slot.region()].into(),
                    self.job.dst.clone(),
                    self.chunks[k].hop2.clone(),
                    self.job.cancel.clone(),
                );
                self.second
                    .submit(job)
                    .on_complete(move |r| me.hop2_done(k, slot, r));
            }
            Action::Finish(result) => {
                if let Some(c) = self.completer.lock().take() {
                    c.complete(result);
                }
            }
        }
    }

    fn slot_arrived(&self, slot: BounceSlot) {
        let start = {
            let mut st = self.state.lock();
            st.waiting_for_slot = false;
            if st.finished || self.stopped(&mut st) || st.next_hop1 >= self.chunks.len() {
                None
            } else {
                let k = st.next_hop1;
                st.next_hop1 += 1;
                st.slots_held += 1;
                st.hops_in_flight += 1;
                Some(k)
            }
        };
        match start {
            Some(k) => {
                note!(self, k, Some(&slot), SlotGranted);
                self.act(Action::Hop1(k, slot));
                self.pump(Vec::new());
            }
            None => self.pump(vec![slot]),
        }
    }

    fn record_error(st: &mut State, e: TransferError) {
        if st.error.is_none() || matches!(st.error, Some(TransferError::Cancelled)) {
            st.error = Some(e);
        }
    }

    fn hop1_done(&self, k: usize, slot: BounceSlot, r: Result<(), TransferError>) {
        note!(self, k, Some(&slot), Hop1End);
        let mut release = Vec::new();
        {
            let mut st = self.state.lock();
            st.hops_in_flight -= 1;
            match r {
                Ok(()) => {
                    st.ready.insert(k, slot);
                }
                Err(e) => {
                    Self::record_error(&mut st, e);
                    st.slots_held -= 1;
                    release.push(slot);
                }
            }
        }
        self.pump(release);
    }

    fn hop2_done(&self, k: usize, slot: BounceSlot, r: Result<(), TransferError>) {
        note!(self, k, Some(&slot), Hop2End);
        {
            let mut st = self.state.lock();
            st.hops_in_flight -= 1;
            st.slots_held -= 1;
            match r {
                Ok(()) => st.hop2_done += 1,
                Err(e) => Self::record_error(&mut st, e),
            }
        }
        self.pump(vec![slot]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Segments `(region, offset, len)` of a byte stream, with
    /// contiguous neighbours merged, so that two cuttings of one stream
    /// compare equal.
    fn normalised(segments: impl IntoIterator<Item = (u32, u64, u64)>) -> Vec<(u32, u64, u64)> {
        let mut out: Vec<(u32, u64, u64)> = Vec::new();
        for (region, offset, len) in segments {
            match out.last_mut() {
                Some(last) if last.0 == region && last.1 + last.2 == offset => last.2 += len,
                _ => out.push((region, offset, len)),
            }
        }
        out
    }

    proptest! {
        #[test]
        fn chunks_cover_every_byte_once_and_fit_a_slot(
            lens in proptest::collection::vec(1u64..40_000, 1..30),
            gaps in proptest::collection::vec(prop_oneof![Just(0u64), 1u64..64], 30),
            slot in 1u64..50_000,
        ) {
            // Some runs continue the previous one (gap 0) on both sides,
            // some only in the source, some nowhere.
            let (mut src, mut dst) = (0u64, 0u64);
            let runs: Vec<CopyRun> = lens.iter().enumerate().map(|(i, &len)| {
                let r = CopyRun { src_region: 0, src_offset: src, dst_region: (i % 2) as u32 * gaps[i].min(1) as u32, dst_offset: dst, len };
                src += len + gaps[i] / 2;
                dst += len + gaps[i];
                r
            }).collect();
            let chunks = chunk_runs(&runs, slot);
            let (mut s1, mut d2) = (Vec::new(), Vec::new());
            for c in &chunks {
                let bytes1: u64 = c.hop1.iter().map(|r| r.len).sum();
                let bytes2: u64 = c.hop2.iter().map(|r| r.len).sum();
                prop_assert_eq!(bytes1, bytes2);
                prop_assert!(bytes1 <= slot);
                // Each hop tiles the slot from 0, in order.
                let mut fill = 0;
                for a in c.hop1.iter() {
                    prop_assert_eq!((a.dst_region, a.dst_offset), (0, fill));
                    fill += a.len;
                    s1.push((a.src_region, a.src_offset, a.len));
                }
                let mut fill = 0;
                for b in c.hop2.iter() {
                    prop_assert_eq!((b.src_region, b.src_offset), (0, fill));
                    fill += b.len;
                    d2.push((b.dst_region, b.dst_offset, b.len));
                }
                // Nothing left to merge inside a chunk.
                for w in c.hop1.windows(2) {
                    prop_assert!(!continues(&w[0], &w[1]));
                }
                for w in c.hop2.windows(2) {
                    prop_assert!(!continues(&w[0], &w[1]));
                }
            }
            // Every chunk but the last fills its slot.
            for c in chunks.iter().rev().skip(1) {
                prop_assert_eq!(c.hop1.iter().map(|r| r.len).sum::<u64>(), slot);
            }
            // Hop 1 reads the runs' sources, hop 2 writes their
            // destinations, byte for byte in the same order.
            prop_assert_eq!(
                normalised(s1),
                normalised(runs.iter().map(|r| (r.src_region, r.src_offset, r.len)))
            );
            prop_assert_eq!(
                normalised(d2),
                normalised(runs.iter().map(|r| (r.dst_region, r.dst_offset, r.len)))
            );
        }
    }
}
