//! The scheduler side: kvbm's books in the engine's scheduler process.
//!
//! A [`Scheduler`] is a kvbm-dist leader (the workers, one per
//! tensor-parallel rank, connect to its endpoint) and a kvbm-pool
//! [`TierEngine`] whose copies the leader's `DistMover` broadcasts to every
//! worker. It matches a request's block hashes against G2 and G3, starts
//! onboards into block ids the engine allocated, queues offloads of the
//! engine's full blocks and releases requests, keyed by the engine's
//! request id. Completions are polled, so the engine's scheduler loop never
//! blocks on a copy unless it asks to.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvbm_block::{SequenceDigest, SequenceHash, VllmBlockHash};
use kvbm_dist::leader::{Leader, LeaderConfig, PendingLeader};
use kvbm_pool::Tier;
use kvbm_pool::tier::{
    G1Lookup, OnboardHandle, OnboardTarget, RetentionHint, TierEngine, TierEngineConfig, TierMover,
    TierPolicy,
};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::{PyKvbmError, Result};

/// The pool key of an engine block hash: its first 8 bytes read
/// little-endian, exactly as kvbm-block's vLLM scheme keys a
/// [`VllmBlockHash`] (so every rank and every process agrees).
pub fn sequence_hash(digest: &[u8]) -> Result<SequenceHash> {
    if digest.len() < 8 {
        return Err(PyKvbmError::Invalid(format!(
            "a block hash of {} bytes (at least 8 needed)",
            digest.len()
        )));
    }
    let mut full = [0u8; 32];
    let n = digest.len().min(32);
    full[..n].copy_from_slice(&digest[..n]);
    Ok(VllmBlockHash(full).sequence_hash())
}

/// Parses an admission policy name: `all`, `reuse_score` or `min_uses:N`.
pub fn parse_policy(name: &str) -> Result<TierPolicy> {
    match name {
        "all" | "write_through" => Ok(TierPolicy::WriteThrough),
        "reuse_score" => Ok(TierPolicy::ReuseScore),
        other => match other.strip_prefix("min_uses:").map(str::parse::<u32>) {
            Some(Ok(n)) if n > 0 => Ok(TierPolicy::MinUses(n)),
            _ => Err(PyKvbmError::Invalid(format!(
                "admission policy {other:?}: expected all, reuse_score or min_uses:N"
            ))),
        },
    }
}

/// The outcome of `Scheduler.match_prefix`.
#[pyclass(module = "kvbm_py._kvbm", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct Match {
    /// Leading blocks the engine already holds (as passed in).
    pub engine_blocks: usize,
    /// Blocks after those that kvbm holds in G2.
    pub g2_blocks: usize,
    /// Blocks after those that kvbm holds in G3.
    pub g3_blocks: usize,
    /// Whether one block was given back so the engine computes the last
    /// prompt token.
    pub gave_back: bool,
    /// Tokens kvbm can load: `(g2_blocks + g3_blocks) × block_size`.
    pub external_tokens: usize,
}

#[pymethods]
impl Match {
    fn __repr__(&self) -> String {
        format!(
            "Match(engine_blocks={}, g2_blocks={}, g3_blocks={}, gave_back={}, external_tokens={})",
            self.engine_blocks,
            self.g2_blocks,
            self.g3_blocks,
            if self.gave_back { "True" } else { "False" },
            self.external_tokens
        )
    }
}

/// The pieces a [`Scheduler`] owns; dropped engine first, then leader.
struct Inner {
    engine: Arc<TierEngine>,
    leader: Leader,
}

/// kvbm's scheduler-side object: the kvbm-dist leader and the tier engine.
///
/// Construct it after every worker was started: it waits (up to
/// `handshake_timeout_s`) for `world_size` workers to connect to
/// `endpoint`, sizes G2 and G3 from the byte budgets (summed over the
/// workers) and starts the tier engine over the workers' memory.
#[pyclass(module = "kvbm_py._kvbm")]
pub struct Scheduler {
    inner: Mutex<Option<Inner>>,
    block_size: usize,
    /// Onboards in progress, by request.
    onboards: Mutex<HashMap<String, OnboardHandle>>,
    /// Requests whose deferred release finished, not yet polled.
    released: Arc<Mutex<Vec<String>>>,
}

