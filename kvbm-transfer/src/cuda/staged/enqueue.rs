//! Enqueuing a staged copy chunk by chunk: the chunker's runs written as
//! the kernel's descriptors, the slot's gather or scatter kernel and its
//! DMA pieces on the lane's two streams, ordered by the slots' events;
//! beside the model, one kernel per half ring of chunks.
//!
//! Grouping: beside the model each kernel of a copy waits for SMs the
//! model's kernels hold, so a few large kernels wait less than many small
//! ones, and while one half's kernel waits the other half's DMA keeps the
//! link busy.

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::super::device::CudaDevice;
use super::super::dma::enqueue_spans;
use super::super::error::{CudaError, CudaResult, check};
use super::super::handles::Stream;
use super::super::kernel::Grid;
use super::super::lanes::{DescLease, DescPool, Lane, Ring};
use super::super::memory::Location;
use super::super::plan::{CopyRun, HostSide, RegionLens, Span, StagedChunker};
use super::super::timeline::{ChunkEvents, Timeline, mark};
use super::Progress;

/// A staged copy's plan and what its runs are resolved and checked with.
pub(crate) struct Plan<'a> {
    pub runs: &'a [CopyRun],
    pub src_bases: &'a [u64],
    pub dst_bases: &'a [u64],
    pub lens: &'a RegionLens,
    pub host: HostSide,
    /// One gather or scatter kernel for up to half the ring's chunks (see
    /// [`super::StagedJob::grouped`]).
    pub grouped: bool,
}

/// What one staged copy needs from the copier.
pub(crate) struct Staging<'a> {
    pub device: &'a CudaDevice,
    pub descs: &'a Arc<DescPool>,
    pub lane: &'a Arc<Lane>,
    pub grid: Grid,
    pub batch: bool,
    /// Ramp chunks before full slots (see `StagedChunker::with_ramp`).
    pub ramp: u32,
}

