//! # kvbm-testkit
//!
//! Everything kvbm's tests and benchmarks share, and never a dependency of a
//! library crate: proptest strategies, fixtures (temporary directories,
//! fault-injecting files and backends), reference models for model-based
//! tests, workload trace readers (Mooncake JSONL), offline-optimal (Belady)
//! and LRU reference simulators, and the `kvbm-bench` binary.

pub mod bench;
pub mod fault;
pub mod sim;
pub mod trace;
