//! The scheduler's half of kvbm as a backend of vLLM's offloading
//! connector: [`OffloadBooks`] (kvbm-pool's [`Ledger`]); the ranks' half is
//! [`PageWorker`](crate::page_worker::PageWorker).
//!
//! Keys are vLLM's offload keys: a block hash followed by the 4-byte
//! big-endian KV cache group index. kvbm files one under the block's
//! sequence hash (its first 8 bytes, as [`sequence_hash`] reads them)
//! mixed with the group, so the same block of two groups has two keys.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvbm_block::{BuildSequenceHasher, SequenceHash};
use kvbm_dist::kept::{HISTORY_EVERY, HistoryKeeper, HistoryWriter};
use kvbm_pool::Tier;
use kvbm_pool::ledger::{Ledger, Presence};
use kvbm_pool::policy::{HistorySnapshot, HistorySource, RetentionHint};
use parking_lot::Mutex;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::error::{PyKvbmError, Result};
use crate::offload_keys::OffloadKeys;
use crate::scheduler::{RetentionArg, parse_policy, retention_hint, sequence_hash};

/// kvbm's key of one vLLM offload key (`hash || group`, the group as 4
/// big-endian bytes).
pub fn offload_key(key: &[u8]) -> Result<SequenceHash> {
    if key.len() < 12 {
        return Err(PyKvbmError::Invalid(format!(
            "an offload key of {} bytes: expected a block hash of at least 8 and a 4-byte group",
            key.len()
        )));
    }
    let (hash, group) = key.split_at(key.len() - 4);
    let group = u32::from_be_bytes([group[0], group[1], group[2], group[3]]);
    let base = sequence_hash(hash)?.0;
    // Group 0 keeps the block's own key, so a single-group model's keys
    // are the sequence hashes kvbm uses everywhere else.
    Ok(SequenceHash(
        base ^ u64::from(group).wrapping_mul(0x9e37_79b9_7f4a_7c15),
    ))
}

/// The kvbm keys of a sequence of offload keys: an [`OffloadKeys`] read
/// in place, any other (a list of `bytes`) key by key.
fn kvbm_keys(keys: &Bound<'_, PyAny>) -> PyResult<Vec<SequenceHash>> {
    if let Ok(k) = keys.cast::<OffloadKeys>()
        && let Some(kvbm) = k.borrow().kvbm_keys()
    {
        return Ok(kvbm);
    }
    keys.try_iter()?.map(|k| listed_key(&k?)).collect()
}

/// kvbm's key of an offload key in a Python list (a `bytes`).
fn listed_key(key: &Bound<'_, PyAny>) -> PyResult<SequenceHash> {
    Ok(offload_key(key.cast::<PyBytes>()?.as_bytes())?)
}

fn keys_of(keys: &[Vec<u8>]) -> Result<Vec<SequenceHash>> {
    keys.iter().map(|k| offload_key(k)).collect()
}

/// What [`OffloadBooks::reserve`] returns to Python: `(index into keys,
/// slot)` per key to write, `(kvbm key, G2 slot, G3 slot)` per block to
/// move to G3 first, the kvbm keys no tier holds any more, refused and
/// full counts, and `(kvbm key, G2 slot)` per block that left G2 for
/// these slots.
type Reserved = (
    Vec<(usize, u32)>,
    Vec<(u64, u32, u32)>,
    Vec<u64>,
    usize,
    usize,
    Vec<(u64, u32)>,
);

/// The keys one request asked for, in the order first asked, and how
/// many of them the use history has.
#[derive(Default)]
struct Asked {
    all: HashSet<SequenceHash, BuildSequenceHasher>,
    order: Vec<SequenceHash>,
    recorded: usize,
}

/// The books and what each request asked for, shared with the lookup
/// callable that vLLM calls key by key.
struct Books {
    ledger: Ledger,
    asked: Mutex<HashMap<String, Asked>>,
}

impl Books {
    fn note(&self, req: &str, keys: impl IntoIterator<Item = SequenceHash>) {
        let mut asked = self.asked.lock();
        let a = match asked.get_mut(req) {
            Some(a) => a,
            None => asked.entry(req.to_owned()).or_default(),
        };
        for k in keys {
            if a.all.insert(k) {
                a.order.push(k);
            }
        }
    }

    /// Records in the use history what `req` asked for since the last
    /// call; returns the request's entry to the caller when `finished`
    /// (then it is forgotten).
    fn record(&self, req: &str, finished: bool) -> Option<Asked> {
        let mut asked = self.asked.lock();
        let a = asked.get_mut(req)?;
        let fresh = a.order[a.recorded..].to_vec();
        a.recorded = a.order.len();
        let done = if finished { asked.remove(req) } else { None };
        drop(asked);
        if !fresh.is_empty() {
            self.ledger.record_request(&fresh);
        }
        done
    }

