//! The CUDA rows of the transfer matrix (feature `cuda`): G1 device memory
//! ↔ G2 pinned host memory through kvbm-transfer's CUDA copier.
//!
//! The device side is engine-shaped (one region per layer); the host side
//! is kvbm's fully contiguous layout. The reference is one large copy of
//! the same bytes on the copy engines, between one device buffer and the
//! same pinned memory, measured in the same run.

use std::sync::Arc;
use std::time::Instant;

use kvbm_layout::{Layout, LayoutKind, RunOrder, plan_copy_ordered};
use kvbm_transfer::cuda::{
    Completion, CopierConfig, CopyOptions, CopyPath, CopyRun as CudaRun, CudaCopier, CudaDevice,
    CudaRegion, DeviceBuffer, Direction, PinnedMemory, PinnedOptions, Probe, probe,
};

use super::error::{BenchError, Result};
use super::pattern::{check_chunk, fill_chunk};

/// An opened GPU and its copier.
pub struct Gpu {
    device: CudaDevice,
    copier: CudaCopier,
}

fn cuda_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Cuda(e.to_string())
}

/// Opens device 0, or says why there is none.
pub fn open() -> std::result::Result<Gpu, String> {
    match probe() {
        Probe::Devices(_) => {}
        Probe::NoDriver => return Err("no CUDA device (libcuda not found)".into()),
        Probe::NoDevice => return Err("no CUDA device".into()),
    }
    let device = CudaDevice::open(0).map_err(|e| format!("no CUDA device ({e})"))?;
    let copier = CudaCopier::new(&device, CopierConfig::for_device(&device))
        .map_err(|e| format!("CUDA copier failed to start ({e})"))?;
    Ok(Gpu { device, copier })
}

/// One side of a copy: its layout, the regions the copier sees, and a
/// way to write and read each region's bytes.
struct Side {
    layout: Layout,
    regions: Vec<Arc<dyn CudaRegion>>,
    device: Vec<Arc<DeviceBuffer>>,
    pinned: Option<Arc<PinnedMemory>>,
}

impl Side {
    fn allocate(gpu: &Gpu, layout: Layout, on_device: bool) -> Result<Side> {
        let mut side = Side {
            layout,
            regions: Vec::new(),
            device: Vec::new(),
            pinned: None,
        };
        for r in 0..side.layout.num_regions() {
            let len = side.layout.region_size(r)? as usize;
            if on_device {
                let b = Arc::new(DeviceBuffer::new(&gpu.device, len).map_err(cuda_err)?);
                side.regions.push(b.clone());
                side.device.push(b);
            } else {
                let p = Arc::new(
                    PinnedMemory::allocate(
                        &gpu.device,
                        len,
                        PinnedOptions::for_device(&gpu.device),
                    )
                    .map_err(cuda_err)?,
                );
                side.regions.push(p.clone());
                side.pinned = Some(p);
            }
        }
        Ok(side)
    }

    fn write(&self, region: usize, data: &[u8]) -> Result<()> {
        match &self.pinned {
            Some(p) => p.write(0, data),
            None => self.device[region].write(0, data),
        }
        .map_err(cuda_err)
    }

    fn read(&self, region: usize, out: &mut [u8]) -> Result<()> {
        match &self.pinned {
            Some(p) => p.read(0, out),
            None => self.device[region].read(0, out),
        }
        .map_err(cuda_err)
    }

    /// Fills every block `b` with the pattern of hash `b`.
    fn fill_all(&self) -> Result<()> {
        let cfg = *self.layout.config();
        for r in 0..self.layout.num_regions() {
            let mut buf = vec![0u8; self.layout.region_size(r)? as usize];
            for b in 0..cfg.num_blocks() {
                for layer in 0..cfg.num_layers() {
                    for outer in 0..cfg.outer_dim() {
                        let c = self.layout.chunk(b, layer, outer)?;
                        if c.region == r {
                            let at = c.offset as usize;
                            fill_chunk(&mut buf[at..at + c.len as usize], b as u64, layer, outer);
                        }
                    }
                }
            }
            self.write(r, &buf)?;
        }
        Ok(())
    }

