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

    /// The chunks of `block` as `(layer, outer, address, length)`.
    fn chunks(&self, block: usize) -> Result<Vec<(usize, usize, u64, usize)>> {
        let layout = self.physical.layout();
        let cfg = layout.config();
        let mut out = Vec::with_capacity(cfg.chunks_per_block());
        for layer in 0..cfg.num_layers() {
            for outer in 0..cfg.outer_dim() {
                let c = layout.chunk(block, layer, outer)?;
                // Every region is one of our buffers: an address region.
                let base = self.buffers[c.region].addr();
                out.push((layer, outer, base + c.offset, c.len as usize));
            }
        }
        Ok(out)
    }

    /// Writes block `block`'s pattern for sequence hash `hash`.
    ///
    /// # Safety
    /// No transfer may be reading or writing this block while the call
    /// runs, and no other thread may access it.
    pub unsafe fn fill(&self, block: usize, hash: u64) -> Result<()> {
        for (layer, outer, addr, len) in self.chunks(block)? {
            // SAFETY: the chunk lies inside its region (the layout proves
            // it) and the region's buffer is alive (we hold it); the caller
            // guarantees nothing else touches this block now.
            let bytes = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            fill_chunk(bytes, hash, layer, outer);
        }
        Ok(())
    }

    /// Checks block `block` against the pattern of `hash`.
    ///
    /// # Safety
    /// No transfer may be writing this block while the call runs.
    pub unsafe fn check(&self, block: usize, hash: u64) -> Result<Option<Mismatch>> {
        for (layer, outer, addr, len) in self.chunks(block)? {
            // SAFETY: as in `fill`; the caller guarantees no writer.
            let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
            if let Some(offset) = check_chunk(bytes, hash, layer, outer) {
                return Ok(Some(Mismatch {
                    layer,
                    outer,
                    offset,
                }));
            }
        }
        Ok(None)
    }
}
