//! A worker's three tiers: G1 from the engine, G2 and G3 sized by the
//! leader.
//!
//! G2 and G3 use the fully contiguous layout (a block is one extent: one
//! request per block to disk, one run per block in host memory) with G1's
//! block shape; G3's blocks are padded to the disk alignment.

use std::path::Path;

use kvbm_layout::{Layout, LayoutKind};
use kvbm_pool::Tier;
use kvbm_transfer::memory::{DISK_ALIGNMENT, DiskAllocator, DiskOptions, IoMode, SystemAllocator};
use kvbm_transfer::{Executor, PhysicalLayout};

use crate::error::{DistError, Result};
use crate::proto::{Configure, TierBounds};
use crate::verify::{Checksums, End};

/// Whether every chunk of G1 starts and ends on the disk alignment (device
/// memory always counts as aligned: it reaches disk through a bounce
/// buffer). Blocks share their strides, so blocks 0 and 1 speak for all.
fn disk_aligned(g1: &PhysicalLayout) -> bool {
    if !g1.kind().is_host() {
        return true;
    }
    let layout = g1.layout();
    let c = *layout.config();
    let aligned = |v: u64| v.is_multiple_of(DISK_ALIGNMENT);
    let bases_aligned = g1.regions().iter().all(|r| r.addr().is_some_and(aligned));
    bases_aligned
        && (0..c.num_blocks().min(2)).all(|block| {
            (0..c.num_layers()).all(|layer| {
                (0..c.outer_dim()).all(|outer| {
                    layout
                        .chunk(block, layer, outer)
                        .is_ok_and(|ch| aligned(ch.offset) && aligned(ch.len))
                })
            })
        })
}

/// G1, and G2 / G3 once configured, with their checksums in verify mode.
#[derive(Clone)]
pub(crate) struct Tiers {
    g1: PhysicalLayout,
    g2: Option<PhysicalLayout>,
    g3: Option<PhysicalLayout>,
    /// Verify mode: the sums of G2's and G3's blocks, shared by every
    /// route that copies on these tiers (the worker's and a lent one).
    checksums: Option<std::sync::Arc<Checksums>>,
}

impl Tiers {
    pub(crate) fn new(g1: PhysicalLayout) -> Self {
        Tiers {
            g1,
            g2: None,
            g3: None,
            checksums: None,
        }
    }

    /// Allocates G2 and G3 as `c` says, replacing earlier ones.
    pub(crate) fn configure(
        &mut self,
        c: &Configure,
        g3_dir: Option<&Path>,
        executor: &Executor,
        g2_allocator: Option<&(dyn Fn(Layout) -> Result<PhysicalLayout> + Send)>,
    ) -> Result<()> {
        let shape = *self.g1.layout().config();
        let blocks = |n: u64| {
            usize::try_from(n).map_err(|_| DistError::InvalidConfig(format!("{n} blocks")))
        };
        let g2 = match c.g2_blocks {
            0 => None,
            n => {
                let layout = Layout::new(
                    shape.with_num_blocks(blocks(n)?)?,
                    LayoutKind::FullyContiguous,
                )?;
                let l = match g2_allocator {
                    Some(alloc) => alloc(layout)?,
                    None => default_g2(self.g1.kind(), layout)?,
                };
                executor.register(&l)?;
                Some(l)
            }
        };
        let g3 = match (c.g3_blocks, g3_dir) {
            (0, _) => None,
            (_, None) => {
                return Err(DistError::InvalidConfig(
                    "G3 requested but this worker has no disk directory".into(),
                ));
            }
            (n, Some(dir)) => {
                let config = shape
                    .with_num_blocks(blocks(n)?)?
                    .with_alignment(DISK_ALIGNMENT)?;
                let layout = Layout::new(config, LayoutKind::FullyContiguous)?;
                // Blocks go between G3 and G1 directly. `O_DIRECT` needs
                // every host address aligned, which an engine's host
                // tensors (a CPU engine's KV cache) need not be: then G3 is
                // read and written through the page cache.
                let options = DiskOptions {
                    io_mode: if disk_aligned(&self.g1) {
                        IoMode::Auto
                    } else {
                        tracing::info!("G1 is not disk-aligned host memory: G3 uses buffered I/O");
                        IoMode::Buffered
                    },
                    ..DiskOptions::default()
                };
                let alloc = DiskAllocator::new(dir, options)?;
                Some(PhysicalLayout::allocate_disk(layout, &alloc)?)
            }
        };
        self.g2 = g2;
        self.g3 = g3;
        // New tiers hold nothing yet: no sums carry over.
        self.checksums = c
            .verify
            .then(|| std::sync::Arc::new(Checksums::new(&self.g1)));
        Ok(())
    }

    /// The checksums of G2 and G3, in verify mode.
    pub(crate) fn checksums(&self) -> Option<&std::sync::Arc<Checksums>> {
        self.checksums.as_ref()
    }

    /// The end of a copy on `tier`, when the tier is present.
    pub(crate) fn end(&self, tier: Tier) -> Option<End> {
        Some(End {
            tier,
            layout: self.layout(tier)?.clone(),
        })
    }

    pub(crate) fn g1(&self) -> &PhysicalLayout {
        &self.g1
    }

    pub(crate) fn bounds(&self) -> TierBounds {
        let n = |l: &Option<PhysicalLayout>| {
            l.as_ref()
                .map_or(0, |l| l.layout().config().num_blocks() as u64)
        };
        TierBounds {
            g1: self.g1.layout().config().num_blocks() as u64,
            g2: n(&self.g2),
            g3: n(&self.g3),
        }
    }

    pub(crate) fn layout(&self, tier: Tier) -> Option<&PhysicalLayout> {
        match tier {
            Tier::G1 => Some(&self.g1),
            Tier::G2 => self.g2.as_ref(),
            Tier::G3 => self.g3.as_ref(),
            Tier::G4 => None,
        }
    }
}

/// G2 when the engine process gave no allocator: pinned memory near G1's
/// GPU, system memory beside a host G1.
fn default_g2(g1: kvbm_transfer::MemoryKind, layout: Layout) -> Result<PhysicalLayout> {
    #[cfg(feature = "cuda")]
    if let kvbm_transfer::MemoryKind::Device(ordinal) = g1 {
        let device = kvbm_transfer::cuda::CudaDevice::open(ordinal as usize)
            .map_err(kvbm_transfer::cuda::backend::to_transfer_error)?;
        return Ok(PhysicalLayout::allocate_pinned(layout, &device)?);
    }
    let _ = g1;
    Ok(PhysicalLayout::allocate_system(
        layout,
        &SystemAllocator::new(),
    )?)
}
