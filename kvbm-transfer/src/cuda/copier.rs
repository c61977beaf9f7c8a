//! The executor of copy plans between G1 (device) and G2 (pinned host).
//!
//! Three paths, because no single one is best everywhere (measured in
//! `docs/benchmarks.md`, "CUDA copies between G1 and G2"):
//!
//! - [`CopyPath::CopyEngine`]: DMA on the copy engines. Affine families of
//!   runs (a block's K and V across layers, see `strided`) go as one
//!   pitched descriptor each, lone runs as flat ones, in batch calls where
//!   the driver has them. Uses no SMs. Each flat descriptor costs the driver
//!   a fixed submission time, so flat runs of a few KiB are
//!   submission-bound; families cut that to a few calls, and then each line
//!   still costs the engine a fixed time of its own, so lines of a few KiB
//!   stay below line rate and only lines of hundreds of KiB reach it.
//! - [`CopyPath::Kernel`]: one launch of the gather/scatter kernel reading or
//!   writing pinned memory through its device pointer. Line rate at every run
//!   size and the lowest latency, but it occupies SMs while it runs.
//! - [`CopyPath::Staged`]: the kernel gathers device runs into a dense
//!   device staging slot (or scatters from one) at HBM speed, and the copy
//!   engines move whole slots to and from the host; a ring of slots
//!   pipelines the two (see `staged`). DMA rate with SMs busy only briefly.
//!
//! [`CudaCopier::choose`] picks by direction, size and run size; callers can
//! force a path. Each direction has its own lanes (a kernel stream, a copy
//! stream, a staging ring and a completion watcher), so offload and onboard
//! overlap.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::completion::{Completion, PollPlan};
pub use super::config::CopierConfig;
use super::config::{
    BUSY_THREADS, CALLER_CHUNKS, IDLE_MAX_CTAS, IDLE_THREADS, IDLE_WARP_BYTES, MIN_FAMILY_HEIGHT,
    RAMP_CHUNKS, STAGED_THREADS, WAKE_POLL_INTERVAL_US,
};
use super::device::CudaDevice;
use super::dma::enqueue_strided;
use super::error::{CudaError, CudaResult};
use super::feeder::Feeder;
use super::handles::Stream;
use super::kernel::{Grid, InlineRuns};
use super::lanes::{DescPool, Lane};
use super::memory::{CudaRegion, Location, allocation_bounds};
use super::pinned::registration_bounds;
use super::plan::{CopyRun, HostSide, RegionLens};
use super::staged::{JobRuns, StagedJob, StagedRing};
use super::strided::{FamilyLimits, OrderBy, Strided, strided_copies};
use super::timeline::Timeline;
use crate::completion::completion_pair;

/// How a copy moves its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyPath {
    /// DMA on the copy engines (no SMs).
    CopyEngine,
    /// The gather/scatter kernel, directly between the two layouts.
    Kernel,
    /// Kernel to/from a device staging ring, DMA between ring and host.
    Staged,
}

/// What the caller knows about the GPU's other work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GpuLoad {
    /// Nothing else needs the SMs: take the fastest path.
    #[default]
    Idle,
    /// The model is running: keep SM use minimal.
    Busy,
}

/// Per-copy options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CopyOptions {
    /// Force a path; `None` lets [`CudaCopier::choose`] pick.
    pub path: Option<CopyPath>,
    /// Whether the GPU is busy with other work.
    pub load: GpuLoad,
}

/// Direction of a copy, from the locations of its two sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Pinned host → device (onboard).
    HostToDevice,
    /// Device → pinned host (offload).
    DeviceToHost,
    /// Device → device.
    DeviceToDevice,
}

impl Direction {
    fn index(self) -> usize {
        match self {
            Direction::HostToDevice => 0,
            Direction::DeviceToHost => 1,
            Direction::DeviceToDevice => 2,
        }
    }
}

