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
use std::sync::mpsc::Receiver;
use std::time::Duration;

use kvbm_block::{SequenceDigest, SequenceHash, VllmBlockHash};
use kvbm_dist::kept::{HISTORY_EVERY, HistoryKeeper, HistoryWriter};
use kvbm_dist::leader::{Leader, LeaderConfig, PendingLeader, RankState};
use kvbm_pool::tier::{
    G1Lookup, OnboardHandle, OnboardTarget, RetentionHint, TierEngine, TierPolicy,
    default_g3_staging_bytes,
};
use kvbm_pool::{KvEvent, KvEventBatch, Tier};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

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
    // vLLM's digests are 32 bytes: a fixed-size copy (a shorter one is
    // padded with zeros).
    let full = match digest.first_chunk::<32>() {
        Some(full) => *full,
        None => {
            let mut full = [0u8; 32];
            full[..digest.len()].copy_from_slice(digest);
            full
        }
    };
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

/// The last answer of `match_prefix` for a request and what it depended
/// on: while none of it changed, the same call gives the same answer.
#[derive(Clone)]
struct LastMatch {
    /// The engine's stored-blocks generation when it was computed.
    generation: u64,
    engine_blocks: usize,
    prompt_tokens: usize,
    /// How many keys it matched over.
    keys: usize,
    result: Match,
}

/// What the scheduler keeps per request between calls, until `release`.
#[derive(Default)]
struct Tracked {
    /// kvbm keys of the request's block hashes, converted once each.
    keys: Vec<SequenceHash>,
    /// Reusable while the engine still holds the match (no onboard or
    /// release since) and nothing was stored into G2/G3.
    last: Option<LastMatch>,
}

/// The key of one engine block hash given as a Python object (`bytes`).
fn key_of(item: &Bound<'_, PyAny>) -> PyResult<SequenceHash> {
    let digest: &[u8] = item.extract().map_err(|_| {
        PyKvbmError::Invalid(format!(
            "a block hash must be bytes, not {}",
            item.get_type()
                .name()
                .map_or_else(|_| "?".to_owned(), |n| n.to_string())
        ))
    })?;
    Ok(sequence_hash(digest)?)
}

/// Brings `keys` up to date with the engine's block hashes `hashes`,
/// converting only those not seen yet. The engine's hash list only grows
/// for a request; a shorter list, or one whose last already converted hash
/// differs, starts over.
fn extend_keys(keys: &mut Vec<SequenceHash>, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
    let Ok(list) = hashes.cast::<PyList>() else {
        keys.clear();
        for item in hashes.try_iter()? {
            keys.push(key_of(&item?)?);
        }
        return Ok(());
    };
    let len = list.len();
    let mut from = keys.len();
    if from > len || (from > 0 && key_of(&list.get_item(from - 1)?)? != keys[from - 1]) {
        keys.clear();
        from = 0;
    }
    keys.reserve(len - from);
    for i in from..len {
        keys.push(key_of(&list.get_item(i)?)?);
    }
    Ok(())
}

/// The tier name an event carries to Python.
fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::G1 => "g1",
        Tier::G2 => "g2",
        Tier::G3 => "g3",
        Tier::G4 => "g4",
    }
}

/// The pieces a [`Scheduler`] owns; dropped engine first, then leader.
struct Inner {
    /// Writes the engine's use history beside the kept tiers (dropped
    /// first: it writes once more while the engine lives).
    history: Option<HistoryWriter>,
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
    /// Per-request keys and last match, by request.
    tracked: Mutex<HashMap<String, Tracked>>,
    /// The tiers' KV events, once `subscribe_events` was called.
    events: Mutex<Option<Receiver<KvEventBatch>>>,
}

impl Scheduler {
    fn engine(&self) -> Result<Arc<TierEngine>> {
        self.inner
            .lock()
            .as_ref()
            .map(|i| Arc::clone(&i.engine))
            .ok_or(PyKvbmError::Closed("the scheduler"))
    }

