//! Host-memory tiers whose bytes the benchmark can write and read: the
//! one place the bench touches raw memory, so the rest stays safe code.
//!
//! A [`HostTier`] is a physical layout in system memory that also keeps
//! the buffers behind its regions, so the benchmark can fill blocks with
//! their pattern before a transfer and check them after one.

use std::sync::Arc;

use kvbm_layout::Layout;
use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::memory::{SystemAllocator, SystemBuffer};

use super::error::Result;
use super::pattern::{check_chunk, fill_chunk};

/// A layout in system memory with access to its bytes.
#[derive(Debug, Clone)]
pub struct HostTier {
    physical: PhysicalLayout,
    buffers: Vec<Arc<SystemBuffer>>,
}

/// Where a block's bytes first differed from its pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    /// Layer of the chunk.
    pub layer: usize,
    /// Plane of the chunk.
    pub outer: usize,
    /// Byte offset inside the chunk.
    pub offset: usize,
}

impl HostTier {
    /// Allocates (and pre-faults) system memory for every region of
    /// `layout`.
    pub fn allocate(layout: Layout) -> Result<Self> {
        let alloc = SystemAllocator::new().populate(true);
        let buffers = (0..layout.num_regions())
            .map(|r| Ok(alloc.allocate(layout.region_size(r)?)?))
            .collect::<Result<Vec<_>>>()?;
        let regions = buffers.iter().map(SystemBuffer::region).collect();
        Ok(HostTier {
            physical: PhysicalLayout::new(layout, regions)?,
            buffers,
        })
    }

    /// The physical layout, for transfers.
    pub fn physical(&self) -> &PhysicalLayout {
        &self.physical
    }

    fn for_each_chunk(
        &self,
        block: usize,
        mut f: impl FnMut(usize, usize, &Arc<SystemBuffer>, usize, usize) -> Option<Mismatch>,
    ) -> Result<Option<Mismatch>> {
        let cfg = self.physical.layout().config();
        for layer in 0..cfg.num_layers() {
            for outer in 0..cfg.outer_dim() {
                let c = self.physical.layout().chunk(block, layer, outer)?;
                // Layout chunks lie inside their region, and every region
                // was allocated at the layout's region size.
                let (start, len) = (c.offset as usize, c.len as usize);
                if let Some(m) = f(layer, outer, &self.buffers[c.region], start, len) {
                    return Ok(Some(m));
                }
            }
        }
        Ok(None)
    }

    /// Writes block `block`'s pattern for sequence hash `hash`.
    ///
    /// # Safety
    /// No transfer may be reading or writing this tier's memory while the
    /// call runs (wait for every transfer that touches it first).
    pub unsafe fn fill(&self, block: usize, hash: u64) -> Result<()> {
        self.for_each_chunk(block, |layer, outer, buf, start, len| {
            // SAFETY: the caller guarantees no transfer touches this memory
            // now, and this is the only slice of the buffer alive.
            let bytes = unsafe { buf.as_mut_slice() };
            fill_chunk(&mut bytes[start..start + len], hash, layer, outer);
            None
        })?;
        Ok(())
    }

    /// Checks block `block` against the pattern of `hash`.
    ///
    /// # Safety
    /// No transfer may be writing this tier's memory while the call runs.
    pub unsafe fn check(&self, block: usize, hash: u64) -> Result<Option<Mismatch>> {
        self.for_each_chunk(block, |layer, outer, buf, start, len| {
            // SAFETY: the caller guarantees no transfer writes this memory
            // now.
            let bytes = unsafe { buf.as_slice() };
            check_chunk(&bytes[start..start + len], hash, layer, outer).map(|offset| Mismatch {
                layer,
                outer,
                offset,
            })
        })
    }
}
