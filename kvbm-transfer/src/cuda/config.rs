//! The copier's settings: the few a deployment may want to change, sized
//! from the device by [`CopierConfig::for_device`], and the fixed constants
//! the copy paths use (`docs/benchmarks.md`, "CUDA copies between G1 and
//! G2", has the measurements behind them).

use super::device::CudaDevice;

/// Settings of a [`CudaCopier`](super::CudaCopier). Start from
/// [`CopierConfig::for_device`] and change what the deployment needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopierConfig {
    /// Lanes (kernel stream + copy stream + watcher) per direction. Copies
    /// of one direction are spread over them, so more lanes let more small
    /// copies of one direction run at once; each lane holds two streams
    /// and a thread.
    pub lanes_per_direction: usize,
    /// Bytes per staging slot. A staging ring per host direction takes
    /// `staging_slot_bytes × staging_slots` of device memory; a deployment
    /// short of GPU memory makes the ring smaller. Beside a model that
    /// holds every SM the staging kernels run only between the model's
    /// kernels, so the ring must hold what the link moves meanwhile: a
    /// smaller ring is fine for an idle GPU, not beside a large GEMM.
    pub staging_slot_bytes: usize,
    /// Slots per staging ring (see `staging_slot_bytes`).
    pub staging_slots: usize,
    /// CTAs of the staged path's gather/scatter kernel. Wide (two per SM
    /// by default, see [`CopierConfig::for_device`]), so a gather that
    /// runs in a gap between the model's kernels finishes quickly; a
    /// deployment that wants the copies to take fewer SMs at once lowers
    /// it.
    pub staged_ctas: u32,
    /// CTAs of the kernel path beside the model ([`GpuLoad::Busy`]): how
    /// many SMs a small copy may take from the model while it runs.
    ///
    /// [`GpuLoad::Busy`]: super::GpuLoad::Busy
    pub busy_ctas: u32,
    /// Copies up to this many bytes take the kernel path: one launch, the
    /// lowest latency. Raise it to favour latency, lower it to keep the
    /// SMs free for the model.
    pub small_copy_bytes: u64,
    /// Larger copies whose runs average at least this many bytes take the
    /// copy engines (no SMs); smaller runs go through the staging ring. A
    /// platform whose copy engines pay less per descriptor lowers it.
    pub engine_run_bytes: u64,
    /// Completion wake-up of host ↔ device copies: once a copy's bytes
    /// could have crossed the host link, its watcher busy-polls for at
    /// most this many microseconds before sleeping in the driver (whose
    /// wake-up after the GPU's interrupt is slow next to a copy). 0 always
    /// sleeps: a deployment short of CPU cores trades that latency for a
    /// core.
    pub wake_spin_us: u64,
    /// Diagnostics: record a timeline of each staged copy (GPU timing
    /// events per chunk), read with `CudaCopier::take_timeline`.
    #[cfg(feature = "diagnostics")]
    pub timeline: bool,
}

impl CopierConfig {
    /// The settings for `device`: the staging kernel sized from its SM
    /// count, the rest fixed (the choices that measured best).
    pub fn for_device(device: &CudaDevice) -> Self {
        CopierConfig {
            lanes_per_direction: 2,
            staging_slot_bytes: 32 << 20,
            staging_slots: 8,
            staged_ctas: STAGED_CTAS_PER_SM * device.sm_count().max(1),
            busy_ctas: 8,
            small_copy_bytes: 4 << 20,
            engine_run_bytes: 128 << 10,
            wake_spin_us: 500,
            #[cfg(feature = "diagnostics")]
            timeline: false,
        }
    }
}

/// CTAs of the staging kernel per SM: the gather is spread over every SM,
/// so it ends soon after it gets them.
const STAGED_CTAS_PER_SM: u32 = 2;

/// Kernel path, idle GPU: threads per CTA.
pub(crate) const IDLE_THREADS: u32 = 512;

/// Kernel path, idle GPU: at most this many CTAs. Few enough that an
/// offload and an onboard kernel fit on the GPU at the same time.
pub(crate) const IDLE_MAX_CTAS: u32 = 64;

/// Kernel path, idle GPU: a warp for every this many bytes (or for every
/// run, when that is more), up to `IDLE_MAX_CTAS`. A small copy reading
/// pinned memory across the host link moves only as fast as it has loads in
/// flight, so a lone block is spread wide.
pub(crate) const IDLE_WARP_BYTES: u64 = 4 << 10;

/// Kernel path, busy GPU: threads per CTA.
pub(crate) const BUSY_THREADS: u32 = 512;

/// Staged path: threads per CTA of the staging kernel.
pub(crate) const STAGED_THREADS: u32 = 512;

/// Strided families of fewer runs go as flat copies (a pitched descriptor
/// costs the driver several flat ones).
pub(crate) const MIN_FAMILY_HEIGHT: u64 = 8;

/// After the busy poll of `wake_spin_us`, the watcher queries the copy's
/// event every this many microseconds (sleeping in between) for at most as
/// long again as the copy's shortest duration, before it sleeps in the
/// driver. For copies that run well below line rate (each direction of an
/// onboard and an offload at once; a copy behind the model's kernels),
/// which outlast the busy poll.
pub(crate) const WAKE_POLL_INTERVAL_US: u64 = 20;

/// When a staging ring has nothing queued, the caller enqueues this many
/// first chunks of a staged copy itself (the GPU starts with no hand-off to
/// the feeder thread, whose wake-up outlasts the first chunk's DMA) and the
/// feeder continues from there.
pub(crate) const CALLER_CHUNKS: usize = 2;

/// Staged copies start with this many smaller chunks (a half slot, a
/// quarter, an eighth for the first), so the first DMA starts soon and each
/// chunk is planned before the last one moved.
pub(crate) const RAMP_CHUNKS: u32 = 3;