    /// Whether `key` can be loaded now. A block whose store is in flight
    /// cannot: asking again later would hold the request back for a copy
    /// that may fail, so every lookup counts it a miss.
    fn loadable(&self, key: SequenceHash) -> bool {
        matches!(self.ledger.presence(key), Presence::Ready)
    }

    /// Records what finished request `req` asked for and forgets it; its
    /// keys get `hint`, if any.
    fn finish(&self, req: &str, hint: Option<RetentionHint>) {
        if let (Some(asked), Some(hint)) = (self.record(req, true), hint) {
            self.ledger.retain(&asked.order, hint);
        }
    }
}

/// The scheduler's books of the host tier (and of a disk tier behind it):
/// which block each slot holds, and which keys each request asked for
/// (the reuse ranking learns from them).
#[pyclass(module = "kvbm_py._kvbm")]
pub struct OffloadBooks {
    books: Arc<Books>,
    /// Writes the use history beside a kept disk tier (see `keep_history`).
    history: Mutex<Option<HistoryWriter>>,
}

/// The books' use history, kept beside a kept disk tier.
impl HistorySource for Books {
    fn history_changes(&self, seq: u64) -> HistorySnapshot {
        self.ledger.history_changes(seq)
    }

    fn restore_history(&self, snapshot: &HistorySnapshot) {
        self.ledger.restore_history(snapshot)
    }
}

/// vLLM's per-key lookup as one call into the books: `(offload key,
/// request context) -> hit or miss`, noting the key as asked for by the
/// request. Built by `OffloadBooks.lookup_fn`.
#[pyclass(module = "kvbm_py._kvbm")]
pub struct KeyLookup {
    books: Arc<Books>,
    hit: Py<PyAny>,
    miss: Py<PyAny>,
}

#[pymethods]
impl KeyLookup {
    fn __call__(
        &self,
        py: Python<'_>,
        key: &[u8],
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let key = offload_key(key)?;
        let req = req_context.getattr(intern!(py, "req_id"))?;
        self.books.note(req.cast::<PyString>()?.to_str()?, [key]);
        Ok(if self.books.loadable(key) {
            self.hit.clone_ref(py)
        } else {
            self.miss.clone_ref(py)
        })
    }
}

/// Unpacks `(slot, kvbm key)` entries (see `kept_common`), takes them up
/// with `take` and returns the keys taken up.
fn restore(
    blocks: &[u8],
    take: impl FnOnce(&[(u32, SequenceHash)]) -> Vec<(u32, SequenceHash)>,
) -> PyResult<Vec<u64>> {
    let blocks: Vec<(u32, SequenceHash)> = crate::kept::unpack_kept(blocks)?
        .into_iter()
        .map(|(s, k)| (s, SequenceHash(k)))
        .collect();
    Ok(take(&blocks).into_iter().map(|(_, k)| k.0).collect())
}

#[pymethods]
impl OffloadBooks {
    /// Books for `slots` host slots and `disk_slots` disk slots behind
    /// them (none when 0); `admission` is `"all"`, `"reuse_score"` or
    /// `"min_uses:N"`.
    #[new]
    #[pyo3(signature = (slots, admission = "reuse_score", disk_slots = 0))]
    fn new(slots: usize, admission: &str, disk_slots: usize) -> PyResult<Self> {
        if slots == 0 {
            return Err(PyKvbmError::Invalid("an offload tier of 0 slots".into()).into());
        }
        let policy = parse_policy(admission)?;
        let ledger = Ledger::with_disk(slots, disk_slots, policy)
            .map_err(|e| PyKvbmError::Invalid(e.to_string()))?;
        let books = Arc::new(Books {
            ledger,
            asked: Mutex::new(HashMap::new()),
        });
        Ok(OffloadBooks {
            books,
            history: Mutex::new(None),
        })
    }

    /// A callable `(offload key, request context) -> hit or miss` for
    /// vLLM's per-key lookup: `hit` where the key is loadable, `miss`
    /// otherwise; the key is noted as asked for by `req_context.req_id`.
    fn lookup_fn(&self, hit: Py<PyAny>, miss: Py<PyAny>) -> KeyLookup {
        KeyLookup {
            books: Arc::clone(&self.books),
            hit,
            miss,
        }
    }

    /// How many of `keys`, from the first, are loadable: what vLLM's
    /// prefix lookup finds asking the `lookup_fn` callable key by key,
    /// in one call. The keys it would have asked (up to the first one not
    /// loadable, that one included) are noted as asked for by `req`.
    fn lookup_prefix(&self, keys: &Bound<'_, PyAny>, req: &str) -> PyResult<usize> {
        let keys = kvbm_keys(keys)?;
        let hits = self.books.ledger.ready_prefix(&keys);
        self.books
            .note(req, keys[..keys.len().min(hits + 1)].iter().copied());
        Ok(hits)
    }

