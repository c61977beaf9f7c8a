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
use kvbm_transfer::memory::Owner;
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::error::PyKvbmError;
use crate::tensors::{RawTensor, TensorMemory, engine_layout, vllm_format};

/// Keeps the engine's tensors (Python objects) alive as long as kvbm's
/// regions over them.
struct TensorKeepAlive(#[allow(dead_code)] Py<PyAny>);

/// How the worker thread ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Exit {
    Running,
    Ok,
    Failed(String),
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

fn tensors_of(tensors: Vec<(u64, Vec<usize>, Vec<usize>)>) -> Vec<RawTensor> {
    tensors
        .into_iter()
        .map(|(addr, shape, strides)| RawTensor {
            addr,
            shape,
            strides,
        })
        .collect()
}

/// What `Worker(...)` was given, in either form of the constructor.
struct WorkerArgs {
    endpoint: String,
    rank: u32,
    world_size: u32,
    tensors: Vec<(u64, Vec<usize>, Vec<usize>)>,
    dtype_bytes: usize,
    num_blocks: usize,
    keepalive: Py<PyAny>,
    secret_file: PathBuf,
    device: Option<u32>,
    g3_dir: Option<PathBuf>,
    kept_identity: Option<String>,
    g2_keep_dir: Option<PathBuf>,
    instance: u64,
    leader_timeout_s: f64,
    /// Test hook: hold every copy back this long.
    #[cfg(feature = "test-hooks")]
    transfer_delay_ms: u64,
}

#[pymethods]
impl Worker {
    /// Registers the engine's KV tensors and starts the worker.
    ///
    /// `tensors` is one `(address, shape, strides)` per attention layer, in
    /// layer order (strides in elements), `dtype_bytes` the element size,
    /// `num_blocks` the engine's block count (it names the block axis),
    /// `keepalive` any object that keeps the tensors alive (kvbm holds a
    /// reference as long as it may touch them). `device` is the CUDA
    /// ordinal of device tensors (feature `cuda`; G2 is then pinned memory
    /// near it), `None` for host tensors. An unsupported tensor shape or
    /// stride is a `ValueError` here, before anything runs.
    #[cfg(not(feature = "test-hooks"))]
    #[new]
    #[pyo3(signature = (endpoint, rank, world_size, tensors, dtype_bytes, num_blocks, keepalive, secret_file, device = None, g3_dir = None, kept_identity = None, g2_keep_dir = None, instance = 0, leader_timeout_s = 600.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        endpoint: String,
        rank: u32,
        world_size: u32,
        tensors: Vec<(u64, Vec<usize>, Vec<usize>)>,
        dtype_bytes: usize,
        num_blocks: usize,
        keepalive: Py<PyAny>,
        secret_file: PathBuf,
        device: Option<u32>,
        g3_dir: Option<PathBuf>,
        kept_identity: Option<String>,
        g2_keep_dir: Option<PathBuf>,
        instance: u64,
        leader_timeout_s: f64,
    ) -> PyResult<Self> {
        Self::start(WorkerArgs {
            endpoint,
            rank,
            world_size,
            tensors,
            dtype_bytes,
            num_blocks,
            keepalive,
            secret_file,
            device,
            g3_dir,
            kept_identity,
            g2_keep_dir,
            instance,
            leader_timeout_s,
        })
    }

    /// Registers the engine's KV tensors and starts the worker.
    ///
    /// `tensors` is one `(address, shape, strides)` per attention layer, in
    /// layer order (strides in elements), `dtype_bytes` the element size,
    /// `num_blocks` the engine's block count (it names the block axis),
    /// `keepalive` any object that keeps the tensors alive (kvbm holds a
    /// reference as long as it may touch them). `device` is the CUDA
    /// ordinal of device tensors (feature `cuda`; G2 is then pinned memory
    /// near it), `None` for host tensors. An unsupported tensor shape or
    /// stride is a `ValueError` here, before anything runs.
    ///
    /// With the test hooks (feature `test-hooks`, the test suite's wheel),
    /// `transfer_delay_ms` holds every copy back that long.
    #[cfg(feature = "test-hooks")]
    #[new]
    #[pyo3(signature = (endpoint, rank, world_size, tensors, dtype_bytes, num_blocks, keepalive, secret_file, device = None, g3_dir = None, kept_identity = None, g2_keep_dir = None, instance = 0, leader_timeout_s = 600.0, transfer_delay_ms = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        endpoint: String,
        rank: u32,
        world_size: u32,
        tensors: Vec<(u64, Vec<usize>, Vec<usize>)>,
        dtype_bytes: usize,
        num_blocks: usize,
        keepalive: Py<PyAny>,
        secret_file: PathBuf,
        device: Option<u32>,
        g3_dir: Option<PathBuf>,
        kept_identity: Option<String>,
        g2_keep_dir: Option<PathBuf>,
        instance: u64,
        leader_timeout_s: f64,
        transfer_delay_ms: u64,
    ) -> PyResult<Self> {
        Self::start(WorkerArgs {
            endpoint,
            rank,
            world_size,
            tensors,
            dtype_bytes,
            num_blocks,
            keepalive,
            secret_file,
            device,
            g3_dir,
            kept_identity,
            g2_keep_dir,
            instance,
            leader_timeout_s,
            transfer_delay_ms,
        })
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

    /// Why the worker stopped, if it stopped on an error.
    fn error(&self) -> Option<String> {
        match &*self.exit.lock() {
            Exit::Failed(e) => Some(e.clone()),
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
    /// The constructor's body, for both its forms.
    fn start(args: WorkerArgs) -> PyResult<Self> {
        let WorkerArgs {
            endpoint,
            rank,
            world_size,
            tensors,
            dtype_bytes,
            num_blocks,
            keepalive,
            secret_file,
            device,
            g3_dir,
            kept_identity,
            g2_keep_dir,
            instance,
            leader_timeout_s,
            #[cfg(feature = "test-hooks")]
            transfer_delay_ms,
        } = args;
        let tensors = tensors_of(tensors);
        let first = tensors
            .first()
            .ok_or_else(|| PyKvbmError::Invalid("no KV tensors given".into()))?;
        let format = vllm_format(&first.shape, num_blocks)?;
        let memory = device.map_or(TensorMemory::Host, TensorMemory::Device);
        if !(leader_timeout_s.is_finite() && leader_timeout_s > 0.0) {
            return Err(
                PyKvbmError::Invalid(format!("leader timeout {leader_timeout_s} s")).into(),
            );
        }
        let owner: Owner = Arc::new(TensorKeepAlive(keepalive));
        // SAFETY: the tensors' memory belongs to the engine, which keeps
        // it allocated while the Python objects in `keepalive` live; the
        // owner holds a reference to them as long as any region does. The
        // engine leaves blocks alone while kvbm copies them (the connector
        // contract: loads into freshly allocated blocks, saves of blocks
        // held until kvbm read them).
        let g1 = unsafe { engine_layout(&format, &tensors, dtype_bytes, memory, owner.clone()) }?;
        let c = *g1.layout().config();
        let secret = crate::secret::shared_secret(&secret_file)?;
        let mut config = WorkerConfig::new(endpoint, instance, rank, world_size, g1, secret);
        config.g3_dir = g3_dir;
        config.kept_identity = kept_identity;
        config.g2_keep_dir = g2_keep_dir;
        config.leader_timeout = Duration::from_secs_f64(leader_timeout_s);
        #[cfg(feature = "test-hooks")]
        {
            config.fault_delay = Duration::from_millis(transfer_delay_ms);
        }
        let exit = Arc::new(Mutex::new(Exit::Running));
        let thread = {
            let exit = Arc::clone(&exit);
            std::thread::Builder::new()
                .name(format!("kvbm-worker-{rank}"))
                .spawn(move || {
                    let r = worker::run(config);
                    // The tensors stay referenced until the worker and its
                    // layouts over them are gone.
                    drop(owner);
                    *exit.lock() = match r {
                        Ok(()) => Exit::Ok,
                        Err(e) => Exit::Failed(e.to_string()),
                    };
                })
                .map_err(|e| PyKvbmError::Invalid(format!("cannot start the worker: {e}")))?
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
