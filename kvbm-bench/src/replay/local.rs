//! The replay's engine in this process: G1 on the GPU (feature `cuda`)
//! or a host stand-in, G2 beside it, G3 a disk file.

use kvbm_layout::{Layout, LayoutKind};
use std::sync::Arc;

use kvbm_pool::tier::{LocalMover, TierEngine, TierLayouts};
use kvbm_transfer::memory::{DiskAllocator, DiskOptions};
use kvbm_transfer::{Executor, ExecutorSpec, PhysicalLayout};

use super::engine::G1Memory;
#[cfg(feature = "cuda")]
use super::gpu;
use super::{ReplayConfig, TierKnobs, failures};
use crate::error::{BenchError, Result};
use crate::host_view::HostTier;

/// Host tiers: G1 a host-memory stand-in, G2 system memory, a CPU
/// executor.
fn host_tiers(
    cfg: &ReplayConfig,
    g1_layout: Layout,
    g2_layout: Option<Layout>,
) -> Result<(G1Memory, Option<PhysicalLayout>, Executor, String)> {
    let g2 = match g2_layout {
        Some(l) => Some(HostTier::allocate(l)?.physical().clone()),
        None => None,
    };
    let exec = if cfg.g3_faults.any() {
        failures::faulty_executor(cfg.memcpy_threads, cfg.g3_faults)?
    } else {
        ExecutorSpec::host()
            .memcpy_threads(cfg.memcpy_threads)
            .disk(true)
            .build()?
    };
    Ok((
        G1Memory::Host(HostTier::allocate(g1_layout)?),
        g2,
        exec,
        if cfg!(feature = "cuda") && !cfg.host_g1 {
            "host-memory stand-in (engine layout, layer-separate K/V): no CUDA device found"
        } else {
            "host-memory stand-in (engine layout, layer-separate K/V)"
        }
        .to_string(),
    ))
}

/// The engine in this process: G1 on the GPU (feature `cuda`, unless
/// `host_g1`) or a host stand-in, G2 next to it, G3 on disk.
pub(crate) fn local_engine(
    cfg: &ReplayConfig,
    knobs: TierKnobs,
    g1_layout: Layout,
    g2_layout: Option<Layout>,
    caps: [usize; 3],
    page: usize,
) -> Result<(TierEngine, G1Memory, String, bool)> {
    #[cfg(feature = "cuda")]
    let gpu = if cfg.host_g1 || cfg.g3_faults.any() {
        None
    } else {
        gpu::device()
    };
    #[cfg(feature = "cuda")]
    let (g1, g2, exec, g1_memory) = match &gpu {
        Some(dev) => (
            G1Memory::Device(gpu::DeviceTier::allocate(dev, g1_layout)?),
            g2_layout.map(|l| gpu::pinned_layout(dev, l)).transpose()?,
            gpu::executor(dev, cfg.memcpy_threads)?,
            format!(
                "GPU memory of {} (engine layout, layer-separate K/V); G2 pinned host memory",
                dev.name()
            ),
        ),
        None => host_tiers(cfg, g1_layout, g2_layout)?,
    };
    #[cfg(not(feature = "cuda"))]
    let (g1, g2, exec, g1_memory) = host_tiers(cfg, g1_layout, g2_layout)?;
    let g3 = match caps[2] {
        0 => None,
        n => {
            let alloc = DiskAllocator::new(&cfg.disk_dir, DiskOptions::default())?;
            Some(PhysicalLayout::allocate_disk(
                Layout::new(
                    cfg.model.layout_config(n, page)?,
                    LayoutKind::FullyContiguous,
                )?,
                &alloc,
            )?)
        }
    };
    let g3_direct = g3.as_ref().is_some_and(|l| {
        l.regions()[0]
            .file_location()
            .is_some_and(|(f, _)| f.is_direct())
    });
    let g1_physical = g1
        .physical()
        .ok_or_else(|| BenchError::Tier("G1 is not in this process".into()))?
        .clone();
    let layouts = TierLayouts {
        g1: g1_physical,
        g2,
        g3,
    };
    let mover = LocalMover::new(layouts, exec).map_err(|e| BenchError::Tier(e.to_string()))?;
    let engine = knobs.build(Arc::new(mover))?;
    Ok((engine, g1, g1_memory, g3_direct))
}
