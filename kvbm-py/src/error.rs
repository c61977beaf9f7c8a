//! The crate's error type and its mapping to Python exceptions.

use pyo3::PyErr;
use pyo3::exceptions::{PyRuntimeError, PyValueError};

/// What can go wrong in the bindings.
#[derive(Debug, thiserror::Error)]
pub enum PyKvbmError {
    /// Bad arguments from Python (shapes, hashes, configuration values).
    #[error("{0}")]
    Invalid(String),
    /// An engine tensor kvbm cannot address exactly.
    #[error("unsupported KV tensor: {0}")]
    Layout(#[from] kvbm_layout::LayoutError),
    /// Building or binding memory failed.
    #[error(transparent)]
    Transfer(#[from] kvbm_transfer::TransferError),
    /// The tier engine refused an operation.
    #[error(transparent)]
    Tier(#[from] kvbm_pool::tier::TierError),
    /// The leader or a worker failed.
    #[error(transparent)]
    Dist(#[from] kvbm_dist::DistError),
    /// The metrics exporter could not start.
    #[error("{0}")]
    Metrics(String),
    /// The object was shut down.
    #[error("{0} is shut down")]
    Closed(&'static str),
}

impl From<PyKvbmError> for PyErr {
    fn from(e: PyKvbmError) -> PyErr {
        match e {
            PyKvbmError::Invalid(_)
            | PyKvbmError::Layout(_)
            | PyKvbmError::Dist(kvbm_dist::DistError::TierTooLarge { .. }) => {
                PyValueError::new_err(e.to_string())
            }
            _ => PyRuntimeError::new_err(e.to_string()),
        }
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, PyKvbmError>;
