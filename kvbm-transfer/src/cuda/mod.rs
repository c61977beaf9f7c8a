//! The CUDA backend: G1 (GPU memory) ↔ G2 (pinned host memory) at line rate.
//!
//! - [`device`]: a probe that reports "no CUDA" instead of panicking, and the
//!   opened device with what the copy paths need to know about it.
//! - [`memory`]: device buffers, and an engine's KV tensors wrapped in place.
//! - [`pinned`]: pinned host memory that is fast to get (parallel first touch
//!   + `cuMemHostRegister`) and grows in the background.
//! - [`plan`]: the pure part of executing a copy plan (merging, staging);
//!   `strided` finds affine families of runs the copy engines move as one
//!   pitched descriptor each.
//! - [`copier`]: the executor with its three paths (copy engines, kernel,
//!   staged) and the rule choosing between them; its lanes
//!   (streams, staging ring, descriptor buffers), the staged path's
//!   pipeline, the feeder thread that continues it and its diagnostic
//!   timelines (feature `diagnostics`) live in private modules (`lanes`,
//!   `staged`, `feeder`, `timeline`); the driver handles they own
//!   (events, streams, pinned allocations, host registrations) release
//!   themselves (`handles`).
//! - [`completion`]: GPU completion as the crate's completion future,
//!   resolved by a watcher thread that sleeps until a copy can have ended,
//!   polls briefly, then sleeps in `cuEventSynchronize`.
//! - [`block_sums`]: block checksums of device memory taken on the GPU
//!   (verify mode), equal to the host's.
//! - [`backend`]: [`CudaBackend`], the copier behind the crate's
//!   `TransferBackend` trait, and pinned/device memory as `MemoryRegion`s.
//!
//! libcuda is loaded at run time; a build needs no CUDA toolkit, and the
//! copy kernel ships as a committed fatbin (`kernels/`).

pub mod backend;
pub mod block_sums;
pub mod completion;
mod config;
pub mod copier;
pub mod device;
mod dma;
pub mod error;
mod feeder;
pub mod file_window;
mod handles;
mod kernel;
mod lanes;
pub mod memory;
mod order;
pub mod pinned;
pub mod plan;
mod staged;
mod strided;
#[cfg(feature = "diagnostics")]
mod timeline;
#[cfg(not(feature = "diagnostics"))]
#[path = "no_timeline.rs"]
mod timeline;

pub use backend::{CudaBackend, to_transfer_error};
pub use block_sums::{ChunkTable, DeviceChecksums};
pub use completion::Completion;
pub use copier::{CopierConfig, CopyOptions, CopyPath, CudaCopier, Direction, GpuLoad};
pub use device::{CudaDevice, Probe, probe};
pub use error::{CudaError, CudaResult};
pub use memory::{CudaRegion, DeviceBuffer, ExternalDeviceMemory, Location};
pub use pinned::{PinStats, PinnedMemory, PinnedOptions};
pub use plan::CopyRun;
