//! # kvbm-testkit
//!
//! Fixtures the tests and benchmarks of kvbm share, and never a dependency
//! of a library crate: block contents to check byte for byte
//! ([`blocks`]), host memory standing in for a GPU ([`stand_in`]),
//! fault injection under the disk backend ([`fault`]), gates that hold
//! work in flight until the test lets it through ([`gate`]), a small real
//! file system to fill up ([`small_fs`]), workload trace
//! readers and a synthetic workload generator ([`trace`]), and, with
//! feature `gemm`, a GEMM loop standing in for the model ([`gemm`]).
//!
//! It sits just above kvbm-transfer and below everything that tests with
//! it: it depends on no pool, no distributed layer and no command-line
//! machinery, so a crate's tests that use it build only what they test.
//! The benchmarks and cache simulators live in kvbm-bench.
//!
//! Its own tests (`tests/`) are kvbm-transfer's tests that need these
//! fixtures: kvbm-transfer cannot depend on this crate, even for its tests,
//! since this crate is built on it.

pub mod blocks;
pub mod fault;
pub mod gate;
#[cfg(feature = "gemm")]
pub mod gemm;
pub mod small_fs;
pub mod stand_in;
pub mod trace;
