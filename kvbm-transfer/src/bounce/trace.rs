//! Per-chunk tracing of two-hop pipelines: where a pipeline sits idle.
//!
//! A two-hop transfer is only as good as its overlap: while hop 2 moves
//! chunk k, hop 1 should already be moving chunk k+1, and a slot that comes
//! back from hop 2 should go straight into hop 1 again. Throughput figures
//! alone cannot say why overlap falls short — a slow hand-off between the
//! hops, too few slots, a hop waiting on the CPU. A [`ChunkTrace`] records
//! when each chunk asked for and got a slot and when each of its hops was
//! submitted and completed, as nanosecond timestamps written into a
//! preallocated buffer (two relaxed stores and one `fetch_add` per event, no
//! allocation, no lock), together with the CPU the event ran on.
//! [`TraceSummary`] turns the records into the answer: the share of the
//! wall time in which both hops had work, only one had, or neither had, and
//! the latencies of the hand-offs between them.
//!
//! Compiled with feature `diagnostics` only. Tracing is off unless an
//! executor is built with [`crate::ExecutorBuilder::chunk_trace`];
//! untraced pipelines pay one branch per event.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

/// What happened to a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TraceEvent {
    /// The pipeline asked the pool for a slot for this chunk.
    SlotAsked = 1,
    /// The slot arrived (at once, or when another chunk returned one).
    SlotGranted = 2,
    /// Hop 1 (source → slot) was submitted to its backend.
    Hop1Start = 3,
    /// Hop 1 completed.
    Hop1End = 4,
    /// Hop 2 (slot → destination) was started: noted when the pipeline
    /// takes it in chunk order, just before it is submitted to its backend.
    Hop2Start = 5,
    /// Hop 2 completed; the slot goes back to the pool.
    Hop2End = 6,
    /// A pipeline started; the record's `chunk` is its number of chunks.
    PipelineStart = 7,
}

impl TraceEvent {
    fn from_code(code: u64) -> Option<Self> {
        Some(match code {
            1 => TraceEvent::SlotAsked,
            2 => TraceEvent::SlotGranted,
            3 => TraceEvent::Hop1Start,
            4 => TraceEvent::Hop1End,
            5 => TraceEvent::Hop2Start,
            6 => TraceEvent::Hop2End,
            7 => TraceEvent::PipelineStart,
            _ => return None,
        })
    }
}

/// One recorded event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceRecord {
    /// Nanoseconds since the trace was created.
    pub t_ns: u64,
    /// Which pipeline (one per two-hop batch), numbered from 0.
    pub pipeline: u32,
    /// The chunk's index within its pipeline.
    pub chunk: u32,
    /// The bounce slot's index in its pool (`u16::MAX` for `SlotAsked`).
    pub slot: u16,
    /// The CPU the event was recorded on.
    pub cpu: u16,
    /// What happened.
    pub event: TraceEvent,
}

// Packing of the second word: event (8 bits) | cpu (16) | slot (16) | chunk (24).
const CHUNK_BITS: u32 = 24;
const SLOT_SHIFT: u32 = CHUNK_BITS;
const CPU_SHIFT: u32 = SLOT_SHIFT + 16;
const EVENT_SHIFT: u32 = CPU_SHIFT + 16;

/// A fixed-capacity, lock-free event log for two-hop pipelines.
pub struct ChunkTrace {
    epoch: Instant,
    /// `[t_ns, packed]` per event; `packed == 0` marks an unwritten entry.
    events: Box<[[AtomicU64; 2]]>,
    /// Pipeline id of each entry.
    pipelines: Box<[AtomicU32]>,
    next: AtomicUsize,
    next_pipeline: AtomicU32,
}

impl std::fmt::Debug for ChunkTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkTrace")
            .field("capacity", &self.events.len())
            .field("recorded", &self.len())
            .finish()
    }
}

