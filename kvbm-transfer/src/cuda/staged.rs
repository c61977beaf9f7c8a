//! The staged path: a device staging ring between the layout's scattered
//! runs and large DMA copies.
//!
//! An offload gathers each slot's runs on the device (the copy kernel, at
//! HBM speed, holding the SMs only briefly) into a dense staging slot and
//! sends the slot to the host as a few large DMA copies (the copy
//! engines at line rate, no SMs); an onboard does the reverse. Kernel and
//! DMA sit on two streams of one lane and hand slots to each other with
//! events, so the DMA of one slot overlaps the gather of the next, and
//! while a long kernel of the model holds every SM the DMA keeps draining
//! (or filling) the slots already staged.
//!
//! Everything is ordered on the GPU: no host thread waits per chunk. Once
//! running, the DMA moves slot after slot at line rate (the gap between
//! slots is tiny next to a slot's DMA), so what the path loses is fixed
//! cost, and that is what this module keeps small:
//!
//! - when the ring has nothing queued, the caller enqueues the first two
//!   chunks itself (the GPU starts with no wait for another thread to wake)
//!   and hands the rest, with the chunker's cursor, to the ring's feeder
//!   thread (see `feeder`), which continues while `copy()` returns; with
//!   copies queued, the whole copy goes behind them on the feeder;
//! - no pass over the plan comes before the first chunk: the chunker checks
//!   each run against its regions as it reaches it (a pass over a large
//!   plan is not free, the list being cache-cold after the caller's wait,
//!   and it would delay the first DMA by all of it). A shared plan is
//!   never copied; a borrowed one is copied (and so checked whole)
//!   after the first chunks are on the GPU, before `copy()` returns;
//! - chunks are planned one at a time, in plan order (see
//!   [`super::plan::StagedChunker`]), the first ones small (an eighth of a
//!   slot, then a quarter, a half), so the first DMA starts tens of
//!   microseconds after the call instead of after the whole plan;
//! - the kernel's copies are written straight into mapped pinned memory.
//!   An offload's kernel reads them there: an upload would go through the
//!   host-to-device copy engine, where it queued behind an onboard's DMA
//!   and held the offload back until the onboard ended. An onboard's
//!   chunk uploads its own descriptors on its copy stream just before its
//!   DMA (a few kilobytes): its kernel would otherwise read them across a
//!   link its own DMA saturates in that direction, slowing both.
//!
//! A `Timeline` (diagnostics, `CopierConfig::timeline`, see `timeline`)
//! records host instants and GPU timing events around every chunk.
//!
//! This module holds the jobs, the ring and how a copy is handed between
//! the caller and the feeder; `enqueue` puts a copy's chunks on the GPU.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::completion::PollPlan;
use super::device::CudaDevice;
use super::error::{CudaError, CudaResult};
use super::feeder::Feeder;
use super::handles::Stream;
use super::kernel::Grid;
use super::lanes::{DescPool, Lane, Ring};
use super::plan::{ChunkCursor, CopyRun, HostSide, RegionLens};
use super::timeline::Timeline;
use crate::completion::Completer;

mod enqueue;

use enqueue::{Plan, Staging};

/// A staged copy handed to its ring's feeder (see `feeder`): everything it
/// needs, owned, and the completer its caller already holds the other end
/// of.
pub(crate) struct StagedJob {
    /// The plan (checked run by run as it is planned).
    pub runs: JobRuns,
    pub src_bases: Vec<u64>,
    pub dst_bases: Vec<u64>,
    /// What every run is checked against.
    pub lens: RegionLens,
    pub host: HostSide,
    /// Set when the caller already enqueued the first chunks. Declared
    /// before `keep`: a job dropped unrun drains the lane (through this)
    /// before its regions go.
    pub progress: Option<Progress>,
    /// Memory regions and anything else the GPU uses until completion.
    pub keep: Vec<Box<dyn Any + Send>>,
    /// The watcher's wake-up hint (see `Watcher::watch`); its shortest
    /// duration is set from the bytes once the copy is wholly planned.
    pub spin: Option<PollPlan>,
    pub completer: Completer<CudaResult<()>>,
    pub timeline: Option<Timeline>,
    /// Counted in the ring's `queued` (handed to the feeder).
    pub queued: bool,
    /// The GPU is busy with the model: the device side of up to half the
    /// ring's chunks goes in one kernel (see
    /// `enqueue`), as each kernel waits for SMs the model holds. The copy
    /// is handed to the feeder whole.
    pub grouped: bool,
}

