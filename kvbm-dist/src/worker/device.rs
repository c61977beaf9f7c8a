//! A worker's own G1 on its GPU (feature `cuda`): device memory for the
//! engine-shaped layout and (feature `probe`) a probe that writes and
//! checks test patterns through host copies. The worker pins G2 and assembles its executor from
//! this G1 as for any device G1 ([`super::executor_spec`]).
//!
//! This is what `kvbm-dist-node worker` runs on when no engine process
//! shares its G1 (benches): the worker stands in for the engine's
//! allocation on GPU `rank`.

use std::sync::Arc;

use kvbm_layout::Layout;
use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::cuda::{CudaDevice, DeviceBuffer, Probe, probe};

#[cfg(feature = "probe")]
use super::probe::{BlockProbe, pattern_byte, rank_seed};
use crate::error::{DistError, Result};

fn cuda_err(what: &str, e: impl std::fmt::Display) -> DistError {
    DistError::InvalidConfig(format!("CUDA {what}: {e}"))
}

/// Device `ordinal`, when it exists.
pub fn device_at(ordinal: usize) -> Option<CudaDevice> {
    match probe() {
        Probe::Devices(n) if ordinal < n => CudaDevice::open(ordinal).ok(),
        _ => None,
    }
}

/// G1 in device memory, one buffer per layout region.
pub struct DeviceG1 {
    physical: PhysicalLayout,
    /// The buffers behind the regions (which keep them alive), for the
    /// probe.
    #[cfg(feature = "probe")]
    buffers: Vec<Arc<DeviceBuffer>>,
}

impl DeviceG1 {
    /// Allocates device memory for every region of `layout`.
    pub fn allocate(device: &CudaDevice, layout: Layout) -> Result<Self> {
        let buffers = (0..layout.num_regions())
            .map(|r| {
                let len = layout.region_size(r)? as usize;
                DeviceBuffer::new(device, len)
                    .map(Arc::new)
                    .map_err(|e| cuda_err("G1 allocation", e))
            })
            .collect::<Result<Vec<_>>>()?;
        let regions = buffers.iter().map(DeviceBuffer::region).collect();
        Ok(DeviceG1 {
            physical: PhysicalLayout::new(layout, regions)?,
            #[cfg(feature = "probe")]
            buffers,
        })
    }

    /// The physical layout, for the worker.
    pub fn physical(&self) -> &PhysicalLayout {
        &self.physical
    }

    /// A probe over this G1's buffers (feature `probe`).
    #[cfg(feature = "probe")]
    pub fn probe(&self) -> DeviceProbe {
        DeviceProbe {
            buffers: self.buffers.clone(),
        }
    }
}

/// A [`BlockProbe`] for G1 in device memory: the host probe's pattern,
/// written and read back one chunk at a time through host copies (feature
/// `probe`).
#[cfg(feature = "probe")]
pub struct DeviceProbe {
    buffers: Vec<Arc<DeviceBuffer>>,
}

#[cfg(feature = "probe")]
impl DeviceProbe {
    /// Calls `f(chunk's device buffer, offset in it, length, index of its
    /// first byte)` for every chunk of `block`, in layer, K/V order.
    fn for_each_chunk(
        &self,
        g1: &PhysicalLayout,
        block: usize,
        mut f: impl FnMut(&DeviceBuffer, usize, usize, u64) -> std::result::Result<(), String>,
    ) -> std::result::Result<(), String> {
        crate::verify::for_each_chunk(g1, block, |chunk, start| {
            let buffer = self
                .buffers
                .get(chunk.region)
                .ok_or_else(|| format!("no device buffer for region {}", chunk.region))?;
            f(buffer, chunk.offset as usize, chunk.len as usize, start)
        })
    }
}

#[cfg(feature = "probe")]
impl BlockProbe for DeviceProbe {
    fn fill(
        &self,
        g1: &PhysicalLayout,
        block: usize,
        seed: u64,
        rank: u32,
    ) -> std::result::Result<(), String> {
        let seed = rank_seed(seed, rank);
        self.for_each_chunk(g1, block, |buffer, offset, len, start| {
            let bytes: Vec<u8> = (0..len as u64)
                .map(|j| pattern_byte(seed, start + j))
                .collect();
            buffer.write(offset, &bytes).map_err(|e| e.to_string())
        })
    }

    fn check(
        &self,
        g1: &PhysicalLayout,
        block: usize,
        seed: u64,
        rank: u32,
    ) -> std::result::Result<bool, String> {
        let seed = rank_seed(seed, rank);
        let mut ok = true;
        self.for_each_chunk(g1, block, |buffer, offset, len, start| {
            let mut bytes = vec![0u8; len];
            buffer.read(offset, &mut bytes).map_err(|e| e.to_string())?;
            ok &= bytes
                .iter()
                .enumerate()
                .all(|(j, &b)| b == pattern_byte(seed, start + j as u64));
            Ok(())
        })?;
        Ok(ok)
    }
}
