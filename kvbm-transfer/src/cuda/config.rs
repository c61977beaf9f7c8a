//! The copier's tunables: path thresholds, grid sizes, the staging ring,
//! the completion poll. Every default is a measured choice (the numbers in
//! the field docs come from the H200 machine, docs/benchmarks.md).

/// Tunables of a [`CudaCopier`](super::CudaCopier). The defaults are the
/// measured choices.
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
    /// After the busy poll of `wake_spin_us`, the watcher queries the
    /// copy's event every this many microseconds (sleeping in between) for
    /// at most as long again as the copy's shortest duration, before it
    /// sleeps in the driver; 0 goes to the driver at once. For copies that
    /// run well below line rate (each direction of an onboard and an
    /// offload at once; a copy behind the model's kernels), which outlast
    /// the busy poll.
    pub wake_poll_interval_us: u64,
    /// An upper bound of the host link's rate in one direction (bytes/s),
    /// for `wake_spin_us`: a copy never ends before its bytes at this rate.
    pub line_rate_bytes_per_s: f64,
    /// How the watcher of a device → host (or device → device) lane waits
    /// for a copy that has another queued behind it (see [`FollowedWait`]).
    /// The driver's wait: on the H200 machine, 8 KiB offloads through the
    /// tier engine with four batches in flight moved the same (0.80–0.83
    /// of the link over 3 s beside a GEMM, 0.93–0.94 idle) with each
    /// choice, and the watcher used 0.09 of a core waiting in the driver,
    /// 0.15–0.24 polling with sleeps and 0.53–0.74 busy-polling every copy.
    pub followed_wait_offload: FollowedWait,
    /// The same for host → device lanes. Polled as the last copy: a
    /// request waits on each onboard, and the driver's wake-up would add
    /// itself to the wait of every onboard but the last of a queue (four
    /// 32 MiB onboards queued at once on the H200 machine resolved 60–90 µs
    /// later each, but the last, when waited for in the driver).
    pub followed_wait_onboard: FollowedWait,
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
    /// With [`GpuLoad::Busy`](super::GpuLoad::Busy), a staged copy's
    /// gathers or scatters go in one kernel per half ring of full-slot
    /// chunks instead of one per chunk. Beside the model each kernel of the
    /// copy waits for SMs the model's kernels hold, so a few large kernels
    /// wait less than many small ones, and while one half's kernel waits
    /// the other half's DMA keeps the link busy. H200 machine, beside a
    /// bf16 GEMM loop, two copies in flight: 0.96–0.99 of line rate at 8
    /// and 32 KiB runs with the GEMM within its noise, against 0.69–0.77
    /// with a kernel per chunk.
    pub busy_grouped_staging: bool,
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
            wake_poll_interval_us: 20,
            line_rate_bytes_per_s: 56e9,
            followed_wait_offload: FollowedWait::Driver,
            followed_wait_onboard: FollowedWait::AsLast,
            staged_feeder: true,
            staged_caller_chunks: 2,
            staged_ramp_chunks: 3,
            busy_grouped_staging: true,
            timeline: false,
        }
    }
}

/// How a lane's watcher waits for a copy with another queued behind it.
///
/// Such a copy ends with the link still busy (the next copy follows on the
/// same streams), so learning of its end late delays no byte of the copies
/// queued behind it; it delays what its owner does next (an engine
/// registers the batch and starts another), which matters once the queue
/// runs short. The last copy handed to a watcher is always waited for as
/// `CopierConfig::wake_spin_us` and `wake_poll_interval_us` say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FollowedWait {
    /// As the last copy: a busy poll, then sleeping polls, then the driver.
    /// The watcher of a stream of copies keeps a core busy.
    AsLast,
    /// Sleeping polls only (every `wake_poll_interval_us`), then the driver.
    Polls,
    /// Straight to the driver's blocking wait (woken 0.14–0.3 ms after the
    /// copy's end on the H200 machine).
    Driver,
}
