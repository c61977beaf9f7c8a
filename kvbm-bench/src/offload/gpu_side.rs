//! The GPU side of the offload bench (feature `cuda`): device G1, pinned
//! G2, the CUDA executor with a handle on its backend, the single-copy
//! references, and the GEMM loop beside busy rows (feature `gemm`).

use std::sync::Arc;
use std::time::Instant;

use kvbm_layout::Layout;
use kvbm_transfer::cuda::{
    CopierConfig, CopyOptions, CopyPath, CopyRun, CudaBackend, CudaCopier, CudaDevice, CudaRegion,
    DeviceBuffer, GpuLoad, PinnedMemory, PinnedOptions,
};
use kvbm_transfer::{Executor, PhysicalLayout};

use super::super::error::{BenchError, Result};
use super::super::replay::gpu;
use super::super::stats::Spread;
#[cfg(not(feature = "gemm"))]
use super::Rep;
use super::{GpuPath, OffloadConfig, Reference};

fn cuda_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Cuda(e.to_string())
}

/// The model's stand-in: the shared GEMM loop (feature `gemm`).
#[cfg(feature = "gemm")]
pub(super) type Gemm = kvbm_testkit::gemm::Gemm;
/// Without feature `gemm` there is no GEMM to run beside the copies.
#[cfg(not(feature = "gemm"))]
pub(super) enum Gemm {}

/// The opened GPU, and the GEMM when busy rows were asked for.
pub(super) struct GpuSide {
    dev: CudaDevice,
    threads: usize,
    path: Option<CopyPath>,
    timeline: bool,
    gemm: std::result::Result<Gemm, String>,
}

impl GpuSide {
    pub(super) fn new(dev: CudaDevice, cfg: &OffloadConfig) -> Result<GpuSide> {
        let busy = cfg.loads.contains(&super::Load::Busy);
        #[cfg(feature = "gemm")]
        let gemm = match busy {
            false => Err("no busy rows asked for".to_string()),
            true => Gemm::new(dev.ordinal()).ok_or_else(|| "no GEMM (cuBLAS missing?)".into()),
        };
        #[cfg(not(feature = "gemm"))]
        let gemm = Err(if busy {
            "built without feature gemm (no GEMM to run beside)"
        } else {
            "no busy rows asked for"
        }
        .to_string());
        Ok(GpuSide {
            dev,
            threads: cfg.memcpy_threads,
            path: match cfg.gpu_path {
                GpuPath::Auto => None,
                GpuPath::Staged => Some(CopyPath::Staged),
                GpuPath::CopyEngine => Some(CopyPath::CopyEngine),
                GpuPath::Kernel => Some(CopyPath::Kernel),
            },
            timeline: cfg.timeline,
            gemm,
        })
    }

    pub(super) fn memory(&self) -> String {
        format!(
            "G1 GPU memory of {} (engine layout, layer-separate K/V), G2 pinned host memory (fully contiguous), CUDA executor",
            self.dev.name()
        )
    }

    pub(super) fn gemm(&self) -> std::result::Result<&Gemm, String> {
        self.gemm.as_ref().map_err(Clone::clone)
    }

    pub(super) fn executor(&self) -> Result<(Executor, Arc<CudaBackend>)> {
        let copier = CopierConfig {
            timeline: self.timeline,
            ..CopierConfig::for_device(&self.dev)
        };
        gpu::executor_with_backend(&self.dev, self.threads, self.path, copier)
    }

    /// G1 on the device, filled with every block's pattern, and G2 pinned.
    pub(super) fn shape(
        &self,
        g1: Layout,
        g2: Layout,
        hash: impl Fn(usize) -> u64,
    ) -> Result<(PhysicalLayout, PhysicalLayout)> {
        let tier = gpu::DeviceTier::allocate(&self.dev, g1)?;
        tier.fill_all(hash)?;
        Ok((tier.physical().clone(), gpu::pinned_layout(&self.dev, g2)?))
    }