    /// vLLM's sliding-window lookup in one call: scanning `keys` from the
    /// last, the end (an index into `keys`, exclusive) of the first run of
    /// `window` consecutive loadable keys, where a run that ends at the
    /// last key needs `first_window` of them; when no run is long enough,
    /// how many keys at the start are loadable. The keys it scans are
    /// noted as asked for by `req`, as the per-key lookups note them.
    fn lookup_window(
        &self,
        keys: &Bound<'_, PyAny>,
        req: &str,
        window: usize,
        first_window: usize,
    ) -> PyResult<usize> {
        let keys = kvbm_keys(keys)?;
        let mut asked = Vec::new();
        let (mut run, mut need) = (0, first_window);
        let mut end = None;
        for (i, &key) in keys.iter().enumerate().rev() {
            asked.push(key);
            if self.books.loadable(key) {
                run += 1;
            } else {
                // A gap: no shorter window to its right counts any more.
                run = 0;
                need = window;
            }
            if run == need {
                end = Some(i + need);
                break;
            }
        }
        self.books.note(req, asked);
        Ok(end.unwrap_or(run))
    }

    /// Notes `keys` as asked for by request `req`.
    fn note(&self, req: &str, keys: Vec<Vec<u8>>) -> PyResult<()> {
        self.books.note(req, keys_of(&keys)?);
        Ok(())
    }

    /// Records in the use history the keys request `req` asked for since
    /// the last call.
    fn record(&self, req: &str) {
        self.books.record(req, false);
    }

    /// Records what finished request `req` asked for and forgets it; its
    /// keys get the retention `hint` (seconds until a follow-up, or
    /// `"done"`), if any.
    #[pyo3(signature = (req, hint = None))]
    fn finish(&self, req: &str, hint: Option<RetentionArg>) -> PyResult<()> {
        let hint = hint.as_ref().map(retention_hint).transpose()?;
        self.books.finish(req, hint);
        Ok(())
    }

    /// Slots in the host tier.
    #[getter]
    fn slots(&self) -> usize {
        self.books.ledger.capacity()
    }

    /// Slots in the disk tier (0 without one).
    #[getter]
    fn disk_slots(&self) -> usize {
        self.books.ledger.disk_capacity()
    }

    /// kvbm's 64-bit key of an offload key.
    #[staticmethod]
    fn key(key: &[u8]) -> PyResult<u64> {
        Ok(offload_key(key)?.0)
    }

    /// `0` when the key is not held, `1` while its store is in flight,
    /// `2` when it can be loaded.
    fn lookup(&self, key: &[u8]) -> PyResult<u8> {
        Ok(match self.books.ledger.presence(offload_key(key)?) {
            Presence::Absent => 0,
            Presence::Writing => 1,
            Presence::Ready => 2,
        })
    }

    /// Slots for the keys to store, in order (each key's parent is the
    /// key before it in the list when `chained`): returns the
    /// `(index into keys, slot)` of each key to write, the blocks to move
    /// from their host slot to a disk slot before those are written (they
    /// are loadable from disk once the store is confirmed), the kvbm keys
    /// of the blocks no tier holds any more, how many keys were refused
    /// by admission or left out because every slot is busy, and the
    /// `(kvbm key, G2 slot)` of every block that left G2 for these slots
    /// (its bytes stay there until the slot is written).
    ///
    /// With `fetched`, the keys are blocks a load brings in from G4: the
    /// admission policy is not asked (a request is about to use them), and
    /// the caller commits them once they arrived and were checked.
    #[pyo3(signature = (keys, chained = true, fetched = false))]
    fn reserve(&self, keys: Vec<Vec<u8>>, chained: bool, fetched: bool) -> PyResult<Reserved> {
        let hashes = keys_of(&keys)?;
        let with_parents: Vec<_> = hashes
            .iter()
            .enumerate()
            .map(|(i, &h)| (h, (chained && i > 0).then(|| hashes[i - 1])))
            .collect();
        let ledger = &self.books.ledger;
        let r = if fetched {
            ledger.reserve_fetched(&with_parents)
        } else {
            ledger.reserve(&with_parents)
        };
        let mut index = std::collections::HashMap::with_capacity(hashes.len());
        for (i, h) in hashes.iter().enumerate() {
            index.entry(*h).or_insert(i);
        }
        let slots = r.slots.iter().map(|(h, s)| (index[h], *s)).collect();
        Ok((
            slots,
            r.demote.iter().map(|m| (m.key.0, m.from, m.to)).collect(),
            r.evicted.iter().map(|h| h.0).collect(),
            r.refused,
            r.full,
            r.vacated.iter().map(|(h, s)| (h.0, *s)).collect(),
        ))
    }

