//! Diagnostics: where a staged copy spends its time.
//!
//! With `CopierConfig::timeline` on, each staged copy records host instants
//! (entry, set-up, each chunk enqueued, handed to the watcher) and GPU
//! timing events around every chunk (kernel end, DMA start and end). The
//! copies recorded since the last read are reported together on one clock,
//! so an onboard and an offload running at once can be compared: host
//! instants from the earliest entry, GPU instants from the earliest copy's
//! start event.

use std::time::Instant;

use cudarc::driver::sys::{self, CUevent, CUstream};

use super::completion::{destroy_event, record_event};
use super::error::{CudaResult, check};

/// One staged copy's timeline.
pub(crate) struct Timeline {
    /// A label for the report (the direction).
    pub label: &'static str,
    pub entered: Instant,
    /// When the copier had checked the plan (the timeline is made then).
    checked: Instant,
    pub set_up: Option<Instant>,
    pub enqueued: Option<Instant>,
    /// When the copy was handed to the watcher.
    pub returned: Option<Instant>,
    start: Option<(CUevent, Instant)>,
    chunks: Vec<(Instant, usize, ChunkEvents)>,
}

// SAFETY: events are driver handles usable from any thread with the context
// current; the timeline is used by one thread at a time (behind a mutex).
unsafe impl Send for Timeline {}

/// GPU timing events around one chunk.
#[derive(Default)]
pub(crate) struct ChunkEvents {
    pub kernel_end: Option<CUevent>,
    pub dma_start: Option<CUevent>,
    pub dma_end: Option<CUevent>,
}

impl Timeline {
    pub(crate) fn new(label: &'static str, entered: Instant) -> Self {
        Timeline {
            label,
            entered,
            checked: Instant::now(),
            set_up: None,
            enqueued: None,
            returned: None,
            start: None,
            chunks: Vec::new(),
        }
    }

    /// Records the GPU start event on `stream` (once).
    pub(crate) fn mark_start(&mut self, stream: CUstream) -> CudaResult<()> {
        if self.start.is_some() {
            return Ok(());
        }
        let e = timed_event()?;
        record_event(e, stream)?;
        self.start = Some((e, Instant::now()));
        Ok(())
    }

    /// Notes one enqueued chunk and its events.
    pub(crate) fn chunk(&mut self, pieces: usize, events: ChunkEvents) {
        self.chunks.push((Instant::now(), pieces, events));
    }

    fn events(&self) -> impl Iterator<Item = CUevent> + '_ {
        self.chunks
            .iter()
            .flat_map(|(_, _, c)| [c.kernel_end, c.dma_start, c.dma_end])
            .chain([self.start.map(|s| s.0)])
            .flatten()
    }
}

/// Records a timing event on `stream` when a timeline is being kept.
pub(crate) fn mark(
    timeline: &Option<&mut Timeline>,
    stream: CUstream,
) -> CudaResult<Option<CUevent>> {
    if timeline.is_none() {
        return Ok(None);
    }
    let e = timed_event()?;
    record_event(e, stream)?;
    Ok(Some(e))
}

/// Waits for every event, then formats the timelines on one clock (µs
/// since the earliest entry for host instants, since the earliest copy's
/// GPU start event for GPU ones); releases the events.
pub(crate) fn report(timelines: Vec<Timeline>) -> String {
    let Some(first) = timelines.iter().min_by_key(|t| t.entered) else {
        return String::new();
    };
    let origin = first.entered;
    let gpu_origin = first.start.map(|s| s.0);
    let us = |t: Option<Instant>| {
        t.map_or(-1.0, |t| {
            t.saturating_duration_since(origin).as_secs_f64() * 1e6
        })
    };
    let at = |e: Option<CUevent>| -> f64 {
        let (Some(e), Some(o)) = (e, gpu_origin) else {
            return -1.0;
        };
        // SAFETY: both events were recorded in this context.
        unsafe { sys::cuEventSynchronize(e) };
        let mut ms = 0f32;
        // SAFETY: as above; `ms` is a valid out-pointer.
        unsafe { sys::cuEventElapsedTime_v2(&mut ms, o, e) };
        f64::from(ms) * 1e3
    };
    let mut out = String::new();
    for t in &timelines {
        out += &format!(
            "staged timeline {}: entered {:.0} us, plan checked {:.0} us, set up {:.0} us, all chunks enqueued {:.0} us, watched {:.0} us",
            t.label,
            us(Some(t.entered)),
            us(Some(t.checked)),
            us(t.set_up),
            us(t.enqueued),
            us(t.returned)
        );
        if let Some((start, host)) = t.start {
            out += &format!(
                ", GPU start event recorded at {:.0} us, at {:.1} us on the GPU clock",
                us(Some(host)),
                at(Some(start))
            );
        }
        for (i, (enq, pieces, c)) in t.chunks.iter().enumerate() {
            out += &format!(
                "\n  chunk {i:>2}: enqueued {:>6.0} us, {pieces:>3} pieces | GPU kernel end {:>7.1}, DMA {:>7.1} .. {:>7.1} us",
                us(Some(*enq)),
                at(c.kernel_end),
                at(c.dma_start),
                at(c.dma_end)
            );
        }
        out.push('\n');
    }
    for t in &timelines {
        t.events().for_each(destroy_event);
    }
    out
}

fn timed_event() -> CudaResult<CUevent> {
    let mut event: CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the caller made the context current.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut event, 0)
    })?;
    Ok(event)
}
