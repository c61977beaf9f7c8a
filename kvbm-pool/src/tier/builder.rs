//! Building a tier engine: the one way to make one.
//!
//! [`TierEngine::builder`] takes the model's [`KvShape`] once and kvbm
//! allocates every tier from it: G1 as an engine lays it out
//! (layer-separate, K and V planes apart) or the engine's own tensors, G2
//! fully contiguous in host memory (pinned when G1 is on a GPU), G3 fully
//! contiguous in an `O_DIRECT` file with blocks padded to the disk's
//! alignment. The executor follows from the tiers (see
//! [`kvbm_transfer::ExecutorSpec`]). Memory that does not hold blocks of
//! the shape is a [`TierError::ShapeMismatch`].
//!
//! [`TierEngine::builder_with_mover`] builds over memory a [`TierMover`]
//! already owns instead: a distributed mover whose workers hold the tiers,
//! or a [`LocalMover`] over layouts the caller
//! allocated. Both builders take the same tuning knobs (policies, offload
//! mode and limits, retention hints; see [`TierEngineBuilder`]); every
//! knob's value is checked when the engine is built.

mod knobs;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvbm_layout::{BlockOrder, Layout, LayoutKind};
use kvbm_transfer::memory::{
    DISK_ALIGNMENT, DiskAllocator, DiskOptions, EngineKvCache, SystemAllocator,
};
use kvbm_transfer::{Executor, ExecutorSpec, MemoryKind, PhysicalLayout};

use super::config::{TierEngineConfig, default_g3_staging_blocks};
use super::mover::{LocalMover, TierMover};
use super::shape::KvShape;
use super::{TierEngine, TierError, TierLayouts, assemble};
use crate::config::Tier;

/// Where G1 comes from.
#[derive(Debug)]
enum G1Source {
    /// kvbm allocates host memory standing in for the GPU.
    Host(usize),
    /// The engine's memory, wrapped.
    Engine(PhysicalLayout),
    /// kvbm allocates device memory.
    #[cfg(feature = "cuda")]
    Device(kvbm_transfer::cuda::CudaDevice, usize),
}

/// Builds a [`TierEngine`]: the tiers, then the knobs, then
/// [`build`](Self::build). Made by [`TierEngine::builder`] (tiers kvbm
/// allocates, [`ShapeTiers`]) or [`TierEngine::builder_with_mover`] (a
/// mover's tiers, [`MoverTiers`]); the knobs are the same for both.
#[derive(Debug)]
pub struct TierEngineBuilder<T = ShapeTiers> {
    tiers: T,
    config: TierEngineConfig,
    /// G3 staging bytes asked for; `None`: the default.
    g3_staging_bytes: Option<u64>,
}

/// The tiers of a [`TierEngineBuilder`] made by [`TierEngine::builder`]:
/// kvbm allocates them for blocks of a KV shape, as the builder's
/// `g1_*`, [`g2_host_bytes`](TierEngineBuilder::g2_host_bytes) and
/// [`g3_disk`](TierEngineBuilder::g3_disk) say.
pub struct ShapeTiers {
    shape: KvShape,
    g1: Option<G1Source>,
    g2_bytes: Option<u64>,
    g3: Option<(PathBuf, u64)>,
    executor: Option<Executor>,
}

impl std::fmt::Debug for ShapeTiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShapeTiers")
            .field("shape", &self.shape)
            .field("g1", &self.g1)
            .field("g2_bytes", &self.g2_bytes)
            .field("g3", &self.g3)
            .field("own_executor", &self.executor.is_some())
            .finish()
    }
}

/// The tiers of a [`TierEngineBuilder`] made by
/// [`TierEngine::builder_with_mover`]: the memory a [`TierMover`] owns.
pub struct MoverTiers {
    mover: Arc<dyn TierMover>,
}

impl std::fmt::Debug for MoverTiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cap = |t| self.mover.capacity(t);
        f.debug_struct("MoverTiers")
            .field("g1", &cap(Tier::G1))
            .field("g2", &cap(Tier::G2))
            .field("g3", &cap(Tier::G3))
            .finish_non_exhaustive()
    }
}

