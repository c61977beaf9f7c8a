//! The layouts a [`PagedWorker`](super::PagedWorker) copies between: the
//! engine's page tensors per group (G1), the one slot region and each
//! group's view of it (G2), and the slot file behind it (G3).

use std::path::Path;

use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind, LayoutStrides};
use kvbm_transfer::memory::{DiskAllocator, DiskOptions, MemoryRegion, Owner, SystemAllocator};
use kvbm_transfer::{MemoryKind, PhysicalLayout};

use super::{KeptFound, PageGroup, PageMemory, PagedKeep, invalid};
use crate::error::Result;
use crate::kept::{KeptStore, Medium, Recovery};

/// A group's pages as a G1 layout: one region per layer, block-first, one
/// chunk of `page_bytes` per block.
///
/// # Safety
/// As [`PagedWorker::new`](super::PagedWorker::new).
pub(super) unsafe fn group_g1(
    group: &PageGroup,
    num_blocks: usize,
    memory: PageMemory,
    owner: &Owner,
) -> Result<PhysicalLayout> {
    if group.layers.is_empty() || group.page_bytes == 0 {
        return Err(invalid(
            "a KV cache group without layers or with empty pages",
        ));
    }
    if group.block_stride < group.page_bytes {
        return Err(invalid(format!(
            "block stride {} is below the page size {}",
            group.block_stride, group.page_bytes
        )));
    }
    if group.layers.contains(&0) {
        return Err(invalid("a page tensor at address 0"));
    }
    let page = usize::try_from(group.page_bytes).map_err(|_| invalid("page too large"))?;
    let config = LayoutConfig::new(num_blocks, group.layers.len(), 1, 1, page, 1)?;
    let strides = LayoutStrides {
        block: group.block_stride,
        layer: 0,
        outer: group.page_bytes,
    };
    let layout = Layout::with_strides(
        config,
        LayoutKind::LayerSeparate(BlockOrder::BlockFirst),
        strides,
    )?;
    let span = layout.region_size(0)?;
    let kind = match memory {
        PageMemory::Host => MemoryKind::System,
        PageMemory::Device(ordinal) => device_kind(ordinal)?,
    };
    let regions = group
        .layers
        .iter()
        // SAFETY: the caller guarantees `num_blocks` blocks of
        // `block_stride` bytes of `memory` from each address, alive while
        // `owner` is.
        .map(|&addr| unsafe { MemoryRegion::from_raw(addr, span, kind, Some(owner.clone())) })
        .collect();
    Ok(PhysicalLayout::new(layout, regions)?)
}

#[cfg(feature = "cuda")]
fn device_kind(ordinal: u32) -> Result<MemoryKind> {
    Ok(MemoryKind::Device(ordinal))
}

#[cfg(not(feature = "cuda"))]
fn device_kind(_ordinal: u32) -> Result<MemoryKind> {
    Err(invalid("device pages need kvbm built with feature `cuda`"))
}

/// `slots` whole slots of `stride` bytes, one chunk each.
pub(super) fn whole_slots(slots: usize, stride: u64) -> Result<Layout> {
    let config = LayoutConfig::new(slots, 1, 1, 1, stride as usize, 1)?;
    Ok(Layout::new(config, LayoutKind::FullyContiguous)?)
}

/// The slot region: `slots` slots of `stride` bytes of pinned memory near
/// a GPU, or of system memory beside host pages; one chunk per slot.
pub(super) fn slot_region(memory: PageMemory, slots: usize, stride: u64) -> Result<PhysicalLayout> {
    let layout = whole_slots(slots, stride)?;
    match memory {
        PageMemory::Host => Ok(PhysicalLayout::allocate_system(
            layout,
            &SystemAllocator::new(),
        )?),
        PageMemory::Device(_ordinal) => {
            #[cfg(feature = "cuda")]
            {
                let device = kvbm_transfer::cuda::CudaDevice::open(_ordinal as usize)
                    .map_err(kvbm_transfer::cuda::backend::to_transfer_error)?;
                Ok(PhysicalLayout::allocate_pinned(layout, &device)?)
            }
            #[cfg(not(feature = "cuda"))]
            Err(invalid("device pages need kvbm built with feature `cuda`"))
        }
    }
}