    /// One large copy each way between pinned memory and a device buffer,
    /// on the copy engines: (host → device, device → host).
    pub(super) fn references(&self, cfg: &OffloadConfig) -> Result<(Reference, Reference)> {
        let bytes = cfg.reference_bytes.max(1 << 20) as usize;
        if bytes as u64 > cfg.max_host_bytes {
            return Err(BenchError::Config(
                "the reference copy needs more host memory than --max-host-gib".into(),
            ));
        }
        let copier =
            CudaCopier::new(&self.dev, CopierConfig::for_device(&self.dev)).map_err(cuda_err)?;
        let pinned = Arc::new(
            PinnedMemory::allocate(&self.dev, bytes, PinnedOptions::for_device(&self.dev))
                .map_err(cuda_err)?,
        );
        let pattern: Vec<u8> = (0..1usize << 20).map(|i| (i * 7 + 1) as u8).collect();
        for at in (0..bytes).step_by(pattern.len()) {
            let n = pattern.len().min(bytes - at);
            pinned.write(at, &pattern[..n]).map_err(cuda_err)?;
        }
        let device: Arc<dyn CudaRegion> =
            Arc::new(DeviceBuffer::new(&self.dev, bytes).map_err(cuda_err)?);
        let host: Arc<dyn CudaRegion> = pinned;
        let one = [CopyRun {
            src_region: 0,
            src_offset: 0,
            dst_region: 0,
            dst_offset: 0,
            len: bytes as u64,
        }];
        let options = CopyOptions {
            path: Some(CopyPath::CopyEngine),
            ..CopyOptions::default()
        };
        let time = |src: &Arc<dyn CudaRegion>, dst: &Arc<dyn CudaRegion>| -> Result<Spread> {
            let mut samples = Vec::new();
            for rep in 0..=cfg.reps {
                let t = Instant::now();
                copier
                    .copy(
                        &one,
                        std::slice::from_ref(src),
                        std::slice::from_ref(dst),
                        options,
                    )
                    .map_err(cuda_err)?
                    .wait()
                    .map_err(cuda_err)?;
                if rep > 0 {
                    samples.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
                }
            }
            Ok(Spread::of(&samples))
        };
        let h2d = time(&host, &device)?;
        let d2h = time(&device, &host)?;
        Ok((
            Reference {
                what: "one pinned -> device copy (copy engine)".into(),
                bytes: bytes as u64,
                gbps: h2d,
            },
            Reference {
                what: "one device -> pinned copy (copy engine)".into(),
                bytes: bytes as u64,
                gbps: d2h,
            },
        ))
    }
}

/// The load the backend was last told, as the report names it.
pub(super) fn load_name(backend: &CudaBackend) -> String {
    match backend.gpu_load() {
        GpuLoad::Busy => "busy",
        GpuLoad::Idle => "idle",
    }
    .into()
}

#[cfg(feature = "gemm")]
pub(super) use with_gemm::{beside_gemm, warm_up};

/// Without the GEMM there are no busy rows to run (the type is empty).
#[cfg(not(feature = "gemm"))]
pub(super) fn warm_up(gemm: &Gemm) {
    match *gemm {}
}

/// Without the GEMM there are no busy rows to run (the type is empty).
#[cfg(not(feature = "gemm"))]
pub(super) fn beside_gemm(
    gemm: &Gemm,
    _backend: &CudaBackend,
    _window: std::time::Duration,
    _timed: impl FnOnce() -> Result<Rep>,
) -> Result<Rep> {
    match *gemm {}
}

#[cfg(feature = "gemm")]
mod with_gemm {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use kvbm_transfer::cuda::{CudaBackend, GpuLoad};

    use super::super::super::error::{BenchError, Result};
    use super::super::Rep;
    use super::{Gemm, load_name};

    /// A few GEMMs, so cuBLAS has picked its kernel before a busy row.
    pub(in super::super) fn warm_up(gemm: &Gemm) {
        gemm.run(5);
    }

    /// Runs `timed` while the GEMM loops on its own stream and the backend
    /// is told the GPU is busy. The GEMM's TFLOP/s inside the timed window
    /// go into the rep, and its TFLOP/s alone: the mean over a window of
    /// `window` just before the offload starts and one just after it ends,
    /// in the same loop. Measured so, alone and during see the same clocks
    /// (a separate, longer alone run read 4–8% *below* the rate during
    /// the offloads on the H200: its clocks had settled lower).
    pub(in super::super) fn beside_gemm(
        gemm: &Gemm,
        backend: &CudaBackend,
        window: Duration,
        timed: impl FnOnce() -> Result<Rep>,
    ) -> Result<Rep> {
        backend.set_gpu_load(GpuLoad::Busy);
        let stop = AtomicBool::new(false);
        let started = AtomicBool::new(false);
        let (log, rep, load, before, after) = std::thread::scope(|s| {
            let h = s.spawn(|| gemm.run_until(&stop, &started));
            while !started.load(Ordering::Relaxed) && !h.is_finished() {
                std::thread::sleep(Duration::from_millis(1));
            }
            // A few products in, so the windows see the loop's steady state.
            std::thread::sleep(Duration::from_millis(20));
            let a0 = Instant::now();
            std::thread::sleep(window);
            let before = (a0, Instant::now());
            let rep = timed();
            let b0 = Instant::now();
            std::thread::sleep(window);
            let after = (b0, Instant::now());
            let load = load_name(backend);
            stop.store(true, Ordering::Relaxed);
            (h.join(), rep, load, before, after)
        });
        backend.set_gpu_load(GpuLoad::Idle);
        let mut rep = rep?;
        let log = log
            .map_err(|_| BenchError::Cuda("the GEMM thread panicked".into()))?
            .map_err(BenchError::Cuda)?;
        rep.gemm_tflops = log.tflops_between(rep.window.0, rep.window.1);
        let alone: Vec<f64> = [before, after]
            .into_iter()
            .filter_map(|(a, b)| log.tflops_between(a, b))
            .collect();
        if !alone.is_empty() {
            rep.gemm_alone_tflops = Some(alone.iter().sum::<f64>() / alone.len() as f64);
        }
        rep.backend_load = Some(load);
        Ok(rep)
    }
}