/// Executes copy plans on one device. `Send + Sync`; share it by reference
/// or `Arc`.
pub struct CudaCopier {
    // Feeders first: dropping one enqueues the copies it was handed and
    // joins. Then the lanes: their watchers drain before descriptors and
    // device go.
    feeders: Vec<Feeder<StagedJob>>,
    /// The staging rings, host-to-device then device-to-host.
    staged: Vec<Arc<StagedRing>>,
    lanes: [Vec<Arc<Lane>>; 3],
    next_lane: [AtomicUsize; 3],
    descs: Arc<DescPool>,
    #[cfg_attr(not(feature = "diagnostics"), allow(dead_code))]
    timeline: Arc<Mutex<Vec<Timeline>>>,
    config: CopierConfig,
    /// Bytes per second the host link moves at best (see
    /// [`CudaDevice::host_link_bytes_per_s`]).
    line_rate: f64,
    device: CudaDevice,
}

impl std::fmt::Debug for CudaCopier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopier")
            .field("device", &self.device)
            .field("config", &self.config)
            .finish()
    }
}

impl CudaCopier {
    /// Creates the lanes, staging rings and watchers for `device`;
    /// `config` usually starts as [`CopierConfig::for_device`]`(device)`.
    pub fn new(device: &CudaDevice, config: CopierConfig) -> CudaResult<Self> {
        if config.lanes_per_direction == 0
            || config.staging_slots == 0
            || config.staging_slot_bytes < 4096
            || config
                .staging_slot_bytes
                .checked_mul(config.staging_slots)
                .is_none()
        {
            return Err(CudaError::InvalidCopy(format!(
                "copier needs at least one lane, one slot, 4 KiB slots and a ring that fits in memory: {config:?}"
            )));
        }
        device.bind()?;
        let mut lanes: [Vec<Arc<Lane>>; 3] = Default::default();
        for (d, name) in [(0, "h2d"), (1, "d2h"), (2, "d2d")] {
            for i in 0..config.lanes_per_direction {
                // One staging ring per direction, on lane 0: staged copies
                // all go there (the ring is large; see `staging_slots`).
                let staged = d != 2 && i == 0;
                // Onboards are polled whatever follows them (a request
                // waits on each); see `completion`.
                let poll_followed = d == 0;
                lanes[d].push(Arc::new(Lane::new(
                    device,
                    &config,
                    staged,
                    poll_followed,
                    &format!("kvbm-{name}-{i}"),
                )?));
            }
        }
        let descs = Arc::new(DescPool {
            device: device.clone(),
            free: Mutex::new(Vec::new()),
        });
        let timeline = Arc::new(Mutex::new(Vec::new()));
        let mut staged = Vec::new();
        let mut feeders = Vec::new();
        for (d, name) in [(0, "h2d"), (1, "d2h")] {
            let ring = Arc::new(StagedRing {
                device: device.clone(),
                descs: Arc::clone(&descs),
                lane: Arc::clone(&lanes[d][0]),
                grid: Grid {
                    ctas: config.staged_ctas,
                    threads: STAGED_THREADS,
                },
                batch: device.has_batch_copy(),
                ramp: RAMP_CHUNKS,
                timelines: Arc::clone(&timeline),
                queued: AtomicUsize::new(0),
                spare_runs: Mutex::new(Vec::new()),
                line_rate: device.host_link_bytes_per_s(),
            });
            let r = Arc::clone(&ring);
            feeders.push(
                Feeder::spawn(&format!("kvbm-{name}-feed"), move |job| r.feed(job)).map_err(
                    |e| CudaError::Os {
                        call: "thread spawn",
                        source: Arc::new(e),
                    },
                )?,
            );
            staged.push(ring);
        }
        Ok(CudaCopier {
            feeders,
            staged,
            lanes,
            next_lane: Default::default(),
            descs,
            timeline,
            config,
            line_rate: device.host_link_bytes_per_s(),
            device: device.clone(),
        })
    }

    /// The device this copier runs on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The configuration in use.
    pub fn config(&self) -> &CopierConfig {
        &self.config
    }