impl Staging<'_> {
    /// Enqueues the copy of `runs` through `ring`, from where `progress`
    /// left it, at most `max_chunks` chunks (all when `None`). Returns the
    /// copy's bytes once it is wholly enqueued (its last operation is then
    /// the last on the lane's stream for its host side, see
    /// [`super::ending_stream`]), `None` while chunks are left (then
    /// `progress` says where to continue). The descriptor buffer the GPU
    /// reads is pushed to `keep` on the first call.
    pub(crate) fn enqueue(
        &self,
        ring: &mut Ring,
        plan: Plan<'_>,
        keep: &mut Vec<Box<dyn Any + Send>>,
        progress: &mut Option<Progress>,
        mut timeline: Option<&mut Timeline>,
        max_chunks: Option<usize>,
    ) -> CudaResult<Option<u64>> {
        let p = match progress {
            Some(p) => p,
            None => progress.insert(self.begin(ring, &plan, keep, &mut timeline)?),
        };
        let Plan {
            runs,
            src_bases,
            dst_bases,
            lens,
            host,
            grouped,
        } = plan;
        let at =
            p.at.take()
                .ok_or_else(|| CudaError::InvalidCopy("staged copy lost its place".into()))?;
        let slot_bytes = ring.slot_bytes as u64;
        let mut chunker =
            StagedChunker::resume(runs, src_bases, dst_bases, lens, host, slot_bytes, at);
        let zero_table = p.zero_table;
        let mut pieces: Vec<Span> = Vec::new();
        let mut chunks = 0usize;
        let mut group = Group::default();
        loop {
            if max_chunks.is_some_and(|m| chunks >= m) {
                self.flush(ring, &mut group, host, zero_table, &mut timeline)?;
                p.at = Some(chunker.into_cursor());
                return Ok(None);
            }
            chunks += 1;
            // A group holds at most half the ring (so the next group's
            // slots are free while its kernel waits, and a copy larger than
            // the ring keeps the link busy), and ends before the descriptors
            // move to another buffer (a group's are contiguous).
            let buffer_full = p.written == p.cap && chunker.runs_left() > 0;
            if group.chunks.len() >= (ring.slots.len() / 2).max(1) || buffer_full {
                self.flush(ring, &mut group, host, zero_table, &mut timeline)?;
            }
            if buffer_full {
                self.next_buffer(p, chunker.runs_left(), host, keep)?;
            }
            let Some((k, runs_ptr, n)) =
                self.write_chunk(ring, p, &mut chunker, host, &mut pieces)?
            else {
                break;
            };
            let chunk = Chunk {
                slot: k,
                runs_ptr,
                runs: n,
                pieces: &pieces,
            };
            if grouped {
                self.add_to_group(ring, &mut group, chunk, host, &timeline)?;
            } else {
                self.launch_chunk(ring, chunk, host, zero_table, &mut timeline)?;
            }
        }
        self.flush(ring, &mut group, host, zero_table, &mut timeline)?;
        if let Some(t) = timeline {
            t.note_enqueued();
        }
        Ok(Some(chunker.bytes()))
    }

    /// Writes the next chunk's descriptors into the buffer (uploading an
    /// onboard's) and its host pieces into `pieces`, and takes the ring's
    /// next slot for it: `(slot, descriptors' address, descriptors)`, or
    /// `None` when the copy has no chunk left.
    fn write_chunk(
        &self,
        ring: &mut Ring,
        p: &mut Progress,
        chunker: &mut StagedChunker<'_>,
        host: HostSide,
        pieces: &mut Vec<Span>,
    ) -> CudaResult<Option<(usize, u64, usize)>> {
        let k = ring.next;
        let slot_addr = ring.buf.ptr() + (k * ring.slot_bytes) as u64;
        // SAFETY: entries `written..cap` lie inside the buffer (checked
        // when it was leased), are properly aligned (ZERO_TABLE is a
        // multiple of 8) and are not yet read by any launch: earlier
        // chunks' launches read only entries before `written`.
        let free = unsafe {
            std::slice::from_raw_parts_mut(
                p.desc_host.add(ZERO_TABLE).cast::<CopyRun>().add(p.written),
                p.cap - p.written,
            )
        };
        let n = chunker.next_chunk(slot_addr, free, pieces)?;
        if n == 0 {
            return Ok(None);
        }
        let runs_ptr = p.desc_gpu + (ZERO_TABLE + p.written * size_of::<CopyRun>()) as u64;
        if host == HostSide::Source {
            self.upload_chunk_descriptors(p, n)?;
        }
        p.written += n;
        ring.next = (k + 1) % ring.slots.len();
        Ok(Some((k, runs_ptr, n)))
    }

    /// A copy's first call: plans its chunks and leases the descriptor
    /// buffer its first chunks are written into.
    fn begin(
        &self,
        ring: &Ring,
        plan: &Plan<'_>,
        keep: &mut Vec<Box<dyn Any + Send>>,
        timeline: &mut Option<&mut Timeline>,
    ) -> CudaResult<Progress> {
        // A grouped copy has one kernel whatever its chunks: full slots
        // from the first (a ramp would spread a 128 MiB copy over 7 slots
        // of 8, so a second copy could not be staged while the first one's
        // kernel waits).
        let ramp = if plan.grouped { 0 } else { self.ramp };
        let slot_bytes = ring.slot_bytes as u64;
        let chunker = StagedChunker::new(
            plan.runs,
            plan.src_bases,
            plan.dst_bases,
            plan.lens,
            plan.host,
            slot_bytes,
        )
        .with_ramp(ramp);
        if let Some(t) = timeline.as_deref_mut() {
            t.note_ordered();
        }
        // The device-side copies are written into pinned memory: an
        // offload's kernel reads them in place (an upload would wait behind
        // a concurrent onboard's DMA on the host-to-device engine), an
        // onboard uploads each chunk's on its own copy stream (see
        // `upload_descriptors`). Sized for the runs and the chunk
        // boundaries of a copy up to LEASE_SLOTS slots; a larger copy
        // leases more as it goes.
        let cap = chunker.device_copies_for(LEASE_SLOTS * slot_bytes);
        let (desc, host_ptr, gpu_ptr) = self.lease(cap)?;
        let dev_ptr = desc.runs_ptr();
        keep.push(Box::new(desc));
        if let Some(t) = timeline.as_deref_mut() {
            t.note_set_up();
            t.mark_start(&self.lane.kernel_stream)?;
        }
        let reads = kernel_reads(plan.host, gpu_ptr, dev_ptr);
        Ok(Progress {
            at: Some(chunker.into_cursor()),
            zero_table: reads,
            desc_host: host_ptr,
            desc_gpu: reads,
            cap,
            written: 0,
            lane: Arc::clone(self.lane),
            finished: false,
        })
    }

    /// The descriptor buffer is full (chunks launched from it still read
    /// it: it stays in `keep`): the rest, `runs_left` runs, goes to a
    /// fresh one.
    fn next_buffer(
        &self,
        p: &mut Progress,
        runs_left: usize,
        host: HostSide,
        keep: &mut Vec<Box<dyn Any + Send>>,
    ) -> CudaResult<()> {
        let cap = runs_left + LEASE_SLOTS as usize + 2;
        let (desc, host_ptr, gpu_ptr) = self.lease(cap)?;
        let dev_ptr = desc.runs_ptr();
        keep.push(Box::new(desc));
        let reads = kernel_reads(host, gpu_ptr, dev_ptr);
        (p.desc_host, p.desc_gpu, p.cap, p.written) = (host_ptr, reads, cap, 0);
        Ok(())
    }

    /// Uploads the `n` descriptors just written for an onboard's chunk:
    /// its kernel reads them from device memory, uploaded on the copy
    /// stream ahead of the chunk's DMA (see `upload_descriptors`); a fresh
    /// buffer's first upload carries its zero table.
    fn upload_chunk_descriptors(&self, p: &Progress, n: usize) -> CudaResult<()> {
        let run_size = size_of::<CopyRun>();
        let from = if p.written == 0 {
            0
        } else {
            ZERO_TABLE + p.written * run_size
        };
        let to = ZERO_TABLE + (p.written + n) * run_size;
        // SAFETY: `from..to` lies inside both sides of the leased buffer
        // (entries below `cap`), whose host side is written and stays
        // untouched until the copy completed.
        unsafe { self.upload_descriptors(p.desc_host, p.desc_gpu, from, to) }
    }

    /// Enqueues one chunk on its own: its kernel and its DMA on the lane's
    /// two streams, ordered through its slot's events.
    fn launch_chunk(
        &self,
        ring: &mut Ring,
        chunk: Chunk<'_>,
        host: HostSide,
        zero_table: u64,
        timeline: &mut Option<&mut Timeline>,
    ) -> CudaResult<()> {
        let lane = self.lane;
        let slot = &mut ring.slots[chunk.slot];
        let mut times = ChunkEvents::default();
        // The descriptors written for the chunk must be visible to the GPU
        // before the launch that reads them.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        let device_side = |stream: &Stream| -> CudaResult<()> {
            // SAFETY: the chunk's copies address user device memory (each
            // run checked against its region by the chunker) and this slot
            // (planned to fit); the descriptors stay alive in `keep` until
            // the copy completed.
            unsafe {
                self.device.inner.kernel.launch(
                    stream,
                    self.grid,
                    chunk.runs_ptr,
                    chunk.runs as u32,
                    zero_table,
                    zero_table,
                )
            }
        };
        match host {
            HostSide::Destination => {
                if slot.used {
                    lane.kernel_stream.wait(&slot.free)?;
                }
                device_side(&lane.kernel_stream)?;
                times.kernel_end = mark(timeline, &lane.kernel_stream)?;
                slot.filled.record(&lane.kernel_stream)?;
                lane.copy_stream.wait(&slot.filled)?;
                self.dma(chunk.pieces, host, &mut times, timeline)?;
                slot.free.record(&lane.copy_stream)?;
            }
            HostSide::Source => {
                if slot.used {
                    lane.copy_stream.wait(&slot.free)?;
                }
                self.dma(chunk.pieces, host, &mut times, timeline)?;
                slot.filled.record(&lane.copy_stream)?;
                lane.kernel_stream.wait(&slot.filled)?;
                device_side(&lane.kernel_stream)?;
                times.kernel_end = mark(timeline, &lane.kernel_stream)?;
                slot.free.record(&lane.kernel_stream)?;
            }
        }
        slot.used = true;
        if let Some(t) = timeline.as_deref_mut() {
            t.chunk(chunk.pieces.len(), times);
        }
        Ok(())
    }

    /// Adds `chunk` to `group`. An onboard's DMA goes now (its kernel
    /// waits for the group); an offload's waits for the group's kernel.
    fn add_to_group(
        &self,
        ring: &mut Ring,
        group: &mut Group,
        chunk: Chunk<'_>,
        host: HostSide,
        timeline: &Option<&mut Timeline>,
    ) -> CudaResult<()> {
        let lane = self.lane;
        let mut times = ChunkEvents::default();
        if host == HostSide::Source {
            let slot = &mut ring.slots[chunk.slot];
            if slot.used {
                lane.copy_stream.wait(&slot.free)?;
            }
            self.dma(chunk.pieces, host, &mut times, timeline)?;
            slot.used = true;
        }
        group.first.get_or_insert(chunk.runs_ptr);
        group.runs += chunk.runs;
        group
            .chunks
            .push((chunk.slot, chunk.pieces.to_vec(), times));
        Ok(())
    }

    /// Launches `group`'s one kernel (after the onboard DMAs it scatters,
    /// or before the offload DMAs it feeds) and empties it.
    fn flush(
        &self,
        ring: &mut Ring,
        group: &mut Group,
        host: HostSide,
        zero_table: u64,
        timeline: &mut Option<&mut Timeline>,
    ) -> CudaResult<()> {
        let (Some(first), Some(&(last, _, _))) = (group.first, group.chunks.last()) else {
            return Ok(());
        };
        let lane = self.lane;
        let launch = |stream: &Stream| -> CudaResult<()> {
            // The group's descriptors were all written before this fence
            // and are contiguous in one buffer (a group ends before the
            // buffer changes).
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            // SAFETY: the copies address user device memory (each run
            // checked against its region by the chunker) and the group's
            // slots (each planned to fit its slot); the descriptors stay
            // alive in `keep` until the copy completed.
            unsafe {
                self.device.inner.kernel.launch(
                    stream,
                    self.grid,
                    first,
                    group.runs as u32,
                    zero_table,
                    zero_table,
                )
            }
        };
        match host {
            HostSide::Source => {
                // The copy stream runs in order: the last chunk's DMA ends
                // after every earlier one.
                ring.slots[last].filled.record(&lane.copy_stream)?;
                lane.kernel_stream.wait(&ring.slots[last].filled)?;
                launch(&lane.kernel_stream)?;
                let mut end = mark(timeline, &lane.kernel_stream)?;
                for (i, (k, pieces, mut times)) in group.chunks.drain(..).enumerate() {
                    ring.slots[k].free.record(&lane.kernel_stream)?;
                    if i == 0 {
                        times.kernel_end = end.take();
                    }
                    if let Some(t) = timeline.as_deref_mut() {
                        t.chunk(pieces.len(), times);
                    }
                }
            }
            HostSide::Destination => {
                for &(k, _, _) in &group.chunks {
                    if ring.slots[k].used {
                        lane.kernel_stream.wait(&ring.slots[k].free)?;
                    }
                }
                launch(&lane.kernel_stream)?;
                let mut end = mark(timeline, &lane.kernel_stream)?;
                ring.slots[last].filled.record(&lane.kernel_stream)?;
                lane.copy_stream.wait(&ring.slots[last].filled)?;
                for (i, (k, pieces, mut times)) in group.chunks.drain(..).enumerate() {
                    self.dma(&pieces, host, &mut times, timeline)?;
                    ring.slots[k].free.record(&lane.copy_stream)?;
                    ring.slots[k].used = true;
                    if i == 0 {
                        times.kernel_end = end.take();
                    }
                    if let Some(t) = timeline.as_deref_mut() {
                        t.chunk(pieces.len(), times);
                    }
                }
            }
        }
        *group = Group::default();
        Ok(())
    }

    /// Copies bytes `from..to` of a descriptor buffer from its pinned host
    /// side to its device side on the copy stream.
    ///
    /// An onboard's DMA saturates the host-to-device direction of the link;
    /// a kernel reading its descriptors from mapped host memory then waits
    /// behind that traffic on every descriptor and takes read bandwidth
    /// from the DMA. Uploaded on the copy stream just before the chunk's
    /// DMA, the descriptors are on the device when the kernel (ordered
    /// after that DMA) starts. An offload's kernel keeps reading in place:
    /// its upload would queue on the host-to-device engine behind a
    /// concurrent onboard.
    ///
    /// # Safety
    /// `from..to` must lie inside the buffer at `host` (pinned) and `dev`
    /// (its device side), and the host bytes must stay unchanged until the
    /// copy stream passed this point.
    unsafe fn upload_descriptors(
        &self,
        host: *mut u8,
        dev: u64,
        from: usize,
        to: usize,
    ) -> CudaResult<()> {
        if to <= from {
            return Ok(());
        }
        // SAFETY: the caller's promise; the stream orders the upload before
        // the chunk's DMA and, through the slot's event, the kernel.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dev + from as u64,
                host.add(from).cast::<c_void>(),
                to - from,
                self.lane.copy_stream.raw(),
            )
        })
    }

    /// Enqueues a chunk's host-side DMA `pieces` on the copy stream, in the
    /// copy's direction, between timing marks.
    fn dma(
        &self,
        pieces: &[Span],
        host: HostSide,
        times: &mut ChunkEvents,
        timeline: &Option<&mut Timeline>,
    ) -> CudaResult<()> {
        let stream = &self.lane.copy_stream;
        let (from, to) = match host {
            HostSide::Source => (Location::PinnedHost, Location::Device),
            HostSide::Destination => (Location::Device, Location::PinnedHost),
        };
        times.dma_start = mark(timeline, stream)?;
        // SAFETY: the pieces address this copy's host runs (each checked
        // against its region by the chunker, the regions kept alive in the
        // job until completion) and its slot of the ring.
        unsafe { enqueue_spans(self.device, self.batch, stream, pieces, from, to)? };
        times.dma_end = mark(timeline, stream)?;
        Ok(())
    }

    /// Leases a descriptor buffer for `cap` device-side copies after the
    /// base table `[0]` (written here); returns it with its host and GPU
    /// addresses.
    fn lease(&self, cap: usize) -> CudaResult<(DescLease, *mut u8, u64)> {
        let need = ZERO_TABLE + cap * std::mem::size_of::<CopyRun>();
        let desc = self.descs.lease(need)?;
        let (host_ptr, gpu_ptr, bytes) = desc.host();
        if bytes < need {
            return Err(CudaError::InvalidCopy("descriptor buffer lost".into()));
        }
        // SAFETY: the buffer holds at least ZERO_TABLE bytes, is 8-byte
        // aligned (page-aligned allocation) and no copy is using it.
        unsafe { host_ptr.cast::<u64>().write(0) };
        Ok((desc, host_ptr, gpu_ptr))
    }
}