impl TierEngine {
    /// Starts building an engine for blocks of `shape`, whose tiers kvbm
    /// allocates: give G1 (`g1_host`, `g1_device`, `g1_engine` or
    /// `g1_layout`), optionally G2 and G3, then the knobs.
    pub fn builder(shape: KvShape) -> TierEngineBuilder<ShapeTiers> {
        TierEngineBuilder {
            tiers: ShapeTiers {
                shape,
                g1: None,
                g2_bytes: None,
                g3: None,
                executor: None,
            },
            config: TierEngineConfig::new(shape.tokens_per_block()),
            g3_staging_bytes: None,
        }
    }

    /// Starts building an engine over the memory `mover` owns, for blocks
    /// of `block_tokens` tokens (the engine's block size; the tiers'
    /// capacities are the mover's). Without
    /// [`g3_staging_bytes`](TierEngineBuilder::g3_staging_bytes) the engine
    /// has no G3 staging area: kvbm cannot tell whether the mover's G2
    /// has room for one beyond its pool.
    pub fn builder_with_mover(
        mover: Arc<dyn TierMover>,
        block_tokens: usize,
    ) -> TierEngineBuilder<MoverTiers> {
        TierEngineBuilder {
            tiers: MoverTiers { mover },
            config: TierEngineConfig::new(block_tokens),
            g3_staging_bytes: None,
        }
    }
}

impl TierEngineBuilder<ShapeTiers> {
    /// G1 in host memory, `blocks` blocks laid out as an engine lays them
    /// out (for engines that run on the CPU, tests and benchmarks).
    pub fn g1_host(mut self, blocks: usize) -> Self {
        self.tiers.g1 = Some(G1Source::Host(blocks));
        self
    }

    /// G1 in `blocks` blocks of device memory that kvbm allocates, laid out
    /// as an engine lays them out.
    #[cfg(feature = "cuda")]
    pub fn g1_device(mut self, device: &kvbm_transfer::cuda::CudaDevice, blocks: usize) -> Self {
        self.tiers.g1 = Some(G1Source::Device(device.clone(), blocks));
        self
    }

    /// G1 is the engine's own KV tensors (host or device memory), as
    /// recognised by [`EngineKvCache`]. Their block shape must be the
    /// engine's KV shape.
    pub fn g1_engine(mut self, cache: EngineKvCache) -> Self {
        self.tiers.g1 = Some(G1Source::Engine(cache.into_physical()));
        self
    }

    /// G1 is memory the caller laid out and allocated itself.
    pub fn g1_layout(mut self, layout: PhysicalLayout) -> Self {
        self.tiers.g1 = Some(G1Source::Engine(layout));
        self
    }

    /// G2 in at most `bytes` of host memory (pinned when G1 is on a GPU),
    /// as many whole blocks as fit.
    pub fn g2_host_bytes(mut self, bytes: u64) -> Self {
        self.tiers.g2_bytes = Some(bytes);
        self
    }

    /// G3 in a file of at most `bytes` in `dir`, as many whole blocks (each
    /// padded to the disk's alignment) as fit. The file is removed when the
    /// engine is dropped, and locked while it lives; `build` first removes
    /// the kvbm files in `dir` that no process holds locked (left by a
    /// process that was killed), so `dir` should hold only scratch files.
    pub fn g3_disk(mut self, dir: impl Into<PathBuf>, bytes: u64) -> Self {
        self.tiers.g3 = Some((dir.into(), bytes));
        self
    }

    /// Moves the bytes with `executor` instead of one assembled from the
    /// tiers, for experts (it must serve every pair of the tiers' memory).
    pub fn executor(mut self, executor: Executor) -> Self {
        self.tiers.executor = Some(executor);
        self
    }

    /// Allocates the tiers, assembles the executor and starts the engine.
    pub fn build(self) -> Result<TierEngine, TierError> {
        self.config.validate().map_err(TierError::InvalidConfig)?;
        let ShapeTiers {
            shape,
            g1,
            g2_bytes,
            g3,
            executor,
        } = self.tiers;
        let mut config = self.config;
        config.g3_staging_blocks = match (g2_bytes, &g3) {
            (Some(g2), Some(_)) => match self.g3_staging_bytes {
                Some(bytes) => whole_blocks_in(bytes, shape.block_bytes()),
                None => default_g3_staging_blocks(g2, shape.block_bytes()),
            },
            _ => 0,
        };
        let g1 = g1_memory(&shape, g1)?;
        let device = g1_device(&g1)?;
        let g2 = match g2_bytes {
            None => None,
            Some(bytes) => Some(g2_memory(&shape, bytes, config.g3_staging_blocks, &device)?),
        };
        let g3 = match &g3 {
            None => None,
            Some((dir, bytes)) => Some(g3_memory(&shape, dir, *bytes)?),
        };
        let executor = match executor {
            Some(e) => e,
            None => default_executor(&device, g3.is_some())?,
        };
        for layout in [&g2].into_iter().flatten() {
            executor.register(layout)?;
        }
        let mover = LocalMover::new(TierLayouts { g1, g2, g3 }, executor)?;
        assemble::start(config, Arc::new(mover))
    }
}

