//! The executor of copy plans between G1 (device) and G2 (pinned host).
//!
//! Three paths, because no single one is best everywhere (figures from the
//! H200 machine, see docs/benchmarks.md):
//!
//! - [`CopyPath::CopyEngine`]: DMA on the copy engines. Affine families of
//!   runs (a block's K and V across layers, see `strided`) go as one
//!   pitched descriptor each, lone runs as flat ones, in batch calls where
//!   the driver has them. Uses no SMs. Each flat descriptor costs the driver
//!   ~0.6 µs, so flat runs of 8–32 KiB are submission-bound; families cut
//!   that to a few calls, and then each line still costs the engine ~0.1
//!   µs (0.84 of line rate at 32 KiB lines, 0.6 at 8 KiB, 0.99 at 256 KiB).
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
use std::time::Duration;

use cudarc::driver::sys::CUstream;

use super::completion::Completion;
use super::device::CudaDevice;
use super::dma::{enqueue_spans, enqueue_strided};
use super::error::{CudaError, CudaResult};
use super::feeder::Feeder;
use super::kernel::Grid;
use super::lanes::{DescPool, Lane};
use super::memory::{CudaRegion, Location, allocation_bounds};
use super::pinned::registration_bounds;
use super::plan::{CopyRun, HostSide, absolute_spans};
use super::staged::{StagedJob, StagedRing};
use super::strided::{FamilyLimits, OrderBy, Strided, strided_copies};
use super::timeline::{Timeline, report};
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

/// Tunables of a [`CudaCopier`]. The defaults are the measured choices.
#[derive(Debug, Clone)]
pub struct CopierConfig {
    /// Lanes (kernel stream + copy stream + watcher) per direction; the
    /// first lane of each host direction also holds the staging ring.
    pub lanes_per_direction: usize,
    /// Bytes per staging slot.
    pub staging_slot_bytes: usize,
    /// Slots per staging ring. Under a model that holds every SM (a large
    /// GEMM), the staging kernels only run between the model's kernels, so
    /// the ring must hold what the DMA moves during one of them: beside a
    /// 1.5 ms GEMM, 8 × 32 MiB reached 0.86–0.89 of line rate at 32 KiB
    /// runs where 8 × 8 MiB reached 0.65. Idle, 8 MiB slots did as well.
    pub staging_slots: usize,
    /// Kernel path, idle GPU: threads per CTA.
    pub idle_threads: u32,
    /// Kernel path, idle GPU: at most this many CTAs. Few enough that an
    /// offload and an onboard kernel fit on the GPU at the same time.
    pub idle_max_ctas: u32,
    /// Kernels give each warp its own run (more loads in flight for small
    /// runs) rather than each CTA.
    pub warp_per_run: bool,
    /// Use `cuMemcpyBatchAsync_v2` / `cuMemcpy3DBatchAsync_v2` where the
    /// driver has them.
    pub use_batch_copy: bool,
    /// Copy-engine path: move affine families of runs as pitched copies
    /// (one descriptor per family) instead of one descriptor per run.
    pub strided_copies: bool,
    /// Families of fewer runs go as flat copies (a pitched descriptor costs
    /// the driver several flat ones).
    pub min_family_height: u64,
    /// Kernel path, busy GPU: CTAs.
    pub busy_ctas: u32,
    /// Kernel path, busy GPU: threads per CTA.
    pub busy_threads: u32,
    /// Staged path: CTAs of the staging kernel. Wide, so the gather that
    /// runs in the gaps between the model's kernels finishes quickly.
    pub staged_ctas: u32,
    /// Staged path: threads per CTA of the staging kernel.
    pub staged_threads: u32,
    /// Copies up to this many bytes take the kernel path (latency).
    pub small_copy_bytes: u64,
    /// Runs of at least this mean size take the copy engines.
    pub engine_run_bytes: u64,
    /// Completion wake-up of host ↔ device copies: once a copy's bytes
    /// could have crossed the host link at `line_rate_bytes_per_s`, its
    /// watcher polls for at most this many microseconds before sleeping in
    /// the driver; 0 always sleeps. The driver's wake-up after the GPU's
    /// interrupt took 0.14–0.3 ms on the H200 machine, a tenth of a 128 MiB
    /// copy.
    pub wake_spin_us: u64,
    /// An upper bound of the host link's rate in one direction (bytes/s),
    /// for `wake_spin_us`: a copy never ends before its bytes at this rate.
    pub line_rate_bytes_per_s: f64,
    /// Staged copies are enqueued by a feeder thread per staging ring, so
    /// `copy()` returns early and an onboard and an offload submitted by
    /// one thread are enqueued side by side (H200 machine, both directions
    /// from one thread at 8 KiB runs: 0.86–0.88 of the bidirectional rate
    /// against 0.76–0.79 without). `false` enqueues on the caller's thread
    /// before `copy()` returns.
    pub staged_feeder: bool,
    /// With the feeder: when a ring has nothing queued, the caller enqueues
    /// this many first chunks of a staged copy itself (the GPU starts with
    /// no hand-off to the feeder thread) and the feeder continues from
    /// there; 0 hands every copy over whole. Handing over whole cost a lone
    /// copy the thread hand-off: on the H200 machine, 8 KiB runs one way,
    /// medians of 8 copies in three runs, 0 chunks 0.863–0.885, 1 chunk
    /// 0.857–0.887 (the feeder's wake-up outlasts the first chunk's DMA),
    /// 2 chunks 0.875–0.898, 3 chunks 0.883–0.903, no feeder 0.879–0.893;
    /// both directions from one thread 2 chunks 0.856–0.877 against
    /// 0.829–0.856 with 0.
    pub staged_caller_chunks: usize,
    /// Staged copies start with this many smaller chunks (a half slot, a
    /// quarter, … back to `1 / 2^n` of a slot for the first), so the first
    /// DMA starts soon and each chunk is planned before the last one moved.
    pub staged_ramp_chunks: u32,
    /// Diagnostics: record a timeline of each staged copy (GPU timing
    /// events per chunk), read with `CudaCopier::take_timeline`.
    #[doc(hidden)]
    pub timeline: bool,
}