impl Scheduler {
    fn engine(&self) -> Result<Arc<TierEngine>> {
        self.inner
            .lock()
            .as_ref()
            .map(|i| Arc::clone(&i.engine))
            .ok_or(PyKvbmError::Closed("the scheduler"))
    }
}

/// A retention hint as Python gives it: seconds until a follow-up, or
/// `"done"`.
#[derive(FromPyObject)]
pub enum RetentionArg {
    /// A follow-up is expected within this many seconds.
    Seconds(f64),
    /// `"done"`: the conversation was closed.
    Word(String),
}

/// The hint `arg` names; a clear error for anything else.
pub fn retention_hint(arg: &RetentionArg) -> Result<RetentionHint> {
    match arg {
        RetentionArg::Seconds(s) if s.is_finite() && *s >= 0.0 && *s < 1e9 => {
            Ok(RetentionHint::ReturnsWithin(Duration::from_secs_f64(*s)))
        }
        RetentionArg::Seconds(s) => Err(PyKvbmError::Invalid(format!(
            "retention: {s} is not a time in seconds"
        ))),
        RetentionArg::Word(w) if w == "done" => Ok(RetentionHint::Done),
        RetentionArg::Word(w) => Err(PyKvbmError::Invalid(format!(
            "retention: {w:?} is neither seconds nor \"done\""
        ))),
    }
}

fn hashes_of(hashes: &[Vec<u8>]) -> Result<Vec<SequenceHash>> {
    hashes.iter().map(|h| sequence_hash(h)).collect()
}