impl ChunkTrace {
    /// A trace with room for `capacity` events (six per chunk); events past
    /// it are counted in [`ChunkTrace::dropped`] and otherwise ignored.
    pub fn new(capacity: usize) -> Self {
        ChunkTrace {
            epoch: Instant::now(),
            events: (0..capacity)
                .map(|_| [AtomicU64::new(0), AtomicU64::new(0)])
                .collect(),
            pipelines: (0..capacity).map(|_| AtomicU32::new(0)).collect(),
            next: AtomicUsize::new(0),
            next_pipeline: AtomicU32::new(0),
        }
    }

    /// Events recorded so far (at most the capacity).
    pub fn len(&self) -> usize {
        self.next.load(Ordering::Acquire).min(self.events.len())
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Events that did not fit.
    pub fn dropped(&self) -> usize {
        self.next
            .load(Ordering::Acquire)
            .saturating_sub(self.events.len())
    }

    /// Forgets every event (call it between runs, with no pipeline running).
    pub fn clear(&self) {
        let n = self.len();
        for e in &self.events[..n] {
            e[1].store(0, Ordering::Relaxed);
        }
        self.next.store(0, Ordering::Release);
        self.next_pipeline.store(0, Ordering::Relaxed);
    }

    pub(crate) fn new_pipeline(&self) -> u32 {
        self.next_pipeline.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn record(
        &self,
        pipeline: u32,
        chunk: usize,
        slot: Option<usize>,
        event: TraceEvent,
    ) {
        let i = self.next.fetch_add(1, Ordering::AcqRel);
        let Some(entry) = self.events.get(i) else {
            return;
        };
        let t = self.epoch.elapsed().as_nanos() as u64;
        let cpu = current_cpu();
        let slot = slot.map_or(u16::MAX as u64, |s| (s as u64).min(u16::MAX as u64 - 1));
        let packed = (event as u64) << EVENT_SHIFT
            | (cpu as u64) << CPU_SHIFT
            | slot << SLOT_SHIFT
            | (chunk as u64 & ((1 << CHUNK_BITS) - 1));
        entry[0].store(t, Ordering::Relaxed);
        self.pipelines[i].store(pipeline, Ordering::Relaxed);
        entry[1].store(packed, Ordering::Release);
    }

    /// The recorded events, ordered by time. Read it when no pipeline runs
    /// (after the transfers completed); an event being written concurrently
    /// may be missing.
    pub fn records(&self) -> Vec<TraceRecord> {
        let mut out: Vec<TraceRecord> = self.events[..self.len()]
            .iter()
            .zip(self.pipelines.iter())
            .filter_map(|(e, p)| {
                let packed = e[1].load(Ordering::Acquire);
                Some(TraceRecord {
                    t_ns: e[0].load(Ordering::Relaxed),
                    pipeline: p.load(Ordering::Relaxed),
                    chunk: (packed & ((1 << CHUNK_BITS) - 1)) as u32,
                    slot: (packed >> SLOT_SHIFT) as u16,
                    cpu: (packed >> CPU_SHIFT) as u16,
                    event: TraceEvent::from_code(packed >> EVENT_SHIFT)?,
                })
            })
            .collect();
        out.sort_by_key(|r| (r.t_ns, r.event));
        out
    }
}

fn current_cpu() -> u16 {
    // SAFETY: sched_getcpu has no preconditions; it returns -1 on failure.
    let cpu = unsafe { libc::sched_getcpu() };
    u16::try_from(cpu).unwrap_or(u16::MAX)
}

/// Median, 90th percentile and maximum of a set of durations (ns).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quantiles {
    /// How many samples.
    pub count: usize,
    /// Median.
    pub p50: u64,
    /// 90th percentile.
    pub p90: u64,
    /// Largest.
    pub max: u64,
}

impl Quantiles {
    fn of(mut v: Vec<u64>) -> Self {
        if v.is_empty() {
            return Quantiles::default();
        }
        v.sort_unstable();
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        Quantiles {
            count: v.len(),
            p50: at(0.5),
            p90: at(0.9),
            max: v[v.len() - 1],
        }
    }
}

impl std::fmt::Display for Quantiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let us = |ns: u64| ns as f64 / 1e3;
        write!(
            f,
            "p50 {:.1} µs, p90 {:.1} µs, max {:.1} µs (n={})",
            us(self.p50),
            us(self.p90),
            us(self.max),
            self.count
        )
    }
}

