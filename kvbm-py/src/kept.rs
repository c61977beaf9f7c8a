//! What a kept G3 directory holds: for `python -m kvbm_py.cache`, and the
//! reports a kept disk tier's ranks hand the scheduler behind vLLM's
//! offloading connector (`(slot, key)` entries packed as bytes, so a tier
//! of millions of blocks crosses processes and is intersected without a
//! Python object per block).

use std::collections::HashSet;
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::error::{PyKvbmError, Result};

/// Bytes of one packed `(slot, key)` entry: the slot (4 bytes) then the
/// key (8 bytes), little-endian.
pub const KEPT_ENTRY_BYTES: usize = 12;

/// `(slot, key)` entries packed.
pub fn pack_kept(blocks: &[(u32, u64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(blocks.len() * KEPT_ENTRY_BYTES);
    for (slot, key) in blocks {
        out.extend_from_slice(&slot.to_le_bytes());
        out.extend_from_slice(&key.to_le_bytes());
    }
    out
}

/// Packed `(slot, key)` entries; an error for a length that is not whole
/// entries.
pub fn unpack_kept(bytes: &[u8]) -> Result<Vec<(u32, u64)>> {
    if !bytes.len().is_multiple_of(KEPT_ENTRY_BYTES) {
        return Err(PyKvbmError::Invalid(format!(
            "a kept report of {} bytes: not whole {KEPT_ENTRY_BYTES}-byte entries",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(KEPT_ENTRY_BYTES)
        .map(|e| {
            let slot = u32::from_le_bytes([e[0], e[1], e[2], e[3]]);
            let mut key = [0u8; 8];
            key.copy_from_slice(&e[4..]);
            (slot, u64::from_le_bytes(key))
        })
        .collect())
}

/// The `(slot, key)` entries every one of `reports` names (each packed,
/// as `PageWorker.kept` gives them), packed in slot order, and how many
/// distinct entries some report named but not every one.
#[pyfunction]
pub fn kept_common(py: Python<'_>, reports: Vec<Vec<u8>>) -> PyResult<(Py<PyBytes>, u64)> {
    let reports = reports
        .iter()
        .map(|r| unpack_kept(r))
        .collect::<Result<Vec<_>>>()?;
    let (common, partial) = py.detach(|| {
        let mut sets = reports
            .iter()
            .map(|r| r.iter().copied().collect::<HashSet<_>>());
        let Some(first) = sets.next() else {
            return (Vec::new(), 0);
        };
        let (mut common, mut every) = (first.clone(), first);
        for set in sets {
            common.retain(|e| set.contains(e));
            every.extend(set);
        }
        let partial = (every.len() - common.len()) as u64;
        let mut common: Vec<(u32, u64)> = common.into_iter().collect();
        common.sort_unstable();
        (common, partial)
    });
    Ok((PyBytes::new(py, &pack_kept(&common)).unbind(), partial))
}

/// Lists the kept G3 directory `path` (one rank's): its identity, block
/// slots, blocks and their bytes, bytes on disk, damaged records, and
/// with `verify` the slots whose bytes fail their checksum (read only
/// while no engine has the directory open; `in_use` says when one has).
#[pyfunction]
#[pyo3(signature = (path, verify = false))]
pub fn inspect_g3(py: Python<'_>, path: PathBuf, verify: bool) -> PyResult<Py<PyDict>> {
    let seen = py
        .detach(|| kvbm_dist::kept::inspect(&path, verify))
        .map_err(PyKvbmError::from)?;
    let d = PyDict::new(py);
    d.set_item("identity", seen.identity)?;
    d.set_item("slots", seen.slots)?;
    d.set_item("blocks", seen.blocks)?;
    d.set_item("block_bytes", seen.block_bytes)?;
    d.set_item("disk_bytes", seen.disk_bytes)?;
    d.set_item("bad_records", seen.bad_records)?;
    d.set_item("bad_blocks", seen.bad_blocks)?;
    d.set_item("verified", seen.verified)?;
    d.set_item("in_use", seen.in_use)?;
    Ok(d.unbind())
}
