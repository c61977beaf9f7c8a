//! The benchmark's one error type: every way a run can fail on user input
//! or on the machine, each with a message that says what to change.

use std::path::PathBuf;

use kvbm_transfer::TransferError;

use kvbm_testkit::trace::TraceError;

/// Why a benchmark could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// `--model` named no preset and no explicit shape.
    #[error(
        "unknown model `{name}`; known presets: {known}, or explicit dimensions LAYERSxOUTERxINNERxDTYPE_BYTES (e.g. 32x2x1024x2)"
    )]
    UnknownModel {
        /// What was asked for.
        name: String,
        /// The preset names, comma-separated.
        known: String,
    },
    /// A configuration value is out of range or inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The workload trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A layout could not be built for the requested shape.
    #[error("layout: {0}")]
    Layout(#[from] kvbm_layout::LayoutError),
    /// Allocating memory or files, or starting a backend, failed.
    #[error("transfer setup: {0}")]
    Transfer(#[from] TransferError),
    /// A CUDA call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// The tier engine refused a call.
    #[error("tier engine: {0}")]
    Tier(String),
    /// A transfer did not complete.
    #[error("transfer {path} failed: {detail}")]
    TransferFailed {
        /// The path (e.g. `G2->G1`).
        path: String,
        /// The failure, with which blocks landed.
        detail: String,
    },
    /// A block's bytes were not what was written for its hash.
    #[error(
        "block {block:#x} came back wrong after {path}: first difference at byte {offset} of chunk (layer {layer}, plane {outer})"
    )]
    Corrupt {
        /// The block's sequence hash (trace block id).
        block: u64,
        /// The path it last moved over.
        path: String,
        /// Layer of the bad chunk.
        layer: usize,
        /// K/V plane of the bad chunk.
        outer: usize,
        /// Byte offset of the first difference inside the chunk.
        offset: usize,
    },
    /// `--dir` cannot hold the run's files.
    #[error("--dir {dir}: {problem}", dir = dir.display())]
    Dir {
        /// The directory given.
        dir: PathBuf,
        /// What is wrong with it, in words.
        problem: String,
    },
    /// SIGINT or SIGTERM stopped the run (see [`crate::shutdown`]).
    #[error("interrupted by {signal}: transfers stopped, G3 files removed")]
    Interrupted {
        /// `SIGINT` or `SIGTERM`.
        signal: &'static str,
        /// The exit status to leave with (128 + the signal number).
        code: u8,
    },
    /// A file an output flag names (`--json-file`, `--svg`) cannot be
    /// written.
    #[error("{flag} {path}: cannot write this file: {source}", path = path.display())]
    OutputFlag {
        /// The flag.
        flag: &'static str,
        /// The file it names.
        path: PathBuf,
        /// Why it cannot be written.
        source: std::io::Error,
    },
    /// Writing an output file failed.
    #[error("{path}: {source}", path = path.display())]
    Output {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// Result alias for the benchmark.
pub type Result<T> = std::result::Result<T, BenchError>;
