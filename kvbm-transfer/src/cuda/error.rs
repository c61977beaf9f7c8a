//! Errors of the CUDA backend.
//!
//! Every driver call that can fail goes through `check`, which turns a
//! non-success `CUresult` into [`CudaError::Driver`] naming the call. A copy
//! whose stream reports an error resolves its completion with that error: a
//! failed copy never reports success.

use cudarc::driver::sys::{CUresult, cudaError_enum};

/// Everything that can go wrong in the CUDA backend.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// libcuda could not be loaded: no driver on this machine.
    #[error("no CUDA driver: libcuda could not be loaded")]
    NoDriver,
    /// The driver loaded but reports no device (or not the one asked for).
    #[error("no CUDA device {ordinal} (the driver reports {count})")]
    NoDevice {
        /// The ordinal that was asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// A driver call failed.
    #[error("{call} failed: {name} ({code}): {message}")]
    Driver {
        /// The driver entry point that failed.
        call: &'static str,
        /// The numeric `CUresult`.
        code: u32,
        /// The driver's name for the error (`CUDA_ERROR_...`).
        name: String,
        /// The driver's description.
        message: String,
    },
    /// `cuMemHostRegister` (or the mapping under it) refused memory.
    #[error("pinning {bytes} bytes of host memory failed: {reason}")]
    Pinning {
        /// How many bytes were asked for.
        bytes: usize,
        /// Why it failed (driver error or OS error).
        reason: String,
    },
    /// A plan or argument that the backend cannot execute.
    #[error("invalid copy: {0}")]
    InvalidCopy(String),
    /// A run of a plan lies outside its region (or names a region the copy
    /// was not given). Found before any of that run's bytes moved.
    #[error(
        "run {run}: {side} bytes {offset}+{len} outside region {region} ({})",
        match region_len { Some(l) => format!("{l} bytes"), None => "no such region".to_string() }
    )]
    OutOfBounds {
        /// The run's index in the plan.
        run: usize,
        /// `"source"` or `"destination"`.
        side: &'static str,
        /// The run's region index on that side.
        region: u32,
        /// The run's offset in that region.
        offset: u64,
        /// The run's length.
        len: u64,
        /// The region's length; `None` when the copy has no such region.
        region_len: Option<u64>,
    },
    /// An operating-system call failed (mmap, thread spawn).
    #[error("{call} failed: {source}")]
    Os {
        /// The call that failed.
        call: &'static str,
        /// The OS error.
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },
    /// The completion thread went away before reporting (the backend was torn
    /// down while a copy was in flight).
    #[error("the copy's completion was lost: the CUDA backend shut down")]
    CompletionLost,
}

impl CudaError {
    /// Builds [`CudaError::Driver`] from a `CUresult`.
    pub(crate) fn driver(call: &'static str, code: CUresult) -> Self {
        let err = cudarc::driver::result::DriverError(code);
        let name = err
            .error_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{code:?}"));
        let message = err
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        CudaError::Driver {
            call,
            code: code as u32,
            name,
            message,
        }
    }
}

/// Turns a `CUresult` into `Ok(())` or a [`CudaError::Driver`] naming `call`.
pub(crate) fn check(call: &'static str, code: CUresult) -> Result<(), CudaError> {
    if code == cudaError_enum::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::driver(call, code))
    }
}

/// Result alias of the CUDA backend.
pub type CudaResult<T> = Result<T, CudaError>;