    /// Blocks that failed their checksum in verify mode, summed over
    /// workers, as the leader counted them.
    fn verify_mismatches(&self) -> Result<u64> {
        self.inner
            .lock()
            .as_ref()
            .map(|i| i.leader.status().verify_mismatches)
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

impl Scheduler {
    /// Forgets the request's keys and last match.
    fn untrack(&self, request_id: &str) {
        self.tracked.lock().remove(request_id);
    }

    /// Forgets the request's last match (its engine state changed).
    fn invalidate(&self, request_id: &str) {
        if let Some(t) = self.tracked.lock().get_mut(request_id) {
            t.last = None;
        }
    }
}

/// Bytes of host memory, beyond `g2_bytes`, that G3 blocks are read into
/// at match (G3 prefetch): `asked` when given, else kvbm's default (at
/// most an eighth of G2); none without a G3.
fn staging_bytes(g2_bytes: u64, g3_bytes: u64, asked: Option<u64>) -> u64 {
    if g3_bytes == 0 {
        return 0;
    }
    asked.unwrap_or_else(|| default_g3_staging_bytes(g2_bytes))
}

/// A scheduler's settings, read from `kvbm_py.config.SchedulerConfig` (or
/// any object with its attributes).
#[derive(FromPyObject)]
struct SchedulerSettings {
    #[pyo3(attribute)]
    endpoint: String,
    #[pyo3(attribute)]
    world_size: u32,
    #[pyo3(attribute)]
    block_size: u32,
    #[pyo3(attribute)]
    g2_bytes: u64,
    #[pyo3(attribute)]
    g3_bytes: u64,
    #[pyo3(attribute)]
    instance: u64,
    #[pyo3(attribute)]
    admission: String,
    #[pyo3(attribute)]
    handshake_timeout_s: f64,
    #[pyo3(attribute)]
    secret_file: Option<std::path::PathBuf>,
    #[pyo3(attribute)]
    offload_in_flight: Option<usize>,
    #[pyo3(attribute)]
    g3_staging_bytes: Option<u64>,
    #[pyo3(attribute)]
    verify: bool,
    #[pyo3(attribute)]
    history_path: Option<std::path::PathBuf>,
}

#[pymethods]
impl Scheduler {
    /// Binds the leader on `config.endpoint`, waits for the workers and
    /// builds the tier engine. `config` is a
    /// `kvbm_py.config.SchedulerConfig` (its fields say what each
    /// setting means). A setting kvbm cannot use is an
    /// `InvalidArgumentError` here, before anything is bound.
    #[new]
    fn new(py: Python<'_>, config: SchedulerSettings) -> PyResult<Self> {
        let SchedulerSettings {
            endpoint,
            world_size,
            block_size,
            g2_bytes,
            g3_bytes,
            instance,
            admission,
            handshake_timeout_s,
            secret_file,
            offload_in_flight,
            g3_staging_bytes,
            verify,
            history_path,
        } = config;
        let policy = parse_policy(&admission)?;
        if !(handshake_timeout_s.is_finite() && handshake_timeout_s > 0.0) {
            return Err(
                PyKvbmError::Invalid(format!("handshake timeout {handshake_timeout_s} s")).into(),
            );
        }
        let staging = staging_bytes(g2_bytes, g3_bytes, g3_staging_bytes);
        let mut config = LeaderConfig::new(
            endpoint,
            instance,
            world_size,
            g2_bytes.saturating_add(staging),
            g3_bytes,
        );
        config.block_size = block_size;
        config.verify = verify;
        config.handshake_timeout = Duration::from_secs_f64(handshake_timeout_s);
        if let Some(path) = &secret_file {
            config.secret = Some(crate::secret::shared_secret(path)?);
        }
        let inner = py.detach(move || -> Result<Inner> {
            let leader = PendingLeader::bind(config)?.handshake()?;
            // The staging area is the last `staging` bytes of the leader's
            // G2, in whole blocks.
            let mut builder = TierEngine::builder_with_mover(leader.mover(), block_size as usize)
                .g2_policy(policy)
                .g3_policy(policy)
                .g3_staging_bytes(staging);
            if let Some(n) = offload_in_flight {
                builder = builder.offload_in_flight(n);
            }
            let engine = Arc::new(builder.build()?);
            // What the workers' kept tiers held before this engine
            // started, ranked by the history written beside them.
            let history = history_path.map(|p| HistoryKeeper::new(p, HISTORY_EVERY));
            if let Some(h) = &history {
                h.load(&*engine);
            }
            leader.restore_kept(&engine);
            let history = history
                .map(|h| h.spawn(&engine))
                .transpose()
                .map_err(|source| kvbm_dist::DistError::Io {
                    what: "start the use-history thread",
                    source,
                })?;
            Ok(Inner {
                history,
                engine,
                leader,
            })
        })?;
        Ok(Scheduler {
            inner: Mutex::new(Some(inner)),
            block_size: block_size as usize,
            onboards: Mutex::default(),
            released: Arc::default(),
            tracked: Mutex::default(),
            events: Mutex::default(),
        })
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    /// G2 blocks set aside as the G3 prefetch's staging area (0: none).
    #[getter]
    fn g3_staging_blocks(&self) -> PyResult<usize> {
        Ok(self.engine()?.g3_staging_blocks())
    }

    /// Staging blocks free now (the others hold G3 blocks read for
    /// matched requests).
    fn staging_free_blocks(&self) -> PyResult<usize> {
        Ok(self.engine()?.staging_free_blocks())
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

    /// Each rank's state as the leader sees it: `"live"`, `"rejoining"`
    /// or `"lost: <why>"`. While a rank is not live, copies fail (and are
    /// reported so); a lost rank's G2 and G3 bytes are gone.
    fn ranks(&self) -> PyResult<Vec<String>> {
        let inner = self.inner.lock();
        let inner = inner.as_ref().ok_or(PyKvbmError::Closed("the scheduler"))?;
        Ok(inner
            .leader
            .status()
            .ranks
            .into_iter()
            .map(|r| match r {
                RankState::Live => "live".to_string(),
                RankState::Rejoining => "rejoining".to_string(),
                RankState::Lost { reason } => format!("lost: {reason}"),
            })
            .collect())
    }

    /// Matches `request_id`'s block hashes (the engine's, one per full
    /// block, in prompt order: a list of `bytes`) beyond the
    /// `engine_blocks` leading blocks the engine already holds.
    /// `prompt_tokens` applies the full-prompt rule: when everything would
    /// hit, one block is given back so the engine computes the last token.
    /// The G2/G3 blocks found are held until `onboard` or `release`.
    ///
    /// Calls for the same request (a waiting request is matched every
    /// scheduler step) convert only the hashes not seen before, and give
    /// the previous answer without matching again while the arguments are
    /// the same and nothing was stored into G2/G3 since. `release` forgets
    /// the request.
    fn match_prefix(
        &self,
        request_id: &str,
        hashes: &Bound<'_, PyAny>,
        prompt_tokens: usize,
        engine_blocks: usize,
    ) -> PyResult<Match> {
        let engine = self.engine()?;
        let generation = engine.stored_generation();
        let mut tracked = self.tracked.lock();
        if !tracked.contains_key(request_id) {
            tracked.insert(request_id.to_owned(), Tracked::default());
        }
        let Some(t) = tracked.get_mut(request_id) else {
            unreachable!("inserted above")
        };
        extend_keys(&mut t.keys, hashes)?;
        if let Some(last) = &t.last
            && last.generation == generation
            && last.engine_blocks == engine_blocks
            && last.prompt_tokens == prompt_tokens
            && last.keys == t.keys.len()
        {
            return Ok(last.result.clone());
        }
        // Matched while holding the GIL: a match takes microseconds and
        // never waits for Python, and releasing the GIL costs about as much.
        let m = engine
            .match_request(
                request_id,
                &t.keys,
                prompt_tokens,
                G1Lookup::Engine {
                    blocks: engine_blocks,
                },
            )
            .map_err(PyKvbmError::from)?;
        let result = Match {
            engine_blocks: m.g1_blocks,
            g2_blocks: m.g2_blocks,
            g3_blocks: m.g3_blocks,
            gave_back: m.gave_back,
            external_tokens: m.external_tokens(),
        };
        t.last = Some(LastMatch {
            generation,
            engine_blocks,
            prompt_tokens,
            keys: t.keys.len(),
            result: result.clone(),
        });
        Ok(result)
    }

    /// Requests whose keys the scheduler keeps (matched, not released).
    fn tracked_requests(&self) -> usize {
        self.tracked.lock().len()
    }

    /// Starts copying the request's matched blocks into the engine's
    /// block ids `block_ids` (one per matched block, in prefix order).
    /// Poll it with `poll_onboards` or wait with
    /// `wait_onboard`.
    fn onboard(&self, request_id: &str, block_ids: Vec<u32>) -> PyResult<()> {
        let engine = self.engine()?;
        self.invalidate(request_id);
        let handle = engine
            .onboard(request_id, OnboardTarget::Blocks(block_ids))
            .map_err(PyKvbmError::from)?;
        self.onboards.lock().insert(request_id.to_owned(), handle);
        Ok(())
    }

    /// Onboards that finished since the last poll: `(loaded, failed)`,
    /// `loaded` the request ids whose every block landed, `failed` pairs of
    /// request id and the exception it failed with (a `TransferError`, or
    /// a `ClosedError` once the scheduler shut down; none of their blocks
    /// counts as loaded).
    fn poll_onboards(&self, py: Python<'_>) -> (Vec<String>, Vec<(String, PyErr)>) {
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
        let (ok, failed) = py.detach(|| {
            let (mut ok, mut failed) = (Vec::new(), Vec::new());
            for (id, handle) in done {
                match handle.wait() {
                    Ok(_) => ok.push(id),
                    Err(e) => failed.push((id, PyKvbmError::from(e))),
                }
            }
            (ok, failed)
        });
        let failed = failed.into_iter().map(|(id, e)| (id, e.into())).collect();
        (ok, failed)
    }

    /// Waits for the request's onboard; returns when every block landed
    /// and raises what it failed with otherwise (a `TransferError`;
    /// nothing of it counts as loaded). A request without an onboard in
    /// progress is an `InvalidArgumentError`.
    fn wait_onboard(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        let handle = self.onboards.lock().remove(request_id).ok_or_else(|| {
            PyKvbmError::Invalid(format!("request {request_id:?} has no onboard in progress"))
        })?;
        py.detach(|| handle.wait())
            .map(drop)
            .map_err(|e| PyKvbmError::from(e).into())
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
        self.untrack(request_id);
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
        self.untrack(&request_id);
        let released = Arc::clone(&self.released);
        std::thread::Builder::new()
            .name("kvbm-release".into())
            .spawn(move || {
                engine.release_after_offloads(request_id.as_str());
                released.lock().push(request_id);
            })
            .map_err(|e| PyKvbmError::System(format!("cannot start a release: {e}")))?;
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

    /// Counters: blocks, bytes, copies (`_transfers`) and the seconds
    /// those copies took, summed, per path (`g1_to_g2`, `g2_to_g3`,
    /// `g2_to_g1`, `g3_to_g1`, `g1_to_g3`), offloads skipped (policy
    /// decisions), blocks whose copy failed (`copy_failures`, every path and
    /// cause; `copy_failures_by` maps `path/errno` to blocks), onboard failures,
    /// matches, hits per tier, the offload queue depth, the blocks each
    /// tier holds now, and blocks that failed their checksum in verify
    /// mode (`verify_mismatches`, summed over workers; 0 when off).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.engine()?;
        let s = engine.stats();
        let d = PyDict::new(py);
        let paths = ["g1_to_g2", "g2_to_g3", "g2_to_g1", "g3_to_g1", "g1_to_g3"];
        for (i, p) in paths.iter().enumerate() {
            d.set_item(format!("{p}_blocks"), s.blocks[i])?;
            d.set_item(format!("{p}_bytes"), s.bytes[i])?;
            d.set_item(format!("{p}_transfers"), s.transfers[i])?;
            d.set_item(format!("{p}_seconds"), s.transfer_nanos[i] as f64 * 1e-9)?;
        }
        d.set_item("offloads_skipped", s.skipped.iter().sum::<u64>())?;
        d.set_item(
            "offloads_not_admitted",
            s.skipped_for(kvbm_pool::metrics::SkipReason::NotAdmitted),
        )?;
        let failures: u64 = s.copy_failures.iter().map(|f| f.blocks).sum();
        d.set_item("copy_failures", failures)?;
        let by = PyDict::new(py);
        for f in &s.copy_failures {
            by.set_item(format!("{}/{}", f.path.label(), f.cause), f.blocks)?;
        }
        d.set_item("copy_failures_by", by)?;
        d.set_item("onboard_failures", s.onboard_failures)?;
        d.set_item("requests", s.requests)?;
        d.set_item("lookups", s.lookups)?;
        d.set_item("hits_g1", s.hits[0])?;
        d.set_item("hits_g2", s.hits[1])?;
        d.set_item("hits_g3", s.hits[2])?;
        d.set_item("queue_depth", s.queue_depth)?;
        d.set_item("g3_recovered_blocks", s.g3_recovered)?;
        d.set_item("g3_rejected_blocks", s.g3_rejected)?;
        d.set_item("g2_recovered_blocks", s.g2_recovered)?;
        d.set_item("g2_rejected_blocks", s.g2_rejected)?;
        d.set_item("g3_unreadable_blocks", s.g3_unreadable)?;
        d.set_item("verify_mismatches", self.verify_mismatches()?)?;
        for (name, tier) in [("g2", Tier::G2), ("g3", Tier::G3)] {
            let held = engine
                .pool(tier)
                .map_or(0, |p| p.capacity() - p.counts().free);
            d.set_item(format!("{name}_used_blocks"), held)?;
        }
        Ok(d)
    }

    /// Starts collecting the tiers' KV events for `take_events` (the first
    /// ones describe what the tiers hold now). Idempotent.
    fn subscribe_events(&self) -> PyResult<()> {
        let engine = self.engine()?;
        let mut events = self.events.lock();
        if events.is_none() {
            *events = Some(engine.subscribe());
        }
        Ok(())
    }

    /// The KV events since the last call, in order, as tuples
    /// `(stored, tier, key, parent)`: `stored` is `True` for a block stored
    /// in `tier` (`"g2"` or `"g3"`) and `False` for one removed from it;
    /// `key` is the block's kvbm key (see `sequence_hash`), `parent` its
    /// parent's (stored events only, `None` for a first block). G1 events
    /// are left out: the engine reports its own G1. Empty until
    /// `subscribe_events`.
    #[allow(clippy::type_complexity)]
    fn take_events(&self) -> Vec<(bool, &'static str, u64, Option<u64>)> {
        let events = self.events.lock();
        let Some(rx) = events.as_ref() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for batch in rx.try_iter() {
            for e in batch.iter() {
                match *e {
                    KvEvent::Stored { tier: Tier::G1, .. }
                    | KvEvent::Removed { tier: Tier::G1, .. } => {}
                    KvEvent::Stored { hash, parent, tier } => {
                        out.push((true, tier_name(tier), hash.0, parent.map(|p| p.0)));
                    }
                    KvEvent::Removed { hash, tier } => {
                        out.push((false, tier_name(tier), hash.0, None));
                    }
                }
            }
        }
        out
    }

    /// Drops every G2 and G3 block no request holds (an engine's cache
    /// reset), empties the records of the tiers kept across restarts and
    /// keeps nothing stored from now on (what the engine computes next may
    /// come from other weights than a restarted engine loads); returns how
    /// many blocks it dropped.
    fn reset(&self) -> PyResult<usize> {
        let engine = {
            let inner = self.inner.lock();
            let inner = inner.as_ref().ok_or(PyKvbmError::Closed("the scheduler"))?;
            inner.leader.mover().stop_keeping();
            Arc::clone(&inner.engine)
        };
        Ok(kvbm_dist::leader::evict_distributed_tiers(&engine))
    }

    /// Writes the use history beside the kept tiers now (for a process
    /// about to exit without a shutdown); whether it wrote one.
    fn save_history(&self, py: Python<'_>) -> bool {
        let guard = self.inner.lock();
        let Some(writer) = guard.as_ref().and_then(|i| i.history.as_ref()) else {
            return false;
        };
        py.detach(|| writer.save_now())
    }

    /// Stops the tier engine and tells every worker to exit. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        let inner = self.inner.lock().take();
        self.onboards.lock().clear();
        self.tracked.lock().clear();
        self.events.lock().take();
        if let Some(inner) = inner {
            py.detach(move || {
                // The last write of the use history needs the engine.
                drop(inner.history);
                drop(inner.engine);
                inner.leader.shutdown();
            });
        }
    }
}
