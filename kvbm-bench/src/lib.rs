//! # kvbm-bench
//!
//! kvbm's benchmarks and cache simulators, a product crate at the top of
//! the stack: the `kvbm-bench` binary (`cargo run --release -p kvbm-bench
//! -- replay`; it is also the worker process its tensor-parallel replay
//! starts, see [`replay::dist`]), the `studies` binary that prints the
//! simulator studies' tables, and kvbm-transfer's benchmarks of the
//! backends alone (`transfer_bench`, `cuda_bench`, `pin_bench`,
//! `nixl_peer`, each behind the features it needs). This library is
//! everything they measure and print, kept out of `main` so tests can
//! drive it; test fixtures (trace readers, stand-ins, fault injection) come
//! from kvbm-testkit.
//!
//! Two benchmarks answer the two questions users ask of kvbm:
//! - [`matrix`]: how fast does kvbm move blocks between tiers, for each
//!   layout pair, block size and batch size, next to the best the same
//!   machine does with one large copy (memory) or a raw sequential
//!   `O_DIRECT` stream (disk)? The ratio is the number that matters; the
//!   absolute figures change with the machine and its load.
//! - [`replay`]: on a real workload, how much prefill does kvbm avoid, how
//!   fast do the onboards go, and how close is the hit rate to LRU and to
//!   Belady's offline optimum at the same capacity? Every onboarded block's
//!   bytes are checked against what was written for its sequence hash.
//!
//! - [`offload`]: what a user of the tier engine gets when G1 blocks go
//!   to G2 — `offload` through `flush`, per offload batches in flight and
//!   batch size, idle and beside a GEMM standing in for the model
//!   (kvbm-testkit's `gemm`, feature `gemm`), every block checked in G2.
//!
//! [`model`] holds the KV shapes (presets and explicit dimensions) both
//! share; [`table`] and [`svg`] render results without any plotting crate.
//!
//! [`soak`] runs the tensor-parallel replay for minutes with a worker
//! killed and restarted every interval (a benchmark, not a test).
//!
//! [`shutdown`] stops a run on SIGINT/SIGTERM with nothing left behind;
//! [`disk_dir`] checks `--dir` and clears it of killed runs' files.
//!
//! [`sim`] holds the cache simulators (LRU, Belady, tiered, reuse score,
//! the bound studies' scorers) the replay compares itself with.

#[cfg(feature = "cuda")]
pub mod cuda_rows;
pub mod disk_dir;
pub mod error;
pub mod host_view;
pub mod matrix;
pub mod model;
#[cfg(feature = "nixl")]
pub mod nixl_rows;
pub mod offload;
pub mod pattern;
pub mod replay;
pub mod shutdown;
pub mod sim;
pub mod soak;
pub mod stats;
pub mod svg;
pub mod table;
pub mod thread_cpu;

pub use error::BenchError;
pub use model::{KvModel, MODEL_PRESETS};