/// A kept G2's slot region, opened.
pub(super) struct KeptRegion {
    /// The slots' records.
    pub(super) store: KeptStore,
    /// The slots.
    pub(super) region: PhysicalLayout,
    /// What the records name, for the books.
    pub(super) found: KeptFound,
    /// The checksum of each slot's recorded block.
    pub(super) sums: Vec<Option<u64>>,
}

/// What a kept store's records name in its first `slots` slots: the
/// report for the books, and each slot's checksum.
pub(super) fn recovered(
    store: &KeptStore,
    recovery: Recovery,
    slots: usize,
) -> (KeptFound, Vec<Option<u64>>) {
    let mut sums = vec![None; slots];
    let mut blocks = Vec::with_capacity(recovery.blocks.len());
    for r in &recovery.blocks {
        if let Some(sum) = sums.get_mut(r.slot as usize) {
            *sum = Some(r.sum);
            blocks.push((r.slot, r.label.hash));
        }
    }
    let found = KeptFound {
        dir: store.dir().to_path_buf(),
        blocks,
        rejected: recovery.rejected,
        started_fresh: recovery.started_fresh,
    };
    (found, sums)
}

/// The slot region of a kept G2: `all` slots of `stride` bytes in a
/// [`KeptStore`] in `keep.dir`, mapped (and pinned in place beside a GPU),
/// with what its records name in the first `slots` (the zero and staging
/// slots after them hold no block).
pub(super) fn kept_slot_region(
    keep: &PagedKeep,
    memory: PageMemory,
    slots: usize,
    all: usize,
    stride: u64,
) -> Result<KeptRegion> {
    let kind = match memory {
        PageMemory::Host => MemoryKind::System,
        PageMemory::Device(ordinal) => device_kind(ordinal)?,
    };
    let pin = crate::worker::g2_pin(kind)?;
    let medium = Medium::Memory {
        pin: pin.as_deref(),
    };
    let (store, region, recovery) = KeptStore::open_free(
        &keep.dir,
        &keep.identity,
        whole_slots(all, stride)?,
        &medium,
    )?;
    let (found, sums) = recovered(&store, recovery, slots);
    Ok(KeptRegion {
        store,
        region,
        found,
        sums,
    })
}

/// The slot file: `slots` slots of `stride` bytes (a multiple of the disk
/// alignment) in a file of its own under `dir`, removed when dropped.
pub(super) fn slot_file(dir: &Path, slots: usize, stride: u64) -> Result<PhysicalLayout> {
    let alloc = DiskAllocator::new(dir, DiskOptions::default())?;
    Ok(PhysicalLayout::allocate_disk(
        whole_slots(slots, stride)?,
        &alloc,
    )?)
}

/// A group's view of the slot region: `[slot][layer][page]`, slot stride
/// `stride`.
pub(super) fn group_g2(
    group: &PageGroup,
    region: &PhysicalLayout,
    stride: u64,
) -> Result<PhysicalLayout> {
    let slots = region.layout().config().num_blocks();
    let config = LayoutConfig::new(
        slots,
        group.layers.len(),
        1,
        1,
        group.page_bytes as usize,
        1,
    )?;
    let strides = LayoutStrides {
        block: stride,
        layer: group.page_bytes,
        outer: group.page_bytes,
    };
    let layout = Layout::with_strides(config, LayoutKind::FullyContiguous, strides)?;
    Ok(PhysicalLayout::new(layout, region.regions().to_vec())?)
}

/// Writes zeros over slot `slot` of `region` (host-addressable memory:
/// system or pinned).
pub(super) fn zero_slot(region: &PhysicalLayout, slot: usize, stride: u64) -> Result<()> {
    let slots = region.layout().config().num_blocks();
    if slot >= slots {
        return Err(invalid(format!("slot {slot} beyond {slots}")));
    }
    let r = &region.regions()[0];
    let addr = r
        .addr()
        .ok_or_else(|| invalid("a slot region without an address"))?;
    // SAFETY: the region holds `slots` slots of `stride` bytes (its
    // layout), host-addressable memory it owns, and `slot` is one of
    // them; no job copies it now (the caller's word).
    unsafe {
        std::ptr::write_bytes((addr + slot as u64 * stride) as *mut u8, 0, stride as usize);
    }
    Ok(())
}
