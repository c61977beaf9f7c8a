//! # kvbm-transfer
//!
//! The data path: memory regions and their allocators (system, pinned,
//! device, disk files), the `TransferBackend` trait with its backends
//! (memcpy, CUDA, io_uring disk, NIXL), and the executor that turns a copy
//! plan from kvbm-layout into moved bytes: strategy choice as a table,
//! two-hop pipelines through bounce buffers, batching, back-pressure,
//! cancellation and completion futures. It sits on kvbm-layout and knows
//! nothing of hashes or pools; kvbm-pool drives it.
//!
//! Map of the crate:
//! - [`memory`]: [`MemoryKind`], [`MemoryRegion`], the system and disk
//!   allocators; [`physical`]: a layout bound to its regions.
//! - [`checksum`]: the block checksum verify mode records and checks,
//!   computed alike on the host and (feature `cuda`) on the GPU.
//! - [`completion`]: [`Completion`] (a future, a blocking wait, or a
//!   callback), [`Completer`], [`CancelToken`].
//! - [`backend`]: the [`TransferBackend`] trait, [`TransferJob`], and the
//!   memcpy backend; [`disk`]: the disk backend and its I/O engines
//!   (io_uring, pread/pwrite, copies out of a mapping of a buffered
//!   file), and [`disk::route`]: one-hop file routes an executor may offer
//!   a batch to before its strategy table.
//! - [`strategy`]: the strategy table and [`select_strategy`].
//! - [`bounce`]: bounce-buffer pools for two-hop transfers; the pipeline
//!   itself is internal to the executor.
//! - [`executor`]: [`Executor`] — batching, the in-flight limit, strategy
//!   dispatch, per-block outcome; [`assembly`]: [`ExecutorSpec`], the
//!   backends and bounce pools a set of tiers needs, assembled.
//! - [`memory::EngineKvCache`]: an engine's own KV tensors, recognised
//!   and wrapped in place as a [`PhysicalLayout`].
//! - `cuda` (feature `cuda`): device and fast pinned memory, the copy
//!   kernel, the CUDA backend (copy engines, kernel, staged paths), and the
//!   file-window route (the GPU's DMA reading page-locked windows of a
//!   buffered file).
//! - `nixl` (feature `nixl`): host ↔ disk through NIXL's POSIX plugin, and
//!   remote G2 → G2 pulls over UCX with a validated peer description.
//!
//! No async runtime is needed: completions are std futures and can be
//! waited on from any thread. Worker threads block; nothing polls.
//!
//! ```
//! use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
//! use kvbm_transfer::memory::{DiskAllocator, DiskOptions, SystemAllocator};
//! use kvbm_transfer::{ExecutorSpec, PhysicalLayout};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // 8 blocks of 2 layers x K/V x 16 tokens x 128 bf16 values (4 KiB chunks).
//! let cfg = LayoutConfig::new(8, 2, 2, 16, 128, 2)?;
//! let engine_like = Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst))?;
//! let tier = Layout::new(cfg, LayoutKind::FullyContiguous)?;
//!
//! // Host memory and a disk file: memcpy, the disk backend, bounce buffers.
//! let exec = ExecutorSpec::host().disk(true).build()?;
//! let host = PhysicalLayout::allocate_system(engine_like, &SystemAllocator::new())?;
//! let dir = std::env::temp_dir().join("kvbm-transfer-doc");
//! let disk = PhysicalLayout::allocate_disk(tier, &DiskAllocator::new(dir, DiskOptions::default())?)?;
//!
//! // Offload host blocks 3 and 5 into disk blocks 0 and 1, then wait.
//! let report = exec.transfer(&host, &disk, &[(3, 0), (5, 1)]).wait()?;
//! assert_eq!(report.blocks, 2);
//! # Ok(())
//! # }
//! ```

pub mod assembly;
pub mod backend;
pub mod bounce;
pub mod checksum;
pub mod completion;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod disk;
pub mod error;
pub mod executor;
mod limiter;
pub mod memory;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod physical;
mod pipeline;
mod pool;
pub mod strategy;

pub use assembly::{AssembledExecutor, ExecutorSpec};
pub use backend::{BackendKind, CopyRun, Side, TransferBackend, TransferJob};
pub use bounce::{BouncePool, BounceSlot};
pub use completion::{CancelToken, Completer, Completion, Outcome, completion_pair};
pub use disk::{DiskBackend, DiskConfig};
pub use error::{Result, TransferError};
pub use executor::{
    Executor, ExecutorBuilder, ExecutorConfig, TransferFailure, TransferHandle, TransferOutcome,
    TransferReport,
};
pub use memory::{MemoryKind, MemoryRegion};
pub use physical::PhysicalLayout;
pub use strategy::{Capabilities, Strategy, select_strategy};