/// A staged copy's plan as the feeder holds it.
pub(crate) enum JobRuns {
    /// A copy of a borrowed plan, in an allocation reused across copies
    /// (see [`StagedRing::spare_runs`]).
    Owned(Vec<CopyRun>),
    /// The caller's shared plan, not copied.
    Shared(Arc<[CopyRun]>),
}

impl JobRuns {
    fn as_slice(&self) -> &[CopyRun] {
        match self {
            JobRuns::Owned(v) => v,
            JobRuns::Shared(a) => a,
        }
    }

    fn take(&mut self) -> JobRuns {
        std::mem::replace(self, JobRuns::Owned(Vec::new()))
    }
}

/// How far a copy got: where its chunker stands and what of its descriptor
/// buffer (leased into the job's `keep`) is written.
pub(crate) struct Progress {
    at: Option<ChunkCursor>,
    /// The base table `[0]` at the start of the first buffer (device-side
    /// copies carry absolute addresses).
    zero_table: u64,
    /// The buffer chunks are written to now (a full one is followed by a
    /// fresh lease; the earlier ones stay in `keep`).
    desc_host: *mut u8,
    /// Where the kernel reads that buffer: its mapped host side for an
    /// offload, its device side for an onboard.
    desc_gpu: u64,
    /// Device-side copies the buffer holds, and how many are written.
    cap: usize,
    written: usize,
    /// Drained if the job is dropped before the rest was enqueued.
    lane: Arc<Lane>,
    finished: bool,
}

// SAFETY: the descriptor pointers address a pinned buffer owned by the job
// (its lease is in the job's `keep`) and written by one thread at a time:
// the caller, then the feeder, each under the lane's lock.
unsafe impl Send for Progress {}

impl Drop for Progress {
    fn drop(&mut self) {
        if !self.finished {
            // Part of the copy is on the GPU and nobody will finish it:
            // let it drain before the job's regions are released.
            let _ = self.lane.device.bind();
            self.lane.drain();
        }
    }
}

/// One direction's staging ring with what feeding it needs; shared by the
/// ring's feeder thread and the copier.
pub(crate) struct StagedRing {
    pub device: CudaDevice,
    pub descs: Arc<DescPool>,
    /// The lane holding the ring (its streams, watcher and the ring itself).
    pub lane: Arc<Lane>,
    pub grid: Grid,
    pub batch: bool,
    /// Ramp chunks before full slots (see `StagedChunker::with_ramp`).
    pub ramp: u32,
    /// Where timelines go (diagnostics).
    pub timelines: Arc<Mutex<Vec<Timeline>>>,
    /// Jobs handed to the feeder and not yet wholly enqueued.
    pub queued: AtomicUsize,
    /// Run lists of finished jobs, reused for the next (a fresh 640 KiB
    /// vector costs page faults on every copy).
    pub spare_runs: Mutex<Vec<Vec<CopyRun>>>,
    /// Bytes per second the host link moves at best (the watcher's
    /// earliest end of a copy, see `PollPlan`).
    pub line_rate: f64,
}