#[pymethods]
impl Scheduler {
    /// Binds the leader on `endpoint`, waits for the workers and builds the
    /// tier engine. `g2_bytes` and `g3_bytes` are summed over all workers;
    /// `admission` is `all`, `reuse_score` or `min_uses:N` (G2 and G3).
    /// The workers must hold the instance secret published at
    /// `secret_file` (or given in `KVBM_INSTANCE_SECRET`); without either
    /// the leader draws one no worker knows. `offload_in_flight` caps the
    /// offload batches copying at once (kvbm's default when `None`; each
    /// holds its G2 targets, so a G2 of very few blocks wants 1).
    #[new]
    #[pyo3(signature = (endpoint, world_size, block_size, g2_bytes, g3_bytes = 0, instance = 0, admission = "reuse_score", handshake_timeout_s = 120.0, secret_file = None, offload_in_flight = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        endpoint: String,
        world_size: u32,
        block_size: u32,
        g2_bytes: u64,
        g3_bytes: u64,
        instance: u64,
        admission: &str,
        handshake_timeout_s: f64,
        secret_file: Option<std::path::PathBuf>,
        offload_in_flight: Option<usize>,
    ) -> PyResult<Self> {
        let policy = parse_policy(admission)?;
        if !(handshake_timeout_s.is_finite() && handshake_timeout_s > 0.0) {
            return Err(
                PyKvbmError::Invalid(format!("handshake timeout {handshake_timeout_s} s")).into(),
            );
        }
        let mut config = LeaderConfig::new(endpoint, instance, world_size, g2_bytes, g3_bytes);
        config.block_size = block_size;
        config.handshake_timeout = Duration::from_secs_f64(handshake_timeout_s);
        if let Some(path) = &secret_file {
            config.secret = Some(crate::secret::shared_secret(path)?);
        }
        let inner = py.detach(move || -> Result<Inner> {
            let leader = PendingLeader::bind(config)?.handshake()?;
            let mut engine_config = TierEngineConfig::new(block_size as usize)
                .g2_policy(policy)
                .g3_policy(policy);
            if let Some(n) = offload_in_flight {
                engine_config = engine_config.offload_in_flight(n);
            }
            let mover: Arc<dyn TierMover> = leader.mover();
            let engine = Arc::new(TierEngine::with_mover(engine_config, mover)?);
            Ok(Inner { engine, leader })
        })?;
        Ok(Scheduler {
            inner: Mutex::new(Some(inner)),
            block_size: block_size as usize,
            onboards: Mutex::default(),
            released: Arc::default(),
        })
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks per worker in each tier: `{"g1": .., "g2": .., "g3": ..}`.
    fn capacity<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.engine()?;
        let d = PyDict::new(py);
        for (name, tier) in [("g1", Tier::G1), ("g2", Tier::G2), ("g3", Tier::G3)] {
            d.set_item(name, engine.mover().capacity(tier).unwrap_or(0))?;
        }
        Ok(d)
    }

    /// Matches `request_id`'s block hashes (the engine's, one per full
    /// block, in prompt order) beyond the `engine_blocks` leading blocks
    /// the engine already holds. `prompt_tokens` applies the full-prompt
    /// rule: when everything would hit, one block is given back so the
    /// engine computes the last token. The G2/G3 blocks found are held
    /// until `onboard` or `release`.
    fn match_prefix(
        &self,
        py: Python<'_>,
        request_id: &str,
        hashes: Vec<Vec<u8>>,
        prompt_tokens: usize,
        engine_blocks: usize,
    ) -> PyResult<Match> {
        let engine = self.engine()?;
        let hashes = hashes_of(&hashes)?;
        let m = py.detach(|| {
            engine.match_request(
                request_id,
                &hashes,
                prompt_tokens,
                G1Lookup::Engine {
                    blocks: engine_blocks,
                },
            )
        });
        let m = m.map_err(PyKvbmError::from)?;
        Ok(Match {
            engine_blocks: m.g1_blocks,
            g2_blocks: m.g2_blocks,
            g3_blocks: m.g3_blocks,
            gave_back: m.gave_back,
            external_tokens: m.external_tokens(),
        })
    }

    /// Starts copying the request's matched blocks into the engine's
    /// block ids `block_ids` (one per matched block, in prefix order).
    /// Poll it with `poll_onboards` or wait with
    /// `wait_onboard`.
    fn onboard(&self, request_id: &str, block_ids: Vec<u32>) -> PyResult<()> {
        let engine = self.engine()?;
        let handle = engine
            .onboard(request_id, OnboardTarget::Blocks(block_ids))
            .map_err(PyKvbmError::from)?;
        self.onboards.lock().insert(request_id.to_owned(), handle);
        Ok(())
    }

    /// Onboards that finished since the last poll: `(loaded, failed)`,
    /// `loaded` the request ids whose every block landed, `failed` pairs of
    /// request id and error (none of their blocks counts as loaded).
    fn poll_onboards(&self, py: Python<'_>) -> (Vec<String>, Vec<(String, String)>) {
        let done: Vec<(String, OnboardHandle)> = {
            let mut onboards = self.onboards.lock();
            let ids: Vec<String> = onboards
                .iter()
                .filter(|(_, h)| h.is_done())
                .map(|(id, _)| id.clone())
                .collect();
            ids.into_iter()
                .filter_map(|id| onboards.remove(&id).map(|h| (id, h)))
                .collect()
        };
        py.detach(|| {
            let (mut ok, mut failed) = (Vec::new(), Vec::new());
            for (id, handle) in done {
                match handle.wait() {
                    Ok(_) => ok.push(id),
                    Err(e) => failed.push((id, e.to_string())),
                }
            }
            (ok, failed)
        })
    }

    /// Waits for the request's onboard: `None` when every block landed,
    /// else the error (nothing of it counts as loaded). A request without
    /// an onboard in progress is an error.
    fn wait_onboard(&self, py: Python<'_>, request_id: &str) -> PyResult<Option<String>> {
        let handle = self.onboards.lock().remove(request_id).ok_or_else(|| {
            PyKvbmError::Invalid(format!("request {request_id:?} has no onboard in progress"))
        })?;
        Ok(py.detach(|| handle.wait().err().map(|e| e.to_string())))
    }

    /// Queues the engine's full blocks `block_ids` of `request_id`, named
    /// by `hashes` (one per block, consecutive along the prompt, `parent`
    /// the hash of the block before the first, if any), for offload to G2.
    /// The engine must leave their bytes unchanged until the request is
    /// released.
    #[pyo3(signature = (request_id, block_ids, hashes, parent = None))]
    fn offload(
        &self,
        request_id: &str,
        block_ids: Vec<u32>,
        hashes: Vec<Vec<u8>>,
        parent: Option<Vec<u8>>,
    ) -> PyResult<()> {
        if block_ids.len() != hashes.len() {
            return Err(PyKvbmError::Invalid(format!(
                "{} block ids for {} hashes",
                block_ids.len(),
                hashes.len()
            ))
            .into());
        }
        let engine = self.engine()?;
        let hashes = hashes_of(&hashes)?;
        let mut parent = parent.as_deref().map(sequence_hash).transpose()?;
        let blocks: Vec<_> = block_ids
            .into_iter()
            .zip(hashes)
            .map(|(id, h)| {
                let p = parent.replace(h);
                (id, h, p)
            })
            .collect();
        engine.offload_engine_blocks(request_id, &blocks);
        Ok(())
    }

    /// Forgets the request: cancels its offloads not yet started and waits
    /// for running ones and for any onboard still writing its blocks.
    /// After it returns the engine may reuse the request's blocks. `False`
    /// if the request was unknown. `retention`, seconds until a follow-up
    /// or `"done"`, is a hint for the request's matched blocks.
    #[pyo3(signature = (request_id, retention = None))]
    fn release(
        &self,
        py: Python<'_>,
        request_id: &str,
        retention: Option<RetentionArg>,
    ) -> PyResult<bool> {
        let engine = self.engine()?;
        if let Some(r) = &retention {
            engine.hint_request(request_id, retention_hint(r)?);
        }
        self.onboards.lock().remove(request_id);
        Ok(py.detach(|| engine.release(request_id)))
    }

    /// Lets the request's queued offloads run (not other requests'), then
    /// releases it, on a thread of its own; the id then shows in
    /// `poll_released`. For an engine that keeps a
    /// finished request's blocks until kvbm read them. `retention` as in
    /// `release`.
    #[pyo3(signature = (request_id, retention = None))]
    fn release_after_offloads(
        &self,
        request_id: String,
        retention: Option<RetentionArg>,
    ) -> PyResult<()> {
        let engine = self.engine()?;
        if let Some(r) = &retention {
            engine.hint_request(request_id.as_str(), retention_hint(r)?);
        }
        self.onboards.lock().remove(&request_id);
        let released = Arc::clone(&self.released);
        std::thread::Builder::new()
            .name("kvbm-release".into())
            .spawn(move || {
                engine.release_after_offloads(request_id.as_str());
                released.lock().push(request_id);
            })
            .map_err(|e| PyKvbmError::Invalid(format!("cannot start a release: {e}")))?;
        Ok(())
    }

    /// Request ids whose deferred release finished since the last poll.
    fn poll_released(&self) -> Vec<String> {
        std::mem::take(&mut *self.released.lock())
    }

    /// Waits until every queued offload was processed.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self.engine()?;
        py.detach(|| engine.flush());
        Ok(())
    }

    /// Requests kvbm knows (matched and not released).
    fn live_requests(&self) -> PyResult<usize> {
        Ok(self.engine()?.live_requests())
    }

    /// Counters: blocks and bytes per path (`g1_to_g2`, `g2_to_g3`,
    /// `g2_to_g1`, `g3_to_g1`), offloads skipped, onboard failures,
    /// matches, hits per tier, the offload queue depth, and the blocks each
    /// tier holds now.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.engine()?;
        let s = engine.stats();
        let d = PyDict::new(py);
        let paths = ["g1_to_g2", "g2_to_g3", "g2_to_g1", "g3_to_g1"];
        for (i, p) in paths.iter().enumerate() {
            d.set_item(format!("{p}_blocks"), s.blocks[i])?;
            d.set_item(format!("{p}_bytes"), s.bytes[i])?;
        }
        d.set_item("offloads_skipped", s.skipped.iter().sum::<u64>())?;
        d.set_item("onboard_failures", s.onboard_failures)?;
        d.set_item("requests", s.requests)?;
        d.set_item("lookups", s.lookups)?;
        d.set_item("hits_g1", s.hits[0])?;
        d.set_item("hits_g2", s.hits[1])?;
        d.set_item("hits_g3", s.hits[2])?;
        d.set_item("queue_depth", s.queue_depth)?;
        for (name, tier) in [("g2", Tier::G2), ("g3", Tier::G3)] {
            let held = engine
                .pool(tier)
                .map_or(0, |p| p.capacity() - p.counts().free);
            d.set_item(format!("{name}_used_blocks"), held)?;
        }
        Ok(d)
    }

    /// Drops every G2 and G3 block no request holds (an engine's cache
    /// reset); returns how many.
    fn reset(&self) -> PyResult<usize> {
        Ok(kvbm_dist::leader::evict_distributed_tiers(&*self.engine()?))
    }

    /// Stops the tier engine and tells every worker to exit. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        let inner = self.inner.lock().take();
        self.onboards.lock().clear();
        if let Some(inner) = inner {
            py.detach(move || {
                drop(inner.engine);
                inner.leader.shutdown();
            });
        }
    }
}