    /// The path [`CudaCopier::copy`] takes for `n_runs` runs of
    /// `total_bytes` in direction `dir` when none is forced.
    ///
    /// The rule, from the measurements in `docs/benchmarks.md`, "CUDA
    /// copies between G1 and G2" (small, medium and large runs, random
    /// blocks, one direction and both at once, idle and beside a bf16 GEMM
    /// loop):
    ///
    /// - device-to-device copies and small copies (up to
    ///   `small_copy_bytes`) take the kernel: one launch, the lowest latency;
    /// - runs of `engine_run_bytes` or more take the copy engines (line rate
    ///   with no SMs, both directions at once);
    /// - smaller runs take the staging ring: its large DMA copies come
    ///   close to line rate one way and both ways, where the kernel reading
    ///   and writing pinned memory across the host link falls behind (most
    ///   of all both ways), and the copy engines pay a fixed cost per line
    ///   that small lines do not hide. Its kernels gather or scatter at HBM
    ///   speed and hold the SMs only briefly, so it is also the choice
    ///   beside the model.
    ///
    /// The GPU's load ([`CopyOptions::load`]) does not change the path, so
    /// it is no argument here: beside the model the staging ring still
    /// beats the copy engines at small runs (it puts the device side of
    /// half a ring of chunks in one kernel, which waits for the model's
    /// SMs once rather than per chunk, while the other half's DMA keeps the
    /// link busy), and the engines already use no SMs at large runs. The
    /// load changes how a path runs instead: the staged path's grouping,
    /// and the grid of a kernel copy.
    pub fn choose(&self, dir: Direction, n_runs: usize, total_bytes: u64) -> CopyPath {
        if dir == Direction::DeviceToDevice || total_bytes <= self.config.small_copy_bytes {
            return CopyPath::Kernel;
        }
        let mean_run = total_bytes / n_runs.max(1) as u64;
        if mean_run >= self.config.engine_run_bytes {
            CopyPath::CopyEngine
        } else {
            CopyPath::Staged
        }
    }

    /// Copies every run from the `src` regions to the `dst` regions.
    ///
    /// All source regions must share one location, and all destination
    /// regions another (or the same, for device-to-device). Every run is
    /// bounds-checked before any of its bytes move; an error returned here
    /// leaves nothing of the copy in flight. The regions are kept alive
    /// until the copy completes. The returned [`Completion`] resolves when
    /// the bytes have landed, or with the driver's error.
    ///
    /// A staged copy (see [`CopyPath::Staged`]) copies the plan for the
    /// thread that enqueues its later chunks, after its first chunks are
    /// on the GPU; [`CudaCopier::copy_shared`] avoids that copy.
    pub fn copy(
        &self,
        runs: &[CopyRun],
        src: &[Arc<dyn CudaRegion>],
        dst: &[Arc<dyn CudaRegion>],
        opts: CopyOptions,
    ) -> CudaResult<Completion> {
        let hold = || held(src, dst);
        self.start(runs, None, src, dst, opts, &hold)
    }

    /// [`CudaCopier::copy`] of a plan the caller shares rather than lends:
    /// nothing reads the whole plan before the GPU starts. A staged copy's
    /// runs are checked as its chunks are planned (its first chunks on
    /// this thread, the rest on the ring's feeder), so a run out of bounds
    /// can be found after earlier chunks moved: the copy then fails with
    /// [`CudaError::OutOfBounds`] on its completion, after the lane
    /// drained, and the runs before it may have landed (no byte outside
    /// the plan's runs is written either way). Other paths check the whole
    /// plan first, as `copy` does.
    pub fn copy_shared(
        &self,
        runs: Arc<[CopyRun]>,
        src: &[Arc<dyn CudaRegion>],
        dst: &[Arc<dyn CudaRegion>],
        opts: CopyOptions,
    ) -> CudaResult<Completion> {
        let plan = Arc::clone(&runs);
        let hold = || held(src, dst);
        self.start(&plan, Some(runs), src, dst, opts, &hold)
    }

    /// [`CudaCopier::copy_shared`] over region tables the caller keeps
    /// (the CUDA backend's, reused from job to job): the copy holds the two
    /// tables until it completes rather than a copy of each.
    pub(crate) fn copy_tables(
        &self,
        runs: Arc<[CopyRun]>,
        src: &Arc<[Arc<dyn CudaRegion>]>,
        dst: &Arc<[Arc<dyn CudaRegion>]>,
        opts: CopyOptions,
    ) -> CudaResult<Completion> {
        let plan = Arc::clone(&runs);
        let hold = || -> Vec<Box<dyn Any + Send>> {
            vec![Box::new(Arc::clone(src)), Box::new(Arc::clone(dst))]
        };
        self.start(&plan, Some(runs), src, dst, opts, &hold)
    }