impl StagedRing {
    /// Starts the staged copy `job` of `plan` (`borrowed`: the caller's
    /// list, valid only during this call; otherwise `plan` is the job's
    /// shared list).
    ///
    /// When the ring has nothing queued, the first `caller_chunks` chunks are
    /// enqueued here; a borrowed plan is then copied for the feeder (which
    /// checks it whole) and one more chunk enqueued, so the feeder starts
    /// with a chunk of runway; the feeder continues. With copies queued,
    /// the whole copy goes to the feeder behind them. A run found out of
    /// bounds here is this call's error (after the lane drained, when part
    /// of the copy was on the GPU); one found by the feeder resolves the
    /// completion with it.
    pub(crate) fn submit(
        &self,
        feeder: &Feeder<StagedJob>,
        caller_chunks: usize,
        mut job: StagedJob,
        plan: &[CopyRun],
        borrowed: bool,
    ) -> CudaResult<()> {
        let lane = &*self.lane;
        let grouped = job.grouped;
        let idle = || caller_chunks > 0 && !grouped && self.queued.load(Ordering::Acquire) == 0;
        // With copies queued the lane is not even locked: the feeder holds
        // it while it enqueues a whole copy, so a caller that waited for it
        // here would wait for every queued copy's enqueue. An idle ring is
        // asked again under the lock.
        let locked = idle().then(|| lane.state.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(mut guard) = locked.filter(|_| idle()) {
            let ring = guard.ring.as_mut();
            match self.enqueue_job(ring, &mut job, plan, Some(caller_chunks)) {
                Ok(None) => {}
                // The whole copy went in here, or failed.
                done => return self.finish_here(finished(done), job),
            }
            if borrowed {
                // (The lane stays locked: the feeder has nothing queued on
                // this ring, and other callers go behind this copy.)
                if let Err(e) = self.own_plan(&mut job, plan) {
                    return self.finish_here(Err(e), job);
                }
                let runs = job.runs.take();
                let more =
                    self.enqueue_job(guard.ring.as_mut(), &mut job, runs.as_slice(), Some(1));
                job.runs = runs;
                match more {
                    Ok(None) => {}
                    done => return self.finish_here(finished(done), job),
                }
            }
            self.queued.fetch_add(1, Ordering::AcqRel);
            drop(guard);
        } else {
            // Behind the queued copies; the place is taken before the
            // borrowed plan is copied, without holding the lane (the
            // feeder needs it meanwhile).
            self.queued.fetch_add(1, Ordering::AcqRel);
            if borrowed && let Err(e) = self.own_plan(&mut job, plan) {
                // Nothing of it is on the GPU: no draining needed.
                self.queued.fetch_sub(1, Ordering::AcqRel);
                return Err(e);
            }
        }
        job.queued = true;
        if let Err(job) = feeder.submit(job) {
            // The feeder thread is gone: enqueue here.
            self.feed(job);
        }
        Ok(())
    }

    /// Copies a borrowed plan into the job (checking every run on the way).
    fn own_plan(&self, job: &mut StagedJob, plan: &[CopyRun]) -> CudaResult<()> {
        let mut owned = self.spare_runs();
        match job.lens.check_plan(plan, Some(&mut owned)) {
            Ok(_) => {
                job.runs = JobRuns::Owned(owned);
                Ok(())
            }
            Err(e) => {
                self.give_back_runs(owned);
                Err(e)
            }
        }
    }

    /// Ends a copy on the caller's thread: hands it to the watcher when it
    /// is wholly enqueued; on an error drains the lane, resolves the job
    /// and returns the error.
    fn finish_here(&self, enqueued: CudaResult<u64>, mut job: StagedJob) -> CudaResult<()> {
        let error = enqueued.as_ref().err().cloned();
        let runs = job.runs.take();
        self.hand_to_watcher(enqueued, job);
        self.give_back(runs);
        error.map_or(Ok(()), Err)
    }

    /// Enqueues `job` on the lane's ring, at most `max_chunks` chunks (all
    /// with `None`); `runs` is the job's plan, held apart from it by the
    /// caller. Returns the copy's bytes once it is wholly enqueued.
    fn enqueue_job(
        &self,
        ring: Option<&mut Ring>,
        job: &mut StagedJob,
        runs: &[CopyRun],
        max_chunks: Option<usize>,
    ) -> CudaResult<Option<u64>> {
        let Some(ring) = ring else {
            return Err(CudaError::InvalidCopy(
                "this lane has no staging ring".into(),
            ));
        };
        self.staging().enqueue(
            ring,
            Plan {
                runs,
                src_bases: &job.src_bases,
                dst_bases: &job.dst_bases,
                lens: &job.lens,
                host: job.host,
                grouped: job.grouped,
            },
            &mut job.keep,
            &mut job.progress,
            job.timeline.as_mut(),
            max_chunks,
        )
    }

    /// An empty vector for a copy's run list, reusing a finished copy's
    /// allocation (a fresh 640 KiB vector costs page faults on every copy).
    pub(crate) fn spare_runs(&self) -> Vec<CopyRun> {
        let mut v = self
            .spare_runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_default();
        v.clear();
        v
    }

    /// Keeps an owned plan's allocation for the next copy.
    fn give_back(&self, runs: JobRuns) {
        if let JobRuns::Owned(v) = runs {
            self.give_back_runs(v);
        }
    }

    /// Keeps a run list's allocation for [`StagedRing::spare_runs`] (a few
    /// of them, none above `MAX_SPARE_RUNS`).
    pub(crate) fn give_back_runs(&self, runs: Vec<CopyRun>) {
        let mut spare = self.spare_runs.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < 4 && runs.capacity() > 0 && runs.capacity() <= MAX_SPARE_RUNS {
            spare.push(runs);
        }
    }

    fn staging(&self) -> Staging<'_> {
        Staging {
            device: &self.device,
            descs: &self.descs,
            lane: &self.lane,
            grid: self.grid,
            batch: self.batch,
            ramp: self.ramp,
        }
    }