impl TierEngineBuilder<MoverTiers> {
    /// Starts the engine over the mover's tiers. The G3 staging area, when
    /// asked for, is the staging bytes' worth of whole blocks at the end of
    /// the mover's G2 (none without a G2 and a G3).
    pub fn build(self) -> Result<TierEngine, TierError> {
        let mover = self.tiers.mover;
        let mut config = self.config;
        config.g3_staging_blocks = match (
            self.g3_staging_bytes,
            mover.capacity(Tier::G2),
            mover.capacity(Tier::G3),
        ) {
            (Some(bytes), Some(_), Some(_)) => whole_blocks_in(bytes, mover.block_bytes(Tier::G2)),
            _ => 0,
        };
        assemble::start(config, mover)
    }
}

/// The device G1 lives on, when it is device memory.
#[cfg(feature = "cuda")]
type G1Device = Option<kvbm_transfer::cuda::CudaDevice>;
/// Without CUDA, G1 is never device memory.
#[cfg(not(feature = "cuda"))]
#[derive(Clone, Copy)]
struct G1Device;

/// G1's memory: allocated for `shape`, or the engine's, checked against it.
fn g1_memory(shape: &KvShape, source: Option<G1Source>) -> Result<PhysicalLayout, TierError> {
    match source {
        None => Err(TierError::InvalidConfig(
            "no G1: call g1_host, g1_device or g1_engine".into(),
        )),
        Some(G1Source::Host(blocks)) => Ok(PhysicalLayout::allocate_system(
            engine_layout(shape, blocks)?,
            &host(),
        )?),
        #[cfg(feature = "cuda")]
        Some(G1Source::Device(device, blocks)) => Ok(PhysicalLayout::allocate_device(
            engine_layout(shape, blocks)?,
            &device,
        )?),
        Some(G1Source::Engine(layout)) => {
            shape.check("G1 (the engine's memory)", layout.layout().config())?;
            Ok(layout)
        }
    }
}

/// The device G1 is on (`None`: host memory).
#[cfg(feature = "cuda")]
fn g1_device(g1: &PhysicalLayout) -> Result<G1Device, TierError> {
    Ok(match g1.kind() {
        MemoryKind::Device(ordinal) => Some(
            kvbm_transfer::cuda::CudaDevice::open(ordinal as usize)
                .map_err(kvbm_transfer::cuda::backend::to_transfer_error)?,
        ),
        _ => None,
    })
}

/// Refuses device memory for G1 in a build without CUDA.
#[cfg(not(feature = "cuda"))]
fn g1_device(g1: &PhysicalLayout) -> Result<G1Device, TierError> {
    match g1.kind() {
        MemoryKind::Device(_) => Err(TierError::InvalidConfig(
            "G1 is device memory: build kvbm-pool with feature `cuda`".into(),
        )),
        _ => Ok(G1Device),
    }
}

