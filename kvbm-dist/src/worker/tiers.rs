//! A worker's three tiers: G1 from the engine, G2 and G3 sized by the
//! leader.
//!
//! G2 and G3 use the fully contiguous layout (a block is one extent: one
//! request per block to disk, one run per block in host memory) with G1's
//! block shape; G3's blocks are padded to the disk alignment.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvbm_layout::{Layout, LayoutKind};
use kvbm_pool::Tier;
use kvbm_pool::rate_limit::{RateLimit, WARN_EVERY};
use kvbm_transfer::memory::{
    DISK_ALIGNMENT, DiskAllocator, DiskOptions, IoMode, MemoryRegion, SystemAllocator, SystemBuffer,
};
use kvbm_transfer::{
    CancelToken, Completion, Executor, PhysicalLayout, TransferError, TransferFailure,
    TransferOutcome,
};

use crate::error::{DistError, Result};
use crate::kept::{BlockLabel, KeptStore, Medium, Recovered};
use crate::proto::{Configure, TierBounds};
use crate::verify::{Checksums, End, Tracked, pieces};

/// Where a worker's G3 lives, and whether G2 and G3 are kept.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Places<'a> {
    /// G3's directory.
    pub(crate) g3_dir: Option<&'a Path>,
    /// The directory of a G2 kept across restarts (in a memory-backed
    /// file system).
    pub(crate) g2_keep_dir: Option<&'a Path>,
    /// Set: G3 (and G2 where it has a directory) is kept across restarts
    /// under this identity.
    pub(crate) identity: Option<&'a str>,
}

/// What a kept tier found when it was opened.
#[derive(Debug, Clone, Default)]
pub(crate) struct Found {
    /// The blocks it held.
    pub(crate) blocks: Arc<[Recovered]>,
    /// Records it left out.
    pub(crate) rejected: u64,
}

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

/// `n` blocks as a count, refused where it does not fit this machine.
fn block_count(n: u64) -> Result<usize> {
    usize::try_from(n).map_err(|_| DistError::InvalidConfig(format!("{n} blocks")))
}

/// A G2 or G3 as configuring opened it: its memory (none when sized 0),
/// its records where it is kept, and what those records held.
#[derive(Default)]
struct OpenedTier {
    /// The tier's memory.
    layout: Option<PhysicalLayout>,
    /// Its records, where it is kept across restarts.
    store: Option<Arc<KeptStore>>,
    /// What its records held when it was opened.
    found: Found,
}

/// G1, and G2 / G3 once configured, with their checksums in verify mode.
#[derive(Clone)]
pub(crate) struct Tiers {
    g1: PhysicalLayout,
    g2: Option<PhysicalLayout>,
    g3: Option<PhysicalLayout>,
    /// The sums of G2's and G3's blocks in verify mode, of G3's where G3
    /// is kept; shared by every route that copies on these tiers (the
    /// worker's and a lent one).
    checksums: Option<Arc<Checksums>>,
    /// G2's records, where G2 is kept across restarts.
    g2_store: Option<Arc<KeptStore>>,
    /// G3's records, where G3 is kept across restarts.
    g3_store: Option<Arc<KeptStore>>,
    /// What a kept G2 held when it was opened.
    g2_found: Found,
    /// What a kept G3 held when it was opened.
    g3_found: Found,
    /// How long opening G3 took (recovery included).
    g3_open: Duration,
    /// Set once a reset stopped the kept tiers ([`Tiers::stop_keeping`]):
    /// tiers opened again after it are stopped too.
    stopped: Arc<AtomicBool>,
}

impl Tiers {
    pub(crate) fn new(g1: PhysicalLayout) -> Self {
        Tiers {
            g1,
            g2: None,
            g3: None,
            checksums: None,
            g2_store: None,
            g3_store: None,
            g2_found: Found::default(),
            g3_found: Found::default(),
            g3_open: Duration::ZERO,
            stopped: Arc::default(),
        }
    }

