//! The ranks' half of kvbm as a backend of vLLM's offloading connector:
//! [`PageWorker`] (kvbm-dist's [`PagedWorker`]) copies one rank's pages of
//! every KV cache group to and from its host and disk slots.

use kvbm_dist::paged::{
    DiskMove, PageCopy, PageGroup, PageMemory, PagedConfig, PagedDisk, PagedKeep, PagedWorker,
    Piece, Shards,
};
use kvbm_transfer::memory::Owner;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::{ErrorKind, PyKvbmError, Result};
use crate::tensors::TensorMemory;

/// One rank's host tier: the engine's page tensors per KV cache group and
/// `slots` host slots, copying jobs between them.
#[pyclass(module = "kvbm_py._kvbm")]
pub struct PageWorker {
    inner: PagedWorker,
}

/// A job's end as Python sees it: `(job, ok, bytes, seconds, failed
/// (group, block) pairs, the `TransferError` it failed with)`.
type Finished = (u64, bool, u64, f64, Vec<(usize, usize)>, Option<PyErr>);

/// The engine's page tensors of each KV cache group (`(tensors, page
/// bytes)`) as kvbm's page groups, with the memory they are in and what
/// keeps them alive. Each tensor is a `(num_blocks, bytes)` view, its
/// rows contiguous, one block stride apart (the same within a group).
fn page_groups(
    groups: &[(Vec<Bound<'_, PyAny>>, u64)],
    num_blocks: usize,
) -> Result<(Vec<PageGroup>, PageMemory, Owner)> {
    let all: Vec<Bound<'_, PyAny>> = groups.iter().flat_map(|(t, _)| t.clone()).collect();
    let (tensors, owner) = crate::dlpack::read_all(&all)?;
    let memory = match tensors.first().map(|t| t.memory) {
        Some(TensorMemory::Device(ordinal)) => PageMemory::Device(ordinal),
        Some(TensorMemory::Host) => PageMemory::Host,
        None => return Err(PyKvbmError::Invalid("no KV cache tensors given".into())),
    };
    let mut tensors = tensors.into_iter();
    let mut out = Vec::with_capacity(groups.len());
    for (g, (layers, page_bytes)) in groups.iter().enumerate() {
        let mut group = PageGroup {
            layers: Vec::with_capacity(layers.len()),
            page_bytes: *page_bytes,
            block_stride: 0,
        };
        for t in tensors.by_ref().take(layers.len()) {
            let elem = t.elem_bytes as u64;
            let (addr, shape, strides) = (t.raw.addr, &t.raw.shape, &t.raw.strides);
            let bytes_of = |n: usize| (n as u64).checked_mul(elem);
            let stride = match (shape.as_slice(), strides.as_slice()) {
                ([rows, bytes], [stride, 1])
                    if *rows == num_blocks
                        && bytes_of(*bytes).is_some_and(|b| b >= *page_bytes) =>
                {
                    bytes_of(*stride).ok_or_else(|| {
                        PyKvbmError::Invalid(format!("KV cache group {g}: a stride of {stride}"))
                    })?
                }
                _ => {
                    return Err(PyKvbmError::Invalid(format!(
                        "KV cache group {g}: a tensor of shape {shape:?} and strides \
                         {strides:?} is not a ({num_blocks} blocks, {page_bytes} page bytes) view"
                    )));
                }
            };
            if group.layers.is_empty() {
                group.block_stride = stride;
            } else if stride != group.block_stride {
                return Err(PyKvbmError::Invalid(format!(
                    "KV cache group {g} mixes block strides {} and {stride}",
                    group.block_stride
                )));
            }
            group.layers.push(addr);
        }
        if group.layers.is_empty() {
            return Err(PyKvbmError::Invalid(format!(
                "KV cache group {g} has no layers"
            )));
        }
        out.push(group);
    }
    Ok((out, memory, owner))
}

/// `(host slot, disk slot, group, kvbm key)` tuples as moves to disk.
fn moves_of(moves: Vec<(usize, usize, usize, u64)>) -> Vec<DiskMove> {
    moves
        .into_iter()
        .map(|(from, to, group, key)| DiskMove::new(from, to, group, key))
        .collect()
}

/// `(group, engine block, slot)` triples as copies from host slots, or
/// from disk slots where `disk`.
fn copies_of(copies: Vec<(usize, usize, usize)>, disk: bool) -> Vec<PageCopy> {
    copies
        .into_iter()
        .map(|(group, block, slot)| match disk {
            false => PageCopy::g2(group, block, slot),
            true => PageCopy::g3(group, block, slot),
        })
        .collect()
}

/// A store's copies, each naming its block's kvbm key where `keys` has
/// one per copy (for a kept host tier); an error when it has another
/// count.
fn keyed_copies(
    copies: Vec<(usize, usize, usize)>,
    keys: Option<Vec<u64>>,
) -> Result<Vec<PageCopy>> {
    let copies = copies_of(copies, false);
    let Some(keys) = keys else {
        return Ok(copies);
    };
    if keys.len() != copies.len() {
        return Err(PyKvbmError::Invalid(format!(
            "a store of {} blocks with {} keys",
            copies.len(),
            keys.len()
        )));
    }
    Ok(copies
        .into_iter()
        .zip(keys)
        .map(|(c, k)| c.keyed(k))
        .collect())
}

/// What a kept tier held when the worker opened it, as Python sees it.
type KeptReport = (String, Py<PyBytes>, u64, Option<String>);

fn kept_report(py: Python<'_>, k: &kvbm_dist::paged::KeptFound) -> KeptReport {
    (
        k.dir.to_string_lossy().into_owned(),
        PyBytes::new(py, &crate::kept::pack_kept(&k.blocks)).unbind(),
        k.rejected,
        k.started_fresh.clone(),
    )
}

#[pymethods]
impl PageWorker {
    /// `groups` holds per KV cache group `(page tensors, page bytes)`:
    /// one tensor per layer, any object with `__dlpack__` (a torch
    /// tensor) viewing the layer as `(num_blocks, bytes)` with its pages
    /// one block stride apart, every tensor of a group with the same
    /// stride, all on the host or all on one CUDA device; kvbm keeps a
    /// reference to each as long as it may touch its memory, and the
    /// caller passes views whose memory spans every block's stride.
    /// `disk_dir` and `disk_slots` put a disk tier of that many slots
    /// behind the host slots, in a file of its own in that directory;
    /// with `disk_kept` (an identity) the disk tier is kept across
    /// restarts in `disk_dir` (see `kept`). With `verify` every stored
    /// slot's checksum is recorded and checked when it is loaded. With
    /// `sum_tail` each slot has room for a checksum after its block, for
    /// G4 (`seal`, `adopt`), salted with `tail_salt` (engines that lay a
    /// block out otherwise take other salts). With `host_kept` (`(directory, identity)`,
    /// the directory in a memory-backed file system) the host slots are
    /// kept across restarts there (see `kept_host`).
    #[new]
    #[pyo3(signature = (groups, num_blocks, slots, slot_bytes, verify = false, disk_dir = None, disk_slots = 0, sum_tail = false, disk_kept = None, host_kept = None, tail_salt = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        groups: Vec<(Vec<Bound<'_, PyAny>>, u64)>,
        num_blocks: usize,
        slots: usize,
        slot_bytes: u64,
        verify: bool,
        disk_dir: Option<std::path::PathBuf>,
        disk_slots: usize,
        sum_tail: bool,
        disk_kept: Option<String>,
        host_kept: Option<(std::path::PathBuf, String)>,
        tail_salt: u64,
    ) -> PyResult<Self> {
        let (groups, memory, owner) = page_groups(&groups, num_blocks)?;
        let config = PagedConfig {
            groups,
            num_blocks,
            memory,
            slots,
            slot_bytes,
            disk: disk_dir.map(|dir| PagedDisk {
                dir,
                slots: disk_slots,
                kept: disk_kept,
            }),
            verify,
            sum_tail,
            tail_salt,
            host_keep: host_kept.map(|(dir, identity)| PagedKeep { dir, identity }),
        };
        // SAFETY: the pages belong to the engine, which keeps them while
        // the tensors live; `owner` holds them and their DLPack capsules
        // (the worker keeps it). Every address has `num_blocks` pages of
        // the group's stride behind it: the tensors have that many rows
        // of that stride (checked in `page_groups`) and the caller's views
        // span the last row's stride (checked on the Python side, which
        // sees the storage). The engine leaves a block alone while a job
        // copies it (the offloading connector's contract).
        let inner = py
            .detach(|| unsafe { PagedWorker::new(config, owner) })
            .map_err(PyKvbmError::Dist)?;
        Ok(PageWorker { inner })
    }

    /// What the kept disk tier held when the worker opened it: `(directory,
    /// (disk slot, kvbm key) entries packed (see `kept_common`), torn or
    /// damaged records, why it started afresh or None)`; None without a
    /// kept disk tier.
    fn kept(&self, py: Python<'_>) -> Option<KeptReport> {
        self.inner.kept().map(|k| kept_report(py, k))
    }

    /// What the kept host tier held when the worker opened it, as `kept`
    /// says of the disk tier (`(host slot, kvbm key)` entries); None
    /// without a kept host tier.
    fn kept_host(&self, py: Python<'_>) -> Option<KeptReport> {
        self.inner.kept_host().map(|k| kept_report(py, k))
    }

    /// Empties every record of the kept tiers and records nothing in them
    /// from now on (the engine's cache was reset: what it computes next
    /// may come from other weights than a restarted engine loads): stores
    /// submitted before record nothing, and the disk tier's records go
    /// after the moves submitted before; a no-op without a kept tier.
    fn stop_keeping(&self) -> PyResult<()> {
        Ok(self.inner.stop_keeping().map_err(PyKvbmError::Dist)?)
    }

    /// Slots in the tier.
    #[getter]
    fn slots(&self) -> usize {
        self.inner.slots()
    }

    /// Starts copying `(group, engine block, host slot)` pages into host
    /// slots, after moving the blocks of `demote` (`(host slot, disk
    /// slot, group, kvbm key)`) to disk. `keys` (one kvbm key per copy)
    /// names the blocks in a kept host tier's records.
    #[pyo3(signature = (job, copies, demote = Vec::new(), keys = None))]
    fn store(
        &self,
        job: u64,
        copies: Vec<(usize, usize, usize)>,
        demote: Vec<(usize, usize, usize, u64)>,
        keys: Option<Vec<u64>>,
    ) -> PyResult<()> {
        let copies = keyed_copies(copies, keys)?;
        Ok(self
            .inner
            .store(job, copies, moves_of(demote))
            .map_err(PyKvbmError::Dist)?)
    }

    /// Empties the kept host tier's records of `slots` before a block from
    /// G4 is written into them; a no-op without a kept host tier.
    fn unrecord(&self, slots: Vec<usize>) -> PyResult<()> {
        Ok(self.inner.unrecord(&slots).map_err(PyKvbmError::Dist)?)
    }

    /// Starts copying host slots into `(group, engine block, host slot)`
    /// pages and disk slots into `(group, engine block, disk slot)` pages
    /// (`disk_copies`).
    #[pyo3(signature = (job, copies, disk_copies = Vec::new()))]
    fn load(
        &self,
        job: u64,
        copies: Vec<(usize, usize, usize)>,
        disk_copies: Vec<(usize, usize, usize)>,
    ) -> PyResult<()> {
        let mut all = copies_of(copies, false);
        all.extend(copies_of(disk_copies, true));
        Ok(self.inner.load(job, all).map_err(PyKvbmError::Dist)?)
    }

    /// `(address, bytes)` of the host slots (slot `i` starts `i *
    /// slot_stride` bytes in), for a G4 client to register and move blocks
    /// in and out of.
    fn slot_memory(&self) -> PyResult<(u64, u64)> {
        Ok(self.inner.slot_memory().map_err(PyKvbmError::Dist)?)
    }

    /// Bytes from one host slot to the next.
    #[getter]
    fn slot_stride(&self) -> u64 {
        self.inner.slot_stride()
    }

    /// Bytes of one block of KV cache group `group` (the first bytes of a
    /// slot holding it).
    fn block_bytes(&self, group: usize) -> PyResult<u64> {
        Ok(self.inner.block_bytes(group).map_err(PyKvbmError::Dist)?)
    }

    /// Writes the checksum of the block of `group` in each of `slots`
    /// right after it (what the block is published to G4 with): per slot
    /// whether it was sealed; not a slot whose bytes changed since they
    /// were stored (verify mode), which must not be published.
    fn seal(&self, py: Python<'_>, group: usize, slots: Vec<usize>) -> PyResult<Vec<bool>> {
        let sealed = py.detach(|| self.inner.seal(group, &slots));
        Ok(sealed.map_err(PyKvbmError::Dist)?)
    }

    /// Checks blocks of `group` that arrived from G4 in `slots`, each with
    /// the checksum it was published with right after it: per slot
    /// whether it matches (one that does not must never be loaded).
    fn adopt(&self, py: Python<'_>, group: usize, slots: Vec<usize>) -> PyResult<Vec<bool>> {
        let good = py.detach(|| self.inner.adopt(group, &slots));
        Ok(good.map_err(PyKvbmError::Dist)?)
    }

    /// `(address, bytes)` of host memory that shards published by an
    /// engine of another parallelism are read into before
    /// :meth:`assemble` (made on the first call; later calls may not ask
    /// for more).
    fn assembly_memory(&self, bytes: u64) -> PyResult<(u64, u64)> {
        Ok(self
            .inner
            .assembly_memory(bytes)
            .map_err(PyKvbmError::Dist)?)
    }

    /// Assembles blocks of `group` in `slots` from their shards in the
    /// assembly memory: block `k`'s bundle of `shard_count` shards of
    /// `shard_bytes` bytes, each followed by its checksum, after `k`
    /// bundles; each shard is checked against its checksum, then
    /// `(src, dst, bytes)` `pieces` are copied from the bundle into the
    /// block and the slot is sealed. Per slot whether it was assembled (one
    /// that was not must never be loaded).
    fn assemble(
        &self,
        py: Python<'_>,
        group: usize,
        slots: Vec<usize>,
        shard_count: usize,
        shard_bytes: u64,
        pieces: Vec<(u64, u64, u64)>,
    ) -> PyResult<Vec<bool>> {
        let shards = Shards {
            count: shard_count,
            bytes: shard_bytes,
        };
        let pieces: Vec<Piece> = pieces
            .into_iter()
            .map(|(src, dst, len)| Piece { src, dst, len })
            .collect();
        let good = py.detach(|| self.inner.assemble(group, &slots, shards, &pieces));
        Ok(good.map_err(PyKvbmError::Dist)?)
    }

    /// Moves `(host slot, disk slot, group, kvbm key)` blocks to disk and
    /// waits (without the GIL): before a block fetched from G4 overwrites
    /// their slots.
    fn move_to_disk(&self, py: Python<'_>, moves: Vec<(usize, usize, usize, u64)>) -> PyResult<()> {
        let moves = moves_of(moves);
        let moved = py.detach(|| self.inner.move_to_disk(&moves));
        Ok(moved.map_err(PyKvbmError::Dist)?)
    }

    /// Jobs ended since the last call.
    fn finished(&self) -> Vec<Finished> {
        self.inner
            .finished()
            .into_iter()
            .map(|r| {
                let failed: Vec<_> = r.failed.iter().map(|c| (c.group, c.block)).collect();
                let ok = failed.is_empty() && r.error.is_none();
                let error = r.error.map(|e| ErrorKind::Transfer.new_err(e));
                (r.job, ok, r.bytes, r.seconds, failed, error)
            })
            .collect()
    }

    /// Waits until none of `jobs` is in flight (without the GIL).
    fn wait(&self, py: Python<'_>, jobs: Vec<u64>) {
        py.detach(|| self.inner.wait(&jobs));
    }

    /// Changes every byte of host slot `slot` (tests: memory that changed
    /// at rest).
    #[cfg(feature = "test-hooks")]
    fn corrupt_slot(&self, slot: usize) -> PyResult<()> {
        Ok(self.inner.corrupt_slot(slot).map_err(PyKvbmError::Dist)?)
    }

    /// Overwrites disk slot `slot` with zeros (tests: a disk that changed
    /// at rest).
    #[cfg(feature = "test-hooks")]
    fn corrupt_disk_slot(&self, slot: usize) -> PyResult<()> {
        Ok(self
            .inner
            .corrupt_disk_slot(slot)
            .map_err(PyKvbmError::Dist)?)
    }
}