impl Default for CopierConfig {
    fn default() -> Self {
        CopierConfig {
            lanes_per_direction: 2,
            staging_slot_bytes: 32 << 20,
            staging_slots: 8,
            idle_threads: 512,
            idle_max_ctas: 64,
            warp_per_run: true,
            use_batch_copy: true,
            strided_copies: true,
            min_family_height: 8,
            busy_ctas: 8,
            busy_threads: 512,
            staged_ctas: 264,
            staged_threads: 512,
            small_copy_bytes: 4 << 20,
            engine_run_bytes: 128 << 10,
            wake_spin_us: 500,
            line_rate_bytes_per_s: 56e9,
            staged_feeder: true,
            staged_caller_chunks: 2,
            staged_ramp_chunks: 3,
            timeline: false,
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
    timeline: Arc<Mutex<Vec<Timeline>>>,
    config: CopierConfig,
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
    /// Creates the lanes, staging rings and watchers for `device`.
    pub fn new(device: &CudaDevice, config: CopierConfig) -> CudaResult<Self> {
        if config.lanes_per_direction == 0
            || config.staging_slots == 0
            || config.staging_slot_bytes < 4096
        {
            return Err(CudaError::InvalidCopy(format!(
                "copier needs at least one lane, one slot and 4 KiB slots: {config:?}"
            )));
        }
        device.bind()?;
        let mut lanes: [Vec<Arc<Lane>>; 3] = Default::default();
        for (d, name) in [(0, "h2d"), (1, "d2h"), (2, "d2d")] {
            for i in 0..config.lanes_per_direction {
                // One staging ring per direction, on lane 0: staged copies
                // all go there (the ring is large; see `staging_slots`).
                let staged = d != 2 && i == 0;
                lanes[d].push(Arc::new(Lane::new(
                    device,
                    &config,
                    staged,
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
                    threads: config.staged_threads,
                    per_warp: config.warp_per_run,
                },
                batch: config.use_batch_copy && device.has_batch_copy(),
                ramp: config.staged_ramp_chunks,
                timelines: Arc::clone(&timeline),
                queued: AtomicUsize::new(0),
                spare_runs: Mutex::new(Vec::new()),
            });
            if config.staged_feeder {
                let r = Arc::clone(&ring);
                feeders.push(
                    Feeder::spawn(&format!("kvbm-{name}-feed"), move |job| r.feed(job)).map_err(
                        |e| CudaError::Os {
                            call: "thread spawn",
                            source: Arc::new(e),
                        },
                    )?,
                );
            }
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
    /// The rule, from the H200 measurements in docs/benchmarks.md (8, 32 and
    /// 256 KiB runs, 256 random blocks, one direction and both at once, idle
    /// and beside a bf16 GEMM loop):
    ///
    /// - device-to-device copies and small copies (up to
    ///   `small_copy_bytes`) take the kernel: one launch, the lowest latency;
    /// - runs of `engine_run_bytes` or more take the copy engines (line rate
    ///   with no SMs, both directions at once);
    /// - smaller runs take the staging ring: 0.96–0.97 of line rate at 32
    ///   KiB runs one way and 0.93–0.98 both ways, where the kernel reads
    ///   and writes pinned memory at 0.91–0.95 one way and 0.78 both ways,
    ///   and the copy engines pay ~0.1 µs per line (0.6 at 8 KiB). Its
    ///   kernels hold the SMs for a few microseconds per 32 MiB, so it is
    ///   also the choice beside the model.
    ///
    /// `load` does not change the choice today (the staged path measured
    /// best idle and busy); it sizes the grid of a forced kernel copy.
    pub fn choose(
        &self,
        dir: Direction,
        n_runs: usize,
        total_bytes: u64,
        load: GpuLoad,
    ) -> CopyPath {
        let _ = load;
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
    /// bounds-checked. The regions are kept alive until the copy completes.
    /// The returned [`Completion`] resolves when the bytes have landed, or
    /// with the driver's error.
    pub fn copy(
        &self,
        runs: &[CopyRun],
        src: &[Arc<dyn CudaRegion>],
        dst: &[Arc<dyn CudaRegion>],
        opts: CopyOptions,
    ) -> CudaResult<Completion> {
        let entered = std::time::Instant::now();
        let dir = direction(src, dst)?;
        // Host ↔ device plans are checked while being copied into an owned
        // list the staged path keeps: one pass over the caller's (often
        // cache-cold) list; each pass over 16,384 cold runs cost ~60 µs
        // before the first byte moved.
        let ring = self.staged.get(dir.index());
        let mut owned = ring.map(|r| r.spare_runs());
        let checked = validate(runs, src, dst, owned.as_mut());
        let give_back = |owned: Option<Vec<CopyRun>>| {
            if let (Some(r), Some(v)) = (ring, owned) {
                r.give_back_runs(v);
            }
        };
        let (total, n_runs) = match checked {
            Ok(c) => c,
            Err(e) => {
                give_back(owned);
                return Err(e);
            }
        };
        if total == 0 {
            give_back(owned);
            return Ok(Completion::ready(Ok(())));
        }
        self.device.bind()?;
        let src_bases: Vec<u64> = src.iter().map(|r| r.device_ptr()).collect();
        let dst_bases: Vec<u64> = dst.iter().map(|r| r.device_ptr()).collect();
        let path = opts
            .path
            .unwrap_or_else(|| self.choose(dir, n_runs, total, opts.load));
        let families = (path == CopyPath::CopyEngine && self.config.strided_copies)
            .then(|| self.families(runs, src, dst, &src_bases, &dst_bases, dir));
        let path = match (path, dir) {
            (CopyPath::Staged, Direction::DeviceToDevice) => CopyPath::Kernel,
            (p, _) => p,
        };
        let _span = tracing::debug_span!(
            "cuda_copy",
            ?dir,
            ?path,
            n_runs,
            total,
            dma_copies = families.as_ref().map_or(n_runs, Vec::len)
        )
        .entered();
        let mut keep: Vec<Box<dyn Any + Send>> =
            vec![Box::new(src.to_vec()), Box::new(dst.to_vec())];
        // The earliest the bytes can have crossed the host link, counted
        // from the call (nothing moves before it); device-to-device copies
        // run at HBM speed and just sleep in the driver.
        let spin = (self.config.wake_spin_us > 0 && dir != Direction::DeviceToDevice).then(|| {
            (
                entered,
                Duration::from_secs_f64(total as f64 / self.config.line_rate_bytes_per_s),
                Duration::from_micros(self.config.wake_spin_us),
            )
        });
        if path == CopyPath::Staged
            && let (Some(ring), Some(owned)) = (ring, owned.take())
        {
            let (completer, completion) = completion_pair();
            let host = if dir == Direction::HostToDevice {
                HostSide::Source
            } else {
                HostSide::Destination
            };
            let job = StagedJob {
                runs: owned,
                src_bases,
                dst_bases,
                total,
                host,
                progress: None,
                keep,
                spin,
                completer,
                timeline: self.config.timeline.then(|| {
                    Timeline::new(
                        if host == HostSide::Source {
                            "H2D"
                        } else {
                            "D2H"
                        },
                        entered,
                    )
                }),
                queued: false,
            };
            ring.submit(
                self.feeders.get(dir.index()),
                self.config.staged_caller_chunks,
                job,
            );
            return Ok(completion);
        }
        give_back(owned);
        let lanes = &self.lanes[dir.index()];
        let lane =
            &lanes[self.next_lane[dir.index()].fetch_add(1, Ordering::Relaxed) % lanes.len()];
        let guard = lane.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut enqueue = || -> CudaResult<CUstream> {
            Ok(match path {
                CopyPath::CopyEngine => {
                    let (src_loc, dst_loc) = (src[0].location(), dst[0].location());
                    match &families {
                        Some(f) => enqueue_strided(
                            &self.device,
                            self.batch(),
                            lane.copy_stream,
                            f,
                            src_loc,
                            dst_loc,
                        )?,
                        None => enqueue_spans(
                            &self.device,
                            self.batch(),
                            lane.copy_stream,
                            &absolute_spans(runs, &src_bases, &dst_bases),
                            src_loc,
                            dst_loc,
                        )?,
                    }
                    lane.copy_stream
                }
                CopyPath::Kernel => {
                    // Empty runs cost the kernel nothing; no filtered copy.
                    self.launch_part(lane, runs, &src_bases, &dst_bases, opts.load, &mut keep)?;
                    lane.kernel_stream
                }
                CopyPath::Staged => {
                    return Err(CudaError::InvalidCopy(
                        "staged copies go through their ring".into(),
                    ));
                }
            })
        };
        let stream = match enqueue() {
            Ok(s) => s,
            Err(e) => {
                // Part of the copy may already be on the GPU: let it drain
                // before the regions (in `keep`) can be freed.
                lane.drain();
                return Err(e);
            }
        };
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

    /// Diagnostics: the timelines of the staged copies since the last call
    /// when `CopierConfig::timeline` is on, on one clock (waits for their
    /// GPU events).
    #[doc(hidden)]
    pub fn take_timeline(&self) -> Option<String> {
        let t = std::mem::take(&mut *self.timeline.lock().unwrap_or_else(|p| p.into_inner()));
        if t.is_empty() {
            return None;
        }
        self.device.bind().ok()?;
        Some(report(t))
    }

    /// Uploads `part`'s descriptors and launches the copy kernel over them
    /// on the lane's kernel stream. (Launching the first 1024 runs ahead of
    /// the rest, to start the GPU sooner, measured the same; not kept. So
    /// did letting the kernel read them in place from mapped pinned memory,
    /// as the staged path does: a kernel copy beside a copy-engine copy
    /// in the other direction stayed at 0.41–0.57 of the bidirectional
    /// rate either way, 1–3 µs slower for a single block; not kept.)
    fn launch_part(
        &self,
        lane: &Lane,
        part: &[CopyRun],
        src_bases: &[u64],
        dst_bases: &[u64],
        load: GpuLoad,
        keep: &mut Vec<Box<dyn Any + Send>>,
    ) -> CudaResult<()> {
        let desc = self
            .descs
            .upload(lane.kernel_stream, part, src_bases, dst_bases)?;
        let total = part.iter().map(|r| r.len).sum();
        let grid = self.kernel_grid(part.len(), total, load);
        // SAFETY: the descriptor holds `part` and both base tables in device
        // memory; every run was bounds-checked against its region, and the
        // regions are kept alive (in `keep`) until completion.
        unsafe {
            self.device.inner.kernel.launch(
                lane.kernel_stream,
                grid,
                desc.runs_ptr(),
                part.len() as u32,
                desc.table_ptr(0),
                desc.table_ptr(src_bases.len()),
            )?
        };
        keep.push(Box::new(desc));
        Ok(())
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
                min_height: self.config.min_family_height,
            },
        )
    }

    fn batch(&self) -> bool {
        self.config.use_batch_copy && self.device.has_batch_copy()
    }

    fn kernel_grid(&self, n_runs: usize, total: u64, load: GpuLoad) -> Grid {
        match load {
            GpuLoad::Busy => Grid {
                ctas: self.config.busy_ctas.max(1),
                threads: self.config.busy_threads,
                per_warp: self.config.warp_per_run,
            },
            GpuLoad::Idle => {
                // One worker per run (or per 64 KiB), up to the cap.
                let items = (n_runs as u64).max(total / (64 << 10)).max(1);
                let per_cta = if self.config.warp_per_run {
                    u64::from(self.config.idle_threads / 32).max(1)
                } else {
                    1
                };
                Grid {
                    ctas: items
                        .div_ceil(per_cta)
                        .min(u64::from(self.config.idle_max_ctas))
                        .max(1) as u32,
                    threads: self.config.idle_threads,
                    per_warp: self.config.warp_per_run,
                }
            }
        }
    }
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

/// Bounds-checks every run (appending it to `copy_to` on the way); returns
/// the total bytes and the number of non-empty runs.
fn validate(
    runs: &[CopyRun],
    src: &[Arc<dyn CudaRegion>],
    dst: &[Arc<dyn CudaRegion>],
    copy_to: Option<&mut Vec<CopyRun>>,
) -> CudaResult<(u64, usize)> {
    if runs.len() > u32::MAX as usize {
        return Err(CudaError::InvalidCopy(
            "more than 2^32 runs in one copy".into(),
        ));
    }
    // Lengths read once (a region still pinning in the background may
    // grow meanwhile; the copy uses what was pinned when it was checked).
    let src_lens: Vec<u64> = src.iter().map(|r| r.len() as u64).collect();
    let dst_lens: Vec<u64> = dst.iter().map(|r| r.len() as u64).collect();
    // One branch-free pass; the error is looked for only when it failed.
    let fits = |region: u32, offset: u64, len: u64, lens: &[u64]| {
        let cap = lens.get(region as usize).copied().unwrap_or(0);
        offset <= cap && len <= cap - offset
    };
    let (mut ok, mut total, mut n) = (true, 0u64, 0usize);
    let mut check = |r: &CopyRun| {
        ok &= fits(r.src_region, r.src_offset, r.len, &src_lens)
            & fits(r.dst_region, r.dst_offset, r.len, &dst_lens);
        total = total.saturating_add(r.len);
        n += usize::from(r.len > 0);
    };
    match copy_to {
        Some(v) => v.extend(runs.iter().map(|r| {
            check(r);
            *r
        })),
        None => runs.iter().for_each(check),
    }
    if ok {
        return Ok((total, n));
    }
    for (i, r) in runs.iter().enumerate() {
        for (region, offset, lens, name) in [
            (r.src_region, r.src_offset, &src_lens, "source"),
            (r.dst_region, r.dst_offset, &dst_lens, "destination"),
        ] {
            if !fits(region, offset, r.len, lens) {
                return Err(CudaError::InvalidCopy(match lens.get(region as usize) {
                    None => format!("run {i}: {name} region {region} does not exist"),
                    Some(cap) => format!(
                        "run {i}: {name} bytes {offset}+{} outside region {region} of {cap} bytes",
                        r.len
                    ),
                }));
            }
        }
    }
    Err(CudaError::InvalidCopy(
        "a run lies outside its region".into(),
    ))
}
