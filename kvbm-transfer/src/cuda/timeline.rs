//! Diagnostics (feature `diagnostics`): where a staged copy spends its
//! time.
//!
//! With `CopierConfig::timeline` on, each staged copy records host instants
//! (entry, set-up, each chunk enqueued, handed to the watcher) and GPU
//! timing events around every chunk (kernel end, DMA start and end). The
//! copies recorded since the last read are reported together on one clock,
//! so an onboard and an offload running at once can be compared: host
//! instants from the earliest entry, GPU instants from the earliest copy's
//! start event.

use std::time::Instant;

use super::config::CopierConfig;
use super::error::CudaResult;
use super::handles::{Event, EventKind, Stream};
use super::plan::HostSide;

/// One staged copy's timeline.
pub(crate) struct Timeline {
    /// A label for the report (the direction).
    label: &'static str,
    entered: Instant,
    /// When the copier had checked the plan (the timeline is made then).
    checked: Instant,
    /// When the chunker had put the runs in host order (if it had to).
    ordered: Option<Instant>,
    set_up: Option<Instant>,
    enqueued: Option<Instant>,
    /// When the copy was handed to the watcher.
    returned: Option<Instant>,
    start: Option<(Event, Instant)>,
    chunks: Vec<(Instant, usize, ChunkEvents)>,
}

/// A GPU timing event of a timeline.
pub(crate) type Mark = Event;

/// GPU timing events around one chunk.
#[derive(Default)]
pub(crate) struct ChunkEvents {
    pub kernel_end: Option<Mark>,
    pub dma_start: Option<Mark>,
    pub dma_end: Option<Mark>,
}

impl Timeline {
    /// A timeline for a staged copy with `host` side asked for at
    /// `entered`, when `config` asks for timelines.
    pub(crate) fn for_copy(
        config: &CopierConfig,
        host: HostSide,
        entered: Instant,
    ) -> Option<Self> {
        let label = match host {
            HostSide::Source => "H2D",
            HostSide::Destination => "D2H",
        };
        config.timeline.then(|| Timeline {
            label,
            entered,
            checked: Instant::now(),
            ordered: None,
            set_up: None,
            enqueued: None,
            returned: None,
            start: None,
            chunks: Vec::new(),
        })
    }

    /// Notes that the copy's runs are in the order they are staged.
    pub(crate) fn note_ordered(&mut self) {
        self.ordered = Some(Instant::now());
    }

    /// Notes that the copy's first chunk is set up.
    pub(crate) fn note_set_up(&mut self) {
        self.set_up = Some(Instant::now());
    }

    /// Notes that every chunk is enqueued.
    pub(crate) fn note_enqueued(&mut self) {
        self.enqueued = Some(Instant::now());
    }

    /// Notes that the copy was handed to the watcher.
    pub(crate) fn note_returned(&mut self) {
        self.returned = Some(Instant::now());
    }

    /// Records the GPU start event on `stream` (once).
    pub(crate) fn mark_start(&mut self, stream: &Stream) -> CudaResult<()> {
        if self.start.is_some() {
            return Ok(());
        }
        let e = Event::new(stream.device(), EventKind::Timing)?;
        e.record(stream)?;
        self.start = Some((e, Instant::now()));
        Ok(())
    }

    /// Notes one enqueued chunk and its events.
    pub(crate) fn chunk(&mut self, pieces: usize, events: ChunkEvents) {
        self.chunks.push((Instant::now(), pieces, events));
    }
}

/// Records a timing event on `stream` when a timeline is being kept.
pub(crate) fn mark(timeline: &Option<&mut Timeline>, stream: &Stream) -> CudaResult<Option<Mark>> {
    if timeline.is_none() {
        return Ok(None);
    }
    let e = Event::new(stream.device(), EventKind::Timing)?;
    e.record(stream)?;
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
    let gpu_origin = first.start.as_ref().map(|s| &s.0);
    let us = |t: Option<Instant>| {
        t.map_or(-1.0, |t| {
            t.saturating_duration_since(origin).as_secs_f64() * 1e6
        })
    };
    let at = |e: Option<&Event>| -> f64 {
        let (Some(e), Some(o)) = (e, gpu_origin) else {
            return -1.0;
        };
        e.elapsed_ms_since(o).map_or(-1.0, |ms| f64::from(ms) * 1e3)
    };
    let mut out = String::new();
    for t in &timelines {
        out += &format!(
            "staged timeline {}: entered {:.0} us, plan checked {:.0} us, ordered {:.0} us, set up {:.0} us, all chunks enqueued {:.0} us, watched {:.0} us",
            t.label,
            us(Some(t.entered)),
            us(Some(t.checked)),
            us(t.ordered),
            us(t.set_up),
            us(t.enqueued),
            us(t.returned)
        );
        if let Some((start, host)) = &t.start {
            out += &format!(
                ", GPU start event recorded at {:.0} us, at {:.1} us on the GPU clock",
                us(Some(*host)),
                at(Some(start))
            );
        }
        for (i, (enq, pieces, c)) in t.chunks.iter().enumerate() {
            out += &format!(
                "\n  chunk {i:>2}: enqueued {:>6.0} us, {pieces:>3} pieces | GPU kernel end {:>7.1}, DMA {:>7.1} .. {:>7.1} us",
                us(Some(*enq)),
                at(c.kernel_end.as_ref()),
                at(c.dma_start.as_ref()),
                at(c.dma_end.as_ref())
            );
        }
        out.push('\n');
    }
    out
}
