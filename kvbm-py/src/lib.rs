//! # kvbm-py
//!
//! Python bindings of kvbm, imported as `kvbm_py` (the native part is
//! `kvbm_py._kvbm`; the name keeps clear of other packages called
//! `kvbm`). Objects thin over the Rust types:
//!
//! - [`Scheduler`](scheduler::Scheduler), in the engine's scheduler
//!   process: a kvbm-dist leader and a kvbm-pool tier engine over the
//!   leader's distributed mover — match, onboard, offload, release, stats.
//! - [`Worker`](worker::Worker), in each engine worker process (one per
//!   tensor-parallel rank): the engine's KV tensors as kvbm's G1, G2 in
//!   host memory and G3 on disk, executing the leader's copies.
//!
//! - [`OffloadBooks`](offload::OffloadBooks) and
//!   [`PageWorker`](page_worker::PageWorker): kvbm as the backend of vLLM's
//!   offloading connector, the books in the scheduler and the copies in
//!   each rank.
//!
//! The vLLM integration (`kvbm_py.vllm`) is Python code in the package,
//! built on these.
//!
//! Module map: [`scheduler`], [`worker`], [`offload`], [`tensors`] (engine tensors as a
//! kvbm layout), [`dlpack`] (tensors as Python hands them over), [`prom`] (the Prometheus
//! exporter), [`secret`] (the instance secret both sides share), [`error`] (the exception
//! classes).

pub mod dlpack;
pub mod error;
pub mod kept;
pub mod offload;
pub mod offload_keys;
pub mod page_worker;
pub mod prom;
pub mod scheduler;
pub mod secret;
pub mod tensors;
pub mod worker;

use pyo3::prelude::*;

/// The hash kvbm keys a block by, from the engine's block hash bytes (the
/// first 8 bytes, little-endian).
#[pyfunction]
fn sequence_hash(digest: &[u8]) -> PyResult<u64> {
    Ok(scheduler::sequence_hash(digest)?.0)
}

/// The environment variable that filters the log lines kvbm writes to
/// standard error (`tracing`'s filter syntax: `info`,
/// `kvbm_dist=debug,warn`, ...); unset, warnings and errors.
pub const LOG_ENV: &str = "KVBM_LOG";

/// Sends kvbm's log lines (lost workers, failed copies, refused peers) to
/// standard error, filtered by [`LOG_ENV`]. Does nothing where the process
/// already installed a `tracing` subscriber.
fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var(LOG_ENV) {
        Ok(spec) => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            eprintln!("kvbm: {LOG_ENV}={spec:?} is not a log filter ({e}); logging warnings");
            EnvFilter::new("warn")
        }),
        Err(_) => EnvFilter::new("warn"),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// The native module `kvbm_py._kvbm`.
#[pymodule]
fn _kvbm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    error::add_classes(m)?;
    m.add_class::<scheduler::Scheduler>()?;
    m.add_class::<scheduler::Match>()?;
    m.add_class::<worker::Worker>()?;
    m.add_class::<offload::OffloadBooks>()?;
    m.add_class::<page_worker::PageWorker>()?;
    m.add_class::<offload_keys::OffloadKeys>()?;
    m.add_function(wrap_pyfunction!(sequence_hash, m)?)?;
    m.add_function(wrap_pyfunction!(kept::inspect_g3, m)?)?;
    m.add_function(wrap_pyfunction!(kept::kept_common, m)?)?;
    m.add_function(wrap_pyfunction!(prom::start_metrics_server, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Whether this build has the test hooks (feature `test-hooks`).
    m.add("TEST_HOOKS", cfg!(feature = "test-hooks"))?;
    m.add("KEPT_ENTRY_BYTES", kept::KEPT_ENTRY_BYTES)?;
    Ok(())
}
