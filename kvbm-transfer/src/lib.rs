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
//!   allocators.
//! - [`completion`]: [`Completion`] (a future, a blocking wait, or a
//!   callback), [`Completer`], [`CancelToken`].
//! - [`backend`]: the [`TransferBackend`] trait, [`TransferJob`], and the
//!   memcpy backend.
//! - [`strategy`]: the strategy table and [`select_strategy`].

pub mod backend;
pub mod completion;
pub mod disk;
pub mod error;
pub mod memory;
mod pool;
pub mod strategy;

pub use backend::{BackendKind, CopyRun, Side, TransferBackend, TransferJob};
pub use completion::{CancelToken, Completer, Completion, Outcome, completion_pair};
pub use error::{Result, TransferError};
pub use memory::{MemoryKind, MemoryRegion};
pub use strategy::{Capabilities, Strategy, select_strategy};