    /// Allocates G2 and G3 as `c` says, replacing earlier ones.
    pub(crate) fn configure(
        &mut self,
        c: &Configure,
        places: Places<'_>,
        executor: &Executor,
        g2_allocator: Option<&(dyn Fn(Layout) -> Result<PhysicalLayout> + Send)>,
    ) -> Result<()> {
        // The old stores let go of their directories before they are
        // opened again.
        self.g2_store = None;
        self.g3_store = None;
        let g2 = match c.g2_blocks {
            0 => OpenedTier::default(),
            n => self.open_g2(n, places, executor, g2_allocator)?,
        };
        let g3_started = Instant::now();
        let g3 = match (c.g3_blocks, places.g3_dir) {
            (0, _) => OpenedTier::default(),
            (_, None) => {
                return Err(DistError::InvalidConfig(
                    "G3 requested but this worker has no disk directory".into(),
                ));
            }
            (n, Some(g3_dir)) => self.open_g3(n, g3_dir, places.identity)?,
        };
        self.g2 = g2.layout;
        self.g3 = g3.layout;
        // New tiers hold nothing yet, but what kept tiers found again: their
        // records carry the sums.
        let tracked = Tracked {
            g2: c.verify || g2.store.is_some(),
            g3: c.verify || g3.store.is_some(),
        };
        self.checksums = (tracked.g2 || tracked.g3).then(|| {
            let sums = Checksums::new(&self.g1, tracked);
            sums.seed(Tier::G2, g2.found.blocks.iter().map(|r| (r.slot, r.sum)));
            sums.seed(Tier::G3, g3.found.blocks.iter().map(|r| (r.slot, r.sum)));
            Arc::new(sums)
        });
        self.g2_store = g2.store;
        self.g3_store = g3.store;
        self.g2_found = g2.found;
        self.g3_found = g3.found;
        if self.stopped.load(Ordering::Acquire) {
            // Configured again after a reset: what the records held is not
            // kept either.
            self.stop_stores()?;
        }
        self.g3_open = if self.g3.is_some() {
            g3_started.elapsed()
        } else {
            Duration::ZERO
        };
        Ok(())
    }

    /// Opens a G2 of `n` blocks of G1's shape, registered with `executor`:
    /// kept in `places.g2_keep_dir` (what it held found again) when G2 is
    /// kept, else from `g2_allocator` or the default for G1's memory.
    fn open_g2(
        &self,
        n: u64,
        places: Places<'_>,
        executor: &Executor,
        g2_allocator: Option<&(dyn Fn(Layout) -> Result<PhysicalLayout> + Send)>,
    ) -> Result<OpenedTier> {
        let shape = *self.g1.layout().config();
        let layout = Layout::new(
            shape.with_num_blocks(block_count(n)?)?,
            LayoutKind::FullyContiguous,
        )?;
        let (l, store, found) = match (places.g2_keep_dir, places.identity) {
            (Some(dir), Some(identity)) => {
                let pin = g2_pin(self.g1.kind())?;
                let medium = Medium::Memory {
                    pin: pin.as_deref(),
                };
                let (store, l, recovery) = KeptStore::open_free(dir, identity, layout, &medium)?;
                let found = Found {
                    blocks: Arc::from(recovery.blocks),
                    rejected: recovery.rejected,
                };
                (l, Some(Arc::new(store)), found)
            }
            (Some(_), None) => {
                return Err(DistError::InvalidConfig(
                    "a kept G2 needs the identity of what it holds".into(),
                ));
            }
            (None, _) => {
                let l = match g2_allocator {
                    Some(alloc) => alloc(layout)?,
                    None => default_g2(self.g1.kind(), layout)?,
                };
                (l, None, Found::default())
            }
        };
        executor.register(&l)?;
        Ok(OpenedTier {
            layout: Some(l),
            store,
            found,
        })
    }

