//! The worker side: one per tensor-parallel rank, in the engine's worker
//! process, owning the bytes.
//!
//! A [`Worker`] turns the engine's KV tensors into kvbm's G1 (no copy: the
//! layout points at the engine's memory), then runs a kvbm-dist worker on a
//! thread of its own: it says hello to the leader in the scheduler process,
//! allocates G2 (host memory) and G3 (a file in `g3_dir`) when the leader
//! sizes them, and executes every copy the leader broadcasts, acknowledging
//! exactly the blocks whose bytes landed. The leader, not this object,
//! learns when a copy finished; the engine's worker reports what the
//! scheduler side tells it.

use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use kvbm_dist::worker::{self, WorkerConfig};
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::error::{ErrorKind, PyKvbmError, Result};
use crate::tensors::{RawTensor, engine_layout, vllm_format};

/// How the worker thread ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Exit {
    Running,
    Ok,
    Failed(ErrorKind, String),
}

/// kvbm's worker-side object for one rank.
#[pyclass(module = "kvbm_py._kvbm")]
pub struct Worker {
    thread: Mutex<Option<JoinHandle<()>>>,
    exit: Arc<Mutex<Exit>>,
    rank: u32,
    num_blocks: usize,
    block_bytes: u64,
}

/// A worker's settings, read from `kvbm_py.config.WorkerConfig` (or any
/// object with its attributes).
#[derive(FromPyObject)]
struct Settings {
    #[pyo3(attribute)]
    endpoint: String,
    #[pyo3(attribute)]
    rank: u32,
    #[pyo3(attribute)]
    world_size: u32,
    #[pyo3(attribute)]
    secret_file: PathBuf,
    #[pyo3(attribute)]
    instance: u64,
    #[pyo3(attribute)]
    g3_dir: Option<PathBuf>,
    #[pyo3(attribute)]
    kept_identity: Option<String>,
    #[pyo3(attribute)]
    g2_keep_dir: Option<PathBuf>,
    #[pyo3(attribute)]
    leader_timeout_s: f64,
    #[pyo3(attribute)]
    transfer_delay_ms: u64,
}

#[pymethods]
impl Worker {
    /// Registers the engine's KV tensors and starts the worker.
    ///
    /// `config` is a `kvbm_py.config.WorkerConfig`; `tensors` holds one
    /// tensor per attention layer, in layer order: any object with
    /// `__dlpack__` (a torch tensor), all on the host or all on one CUDA
    /// device (feature `cuda`; G2 is then pinned memory near it). kvbm
    /// keeps a reference to each as long as it may touch its memory.
    /// `num_blocks` is the engine's block count (it names the block
    /// axis). An unsupported tensor shape or stride is an
    /// `InvalidArgumentError` here, before anything runs.
    #[new]
    fn new(config: Settings, tensors: Vec<Bound<'_, PyAny>>, num_blocks: usize) -> PyResult<Self> {
        Ok(Self::start(config, &tensors, num_blocks)?)
    }

    /// This worker's rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// G1 blocks (the engine's).
    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Bytes of one block on this rank (all layers, K and V).
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Whether the worker still runs.
    fn is_running(&self) -> bool {
        *self.exit.lock() == Exit::Running
    }

    /// The error the worker stopped on (a `KvbmError`), `None` while it
    /// runs or when it stopped cleanly.
    fn exception(&self) -> Option<PyErr> {
        match &*self.exit.lock() {
            Exit::Failed(kind, message) => Some(kind.new_err(message.clone())),
            _ => None,
        }
    }