/// Where the wall time of a traced run went, summed over every pipeline
/// in the trace (they share the backends, so the resource view is what
/// counts). "Busy" means at least one hop of that kind was submitted and
/// not yet complete: the backend had work, whether or not it got a CPU.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TraceSummary {
    /// Chunks that finished hop 2.
    pub chunks: usize,
    /// First to last event.
    pub span_ns: u64,
    /// Share of the span with hop 1 and hop 2 both busy (the overlap).
    pub both: f64,
    /// Hop 1 busy, hop 2 idle: hop 2 waits for data (hop-1-bound).
    pub hop1_only: f64,
    /// Hop 2 busy, hop 1 idle although a running pipeline still has chunks
    /// for it: every slot it may hold is in hop 2 or queued for it
    /// (hop-2-bound, or too few slots).
    pub hop2_only_slot_bound: f64,
    /// Hop 2 busy, hop 1 idle with no chunk left for it in any running
    /// pipeline: the tail of a batch.
    pub hop2_only_tail: f64,
    /// Neither hop busy: a bubble (hand-off latency, start-up, gaps between
    /// batches).
    pub idle: f64,
    /// Time with at least one hop 1 in flight (ns); the bytes of the run
    /// over this is the rate hop 1 kept up while it had work.
    pub hop1_busy_ns: u64,
    /// Time with at least one hop 2 in flight (ns).
    pub hop2_busy_ns: u64,
    /// Per chunk, hop 1 submitted → completed.
    pub hop1: Quantiles,
    /// Per chunk, hop 2 submitted → completed.
    pub hop2: Quantiles,
    /// Hop 1 completed → hop 2 submitted, for chunks whose predecessor was
    /// already submitted to hop 2 (pure hand-off cost, no ordering wait).
    pub handoff: Quantiles,
    /// Slot asked → granted.
    pub slot_wait: Quantiles,
    /// Slot granted → hop 1 submitted.
    pub grant_to_hop1: Quantiles,
    /// Per (hop, CPU): completions of that hop seen on that CPU (the
    /// thread that finished the hop ran there), to see thread placement.
    pub cpus: Vec<(u8, u16, usize)>,
}

impl TraceSummary {
    /// Analyses the records of [`ChunkTrace::records`].
    pub fn from_records(records: &[TraceRecord]) -> Self {
        use TraceEvent as E;
        let Some(first) = records.first() else {
            return TraceSummary::default();
        };
        let start = first.t_ns;
        let end = records.last().map_or(start, |r| r.t_ns);
        let mut at: FirstSeen = HashMap::new();
        for r in records {
            at.entry((r.pipeline, r.chunk, r.event)).or_insert(r.t_ns);
        }
        let span = |a: TraceEvent, b: TraceEvent| -> Vec<u64> {
            records
                .iter()
                .filter(|r| r.event == a)
                .filter_map(|r| {
                    at.get(&(r.pipeline, r.chunk, b))
                        .map(|&t| t.saturating_sub(r.t_ns))
                })
                .collect()
        };
        let handoff = handoff_times(records, &at);
        let Overlap {
            both,
            h1_only,
            slot_bound,
            other,
            idle,
            cpus,
        } = Overlap::sweep(records, start);
        let total = (end - start).max(1) as f64;
        TraceSummary {
            chunks: records.iter().filter(|r| r.event == E::Hop2End).count(),
            span_ns: end - start,
            both: both as f64 / total,
            hop1_only: h1_only as f64 / total,
            hop2_only_slot_bound: slot_bound as f64 / total,
            hop2_only_tail: other as f64 / total,
            idle: idle as f64 / total,
            hop1_busy_ns: both + h1_only,
            hop2_busy_ns: both + slot_bound + other,
            hop1: Quantiles::of(span(E::Hop1Start, E::Hop1End)),
            hop2: Quantiles::of(span(E::Hop2Start, E::Hop2End)),
            handoff: Quantiles::of(handoff),
            slot_wait: Quantiles::of(span(E::SlotAsked, E::SlotGranted)),
            grant_to_hop1: Quantiles::of(span(E::SlotGranted, E::Hop1Start)),
            cpus,
        }
    }
}

