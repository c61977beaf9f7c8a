//! The staged path: a device staging ring between the layout's scattered
//! runs and large DMA copies.
//!
//! An offload gathers each slot's runs on the device (the copy kernel, at
//! HBM speed, a few microseconds of SMs per 32 MiB) into a dense staging
//! slot and sends the slot to the host as a few large DMA copies (the copy
//! engines at line rate, no SMs); an onboard does the reverse. Kernel and
//! DMA sit on two streams of one lane and hand slots to each other with
//! events, so the DMA of one slot overlaps the gather of the next, and
//! while a long kernel of the model holds every SM the DMA keeps draining
//! (or filling) the slots already staged.
//!
//! Everything is ordered on the GPU: the submitting thread enqueues the
//! whole copy and returns; no host thread waits per chunk. Once running,
//! the DMA moves slot after slot at line rate (1.3 µs between slots on the
//! H200 machine), so what the path loses is fixed cost, and that is what
//! this module keeps small:
//!
//! - chunks are planned one at a time, in plan order (see
//!   [`StagedChunker`]), the first ones small (an eighth of a slot, then a
//!   quarter, a half), so the first DMA starts tens of microseconds after
//!   the call instead of after the whole plan;
//! - the kernel's copies are written straight into mapped pinned memory
//!   and read there by the kernel. An upload would go through the
//!   host-to-device copy engine, where it queued behind an onboard's DMA
//!   and held a concurrent offload back until the onboard ended (both
//!   directions from one thread at 0.5 of the bidirectional rate).
//!
//! A [`Timeline`] (diagnostics, `CopierConfig::timeline`) records host
//! instants and GPU timing events around every chunk.

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::{self, CUevent, CUstream};

use super::device::CudaDevice;
use super::dma::enqueue_spans;
use super::error::{CudaError, CudaResult, check};
use super::kernel::Grid;
use super::lanes::{DescPool, Lane, Ring};
use super::memory::Location;
use super::plan::{CopyRun, HostSide, Span, StagedChunker};

/// What one staged copy needs from the copier.
pub(crate) struct Staging<'a> {
    pub device: &'a CudaDevice,
    pub descs: &'a Arc<DescPool>,
    pub lane: &'a Lane,
    pub grid: Grid,
    pub batch: bool,
}

