//! Building a tier engine from a KV shape and tier sizes.
//!
//! [`TierEngine::builder`] takes the model's [`KvShape`] once; every tier's
//! layout follows from it: G1 as an engine lays it out (layer-separate,
//! K and V planes apart) or the engine's own tensors, G2 fully contiguous
//! in host memory (pinned when G1 is on a GPU), G3 fully contiguous in an
//! `O_DIRECT` file with blocks padded to the disk's alignment. The
//! executor follows from the tiers (see [`kvbm_transfer::ExecutorSpec`]).
//! Memory that does not hold blocks of the shape is a
//! [`TierError::ShapeMismatch`].

use std::path::PathBuf;

use kvbm_layout::{BlockOrder, Layout, LayoutKind};
use kvbm_transfer::memory::{
    DISK_ALIGNMENT, DiskAllocator, DiskOptions, EngineKvCache, SystemAllocator,
};
use kvbm_transfer::{Executor, ExecutorSpec, MemoryKind, PhysicalLayout};

use super::config::{OffloadMode, TierEngineConfig, TierPolicy};
use super::shape::KvShape;
use super::{TierEngine, TierError, TierLayouts};

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

/// Builds a [`TierEngine`]: the KV shape, then the tiers, then
/// [`build`](Self::build). Made by [`TierEngine::builder`].
pub struct TierEngineBuilder {
    shape: KvShape,
    g1: Option<G1Source>,
    g2_bytes: Option<u64>,
    /// G3 prefetch staging blocks; `None`: the default bytes' worth.
    g3_staging: Option<usize>,
    g3: Option<(PathBuf, u64)>,
    config: TierEngineConfig,
    executor: Option<Executor>,
}

impl std::fmt::Debug for TierEngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierEngineBuilder")
            .field("shape", &self.shape)
            .field("g1", &self.g1)
            .field("g2_bytes", &self.g2_bytes)
            .field("g3", &self.g3)
            .field("config", &self.config)
            .field("own_executor", &self.executor.is_some())
            .finish()
    }
}

impl TierEngine {
    /// Starts building an engine for blocks of `shape`.
    pub fn builder(shape: KvShape) -> TierEngineBuilder {
        TierEngineBuilder {
            shape,
            g1: None,
            g2_bytes: None,
            g3_staging: None,
            g3: None,
            config: TierEngineConfig::new(shape.tokens_per_block()),
            executor: None,
        }
    }
}

impl TierEngineBuilder {
    /// G1 in host memory, `blocks` blocks laid out as an engine lays them
    /// out (for engines that run on the CPU, tests and benchmarks).
    pub fn g1_host(mut self, blocks: usize) -> Self {
        self.g1 = Some(G1Source::Host(blocks));
        self
    }

    /// G1 in `blocks` blocks of device memory that kvbm allocates, laid out
    /// as an engine lays them out.
    #[cfg(feature = "cuda")]
    pub fn g1_device(mut self, device: &kvbm_transfer::cuda::CudaDevice, blocks: usize) -> Self {
        self.g1 = Some(G1Source::Device(device.clone(), blocks));
        self
    }

    /// G1 is the engine's own KV tensors (host or device memory), as
    /// recognised by [`EngineKvCache`]. Their block shape must be the
    /// engine's KV shape.
    pub fn g1_engine(mut self, cache: EngineKvCache) -> Self {
        self.g1 = Some(G1Source::Engine(cache.into_physical()));
        self
    }

    /// G1 is memory the caller laid out and allocated itself.
    pub fn g1_layout(mut self, layout: PhysicalLayout) -> Self {
        self.g1 = Some(G1Source::Engine(layout));
        self
    }

    /// G2 in at most `bytes` of host memory (pinned when G1 is on a GPU),
    /// as many whole blocks as fit.
    pub fn g2_host_bytes(mut self, bytes: u64) -> Self {
        self.g2_bytes = Some(bytes);
        self
    }

    /// Host memory for `blocks` blocks of G3 prefetch staging, beyond the G2
    /// budget (0: no prefetch; G3 blocks are read into G1 at onboard).
    /// Without this call, [`DEFAULT_G3_STAGING_BYTES`](super::DEFAULT_G3_STAGING_BYTES)
    /// worth when the engine has both a G2 and a G3 (see
    /// [`TierEngineConfig::g3_staging_blocks`]).
    pub fn g3_staging_blocks(mut self, blocks: usize) -> Self {
        self.g3_staging = Some(blocks);
        self
    }

    /// G3 in a file of at most `bytes` in `dir`, as many whole blocks (each
    /// padded to the disk's alignment) as fit. The file is removed when the
    /// engine is dropped, and locked while it lives; `build` first removes
    /// the kvbm files in `dir` that no process holds locked (left by a
    /// process that was killed), so `dir` should hold only scratch files.
    pub fn g3_disk(mut self, dir: impl Into<PathBuf>, bytes: u64) -> Self {
        self.g3 = Some((dir.into(), bytes));
        self
    }

    /// Admission and eviction in G2.
    pub fn g2_policy(mut self, policy: TierPolicy) -> Self {
        self.config.g2_policy = policy;
        self
    }

    /// Admission and eviction in G3.
    pub fn g3_policy(mut self, policy: TierPolicy) -> Self {
        self.config.g3_policy = policy;
        self
    }

    /// When G1 blocks are copied to G2.
    pub fn offload_mode(mut self, mode: OffloadMode) -> Self {
        self.config.offload_mode = mode;
        self
    }