/// Where the kernel of a staged copy reads its descriptors: an onboard's
/// from the buffer's device side (uploaded per chunk), an offload's from
/// its mapped host side.
fn kernel_reads(host: HostSide, mapped: u64, device: u64) -> u64 {
    match host {
        HostSide::Source => device,
        HostSide::Destination => mapped,
    }
}

/// One chunk of a staged copy as planned: its ring slot, its device-side
/// copies (`runs` descriptors at `runs_ptr`) and its host-side DMA pieces.
struct Chunk<'a> {
    slot: usize,
    runs_ptr: u64,
    runs: usize,
    pieces: &'a [Span],
}

/// Chunks whose device side goes in one kernel (see [`super::StagedJob::grouped`]):
/// where their descriptors start, how many there are, and per chunk its
/// slot, host pieces and timing events.
#[derive(Default)]
struct Group {
    first: Option<u64>,
    runs: usize,
    chunks: Vec<(usize, Vec<Span>, ChunkEvents)>,
}

/// Slots' worth of chunk boundaries a staged copy's first descriptor
/// buffer has room for (64 slots of 32 MiB: 2 GiB).
const LEASE_SLOTS: u64 = 64;

/// Bytes at the start of a staged descriptor buffer holding the base table
/// `[0]`: device-side copies carry absolute addresses.
const ZERO_TABLE: usize = 8;
