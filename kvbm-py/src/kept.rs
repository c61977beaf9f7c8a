//! What a kept G3 directory holds, for `python -m kvbm_py.cache`.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::PyKvbmError;

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