impl Staging<'_> {
    /// Enqueues the copy of `runs` through `ring`; returns the stream whose
    /// last operation ends the copy. The descriptor buffer the GPU reads is
    /// pushed to `keep`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn enqueue(
        &self,
        ring: &mut Ring,
        runs: &[CopyRun],
        total: u64,
        src_bases: &[u64],
        dst_bases: &[u64],
        host: HostSide,
        keep: &mut Vec<Box<dyn Any + Send>>,
        mut timeline: Option<&mut Timeline>,
    ) -> CudaResult<CUstream> {
        let (lane, device) = (self.lane, self.device);
        let mut chunker =
            StagedChunker::new(runs, src_bases, dst_bases, host, ring.slot_bytes as u64);
        // The device-side copies are written straight into pinned memory
        // the kernel reads in place: no upload, so no wait behind another
        // copy's DMA on the host-to-device engine (an upload queued there
        // behind an onboard serialised offload and onboard).
        let cap = chunker.max_device_copies(total);
        let run_size = std::mem::size_of::<CopyRun>();
        let desc = self.descs.lease(ZERO_TABLE + cap * run_size)?;
        let (host_ptr, gpu_ptr, bytes) = desc.host();
        if bytes < ZERO_TABLE + cap * run_size {
            return Err(CudaError::InvalidCopy("descriptor buffer lost".into()));
        }
        // SAFETY: the buffer holds at least ZERO_TABLE bytes, is 8-byte
        // aligned (page-aligned allocation) and no copy is using it.
        unsafe { host_ptr.cast::<u64>().write(0) };
        keep.push(Box::new(desc));
        let zero_table = gpu_ptr;
        if let Some(t) = timeline.as_deref_mut() {
            t.set_up = Some(Instant::now());
            t.mark_start(lane.kernel_stream)?;
        }
        let mut pieces: Vec<Span> = Vec::new();
        let mut written = 0usize;
        loop {
            let k = ring.next;
            let slot_addr = ring.buf.ptr() + (k * ring.slot_bytes) as u64;
            // SAFETY: entries `written..cap` lie inside the buffer (checked
            // above), are properly aligned (ZERO_TABLE is a multiple of 8)
            // and are not yet read by any launch: earlier chunks' launches
            // read only entries before `written`.
            let free = unsafe {
                std::slice::from_raw_parts_mut(
                    host_ptr.add(ZERO_TABLE).cast::<CopyRun>().add(written),
                    cap - written,
                )
            };
            let n = chunker.next_chunk(slot_addr, free, &mut pieces);
            if n == 0 {
                break;
            }
            let runs_ptr = gpu_ptr + (ZERO_TABLE + written * run_size) as u64;
            written += n;
            ring.next = (k + 1) % ring.slots.len();
            let slot = &mut ring.slots[k];
            let mut times = ChunkEvents::default();
            // The descriptors written above must be visible to the GPU
            // before the launch that reads them.
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            let device_side = |stream: CUstream| -> CudaResult<()> {
                // SAFETY: the chunk's copies address user device memory
                // (bounds-checked by the copier) and this slot (planned to
                // fit); the descriptors stay alive in `keep` until the copy
                // completed.
                unsafe {
                    device.inner.kernel.launch(
                        stream, self.grid, runs_ptr, n as u32, zero_table, zero_table,
                    )
                }
            };
            match host {
                HostSide::Destination => {
                    if slot.used {
                        wait_event(lane.kernel_stream, slot.free)?;
                    }
                    device_side(lane.kernel_stream)?;
                    times.kernel_end = mark(&timeline, lane.kernel_stream)?;
                    record_event(slot.filled, lane.kernel_stream)?;
                    wait_event(lane.copy_stream, slot.filled)?;
                    times.dma_start = mark(&timeline, lane.copy_stream)?;
                    enqueue_spans(
                        device,
                        self.batch,
                        lane.copy_stream,
                        &pieces,
                        Location::Device,
                        Location::PinnedHost,
                    )?;
                    times.dma_end = mark(&timeline, lane.copy_stream)?;
                    record_event(slot.free, lane.copy_stream)?;
                }
                HostSide::Source => {
                    if slot.used {
                        wait_event(lane.copy_stream, slot.free)?;
                    }
                    times.dma_start = mark(&timeline, lane.copy_stream)?;
                    enqueue_spans(
                        device,
                        self.batch,
                        lane.copy_stream,
                        &pieces,
                        Location::PinnedHost,
                        Location::Device,
                    )?;
                    times.dma_end = mark(&timeline, lane.copy_stream)?;
                    record_event(slot.filled, lane.copy_stream)?;
                    wait_event(lane.kernel_stream, slot.filled)?;
                    device_side(lane.kernel_stream)?;
                    times.kernel_end = mark(&timeline, lane.kernel_stream)?;
                    record_event(slot.free, lane.kernel_stream)?;
                }
            }
            slot.used = true;
            if let Some(t) = timeline.as_deref_mut() {
                t.chunks.push((Instant::now(), pieces.len(), times));
            }
        }
        if let Some(t) = timeline {
            t.enqueued = Some(Instant::now());
        }
        Ok(match host {
            HostSide::Destination => lane.copy_stream,
            HostSide::Source => lane.kernel_stream,
        })
    }
}

/// Bytes at the start of a staged descriptor buffer holding the base table
/// `[0]`: device-side copies carry absolute addresses.
const ZERO_TABLE: usize = 8;