    /// Enqueues `job` (or what the caller left of it) chunk after chunk and
    /// hands it to the lane's watcher. Never reports success for a copy
    /// that was not wholly enqueued: on an error the lane drains (part of
    /// the copy may be on the GPU and must end before its regions can go)
    /// and the completer gets the error.
    pub(crate) fn feed(&self, mut job: StagedJob) {
        if let Err(e) = self.device.bind() {
            if let Some(p) = job.progress.as_mut() {
                // No context to drain in: the drop below cannot help.
                p.finished = true;
            }
            self.finish_queued(&job);
            job.completer.complete(Err(e));
            return;
        }
        let lane = &*self.lane;
        let mut guard = lane.state.lock().unwrap_or_else(|p| p.into_inner());
        let runs = job.runs.take();
        let enqueued =
            finished(self.enqueue_job(guard.ring.as_mut(), &mut job, runs.as_slice(), None));
        self.finish_queued(&job);
        self.hand_to_watcher(enqueued, job);
        drop(guard);
        self.give_back(runs);
    }

    fn finish_queued(&self, job: &StagedJob) {
        if job.queued {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Hands a wholly enqueued copy to the watcher, or fails it: drains the
    /// lane, then releases its regions and resolves it with the error.
    fn hand_to_watcher(&self, enqueued: CudaResult<u64>, job: StagedJob) {
        let stream = ending_stream(&self.lane, job.host);
        let StagedJob {
            progress,
            keep,
            spin,
            completer,
            timeline,
            ..
        } = job;
        if let Some(mut p) = progress {
            // Drained below on an error; watched otherwise.
            p.finished = true;
        }
        if let Some(mut t) = timeline {
            t.note_returned();
            self.timelines
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(t);
        }
        let lane = &*self.lane;
        let failed = match enqueued {
            Ok(bytes) => {
                let spin = spin.map(|p| PollPlan {
                    shortest: Duration::from_secs_f64(bytes as f64 / self.line_rate),
                    ..p
                });
                lane.watcher.watch_with(stream, keep, spin, completer).err()
            }
            Err(e) => Some((e, keep, completer)),
        };
        if let Some((e, keep, completer)) = failed {
            lane.drain();
            drop(keep);
            completer.complete(Err(e));
        }
    }
}

/// The stream whose last operation ends a staged copy with `host` side:
/// an offload ends with its last DMA, an onboard with its last scatter.
pub(crate) fn ending_stream(lane: &Lane, host: HostSide) -> &Stream {
    match host {
        HostSide::Destination => &lane.copy_stream,
        HostSide::Source => &lane.kernel_stream,
    }
}

/// A copy enqueued with no chunk limit: wholly enqueued, or an error.
fn finished(enqueued: CudaResult<Option<u64>>) -> CudaResult<u64> {
    enqueued
        .and_then(|s| s.ok_or_else(|| CudaError::InvalidCopy("staged copy left unfinished".into())))
}

/// Run lists up to this capacity (5 MiB) are kept for reuse; a larger one
/// is freed rather than held for the copier's lifetime.
const MAX_SPARE_RUNS: usize = 1 << 17;