    /// Starts a copy of `runs` (`shared` with the staging ring's feeder
    /// when the caller shares the plan): checks it, picks its path and
    /// lane, enqueues it and hands it to the lane's watcher, with what
    /// `hold` gives to keep the regions alive until it completed.
    fn start(
        &self,
        runs: &[CopyRun],
        shared: Option<Arc<[CopyRun]>>,
        src: &[Arc<dyn CudaRegion>],
        dst: &[Arc<dyn CudaRegion>],
        opts: CopyOptions,
        hold: &dyn Fn() -> Vec<Box<dyn Any + Send>>,
    ) -> CudaResult<Completion> {
        let entered = Instant::now();
        let dir = direction(src, dst)?;
        if runs.len() > u32::MAX as usize {
            return Err(CudaError::InvalidCopy(
                "more than 2^32 runs in one copy".into(),
            ));
        }
        // Lengths read once (a region still pinning in the background may
        // grow meanwhile; the copy uses what was pinned when it was asked).
        let lens = RegionLens {
            src: src.iter().map(|r| r.len() as u64).collect(),
            dst: dst.iter().map(|r| r.len() as u64).collect(),
        };
        // The path is chosen from the plan's start (see `PlanLook`): only a
        // staged copy goes on without a pass over the whole plan.
        let path = self.path_for(dir, runs, opts.path);
        if path == CopyPath::Staged
            && let Some(ring) = self.staged.get(dir.index())
        {
            return self.staged(
                ring,
                runs,
                shared,
                src,
                dst,
                lens,
                dir,
                entered,
                opts.load,
                hold(),
            );
        }
        let (total, n_runs) = lens.check_plan(runs, None)?;
        if total == 0 {
            return Ok(Completion::ready(Ok(())));
        }
        self.device.bind()?;
        let src_bases: Vec<u64> = src.iter().map(|r| r.device_ptr()).collect();
        let dst_bases: Vec<u64> = dst.iter().map(|r| r.device_ptr()).collect();
        let families = if path == CopyPath::CopyEngine {
            self.families(runs, src, dst, &src_bases, &dst_bases, dir)
        } else {
            Vec::new()
        };
        let _span = tracing::debug_span!(
            "cuda_copy",
            ?dir,
            ?path,
            n_runs,
            total,
            dma_copies = if families.is_empty() {
                n_runs
            } else {
                families.len()
            }
        )
        .entered();
        let mut keep = hold();
        let spin = self.poll_plan(dir, entered, total);
        let lanes = &self.lanes[dir.index()];
        let lane =
            &lanes[self.next_lane[dir.index()].fetch_add(1, Ordering::Relaxed) % lanes.len()];
        let guard = lane.state.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: every run was bounds-checked against its region
        // (`check_plan`), `families` are the families of those runs, and the
        // regions stay alive (in `keep`) until the copy completed.
        let stream = unsafe {
            self.enqueue_direct(
                lane, path, runs, &families, src, dst, &src_bases, &dst_bases, opts.load, &mut keep,
            )
        }?;
        let completion = match lane.watcher.watch(stream, keep, spin) {
            Ok(c) => Ok(c),
            Err((e, keep)) => {
                lane.drain();
                drop(keep);
                Err(e)
            }
        };
        drop(guard);
        completion
    }

    /// The path a copy of `runs` in `dir` takes: the one `forced`, else
    /// [`CudaCopier::choose`]'s pick from the plan's start (see
    /// `PlanLook`); device-to-device copies never stage.
    fn path_for(&self, dir: Direction, runs: &[CopyRun], forced: Option<CopyPath>) -> CopyPath {
        let look = PlanLook::of(runs, self.config.small_copy_bytes);
        let mut path = forced.unwrap_or_else(|| self.choose(dir, look.n_runs, look.total));
        if path == CopyPath::Staged && dir == Direction::DeviceToDevice {
            path = CopyPath::Kernel;
        }
        path
    }

