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
//! - [`completion`]: [`Completion`] (a future, a blocking wait, or a
//!   callback), [`Completer`], [`CancelToken`].
//! - [`backend`]: the [`TransferBackend`] trait, [`TransferJob`], and the
//!   memcpy backend; [`disk`]: the disk backend and its I/O engines
//!   (io_uring, pread/pwrite).
//! - [`strategy`]: the strategy table and [`select_strategy`].
//! - [`bounce`]: bounce-buffer pools for two-hop transfers; the pipeline
//!   itself is internal to the executor.
//! - [`executor`]: [`Executor`] — batching, the in-flight limit, strategy
//!   dispatch, per-block outcome.
//! - `cuda` (feature `cuda`): device and fast pinned memory, the copy
//!   kernel, and the CUDA backend (copy engines, kernel, staged paths).
//!
//! No async runtime is needed: completions are std futures and can be
//! waited on from any thread. Worker threads block; nothing polls.

pub mod backend;
pub mod bounce;
pub mod completion;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod disk;
pub mod error;
pub mod executor;
mod limiter;
pub mod memory;
pub mod physical;
mod pipeline;
mod pool;
pub mod strategy;

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