    /// Opens a G3 of `n` blocks of G1's shape, padded to the disk
    /// alignment, in `g3_dir`: kept under `identity` (what it held found
    /// again) when there is one, else a plain disk file.
    fn open_g3(&self, n: u64, g3_dir: &Path, identity: Option<&str>) -> Result<OpenedTier> {
        let shape = *self.g1.layout().config();
        let config = shape
            .with_num_blocks(block_count(n)?)?
            .with_alignment(DISK_ALIGNMENT)?;
        let layout = Layout::new(config, LayoutKind::FullyContiguous)?;
        // Blocks go between G3 and G1 directly. `O_DIRECT` needs every host
        // address aligned, which an engine's host tensors (a CPU engine's
        // KV cache) need not be: then G3 is read and written through the
        // page cache.
        let io_mode = if disk_aligned(&self.g1) {
            IoMode::Auto
        } else {
            tracing::info!("G1 is not disk-aligned host memory: G3 uses buffered I/O");
            IoMode::Buffered
        };
        Ok(match identity {
            Some(identity) => {
                let (store, g3, recovery) =
                    KeptStore::open_free(g3_dir, identity, layout, &Medium::Disk(io_mode))?;
                OpenedTier {
                    layout: Some(g3),
                    store: Some(Arc::new(store)),
                    found: Found {
                        blocks: Arc::from(recovery.blocks),
                        rejected: recovery.rejected,
                    },
                }
            }
            None => {
                let options = DiskOptions {
                    io_mode,
                    ..DiskOptions::default()
                };
                let alloc = DiskAllocator::new(g3_dir, options)?;
                OpenedTier {
                    layout: Some(PhysicalLayout::allocate_disk(layout, &alloc)?),
                    store: None,
                    found: Found::default(),
                }
            }
        })
    }

    /// From now on the kept tiers record nothing, and their records are
    /// emptied now: the engine's cache was reset, and what it computes
    /// after a reset may come from other weights than those a restarted
    /// engine loads (vLLM resets the cache around an in-place weight
    /// update), so a restarted worker finds none of the blocks. The tiers
    /// go on serving this engine. A no-op where no tier is kept.
    pub(crate) fn stop_keeping(&self) -> Result<()> {
        self.stopped.store(true, Ordering::Release);
        self.stop_stores()
    }

    /// Stops the kept tiers' stores: a copy that landed before wrote its
    /// records (emptied here), one that lands after records nothing (see
    /// [`KeptStore::stop`]).
    fn stop_stores(&self) -> Result<()> {
        for (tier, store) in [(Tier::G2, &self.g2_store), (Tier::G3, &self.g3_store)] {
            if let Some(store) = store {
                store.stop().map_err(|e| {
                    DistError::InvalidConfig(format!("emptying the {tier:?} records: {e}"))
                })?;
            }
        }
        Ok(())
    }

    /// What a kept G2 found when it was opened (nothing where G2 is not
    /// kept).
    pub(crate) fn g2_found(&self) -> &Found {
        &self.g2_found
    }

    /// What a kept G3 found when it was opened.
    pub(crate) fn g3_found(&self) -> &Found {
        &self.g3_found
    }

    /// How long opening G3 took at the last configure (a kept one's
    /// recovery included; zero without G3).
    pub(crate) fn g3_open(&self) -> Duration {
        self.g3_open
    }

    /// Copies `pairs` from `src` to `dst` on `executor`, checks them where
    /// checksums are kept, and records in a kept G2 or G3 the blocks
    /// `labels` names (one per pair, or none) once they landed. Calls `done` with
    /// the settled outcome and the number of checksum mismatches.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy(
        &self,
        executor: &Executor,
        src: Tier,
        dst: Tier,
        pairs: Vec<(usize, usize)>,
        labels: Vec<BlockLabel>,
        cancel: CancelToken,
        done: impl FnOnce(TransferOutcome, u32) + Send + 'static,
    ) {
        let (Some(s), Some(d)) = (self.end(src), self.end(dst)) else {
            return done(failed(format!("{src:?} -> {dst:?}: tier absent"), pairs), 0);
        };
        let store = self.kept(dst).cloned();
        if let Err(e) = self.forget_targets(dst, &pairs) {
            return done(failed(format!("{dst:?} records: {e}"), pairs), 0);
        }
        if let Some(sums) = self.checksums.as_ref().filter(|c| c.checks(src, dst)) {
            let per_piece = pieces::piece_blocks(&s, &d, pieces::PIECE_BYTES);
            // Pieces settle without records: a copy to be recorded in a
            // kept tier lands whole first.
            let recorded = store.is_some() && !labels.is_empty();
            if pairs.len() > per_piece && !recorded {
                // Reads checked once landed: hashing overlaps the reading.
                return pieces::copy_in_pieces(
                    sums, executor, s, d, pairs, per_piece, cancel, done,
                );
            }
        }
        let completion: Completion<TransferOutcome> = executor
            .transfer_with(&s.layout, &d.layout, &pairs, cancel)
            .into_completion();
        let Some(sums) = self.checksums.clone() else {
            return completion.on_complete(move |outcome| done(outcome, 0));
        };
        let settled = pairs.clone();
        let keep = store.filter(|_| labels.len() == pairs.len());
        let table = Arc::clone(&sums);
        sums.settle_later(s, d, settled, completion, move |outcome, mismatches| {
            if let Some(store) = keep {
                commit(&store, dst, &table, &pairs, &labels, &outcome);
            }
            done(outcome, mismatches);
        });
    }

    /// The store that keeps `tier` across restarts, where it is kept.
    fn kept(&self, tier: Tier) -> Option<&Arc<KeptStore>> {
        match tier {
            Tier::G2 => self.g2_store.as_ref(),
            Tier::G3 => self.g3_store.as_ref(),
            _ => None,
        }
    }

    /// Empties the kept records of the slots `pairs` write in `dst` (a
    /// no-op where `dst` is not kept): a slot about to be written names
    /// nothing until it landed and, where the copy is recorded, was
    /// committed again.
    pub(crate) fn forget_targets(
        &self,
        dst: Tier,
        pairs: &[(usize, usize)],
    ) -> std::io::Result<()> {
        let Some(store) = self.kept(dst) else {
            return Ok(());
        };
        let slots: Vec<u32> = pairs.iter().map(|p| p.1 as u32).collect();
        store.forget(&slots)
    }

    /// The checksums of G2 and G3, in verify mode.
    #[cfg(feature = "nixl")]
    pub(crate) fn checksums(&self) -> Option<&Arc<Checksums>> {
        self.checksums.as_ref()
    }

    /// The end of a copy on `tier`, when the tier is present.
    pub(crate) fn end(&self, tier: Tier) -> Option<End> {
        Some(End {
            tier,
            layout: self.layout(tier)?.clone(),
        })
    }

    /// G1, for the probe.
    #[cfg(feature = "probe")]
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