    /// Waits up to `timeout_s` for the worker to stop (the leader's
    /// shutdown stops it); `True` if it stopped.
    #[pyo3(signature = (timeout_s = 10.0))]
    fn join(&self, py: Python<'_>, timeout_s: f64) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs_f64(timeout_s.max(0.0));
        py.detach(|| {
            while *self.exit.lock() == Exit::Running {
                if std::time::Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            if let Some(t) = self.thread.lock().take() {
                // The thread recorded its exit; a panic has nothing to add.
                let _ = t.join();
            }
            true
        })
    }
}

impl Worker {
    /// The constructor's body.
    fn start(s: Settings, tensors: &[Bound<'_, PyAny>], num_blocks: usize) -> Result<Self> {
        if s.world_size == 0 || s.rank >= s.world_size {
            return Err(PyKvbmError::Invalid(format!(
                "rank {} of a world of {} workers",
                s.rank, s.world_size
            )));
        }
        if !(s.leader_timeout_s.is_finite() && s.leader_timeout_s > 0.0) {
            return Err(PyKvbmError::Invalid(format!(
                "leader timeout {} s",
                s.leader_timeout_s
            )));
        }
        if s.transfer_delay_ms > 0 && !cfg!(feature = "test-hooks") {
            return Err(PyKvbmError::Invalid(
                "transfer_delay_ms needs a wheel built with feature test-hooks".into(),
            ));
        }
        let (tensors, owner) = crate::dlpack::read_all(tensors)?;
        let first = tensors
            .first()
            .ok_or_else(|| PyKvbmError::Invalid("no KV tensors given".into()))?;
        let (dtype_bytes, memory) = (first.elem_bytes, first.memory);
        if let Some((i, t)) = tensors
            .iter()
            .enumerate()
            .find(|(_, t)| t.elem_bytes != dtype_bytes)
        {
            return Err(PyKvbmError::Invalid(format!(
                "KV tensor {i} has elements of {} bytes, tensor 0 of {dtype_bytes}",
                t.elem_bytes
            )));
        }
        let format = vllm_format(&first.raw.shape, num_blocks)?;
        let raw: Vec<RawTensor> = tensors.into_iter().map(|t| t.raw).collect();
        // SAFETY: the tensors' memory belongs to the engine, which keeps
        // it allocated while the Python objects live; `owner` holds them
        // and their DLPack capsules as long as any region does (and the
        // worker thread holds `owner` until the layouts are gone). The
        // engine leaves blocks alone while kvbm copies them (the connector
        // contract: loads into freshly allocated blocks, saves of blocks
        // held until kvbm read them).
        let g1 = unsafe { engine_layout(&format, &raw, dtype_bytes, memory, owner.clone()) }?;
        let c = *g1.layout().config();
        let secret = crate::secret::shared_secret(&s.secret_file)?;
        let rank = s.rank;
        let mut config = WorkerConfig::new(s.endpoint, s.instance, rank, s.world_size, g1, secret);
        config.g3_dir = s.g3_dir;
        config.kept_identity = s.kept_identity;
        config.g2_keep_dir = s.g2_keep_dir;
        config.leader_timeout = Duration::from_secs_f64(s.leader_timeout_s);
        #[cfg(feature = "test-hooks")]
        {
            config.fault_delay = Duration::from_millis(s.transfer_delay_ms);
        }
        let exit = Arc::new(Mutex::new(Exit::Running));
        let thread = {
            let exit = Arc::clone(&exit);
            std::thread::Builder::new()
                .name(format!("kvbm-worker-{rank}"))
                .spawn(move || {
                    let r = worker::run(config).map_err(PyKvbmError::from);
                    // The tensors stay referenced until the worker and its
                    // layouts over them are gone.
                    drop(owner);
                    *exit.lock() = match r {
                        Ok(()) => Exit::Ok,
                        Err(e) => Exit::Failed(e.kind(), e.to_string()),
                    };
                })
                .map_err(|e| PyKvbmError::System(format!("cannot start the worker: {e}")))?
        };
        Ok(Worker {
            thread: Mutex::new(Some(thread)),
            exit,
            rank,
            num_blocks: c.num_blocks(),
            block_bytes: c.block_bytes(),
        })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // The thread ends when the leader shuts it down or goes silent;
        // it owns everything it touches, so it may outlive this object.
        drop(self.thread.lock().take());
    }
}