    /// Enqueues a direct (unstaged) copy on `lane`: `families` on its copy
    /// stream for the copy engines, or one kernel launch over `runs` on its
    /// kernel stream; returns the stream whose completion ends the copy.
    /// On an error, lets whatever part was enqueued drain first.
    ///
    /// # Safety
    /// Every run must have been bounds-checked against its region,
    /// `families` must cover exactly the runs' bytes and respect
    /// registration and allocation bounds (as [`Self::families`] makes
    /// them), and the regions must stay alive until the copy completed.
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue_direct<'l>(
        &self,
        lane: &'l Lane,
        path: CopyPath,
        runs: &[CopyRun],
        families: &[Strided],
        src: &[Arc<dyn CudaRegion>],
        dst: &[Arc<dyn CudaRegion>],
        src_bases: &[u64],
        dst_bases: &[u64],
        load: GpuLoad,
        keep: &mut Vec<Box<dyn Any + Send>>,
    ) -> CudaResult<&'l Stream> {
        let mut enqueue = || -> CudaResult<&'l Stream> {
            Ok(match path {
                CopyPath::CopyEngine => {
                    let (src_loc, dst_loc) = (src[0].location(), dst[0].location());
                    // SAFETY: as the caller promises, every run was
                    // bounds-checked against its region, the families
                    // cover exactly the runs' bytes and respect
                    // registration and allocation bounds, and the regions
                    // stay alive until the copy completed.
                    unsafe {
                        enqueue_strided(
                            &self.device,
                            self.device.has_batch_copy(),
                            &lane.copy_stream,
                            families,
                            src_loc,
                            dst_loc,
                        )?
                    };
                    &lane.copy_stream
                }
                CopyPath::Kernel => {
                    // Empty runs cost the kernel nothing; no filtered copy.
                    self.launch_part(lane, runs, src_bases, dst_bases, load, keep)?;
                    &lane.kernel_stream
                }
                CopyPath::Staged => {
                    return Err(CudaError::InvalidCopy(
                        "staged copies go through their ring".into(),
                    ));
                }
            })
        };
        match enqueue() {
            Ok(s) => Ok(s),
            Err(e) => {
                // Part of the copy may already be on the GPU: let it drain
                // before the regions (in `keep`) can be freed.
                lane.drain();
                Err(e)
            }
        }
    }

    /// How the watcher polls for the end of a copy of `total` bytes asked
    /// for at `asked`: from the earliest the bytes can have crossed the
    /// host link (nothing moves before the call); device-to-device copies
    /// run at HBM speed and just sleep in the driver.
    fn poll_plan(&self, dir: Direction, asked: Instant, total: u64) -> Option<PollPlan> {
        (self.config.wake_spin_us > 0 && dir != Direction::DeviceToDevice).then(|| PollPlan {
            asked,
            shortest: Duration::from_secs_f64(total as f64 / self.line_rate),
            busy: Duration::from_micros(self.config.wake_spin_us),
            interval: Duration::from_micros(WAKE_POLL_INTERVAL_US),
        })
    }

    /// Starts a staged copy on `ring` (see `StagedRing::submit`).
    #[allow(clippy::too_many_arguments)]
    fn staged(
        &self,
        ring: &StagedRing,
        runs: &[CopyRun],
        shared: Option<Arc<[CopyRun]>>,
        src: &[Arc<dyn CudaRegion>],
        dst: &[Arc<dyn CudaRegion>],
        lens: RegionLens,
        dir: Direction,
        entered: Instant,
        load: GpuLoad,
        keep: Vec<Box<dyn Any + Send>>,
    ) -> CudaResult<Completion> {
        let _span = tracing::debug_span!(
            "cuda_copy",
            ?dir,
            path = ?CopyPath::Staged,
            n_runs = runs.len(),
            shared = shared.is_some()
        )
        .entered();
        self.device.bind()?;
        let borrowed = shared.is_none();
        let (completer, completion) = completion_pair();
        let host = if dir == Direction::HostToDevice {
            HostSide::Source
        } else {
            HostSide::Destination
        };
        let job = StagedJob {
            runs: match shared {
                Some(a) => JobRuns::Shared(a),
                None => JobRuns::Owned(Vec::new()),
            },
            src_bases: src.iter().map(|r| r.device_ptr()).collect(),
            dst_bases: dst.iter().map(|r| r.device_ptr()).collect(),
            lens,
            host,
            progress: None,
            keep,
            // (The shortest duration is set once the bytes are known.)
            spin: self.poll_plan(dir, entered, 0),
            completer,
            timeline: Timeline::for_copy(&self.config, host, entered),
            queued: false,
            grouped: load == GpuLoad::Busy,
        };
        let feeder = self
            .feeders
            .get(dir.index())
            .ok_or_else(|| CudaError::InvalidCopy("no staging ring in this direction".into()))?;
        ring.submit(feeder, CALLER_CHUNKS, job, runs, borrowed)?;
        Ok(completion)
    }

    /// Diagnostics: the timelines of the staged copies since the last call
    /// when `CopierConfig::timeline` is on, on one clock (waits for their
    /// GPU events).
    #[cfg(feature = "diagnostics")]
    pub fn take_timeline(&self) -> Option<String> {
        let t = std::mem::take(&mut *self.timeline.lock().unwrap_or_else(|p| p.into_inner()));
        if t.is_empty() {
            return None;
        }
        self.device.bind().ok()?;
        Some(super::timeline::report(t))
    }

    /// Launches the copy kernel over `part` on the lane's kernel stream: a
    /// part of up to [`INLINE_RUNS`](super::kernel::INLINE_RUNS) runs
    /// travels in the launch's parameters (a lone block's pages start
    /// moving with no upload ahead of them); a larger one has its
    /// descriptors uploaded first.
    fn launch_part(
        &self,
        lane: &Lane,
        part: &[CopyRun],
        src_bases: &[u64],
        dst_bases: &[u64],
        load: GpuLoad,
        keep: &mut Vec<Box<dyn Any + Send>>,
    ) -> CudaResult<()> {
        let total = part.iter().map(|r| r.len).sum();
        let grid = self.kernel_grid(part.len(), total, load);
        let inline = InlineRuns::new(part.iter().map(|r| {
            (
                src_bases[r.src_region as usize] + r.src_offset,
                dst_bases[r.dst_region as usize] + r.dst_offset,
                r.len,
            )
        }));
        if let Some(plan) = inline {
            // SAFETY: every run was bounds-checked against its region,
            // whose base the address adds its offset to, and the regions
            // are kept alive (in `keep`) until completion.
            return unsafe {
                self.device
                    .inner
                    .kernel
                    .launch_inline(&lane.kernel_stream, grid, &plan)
            };
        }
        // SAFETY: the lease goes into `keep` before anything can fail,
        // and `keep` is released only after the copy completed (or, on an
        // error, after the lane drained).
        let desc = unsafe {
            self.descs
                .upload(&lane.kernel_stream, part, src_bases, dst_bases)?
        };
        let (runs_ptr, src_table, dst_table) = (
            desc.runs_ptr(),
            desc.table_ptr(0),
            desc.table_ptr(src_bases.len()),
        );
        keep.push(Box::new(desc));
        // SAFETY: the descriptor holds `part` and both base tables in device
        // memory; every run was bounds-checked against its region, and the
        // regions and the descriptor are kept alive (in `keep`) until
        // completion.
        unsafe {
            self.device.inner.kernel.launch(
                &lane.kernel_stream,
                grid,
                runs_ptr,
                part.len() as u32,
                src_table,
                dst_table,
            )
        }
    }

    /// The plan as affine families for the copy engines, grouped in host
    /// address order and never across a registration or allocation
    /// boundary.
    fn families(
        &self,
        runs: &[CopyRun],
        src: &[Arc<dyn CudaRegion>],
        dst: &[Arc<dyn CudaRegion>],
        src_bases: &[u64],
        dst_bases: &[u64],
        dir: Direction,
    ) -> Vec<Strided> {
        let host = registration_bounds();
        let bounds = |regions: &[Arc<dyn CudaRegion>]| match regions[0].location() {
            Location::PinnedHost => host.to_vec(),
            Location::Device => allocation_bounds(regions),
        };
        let order = match dir {
            Direction::HostToDevice => OrderBy::Source,
            Direction::DeviceToHost | Direction::DeviceToDevice => OrderBy::Destination,
        };
        strided_copies(
            runs,
            src_bases,
            dst_bases,
            order,
            &bounds(src),
            &bounds(dst),
            FamilyLimits {
                max_pitch: self.device.max_pitch(),
                min_height: MIN_FAMILY_HEIGHT,
            },
        )
    }

    fn kernel_grid(&self, n_runs: usize, total: u64, load: GpuLoad) -> Grid {
        match load {
            GpuLoad::Busy => Grid {
                ctas: self.config.busy_ctas.max(1),
                threads: BUSY_THREADS,
            },
            GpuLoad::Idle => {
                // One warp per run (or per IDLE_WARP_BYTES), up to the cap.
                let items = (n_runs as u64).max(total / IDLE_WARP_BYTES).max(1);
                let per_cta = u64::from(IDLE_THREADS / 32).max(1);
                Grid {
                    ctas: items.div_ceil(per_cta).min(u64::from(IDLE_MAX_CTAS)).max(1) as u32,
                    threads: IDLE_THREADS,
                }
            }
        }
    }
}

