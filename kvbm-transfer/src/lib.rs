//! # kvbm-transfer
//!
//! The data path: memory regions and their allocators (system, pinned,
//! device, disk files), the `TransferBackend` trait with its backends
//! (memcpy, CUDA, io_uring disk, NIXL), and the executor that turns a copy
//! plan from kvbm-layout into moved bytes: strategy choice as a table,
//! two-hop pipelines through bounce buffers, batching, back-pressure,
//! cancellation and completion futures. It sits on kvbm-layout and knows
//! nothing of hashes or pools; kvbm-pool drives it.

#[cfg(feature = "cuda")]
pub mod cuda;
