//! Host memory shared with the engine process through a file mapping.
//!
//! G1 belongs to the engine. On a GPU it is the engine's device memory; on
//! a CPU machine (tests, benches) an engine process stands in with a file
//! both processes map shared: the engine writes KV into it and reads what
//! kvbm onboarded, the worker moves blocks in and out of it. Regions are
//! laid out back to back in the file, region `r` at `r × region size`.

use std::fs::OpenOptions;
use std::path::Path;
use std::sync::Arc;

use kvbm_layout::Layout;
use kvbm_transfer::{MemoryKind, MemoryRegion, PhysicalLayout};
use memmap2::MmapMut;

use crate::error::{DistError, Result};

/// A shared, writable mapping of a whole file.
pub struct SharedMapping {
    map: MmapMut,
}

impl SharedMapping {
    /// Maps `path` (which must exist and hold at least `len` bytes).
    pub fn open(path: &Path, len: u64) -> Result<SharedMapping> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| DistError::Io {
                what: "open shared G1 file",
                source,
            })?;
        let have = file
            .metadata()
            .map_err(|source| DistError::Io {
                what: "stat shared G1 file",
                source,
            })?
            .len();
        if have < len {
            return Err(DistError::InvalidConfig(format!(
                "shared G1 file {} holds {have} bytes, the layout needs {len}",
                path.display()
            )));
        }
        let len = usize::try_from(len)
            .map_err(|_| DistError::InvalidConfig(format!("{len} bytes cannot be mapped")))?;
        // SAFETY: the mapping is shared with the engine process by design;
        // the engine does not touch blocks while a transfer moves them (the
        // same contract as device memory an engine hands to kvbm), and the
        // file is not truncated while mapped (both sides only write bytes).
        let map =
            unsafe { memmap2::MmapOptions::new().len(len).map_mut(&file) }.map_err(|source| {
                DistError::Io {
                    what: "map shared G1 file",
                    source,
                }
            })?;
        Ok(SharedMapping { map })
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The mapped bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// Builds the physical layout `layout` over the mapping, region `r` at
    /// `r × region size`.
    pub fn physical_layout(self: &Arc<Self>, layout: Layout) -> Result<PhysicalLayout> {
        let size = layout.uniform_region_size();
        let need = size
            .checked_mul(layout.num_regions() as u64)
            .filter(|&n| n <= self.map.len() as u64)
            .ok_or_else(|| {
                DistError::InvalidConfig(format!(
                    "layout needs {} regions of {size} bytes, the mapping holds {}",
                    layout.num_regions(),
                    self.map.len()
                ))
            })?;
        let base = self.map.as_ptr() as u64;
        let owner: kvbm_transfer::memory::Owner = self.clone();
        let regions = (0..layout.num_regions() as u64)
            .map(|r| {
                // SAFETY: `[base + r·size, +size)` lies inside the mapping
                // (checked above: `num_regions · size <= len`), which the
                // owner keeps alive as long as the region; host memory.
                unsafe {
                    MemoryRegion::from_raw(
                        base + r * size,
                        size,
                        MemoryKind::System,
                        Some(owner.clone()),
                    )
                }
            })
            .collect();
        debug_assert!(need <= self.map.len() as u64);
        Ok(PhysicalLayout::new(layout, regions)?)
    }
}

/// Creates (or resizes) the file an engine shares as G1 for `layout`.
pub fn create_shared_file(path: &Path, layout: &Layout) -> Result<()> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|source| DistError::Io {
            what: "create shared G1 file",
            source,
        })?;
    file.set_len(layout.total_bytes())
        .map_err(|source| DistError::Io {
            what: "size shared G1 file",
            source,
        })
}