/// What a copy of `src` and `dst` keeps alive until it completed: the
/// regions.
fn held(src: &[Arc<dyn CudaRegion>], dst: &[Arc<dyn CudaRegion>]) -> Vec<Box<dyn Any + Send>> {
    vec![Box::new(src.to_vec()), Box::new(dst.to_vec())]
}

/// Figures out the direction and checks the locations are consistent.
fn direction(src: &[Arc<dyn CudaRegion>], dst: &[Arc<dyn CudaRegion>]) -> CudaResult<Direction> {
    let one = |regions: &[Arc<dyn CudaRegion>], side: &str| -> CudaResult<Location> {
        let first = regions
            .first()
            .ok_or_else(|| CudaError::InvalidCopy(format!("no {side} regions")))?
            .location();
        if regions.iter().any(|r| r.location() != first) {
            return Err(CudaError::InvalidCopy(format!(
                "{side} regions mix device and host memory"
            )));
        }
        Ok(first)
    };
    match (one(src, "source")?, one(dst, "destination")?) {
        (Location::PinnedHost, Location::Device) => Ok(Direction::HostToDevice),
        (Location::Device, Location::PinnedHost) => Ok(Direction::DeviceToHost),
        (Location::Device, Location::Device) => Ok(Direction::DeviceToDevice),
        (Location::PinnedHost, Location::PinnedHost) => Err(CudaError::InvalidCopy(
            "host-to-host copies belong to the memcpy backend".into(),
        )),
    }
}