/// G2: as many whole blocks as `bytes` hold, then `staging` blocks more;
/// pinned when G1 is on a device.
fn g2_memory(
    shape: &KvShape,
    bytes: u64,
    staging: usize,
    device: &G1Device,
) -> Result<PhysicalLayout, TierError> {
    let blocks = whole_blocks("G2", bytes, shape.block_bytes())?;
    let layout = Layout::new(
        shape.layout_config(blocks + staging)?,
        LayoutKind::FullyContiguous,
    )
    .map_err(layout_err)?;
    #[cfg(feature = "cuda")]
    if let Some(device) = device {
        return Ok(PhysicalLayout::allocate_pinned(layout, device)?);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    Ok(PhysicalLayout::allocate_system(layout, &host())?)
}

/// G3: a file in `dir` of as many whole disk-aligned blocks as `bytes`
/// hold, after removing the files killed processes left there.
fn g3_memory(shape: &KvShape, dir: &Path, bytes: u64) -> Result<PhysicalLayout, TierError> {
    let padded = shape.block_bytes().div_ceil(DISK_ALIGNMENT) * DISK_ALIGNMENT;
    let config = shape
        .layout_config(whole_blocks("G3", bytes, padded)?)?
        .with_alignment(DISK_ALIGNMENT)
        .map_err(layout_err)?;
    let layout = Layout::new(config, LayoutKind::FullyContiguous).map_err(layout_err)?;
    let disk = DiskAllocator::new(dir, DiskOptions::default())?;
    let stale = kvbm_transfer::memory::remove_stale_files(disk.dir())?;
    if !stale.is_empty() {
        tracing::warn!(
            dir = %disk.dir().display(),
            files = stale.len(),
            "removed G3 files left by killed processes (no process held their lock)"
        );
    }
    Ok(PhysicalLayout::allocate_disk(layout, &disk)?)
}

/// The executor the tiers need: host copies, the device's when G1 is on
/// one, and disk I/O with a G3.
fn default_executor(device: &G1Device, disk: bool) -> Result<Executor, TierError> {
    let spec = ExecutorSpec::host();
    #[cfg(feature = "cuda")]
    let spec = match device {
        Some(d) => ExecutorSpec::device(d.clone()),
        None => spec,
    };
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    Ok(spec.disk(disk).build()?)
}

fn host() -> SystemAllocator {
    SystemAllocator::new()
}

fn layout_err(e: kvbm_layout::LayoutError) -> TierError {
    TierError::InvalidConfig(e.to_string())
}

/// G1 as engines lay it out: one region per layer, K and V planes apart.
fn engine_layout(shape: &KvShape, blocks: usize) -> Result<Layout, TierError> {
    Layout::new(
        shape.layout_config(blocks)?,
        LayoutKind::LayerSeparate(BlockOrder::OuterFirst),
    )
    .map_err(layout_err)
}

/// Whole blocks of `block_bytes` in `bytes` (possibly none).
fn whole_blocks_in(bytes: u64, block_bytes: u64) -> usize {
    usize::try_from(bytes / block_bytes.max(1)).unwrap_or(usize::MAX)
}

/// Whole blocks of `block_bytes` in `bytes`; at least one.
fn whole_blocks(tier: &str, bytes: u64, block_bytes: u64) -> Result<usize, TierError> {
    let n = bytes / block_bytes.max(1);
    if n == 0 {
        return Err(TierError::InvalidConfig(format!(
            "{tier}: {bytes} bytes hold no block of {block_bytes} bytes"
        )));
    }
    usize::try_from(n).map_err(|_| TierError::InvalidConfig(format!("{tier}: {n} blocks")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tier;
    use crate::tier::TierPolicy;

    /// 4 KiB chunks: the disk's alignment.
    fn shape() -> KvShape {
        KvShape::mha(2, 1, 128)
    }

    #[test]
    fn tiers_follow_from_the_shape_and_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let block = shape().block_bytes();
        let engine = TierEngine::builder(shape())
            .g1_host(8)
            .g2_host_bytes(10 * block + 1)
            .g3_disk(dir.path(), 20 * block)
            .build()
            .unwrap();
        assert_eq!(engine.block_size(), 16);
        assert_eq!(engine.pool(Tier::G1).unwrap().capacity(), 8);
        assert_eq!(engine.pool(Tier::G2).unwrap().capacity(), 10);
        assert_eq!(engine.pool(Tier::G3).unwrap().capacity(), 20);
        // Staging for G3 prefetch comes on top of G2's budget.
        assert_eq!(engine.staging_free_blocks(), 1);
        let g2_memory = engine
            .layout(Tier::G2)
            .unwrap()
            .layout()
            .config()
            .num_blocks();
        assert_eq!(g2_memory, 11);
        let off = TierEngine::builder(shape())
            .g1_host(8)
            .g2_host_bytes(10 * block)
            .g3_disk(dir.path(), 20 * block)
            .g3_staging_bytes(0)
            .build()
            .unwrap();
        assert_eq!(off.staging_free_blocks(), 0);
        assert_eq!(off.pool(Tier::G2).unwrap().capacity(), 10);
    }

    #[test]
    fn mismatches_are_typed_errors() {
        let other = engine_layout(&shape().block_tokens(32), 4).unwrap();
        let g1 = PhysicalLayout::allocate_system(other, &host()).unwrap();
        let err = TierEngine::builder(shape())
            .g1_layout(g1)
            .build()
            .unwrap_err();
        assert!(
            matches!(
                err,
                TierError::ShapeMismatch {
                    dimension: "tokens per block",
                    ..
                }
            ),
            "{err}"
        );
        let err = TierEngine::builder(shape())
            .g1_host(4)
            .g2_host_bytes(1)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("hold no block"), "{err}");
        assert!(TierEngine::builder(shape()).build().is_err());
        // Chunks smaller than the disk's alignment cannot be read with
        // O_DIRECT: G3 refuses them by name.
        let dir = tempfile::tempdir().unwrap();
        let small = KvShape::mha(2, 1, 64);
        let err = TierEngine::builder(small)
            .g1_host(4)
            .g3_disk(dir.path(), 64 * small.block_bytes())
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("chunk size"), "{err}");
    }

    #[test]
    fn bad_knobs_are_errors_not_panics() {
        for builder in [
            TierEngine::builder(shape()).g1_host(8).offload_in_flight(0),
            TierEngine::builder(shape()).g1_host(8).hint_slack(0.5),
            TierEngine::builder(shape()).g1_host(8).offload_limits(0, 1),
            TierEngine::builder(shape())
                .g1_host(8)
                .g2_policy(TierPolicy::MinUses(0)),
            TierEngine::builder(shape())
                .g1_host(8)
                .reuse_age_exponent(f64::NAN),
        ] {
            let err = builder.build().unwrap_err();
            assert!(matches!(err, TierError::InvalidConfig(_)), "{err}");
        }
    }

    /// A local mover over host G1 and G2 (`g2` blocks) and, with `dir`, a
    /// G3 of 16 blocks there.
    fn mover(g2: usize, dir: Option<&Path>) -> Arc<dyn TierMover> {
        let physical = |blocks: usize| {
            let layout = Layout::new(
                shape().layout_config(blocks).unwrap(),
                LayoutKind::FullyContiguous,
            )
            .unwrap();
            PhysicalLayout::allocate_system(layout, &host()).unwrap()
        };
        let g3 = dir.map(|d| {
            let layout = g3_layout(16);
            let disk = DiskAllocator::new(d, DiskOptions::default()).unwrap();
            PhysicalLayout::allocate_disk(layout, &disk).unwrap()
        });
        let layouts = TierLayouts {
            g1: physical(8),
            g2: Some(physical(g2)),
            g3,
        };
        let executor = ExecutorSpec::host().disk(true).build().unwrap();
        Arc::new(LocalMover::new(layouts, executor).unwrap())
    }

    fn g3_layout(blocks: usize) -> Layout {
        let config = shape()
            .layout_config(blocks)
            .unwrap()
            .with_alignment(DISK_ALIGNMENT)
            .unwrap();
        Layout::new(config, LayoutKind::FullyContiguous).unwrap()
    }

    #[test]
    fn over_a_mover_the_staging_area_follows_from_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let block = shape().block_bytes();
        let staged = TierEngine::builder_with_mover(mover(12, Some(dir.path())), 16)
            .g3_staging_bytes(2 * block + 1)
            .build()
            .unwrap();
        assert_eq!(staged.g3_staging_blocks(), 2);
        assert_eq!(staged.staging_free_blocks(), 2);
        assert_eq!(staged.pool(Tier::G2).unwrap().capacity(), 10);
        // None unless asked for, and none without a G3.
        let plain = TierEngine::builder_with_mover(mover(12, Some(dir.path())), 16)
            .build()
            .unwrap();
        assert_eq!(plain.g3_staging_blocks(), 0);
        assert_eq!(plain.pool(Tier::G2).unwrap().capacity(), 12);
        let no_g3 = TierEngine::builder_with_mover(mover(12, None), 16)
            .g3_staging_bytes(2 * block)
            .build()
            .unwrap();
        assert_eq!(no_g3.g3_staging_blocks(), 0);
        // The staging area must leave G2's pool a block.
        let err = TierEngine::builder_with_mover(mover(2, Some(dir.path())), 16)
            .g3_staging_bytes(2 * block)
            .build()
            .unwrap_err();
        assert!(matches!(err, TierError::InvalidConfig(_)), "{err}");
        let err = TierEngine::builder_with_mover(mover(2, None), 0)
            .build()
            .unwrap_err();
        assert!(matches!(err, TierError::InvalidConfig(_)), "{err}");
    }
}