    /// Write-back: keeps `blocks` G1 slots free ahead of need (at most half
    /// of G1; 0: off) instead of the automatic size, their victims saved in
    /// the background (see [`TierEngineConfig::g1_free_reserve`]).
    pub fn g1_free_reserve(mut self, blocks: usize) -> Self {
        self.config.g1_free_reserve = Some(blocks);
        self
    }

    /// Every engine parameter at once, for experts. Its block size must be
    /// the shape's tokens per block.
    pub fn config(mut self, config: TierEngineConfig) -> Self {
        self.config = config;
        self
    }

    /// Moves the bytes with `executor` instead of one assembled from the
    /// tiers, for experts (it must serve every pair of the tiers' memory).
    pub fn executor(mut self, executor: Executor) -> Self {
        self.executor = Some(executor);
        self
    }

    /// Allocates the tiers, assembles the executor and starts the engine.
    pub fn build(self) -> Result<TierEngine, TierError> {
        let shape = self.shape;
        if self.config.block_size != shape.tokens_per_block() {
            return Err(TierError::ShapeMismatch {
                what: "the engine configuration".into(),
                dimension: "tokens per block",
                expected: shape.tokens_per_block(),
                found: self.config.block_size,
            });
        }
        let g1 = match self.g1 {
            None => {
                return Err(TierError::InvalidConfig(
                    "no G1: call g1_host, g1_device or g1_engine".into(),
                ));
            }
            Some(G1Source::Host(blocks)) => {
                PhysicalLayout::allocate_system(engine_layout(&shape, blocks)?, &host())?
            }
            #[cfg(feature = "cuda")]
            Some(G1Source::Device(device, blocks)) => {
                PhysicalLayout::allocate_device(engine_layout(&shape, blocks)?, &device)?
            }
            Some(G1Source::Engine(layout)) => {
                shape.check("G1 (the engine's memory)", layout.layout().config())?;
                layout
            }
        };
        #[cfg(feature = "cuda")]
        let device = match g1.kind() {
            MemoryKind::Device(ordinal) => Some(
                kvbm_transfer::cuda::CudaDevice::open(ordinal as usize)
                    .map_err(kvbm_transfer::cuda::backend::to_transfer_error)?,
            ),
            _ => None,
        };
        #[cfg(not(feature = "cuda"))]
        if let MemoryKind::Device(_) = g1.kind() {
            return Err(TierError::InvalidConfig(
                "G1 is device memory: build kvbm-pool with feature `cuda`".into(),
            ));
        }
        let mut config = self.config;
        config.g3_staging_blocks = match (self.g2_bytes, &self.g3) {
            (Some(g2), Some(_)) => self.g3_staging.unwrap_or(match config.g3_staging_blocks {
                0 => super::config::default_g3_staging_blocks(g2, shape.block_bytes()),
                n => n,
            }),
            _ => 0,
        };
        let g2 = match self.g2_bytes {
            None => None,
            Some(bytes) => {
                let blocks = whole_blocks("G2", bytes, shape.block_bytes())?;
                let layout = Layout::new(
                    shape.layout_config(blocks + config.g3_staging_blocks)?,
                    LayoutKind::FullyContiguous,
                )
                .map_err(layout_err)?;
                #[cfg(feature = "cuda")]
                if let Some(device) = &device {
                    Some(PhysicalLayout::allocate_pinned(layout, device)?)
                } else {
                    Some(PhysicalLayout::allocate_system(layout, &host())?)
                }
                #[cfg(not(feature = "cuda"))]
                Some(PhysicalLayout::allocate_system(layout, &host())?)
            }
        };
        let g3 = match &self.g3 {
            None => None,
            Some((dir, bytes)) => {
                let padded = shape.block_bytes().div_ceil(DISK_ALIGNMENT) * DISK_ALIGNMENT;
                let config = shape
                    .layout_config(whole_blocks("G3", *bytes, padded)?)?
                    .with_alignment(DISK_ALIGNMENT)
                    .map_err(layout_err)?;
                let layout =
                    Layout::new(config, LayoutKind::FullyContiguous).map_err(layout_err)?;
                let disk = DiskAllocator::new(dir, DiskOptions::default())?;
                let stale = kvbm_transfer::memory::remove_stale_files(disk.dir())?;
                if !stale.is_empty() {
                    tracing::warn!(
                        dir = %disk.dir().display(),
                        files = stale.len(),
                        "removed G3 files left by killed processes (no process held their lock)"
                    );
                }
                Some(PhysicalLayout::allocate_disk(layout, &disk)?)
            }
        };
        let executor = match self.executor {
            Some(e) => e,
            None => {
                let spec = ExecutorSpec::host();
                #[cfg(feature = "cuda")]
                let spec = match device {
                    Some(d) => ExecutorSpec::device(d),
                    None => spec,
                };
                spec.disk(g3.is_some()).build()?
            }
        };
        for layout in [&g2].into_iter().flatten() {
            executor.register(layout)?;
        }
        TierEngine::new(config, TierLayouts { g1, g2, g3 }, executor)
    }
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
            .g3_staging_blocks(0)
            .build()
            .unwrap();
        assert_eq!(off.staging_free_blocks(), 0);
        assert_eq!(off.pool(Tier::G2).unwrap().capacity(), 10);
    }

    #[test]
    fn mismatches_are_typed_errors() {
        let err = TierEngine::builder(shape())
            .g1_host(8)
            .config(TierEngineConfig::new(32))
            .build()
            .unwrap_err();
        assert!(matches!(err, TierError::ShapeMismatch { .. }), "{err}");
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
}