/// What the start of a plan says, enough to choose a path: runs are read
/// until the bytes pass `small` (a copy above it is not a small one) and at
/// least `LOOK_RUNS` runs are seen, or the plan ends (then the figures are
/// the whole plan's). KV plans are uniform, so the mean run of their start
/// is the plan's; a staged copy then needs no pass over the whole plan
/// before its first chunk (see `staged`).
#[derive(Debug, Clone, Copy)]
struct PlanLook {
    total: u64,
    n_runs: usize,
}

/// Runs read at least by [`PlanLook::of`].
const LOOK_RUNS: usize = 1024;

impl PlanLook {
    fn of(runs: &[CopyRun], small: u64) -> Self {
        let (mut total, mut n_runs) = (0u64, 0usize);
        for (i, r) in runs.iter().enumerate() {
            if i >= LOOK_RUNS && total > small {
                break;
            }
            total = total.saturating_add(r.len);
            n_runs += usize::from(r.len > 0);
        }
        PlanLook { total, n_runs }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(n: usize, len: u64) -> Vec<CopyRun> {
        (0..n as u64)
            .map(|i| CopyRun {
                src_region: 0,
                src_offset: i * len,
                dst_region: 0,
                dst_offset: i * len,
                len,
            })
            .collect()
    }

    #[test]
    fn a_small_plan_is_read_whole_and_a_large_one_only_at_its_start() {
        // 4 MiB in 512 runs of 8 KiB: all of it.
        let small = PlanLook::of(&runs(512, 8 << 10), 4 << 20);
        assert_eq!((small.total, small.n_runs), (4 << 20, 512));
        // 128 MiB in 16,384 runs: the first LOOK_RUNS, enough for the
        // mean run and to know the copy is not a small one.
        let large = PlanLook::of(&runs(16_384, 8 << 10), 4 << 20);
        assert_eq!(large.n_runs, LOOK_RUNS);
        assert_eq!(large.total / large.n_runs as u64, 8 << 10);
        assert!(large.total > 4 << 20);
        // Empty runs count for nothing; an empty plan divides by nothing.
        let mut with_empty = runs(4, 100);
        with_empty[1].len = 0;
        let l = PlanLook::of(&with_empty, 4 << 20);
        assert_eq!((l.total, l.n_runs), (300, 3));
        let none = PlanLook::of(&[], 0);
        assert_eq!((none.total, none.n_runs), (0, 0));
    }
}