/// When each `(pipeline, chunk, event)` was first recorded (ns).
type FirstSeen = HashMap<(u32, u32, TraceEvent), u64>;

/// Hop 1 completed → hop 2 submitted, per chunk whose predecessor was
/// already submitted to hop 2 when its hop 1 completed.
fn handoff_times(records: &[TraceRecord], at: &FirstSeen) -> Vec<u64> {
    use TraceEvent as E;
    records
        .iter()
        .filter(|r| r.event == E::Hop1End)
        .filter_map(|r| {
            let started = *at.get(&(r.pipeline, r.chunk, E::Hop2Start))?;
            let prev_started = if r.chunk == 0 {
                0
            } else {
                *at.get(&(r.pipeline, r.chunk - 1, E::Hop2Start))?
            };
            (prev_started <= r.t_ns).then(|| started.saturating_sub(r.t_ns))
        })
        .collect()
}

/// How long (ns) the two hops overlapped over a trace's timeline, and where
/// each hop's completions ran.
struct Overlap {
    /// Both hops in flight.
    both: u64,
    /// Only hop 1 in flight.
    h1_only: u64,
    /// Only hop 2 in flight while chunks still wait to start hop 1.
    slot_bound: u64,
    /// Only hop 2 in flight, nothing left to start.
    other: u64,
    /// Neither hop in flight.
    idle: u64,
    /// Per (hop, CPU), completions of that hop seen there, sorted.
    cpus: Vec<(u8, u16, usize)>,
}

impl Overlap {
    /// Sweeps the timeline from `start` with counters of hops in flight and
    /// of chunks that running pipelines have not yet started on hop 1.
    fn sweep(records: &[TraceRecord], start: u64) -> Self {
        use TraceEvent as E;
        let (mut h1, mut h2, mut left) = (0i64, 0i64, 0i64);
        let (mut both, mut h1_only, mut slot_bound, mut other, mut idle) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        let mut last = start;
        let mut cpus: HashMap<(u8, u16), usize> = HashMap::new();
        for r in records {
            let dt = r.t_ns - last;
            match (h1 > 0, h2 > 0) {
                (true, true) => both += dt,
                (true, false) => h1_only += dt,
                (false, true) if left > 0 => slot_bound += dt,
                (false, true) => other += dt,
                (false, false) => idle += dt,
            }
            last = r.t_ns;
            match r.event {
                E::PipelineStart => left += i64::from(r.chunk),
                E::SlotAsked | E::SlotGranted => {}
                E::Hop1Start => {
                    h1 += 1;
                    left -= 1;
                }
                E::Hop1End => h1 -= 1,
                E::Hop2Start => h2 += 1,
                E::Hop2End => h2 -= 1,
            }
            match r.event {
                E::Hop1End => *cpus.entry((1, r.cpu)).or_default() += 1,
                E::Hop2End => *cpus.entry((2, r.cpu)).or_default() += 1,
                _ => {}
            }
        }
        let mut cpus: Vec<(u8, u16, usize)> =
            cpus.into_iter().map(|((h, c), n)| (h, c, n)).collect();
        cpus.sort_unstable();
        Overlap {
            both,
            h1_only,
            slot_bound,
            other,
            idle,
            cpus,
        }
    }
}

