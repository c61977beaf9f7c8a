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
    /// Reads and writes the bytes (every region is one of `buffers`).
    view: HostLayoutView,
    /// Keeps the memory behind the view's regions.
    _buffers: Vec<Arc<SystemBuffer>>,
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
            view: HostLayoutView::new(PhysicalLayout::new(layout, regions)?)?,
            _buffers: buffers,
        })
    }

    /// The physical layout, for transfers.
    pub fn physical(&self) -> &PhysicalLayout {
        &self.view.physical
    }

    /// Writes block `block`'s pattern for sequence hash `hash`.
    ///
    /// # Safety
    /// No transfer may be reading or writing this block while the call
    /// runs, and no other thread may access it.
    pub unsafe fn fill(&self, block: usize, hash: u64) -> Result<()> {
        for (layer, outer, addr, len) in self.view.chunks(block)? {
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
        // SAFETY: the caller guarantees no writer; the view's regions are
        // our buffers, alive as long as `self`.
        unsafe { self.view.check(block, hash) }
    }
}

/// A physical layout in host memory someone else owns (pinned G2 next to
/// a GPU, or a [`HostTier`]), seen through its regions' addresses, so the
/// benchmark can clear and check blocks wherever the host bytes came from.
#[derive(Debug, Clone)]
pub struct HostLayoutView {
    physical: PhysicalLayout,
}

impl HostLayoutView {
    /// A view of `physical`; an error when a region is not host memory.
    pub fn new(physical: PhysicalLayout) -> Result<Self> {
        if let Some(r) = physical
            .regions()
            .iter()
            .find(|r| !r.kind().is_host() || r.addr().is_none())
        {
            return Err(super::error::BenchError::Config(format!(
                "a {:?} region is not host memory the bench can read",
                r.kind()
            )));
        }
        Ok(HostLayoutView { physical })
    }

    /// The chunks of `block` as `(layer, outer, address, length)`.
    fn chunks(&self, block: usize) -> Result<Vec<(usize, usize, u64, usize)>> {
        let layout = self.physical.layout();
        let cfg = layout.config();
        let regions = self.physical.regions();
        let mut out = Vec::with_capacity(cfg.chunks_per_block());
        for layer in 0..cfg.num_layers() {
            for outer in 0..cfg.outer_dim() {
                let c = layout.chunk(block, layer, outer)?;
                // `new` checked that every region has a host address.
                let base = regions[c.region].addr().unwrap_or(0);
                out.push((layer, outer, base + c.offset, c.len as usize));
            }
        }
        Ok(out)
    }

    /// Checks block `block` against the pattern of `hash`.
    ///
    /// # Safety
    /// No transfer may be writing this block while the call runs.
    pub unsafe fn check(&self, block: usize, hash: u64) -> Result<Option<Mismatch>> {
        for (layer, outer, addr, len) in self.chunks(block)? {
            // SAFETY: the chunk lies inside its region (the layout proves
            // it), the region is live host memory (the physical layout
            // holds its owner), and the caller guarantees no writer.
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

    /// Zeroes every region, on up to `threads` threads, so that a block a
    /// later transfer fails to write cannot pass as written.
    ///
    /// # Safety
    /// No transfer may touch the layout while the call runs, and no other
    /// thread may access its memory.
    pub unsafe fn zero(&self, threads: usize) {
        const PIECE: u64 = 64 << 20;
        let mut pieces = Vec::new();
        for r in self.physical.regions().iter() {
            let base = r.addr().unwrap_or(0);
            let mut at = 0;
            while at < r.len() {
                let len = PIECE.min(r.len() - at);
                pieces.push((base + at, len as usize));
                at += len;
            }
        }
        let threads = threads.clamp(1, pieces.len().max(1));
        std::thread::scope(|s| {
            for part in pieces.chunks(pieces.len().div_ceil(threads).max(1)) {
                s.spawn(move || {
                    for &(addr, len) in part {
                        // SAFETY: each piece lies inside a live host region
                        // (checked in `new`), pieces do not overlap, and the
                        // caller guarantees nothing else touches them.
                        unsafe { std::ptr::write_bytes(addr as *mut u8, 0, len) };
                    }
                });
            }
        });
    }
}