/// Where a staged copy spent its time: host instants and GPU timing events
/// (diagnostics, see `CopierConfig::timeline`).
pub(crate) struct Timeline {
    pub entered: Instant,
    pub set_up: Option<Instant>,
    pub enqueued: Option<Instant>,
    pub returned: Option<Instant>,
    start: Option<(CUevent, Instant)>,
    chunks: Vec<(Instant, usize, ChunkEvents)>,
}

// SAFETY: events are driver handles usable from any thread with the context
// current; the timeline is used by one thread at a time (behind a mutex).
unsafe impl Send for Timeline {}

#[derive(Default)]
struct ChunkEvents {
    kernel_end: Option<CUevent>,
    dma_start: Option<CUevent>,
    dma_end: Option<CUevent>,
}

impl Timeline {
    pub(crate) fn new(entered: Instant) -> Self {
        Timeline {
            entered,
            set_up: None,
            enqueued: None,
            returned: None,
            start: None,
            chunks: Vec::new(),
        }
    }

    fn mark_start(&mut self, stream: CUstream) -> CudaResult<()> {
        let e = timed_event()?;
        record_event(e, stream)?;
        self.start = Some((e, Instant::now()));
        Ok(())
    }

    /// Waits for every event, then formats the timeline (µs since entry for
    /// host instants, since the start event for GPU ones).
    pub(crate) fn report(self) -> String {
        let us = |t: Option<Instant>| t.map_or(-1.0, |t| (t - self.entered).as_secs_f64() * 1e6);
        let mut out = format!(
            "staged timeline: set up {:.0} us, all chunks enqueued {:.0} us, returned {:.0} us",
            us(self.set_up),
            us(self.enqueued),
            us(self.returned)
        );
        let Some((start, start_host)) = self.start else {
            return out;
        };
        out += &format!(
            ", GPU start event recorded at {:.0} us",
            (start_host - self.entered).as_secs_f64() * 1e6
        );
        let at = |e: Option<CUevent>| -> f64 {
            let Some(e) = e else { return -1.0 };
            // SAFETY: both events were recorded in this context.
            unsafe { sys::cuEventSynchronize(e) };
            let mut ms = 0f32;
            // SAFETY: as above; `ms` is a valid out-pointer.
            unsafe { sys::cuEventElapsedTime_v2(&mut ms, start, e) };
            f64::from(ms) * 1e3
        };
        for (i, (enq, pieces, c)) in self.chunks.iter().enumerate() {
            out += &format!(
                "\n  chunk {i:>2}: enqueued {:>6.0} us, {pieces:>3} pieces | GPU kernel end {:>7.1}, DMA {:>7.1} .. {:>7.1} us",
                (*enq - self.entered).as_secs_f64() * 1e6,
                at(c.kernel_end),
                at(c.dma_start),
                at(c.dma_end)
            );
        }
        for (_, _, c) in &self.chunks {
            for e in [c.kernel_end, c.dma_start, c.dma_end].into_iter().flatten() {
                super::completion::destroy_event(e);
            }
        }
        super::completion::destroy_event(start);
        out
    }
}

fn timed_event() -> CudaResult<CUevent> {
    let mut event: CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the caller made the context current.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut event, 0)
    })?;
    Ok(event)
}

fn mark(timeline: &Option<&mut Timeline>, stream: CUstream) -> CudaResult<Option<CUevent>> {
    if timeline.is_none() {
        return Ok(None);
    }
    let e = timed_event()?;
    record_event(e, stream)?;
    Ok(Some(e))
}

pub(crate) fn record_event(event: CUevent, stream: CUstream) -> CudaResult<()> {
    // SAFETY: event and stream belong to the current context.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(event, stream)
    })
}

pub(crate) fn wait_event(stream: CUstream, event: CUevent) -> CudaResult<()> {
    // SAFETY: event and stream belong to the current context.
    check("cuStreamWaitEvent", unsafe {
        sys::cuStreamWaitEvent(stream, event, 0)
    })
}