    /// Checks that block `d` holds the pattern of `s` for every `(s, d)`.
    fn check(&self, pairs: &[(usize, usize)], path: &str) -> Result<()> {
        let cfg = *self.layout.config();
        let mut regions = Vec::new();
        for r in 0..self.layout.num_regions() {
            let mut buf = vec![0u8; self.layout.region_size(r)? as usize];
            self.read(r, &mut buf)?;
            regions.push(buf);
        }
        for &(s, d) in pairs {
            for layer in 0..cfg.num_layers() {
                for outer in 0..cfg.outer_dim() {
                    let c = self.layout.chunk(d, layer, outer)?;
                    let at = c.offset as usize;
                    let bytes = &regions[c.region][at..at + c.len as usize];
                    if let Some(offset) = check_chunk(bytes, s as u64, layer, outer) {
                        return Err(BenchError::Corrupt {
                            block: s as u64,
                            path: path.to_string(),
                            layer,
                            outer,
                            offset,
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

/// What one CUDA cell measured.
pub struct CudaMeasurement {
    /// Bytes per repetition (copy planner's count).
    pub bytes: u64,
    /// kvbm GB/s per repetition.
    pub samples: Vec<f64>,
    /// Reference GB/s per repetition.
    pub refs: Vec<f64>,
    /// The path the copier chose for one batch.
    pub path: CopyPath,
}

/// Measures `reps` repetitions of moving `pairs` from `src_kind` on the
/// device (`to_device` false) or host, in transfers of `per_batch`.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    gpu: &Gpu,
    cfg: kvbm_layout::LayoutConfig,
    src_kind: LayoutKind,
    dst_kind: LayoutKind,
    to_device: bool,
    pairs: &[(usize, usize)],
    per_batch: usize,
    reps: usize,
    name: &str,
) -> Result<CudaMeasurement> {
    let src = Side::allocate(gpu, Layout::new(cfg, src_kind)?, !to_device)?;
    let dst = Side::allocate(gpu, Layout::new(cfg, dst_kind)?, to_device)?;
    src.fill_all()?;
    let (plans, bytes) = batch_plans(&src, &dst, pairs, per_batch, to_device)?;
    let dir = if to_device {
        Direction::HostToDevice
    } else {
        Direction::DeviceToHost
    };
    let first = plans.first().map(Vec::as_slice).unwrap_or(&[]);
    let path = gpu
        .copier
        .choose(dir, first.len(), first.iter().map(|r| r.len).sum());
    let reference = Reference::new(gpu, &src, &dst, bytes, to_device)?;
    let mut samples = Vec::with_capacity(reps);
    let mut refs = Vec::with_capacity(reps);
    for rep in 0..reps.max(1) {
        let t0 = Instant::now();
        copy_batches(gpu, &plans, &src, &dst)?;
        samples.push(bytes as f64 / t0.elapsed().as_secs_f64() / 1e9);
        if rep == 0 {
            dst.check(pairs, name)?;
        }
        let t0 = Instant::now();
        reference.copy(gpu)?;
        refs.push(bytes as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    Ok(CudaMeasurement {
        bytes,
        samples,
        refs,
        path,
    })
}

/// The copier's runs for each transfer of `per_batch` of `pairs`, and the
/// bytes of them all.
fn batch_plans(
    src: &Side,
    dst: &Side,
    pairs: &[(usize, usize)],
    per_batch: usize,
    to_device: bool,
) -> Result<(Vec<Vec<CudaRun>>, u64)> {
    let mut plans = Vec::new();
    let mut bytes = 0;
    // Runs in host order for an onboard, as kvbm-transfer's executor plans.
    let order = if to_device {
        RunOrder::Source
    } else {
        RunOrder::Destination
    };
    for chunk in pairs.chunks(per_batch) {
        let plan = plan_copy_ordered(&src.layout, &dst.layout, chunk, order)?;
        bytes += plan.total_bytes();
        let runs: Vec<CudaRun> = plan
            .runs()
            .iter()
            .map(|r| CudaRun {
                src_region: r.src_region,
                src_offset: r.src_offset,
                dst_region: r.dst_region,
                dst_offset: r.dst_offset,
                len: r.len,
            })
            .collect();
        plans.push(runs);
    }
    Ok((plans, bytes))
}

/// Starts every transfer of `plans`, waits for all of them, then reports
/// the first failure.
fn copy_batches(gpu: &Gpu, plans: &[Vec<CudaRun>], src: &Side, dst: &Side) -> Result<()> {
    let mut pending: Vec<Completion> = Vec::with_capacity(plans.len());
    for runs in plans {
        pending.push(
            gpu.copier
                .copy(runs, &src.regions, &dst.regions, CopyOptions::default())
                .map_err(cuda_err)?,
        );
    }
    let results: Vec<_> = pending.into_iter().map(Completion::wait).collect();
    results
        .into_iter()
        .collect::<std::result::Result<(), _>>()
        .map_err(cuda_err)
}

/// The reference: one copy of a cell's bytes on the copy engines, between
/// its host side and a flat device buffer.
struct Reference {
    one: [CudaRun; 1],
    src: [Arc<dyn CudaRegion>; 1],
    dst: [Arc<dyn CudaRegion>; 1],
}

impl Reference {
    /// The reference for `bytes` of the host side of `src` → `dst`.
    fn new(gpu: &Gpu, src: &Side, dst: &Side, bytes: u64, to_device: bool) -> Result<Reference> {
        let flat = Arc::new(DeviceBuffer::new(&gpu.device, bytes as usize).map_err(cuda_err)?);
        let host: Arc<dyn CudaRegion> = if to_device {
            src.regions[0].clone()
        } else {
            dst.regions[0].clone()
        };
        let flat: Arc<dyn CudaRegion> = flat;
        let one = [CudaRun {
            src_region: 0,
            src_offset: 0,
            dst_region: 0,
            dst_offset: 0,
            len: bytes,
        }];
        let (src, dst) = if to_device {
            ([host], [flat])
        } else {
            ([flat], [host])
        };
        Ok(Reference { one, src, dst })
    }

    /// Runs the copy and waits for it.
    fn copy(&self, gpu: &Gpu) -> Result<()> {
        gpu.copier
            .copy(
                &self.one,
                &self.src,
                &self.dst,
                CopyOptions {
                    path: Some(CopyPath::CopyEngine),
                    ..CopyOptions::default()
                },
            )
            .map_err(cuda_err)?
            .wait()
            .map_err(cuda_err)
    }
}
