//! A worker's three tiers: G1 from the engine, G2 and G3 sized by the
//! leader.
//!
//! G2 and G3 use the fully contiguous layout (a block is one extent: one
//! request per block to disk, one run per block in host memory) with G1's
//! block shape; G3's blocks are padded to the disk alignment.

use std::path::Path;

use kvbm_layout::{Layout, LayoutKind};
use kvbm_pool::Tier;
use kvbm_transfer::memory::{DISK_ALIGNMENT, DiskAllocator, DiskOptions, SystemAllocator};
use kvbm_transfer::{Executor, PhysicalLayout};

use crate::error::{DistError, Result};
use crate::proto::{Configure, TierBounds};

pub(crate) struct Tiers {
    g1: PhysicalLayout,
    g2: Option<PhysicalLayout>,
    g3: Option<PhysicalLayout>,
}

impl Tiers {
    pub(crate) fn new(g1: PhysicalLayout) -> Self {
        Tiers {
            g1,
            g2: None,
            g3: None,
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
                let alloc = DiskAllocator::new(dir, DiskOptions::default())?;
                Some(PhysicalLayout::allocate_disk(layout, &alloc)?)
            }
        };
        self.g2 = g2;
        self.g3 = g3;
        Ok(())
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
