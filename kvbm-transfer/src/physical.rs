//! Physical layouts: a kvbm-layout [`Layout`] bound to the memory regions
//! that hold it.
//!
//! The layout says where every `(block, layer, K/V)` chunk sits relative to
//! its region; the physical layout adds where each region is. All regions of
//! one physical layout have the same [`MemoryKind`], so one strategy serves a
//! whole transfer.

use std::sync::Arc;

use kvbm_layout::Layout;

use crate::error::{Result, TransferError};
use crate::memory::{
    DISK_ALIGNMENT, DiskAllocator, DiskFile, MemoryKind, MemoryRegion, SystemAllocator,
};

/// A layout and its regions.
#[derive(Debug, Clone)]
pub struct PhysicalLayout {
    layout: Layout,
    regions: Arc<[MemoryRegion]>,
    kind: MemoryKind,
}

impl PhysicalLayout {
    /// Binds `layout` to `regions`: one region per layout region, each at
    /// least as long as the layout needs, all of one kind.
    pub fn new(layout: Layout, regions: Vec<MemoryRegion>) -> Result<Self> {
        if regions.len() != layout.num_regions() {
            return Err(TransferError::LayoutMismatch(format!(
                "layout has {} regions, {} given",
                layout.num_regions(),
                regions.len()
            )));
        }
        let kind = regions[0].kind();
        for (i, r) in regions.iter().enumerate() {
            let need = layout.region_size(i)?;
            if r.len() < need {
                return Err(TransferError::LayoutMismatch(format!(
                    "region {i} is {} bytes, the layout needs {need}",
                    r.len()
                )));
            }
            if r.kind() != kind {
                return Err(TransferError::LayoutMismatch(format!(
                    "region {i} is {:?}, region 0 is {kind:?}",
                    r.kind()
                )));
            }
        }
        Ok(PhysicalLayout {
            layout,
            regions: regions.into(),
            kind,
        })
    }

    /// Allocates system memory for every region of `layout`.
    pub fn allocate_system(layout: Layout, alloc: &SystemAllocator) -> Result<Self> {
        let regions = (0..layout.num_regions())
            .map(|r| Ok(alloc.allocate(layout.region_size(r)?)?.region()))
            .collect::<Result<Vec<_>>>()?;
        Self::new(layout, regions)
    }

    /// Allocates one disk file holding every region of `layout`, each region
    /// starting on a [`DISK_ALIGNMENT`] boundary.
    ///
    /// Disk blocks occupy aligned extents: the layout's chunk size and
    /// strides must be multiples of [`DISK_ALIGNMENT`] (pad blocks with
    /// `LayoutConfig::with_alignment` or explicit strides), otherwise this is
    /// a [`TransferError::Misaligned`] naming the alignment.
    pub fn allocate_disk(layout: Layout, alloc: &DiskAllocator) -> Result<Self> {
        let len = Self::disk_bytes(&layout, alloc.dir())?;
        let file = alloc.allocate(len)?;
        Self::on_disk_file(layout, file)
    }

    /// The bytes of the one disk file that holds every region of `layout`
    /// ([`PhysicalLayout::allocate_disk`]'s rules; `dir` names where the
    /// file goes in an error).
    pub fn disk_bytes(layout: &Layout, dir: &std::path::Path) -> Result<u64> {
        let strides = layout.strides();
        for (what, value) in [
            ("chunk size", layout.config().chunk_bytes()),
            ("block stride", strides.block),
            ("layer stride", strides.layer),
            ("outer stride", strides.outer),
        ] {
            if !value.is_multiple_of(DISK_ALIGNMENT) {
                return Err(TransferError::Misaligned {
                    alignment: DISK_ALIGNMENT,
                    what,
                    value,
                    path: dir.to_path_buf(),
                });
            }
        }
        let mut end = 0u64;
        for r in 0..layout.num_regions() {
            end += layout.region_size(r)?.div_ceil(DISK_ALIGNMENT) * DISK_ALIGNMENT;
        }
        Ok(end)
    }

    /// `layout` over `file` (of at least [`PhysicalLayout::disk_bytes`]),
    /// each region starting on a [`DISK_ALIGNMENT`] boundary, in order.
    pub fn on_disk_file(layout: Layout, file: Arc<DiskFile>) -> Result<Self> {
        let mut offsets = Vec::with_capacity(layout.num_regions());
        let mut end = 0u64;
        for r in 0..layout.num_regions() {
            offsets.push(end);
            end += layout.region_size(r)?.div_ceil(DISK_ALIGNMENT) * DISK_ALIGNMENT;
        }
        if end > file.len() {
            return Err(TransferError::InvalidRequest(format!(
                "{} holds {} bytes; the layout needs {end}",
                file.path().display(),
                file.len()
            )));
        }
        let regions = offsets
            .iter()
            .enumerate()
            .map(|(r, &off)| MemoryRegion::file(file.clone(), off, layout.region_size(r)?))
            .collect::<Result<Vec<_>>>()?;
        Self::new(layout, regions)
    }

    /// Allocates device memory on `device` for every region of `layout`
    /// (a G1 that kvbm owns, for tests and benchmarks; engines hand their
    /// own tensors through [`crate::memory::EngineKvCache`]).
    #[cfg(feature = "cuda")]
    pub fn allocate_device(layout: Layout, device: &crate::cuda::CudaDevice) -> Result<Self> {
        use crate::cuda::backend::to_transfer_error;
        let regions = (0..layout.num_regions())
            .map(|r| {
                let len = usize::try_from(layout.region_size(r)?).map_err(|_| {
                    TransferError::InvalidRequest(format!("region {r} does not fit in memory"))
                })?;
                let buffer =
                    crate::cuda::DeviceBuffer::new(device, len).map_err(to_transfer_error)?;
                Ok(Arc::new(buffer).region())
            })
            .collect::<Result<Vec<_>>>()?;
        Self::new(layout, regions)
    }

    /// Allocates pinned host memory near `device` for every region of
    /// `layout` (G2 beside a GPU G1: the GPU reads and writes it at the
    /// link's rate).
    #[cfg(feature = "cuda")]
    pub fn allocate_pinned(layout: Layout, device: &crate::cuda::CudaDevice) -> Result<Self> {
        use crate::cuda::backend::to_transfer_error;
        use crate::cuda::{PinnedMemory, PinnedOptions};
        let regions = (0..layout.num_regions())
            .map(|r| {
                let len = usize::try_from(layout.region_size(r)?).map_err(|_| {
                    TransferError::InvalidRequest(format!("region {r} does not fit in memory"))
                })?;
                let pinned = PinnedMemory::allocate(device, len, PinnedOptions::for_device(device))
                    .map_err(to_transfer_error)?;
                Ok(Arc::new(pinned).region())
            })
            .collect::<Result<Vec<_>>>()?;
        Self::new(layout, regions)
    }

    /// The logical layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The regions, indexed like the layout's regions.
    pub fn regions(&self) -> &Arc<[MemoryRegion]> {
        &self.regions
    }

    /// The memory kind of every region.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }
}
