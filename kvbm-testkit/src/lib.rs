//! # kvbm-testkit
//!
//! Everything kvbm's tests and benchmarks share, and never a dependency of a
//! library crate: proptest strategies, fixtures (temporary directories,
//! fault-injecting files and backends, host memory standing in for a GPU), reference models for model-based
//! tests, workload trace readers (Mooncake JSONL), offline-optimal (Belady)
//! and LRU reference simulators, and the `kvbm-bench` binary.

pub mod bench;
pub mod fault;
pub mod sim;
pub mod stand_in;
pub mod trace;