    /// Takes up the blocks a disk tier kept across a restart holds,
    /// `(disk slot, kvbm key)` entries packed as `PageWorker.kept` gives
    /// them: they are loadable from their slots. Returns the keys taken up
    /// (not a slot or key listed twice, nor a slot beyond the tier). Call
    /// it before the first store.
    fn restore_disk(&self, blocks: &[u8]) -> PyResult<Vec<u64>> {
        restore(blocks, |b| self.books.ledger.restore_disk(b))
    }

    /// Takes up the blocks a host tier kept across a restart holds, as
    /// `restore_disk` (`(host slot, kvbm key)` entries packed as
    /// `PageWorker.kept_host` gives them). Call it before `restore_disk`: a
    /// key both tiers hold is served from the host tier.
    fn restore_host(&self, blocks: &[u8]) -> PyResult<Vec<u64>> {
        restore(blocks, |b| self.books.ledger.restore_host(b))
    }

    /// Keeps the use history in the file `path` beside a kept disk tier:
    /// takes up what it holds (call it before `restore_disk`, so the kept
    /// blocks rank by their past uses), then writes it every second on a
    /// thread and once more at `close_history`. Returns the blocks the
    /// file remembered (0 for none, or a damaged file, which is logged).
    fn keep_history(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<usize> {
        let keeper = HistoryKeeper::new(path, HISTORY_EVERY);
        let remembered = py.detach(|| keeper.load(&*self.books));
        let writer = keeper.spawn(&self.books).map_err(|e| {
            PyKvbmError::Invalid(format!("cannot start the use-history thread: {e}"))
        })?;
        *self.history.lock() = Some(writer);
        Ok(remembered)
    }

    /// Writes the use history a last time and stops its thread (a no-op
    /// without `keep_history`).
    fn close_history(&self, py: Python<'_>) {
        let writer = self.history.lock().take();
        py.detach(|| drop(writer));
    }

    /// Confirms (`ok`) or abandons the stores of `keys`.
    fn commit(&self, keys: Vec<Vec<u8>>, ok: bool) -> PyResult<()> {
        self.books.ledger.commit(&keys_of(&keys)?, ok);
        Ok(())
    }

    /// Pins `keys` for one load and returns where each is read: `(on
    /// disk, slot)`; `ValueError` if any is not loadable (then nothing is
    /// pinned).
    fn pin(&self, keys: Vec<Vec<u8>>) -> PyResult<Vec<(bool, u32)>> {
        let sources = self
            .books
            .ledger
            .pin(&keys_of(&keys)?)
            .map_err(|e| PyKvbmError::Invalid(e.to_string()))?;
        Ok(sources
            .iter()
            .map(|s| (s.tier == Tier::G3, s.slot))
            .collect())
    }

    /// Ends one load of each of `keys`.
    fn unpin(&self, keys: Vec<Vec<u8>>) -> PyResult<()> {
        self.books.ledger.unpin(&keys_of(&keys)?);
        Ok(())
    }

    /// Marks `keys` as just used.
    fn touch(&self, keys: Vec<Vec<u8>>) -> PyResult<()> {
        self.books.ledger.touch(&keys_of(&keys)?);
        Ok(())
    }

    /// Drops every block no load or store uses; returns how many.
    fn reset(&self) -> usize {
        self.books.ledger.reset()
    }

    /// Forgets every store and load in flight and drops every block (the
    /// engine waits for its copies in flight before it sends new ones).
    fn clear(&self) -> usize {
        self.books.ledger.clear()
    }

    /// Marks `keys` as damaged: never loaded again (a load of them
    /// failed).
    fn doom(&self, keys: Vec<Vec<u8>>) -> PyResult<()> {
        self.books.ledger.doom(&keys_of(&keys)?);
        Ok(())
    }

    /// `{"ready", "writing", "reading", "on_disk", "demoting"}` slot
    /// counts: host blocks loadable, host slots being written, blocks
    /// being read, disk blocks loadable, disk slots being written.
    fn counts(&self) -> std::collections::HashMap<&'static str, usize> {
        let c = self.books.ledger.counts();
        [
            ("ready", c.ready),
            ("writing", c.writing),
            ("reading", c.reading),
            ("on_disk", c.on_disk),
            ("demoting", c.demoting),
        ]
        .into()
    }

    /// `(on disk, stored, key)` for every block stored or removed since
    /// the last call (kvbm keys).
    fn take_events(&self) -> Vec<(bool, bool, u64)> {
        self.books
            .ledger
            .take_events()
            .into_iter()
            .map(|(t, s, h)| (t == Tier::G3, s, h.0))
            .collect()
    }
}
