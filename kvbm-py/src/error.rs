//! The crate's error type and its mapping to Python exceptions.
//!
//! Every failure reaches Python as a subclass of `kvbm_py.KvbmError` that
//! says what went wrong ([`ErrorKind`]):
//!
//! - `InvalidArgumentError` (also a `ValueError`): an argument or a
//!   configuration value kvbm cannot use (a shape, a hash, a size);
//! - `TransferError`: a copy between tiers failed, or memory for one
//!   could not be had;
//! - `ClosedError`: the object, or the peer it needs, was shut down;
//! - `KvbmTimeoutError` (also a `TimeoutError`): a peer did not answer in
//!   time;
//! - `KvbmError` itself for anything else (a socket, a file, a worker's
//!   own failure).
//!
//! The classes are made once per interpreter (Python's `type`, so that
//! two of them can have two bases) and added to `kvbm_py._kvbm` by
//! [`add_classes`].

use pyo3::PyErr;
use pyo3::exceptions::{PyException, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use kvbm_dist::DistError;
use kvbm_pool::tier::TierError;

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
    Tier(#[from] TierError),
    /// The leader or a worker failed.
    #[error(transparent)]
    Dist(#[from] DistError),
    /// The metrics exporter could not start.
    #[error("{0}")]
    Metrics(String),
    /// The object was shut down.
    #[error("{0} is shut down")]
    Closed(&'static str),
    /// The operating system refused a resource (a thread).
    #[error("{0}")]
    System(String),
}

/// Which Python exception class a failure is raised as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// `InvalidArgumentError`: an argument or configuration value.
    Invalid,
    /// `TransferError`: a copy, or the memory for one.
    Transfer,
    /// `ClosedError`: a component that was shut down or is gone.
    Closed,
    /// `KvbmTimeoutError`: a peer did not answer in time.
    Timeout,
    /// `KvbmError` itself: anything else.
    Other,
}

impl ErrorKind {
    /// A Python exception of this kind carrying `message`.
    pub fn new_err(self, message: impl Into<String>) -> PyErr {
        let message = message.into();
        Python::attach(|py| match classes(py) {
            Ok(c) => PyErr::from_type(c.of(self).bind(py).clone(), message),
            Err(e) => e,
        })
    }
}

impl PyKvbmError {
    /// The exception class this error is raised as.
    pub fn kind(&self) -> ErrorKind {
        match self {
            PyKvbmError::Invalid(_) | PyKvbmError::Layout(_) => ErrorKind::Invalid,
            PyKvbmError::Transfer(_) => ErrorKind::Transfer,
            PyKvbmError::Tier(e) => tier_kind(e),
            PyKvbmError::Dist(e) => dist_kind(e),
            PyKvbmError::Metrics(_) | PyKvbmError::System(_) => ErrorKind::Other,
            PyKvbmError::Closed(_) => ErrorKind::Closed,
        }
    }
}

/// The class of a tier engine's error.
fn tier_kind(e: &TierError) -> ErrorKind {
    match e {
        TierError::InvalidConfig(_)
        | TierError::ShapeMismatch { .. }
        | TierError::UnknownRequest(_)
        | TierError::AlreadyOnboarding(_)
        | TierError::DuplicateRequest(_)
        | TierError::DestinationMismatch { .. }
        | TierError::NotAllocated { .. }
        | TierError::StillOnboarding(_) => ErrorKind::Invalid,
        TierError::Onboard { .. }
        | TierError::Released(_)
        | TierError::SharedOnboardFailed(_)
        | TierError::Transfer(_) => ErrorKind::Transfer,
        TierError::Shutdown => ErrorKind::Closed,
        TierError::Pool(_) => ErrorKind::Other,
    }
}

/// The class of a leader's or worker's error.
fn dist_kind(e: &DistError) -> ErrorKind {
    match e {
        DistError::InvalidConfig(_) | DistError::TierTooLarge { .. } | DistError::Layout(_) => {
            ErrorKind::Invalid
        }
        DistError::Transfer(_)
        | DistError::ChecksumMismatch { .. }
        | DistError::ChecksumUnavailable { .. } => ErrorKind::Transfer,
        DistError::Timeout { .. } => ErrorKind::Timeout,
        DistError::LeaderGone(_) => ErrorKind::Closed,
        _ => ErrorKind::Other,
    }
}

impl From<PyKvbmError> for PyErr {
    fn from(e: PyKvbmError) -> PyErr {
        e.kind().new_err(e.to_string())
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, PyKvbmError>;

/// kvbm's exception classes.
struct Classes {
    base: Py<PyType>,
    invalid: Py<PyType>,
    transfer: Py<PyType>,
    closed: Py<PyType>,
    timeout: Py<PyType>,
}

impl Classes {
    /// The class of `kind`.
    fn of(&self, kind: ErrorKind) -> &Py<PyType> {
        match kind {
            ErrorKind::Invalid => &self.invalid,
            ErrorKind::Transfer => &self.transfer,
            ErrorKind::Closed => &self.closed,
            ErrorKind::Timeout => &self.timeout,
            ErrorKind::Other => &self.base,
        }
    }
}

/// The interpreter's classes, made on first use.
static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

/// A class `name` of the native module with `bases`, made as Python's
/// `type(name, bases, namespace)` makes one.
fn make_class(
    py: Python<'_>,
    name: &str,
    doc: &str,
    bases: &[Bound<'_, PyType>],
) -> PyResult<Py<PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "kvbm_py._kvbm")?;
    namespace.set_item("__doc__", doc)?;
    let bases = PyTuple::new(py, bases)?;
    let class = py
        .get_type::<PyType>()
        .call1((name, bases, namespace))?
        .cast_into::<PyType>()?;
    Ok(class.unbind())
}

/// kvbm's exception classes, made once per interpreter.
fn classes(py: Python<'_>) -> PyResult<&'static Classes> {
    CLASSES.get_or_try_init(py, || {
        let base = make_class(
            py,
            "KvbmError",
            "The base class of every error kvbm raises.",
            &[py.get_type::<PyException>()],
        )?;
        let sub = |name: &str, doc: &str, also: Option<Bound<'_, PyType>>| {
            let mut bases = vec![base.bind(py).clone()];
            bases.extend(also);
            make_class(py, name, doc, &bases)
        };
        Ok(Classes {
            invalid: sub(
                "InvalidArgumentError",
                "An argument or configuration value kvbm cannot use (also a ValueError).",
                Some(py.get_type::<PyValueError>()),
            )?,
            transfer: sub(
                "TransferError",
                "A copy between the engine's memory and kvbm's tiers failed, or the memory \
                 for one could not be had.",
                None,
            )?,
            closed: sub(
                "ClosedError",
                "The object, or the peer it works with, was shut down.",
                None,
            )?,
            timeout: sub(
                "KvbmTimeoutError",
                "A peer did not answer in time (also a TimeoutError).",
                Some(py.get_type::<PyTimeoutError>()),
            )?,
            base,
        })
    })
}

/// Adds the exception classes to the native module.
pub fn add_classes(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let c = classes(py)?;
    for (name, class) in [
        ("KvbmError", &c.base),
        ("InvalidArgumentError", &c.invalid),
        ("TransferError", &c.transfer),
        ("ClosedError", &c.closed),
        ("KvbmTimeoutError", &c.timeout),
    ] {
        m.add(name, class.clone_ref(py))?;
    }
    Ok(())
}