impl std::fmt::Display for TraceSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pct = |x: f64| x * 100.0;
        writeln!(
            f,
            "{} chunks over {:.1} ms: both hops busy {:.1}%, hop 1 only {:.1}%, hop 2 only (slot-bound) {:.1}%, hop 2 only (tail) {:.1}%, neither {:.1}%",
            self.chunks,
            self.span_ns as f64 / 1e6,
            pct(self.both),
            pct(self.hop1_only),
            pct(self.hop2_only_slot_bound),
            pct(self.hop2_only_tail),
            pct(self.idle)
        )?;
        writeln!(f, "hop 1 per chunk: {}", self.hop1)?;
        writeln!(f, "hop 2 per chunk: {}", self.hop2)?;
        writeln!(f, "hand-off hop 1 end → hop 2 submit: {}", self.handoff)?;
        writeln!(f, "slot wait: {}", self.slot_wait)?;
        writeln!(f, "slot granted → hop 1 submit: {}", self.grant_to_hop1)?;
        write!(f, "hop completions per (hop, cpu):")?;
        for (h, c, n) in &self.cpus {
            write!(f, " ({h}, {c}): {n}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TraceEvent as E;

    fn rec(t_ns: u64, chunk: u32, event: TraceEvent) -> TraceRecord {
        TraceRecord {
            t_ns,
            pipeline: 0,
            chunk,
            slot: 0,
            cpu: 0,
            event,
        }
    }

    #[test]
    fn records_round_trip_through_the_packed_log() {
        let t = ChunkTrace::new(4);
        t.record(3, 77, Some(5), E::Hop1Start);
        t.record(3, 77, None, E::SlotAsked);
        let r = t.records();
        assert_eq!(r.len(), 2);
        let h = r.iter().find(|r| r.event == E::Hop1Start).unwrap();
        assert_eq!((h.pipeline, h.chunk, h.slot), (3, 77, 5));
        let a = r.iter().find(|r| r.event == E::SlotAsked).unwrap();
        assert_eq!(a.slot, u16::MAX);
        for _ in 0..5 {
            t.record(0, 0, None, E::Hop2End);
        }
        assert_eq!((t.len(), t.dropped()), (4, 3));
        t.clear();
        assert!(t.is_empty() && t.records().is_empty());
    }

    #[test]
    fn summary_splits_the_timeline_by_which_hop_is_busy() {
        // Chunk 0: hop 1 0–10, hop 2 12–30. Chunk 1: slot asked at 10,
        // granted at 30, hop 1 30–40, hop 2 40–50.
        let r = vec![
            rec(0, 2, E::PipelineStart),
            rec(0, 0, E::SlotAsked),
            rec(0, 0, E::SlotGranted),
            rec(0, 0, E::Hop1Start),
            rec(10, 0, E::Hop1End),
            rec(10, 1, E::SlotAsked),
            rec(12, 0, E::Hop2Start),
            rec(30, 0, E::Hop2End),
            rec(30, 1, E::SlotGranted),
            rec(30, 1, E::Hop1Start),
            rec(40, 1, E::Hop1End),
            rec(40, 1, E::Hop2Start),
            rec(50, 1, E::Hop2End),
        ];
        let s = TraceSummary::from_records(&r);
        assert_eq!(s.chunks, 2);
        assert_eq!(s.span_ns, 50);
        // hop 1 only: 0–10 and 30–40; idle 10–12; hop 2 slot-bound 12–30
        // (chunk 1 not started); hop 2 alone with nothing left 40–50.
        assert!((s.hop1_only - 0.4).abs() < 1e-9);
        assert!((s.idle - 0.04).abs() < 1e-9);
        assert!((s.hop2_only_slot_bound - 0.36).abs() < 1e-9);
        assert!((s.hop2_only_tail - 0.2).abs() < 1e-9);
        assert_eq!(s.both, 0.0);
        assert_eq!((s.hop1_busy_ns, s.hop2_busy_ns), (20, 28));
        assert_eq!(s.handoff.count, 2);
        assert_eq!(s.handoff.max, 2);
        assert_eq!(s.slot_wait.max, 20);
        assert_eq!(s.hop2.max, 18);
    }
}