/// How a kept G2 is pinned: in place for G1's GPU (feature `cuda`), not at
/// all beside a host G1.
#[allow(clippy::type_complexity)]
pub(crate) fn g2_pin(
    g1: kvbm_transfer::MemoryKind,
) -> Result<Option<Box<dyn Fn(Arc<SystemBuffer>) -> Result<MemoryRegion>>>> {
    #[cfg(feature = "cuda")]
    if let kvbm_transfer::MemoryKind::Device(ordinal) = g1 {
        use kvbm_transfer::cuda::backend::to_transfer_error;
        use kvbm_transfer::cuda::{CudaDevice, PinnedMemory, PinnedOptions};
        let device = CudaDevice::open(ordinal as usize).map_err(to_transfer_error)?;
        return Ok(Some(Box::new(move |buffer| {
            let pinned =
                PinnedMemory::register(&device, buffer, PinnedOptions::for_device(&device))
                    .map_err(to_transfer_error)?;
            Ok(Arc::new(pinned).region())
        })));
    }
    let _ = g1;
    Ok(None)
}

/// A copy of which nothing landed.
fn failed(message: String, pairs: Vec<(usize, usize)>) -> TransferOutcome {
    Err(Box::new(TransferFailure {
        error: TransferError::InvalidRequest(message),
        completed: Vec::new(),
        failed: pairs,
        culprit: None,
    }))
}

/// Records in `store` the labelled blocks of a copy into kept tier `tier`
/// that landed and passed their checks.
fn commit(
    store: &KeptStore,
    tier: Tier,
    sums: &Checksums,
    pairs: &[(usize, usize)],
    labels: &[BlockLabel],
    outcome: &TransferOutcome,
) {
    let landed: std::collections::HashSet<(usize, usize)> = match outcome {
        Ok(_) => pairs.iter().copied().collect(),
        Err(f) => f.completed.iter().copied().collect(),
    };
    let blocks: Vec<(u32, BlockLabel, u64)> = pairs
        .iter()
        .zip(labels)
        .filter(|(p, _)| landed.contains(p))
        .filter_map(|(&(_, d), &label)| {
            let slot = d as u32;
            sums.get(tier, slot).map(|sum| (slot, label, sum))
        })
        .collect();
    if let Err(e) = store.commit(&blocks) {
        static WARN: RateLimit = RateLimit::new(WARN_EVERY);
        if let Some(held_back) = WARN.check() {
            tracing::warn!(
                held_back,
                "{tier:?} records not written ({e}): those blocks will not outlive this engine"
            );
        }
    }
}
