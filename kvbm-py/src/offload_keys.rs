//! A request's offload keys of one KV cache group, kept as kvbm keys and
//! the block hashes they come from, made into Python `bytes` only when
//! vLLM reads one.
//!
//! vLLM's offloading connector keeps a list of `bytes` keys per request
//! and group, each the block hash of a chunk's last block followed by the
//! group as 4 big-endian bytes. Making those objects, one allocation per
//! key, is most of what asking about a new request costs, and asking only
//! needs the keys' kvbm keys. [`OffloadKeys`] stands in for the list:
//!
//! - it is extended from the request's block hashes in one call, with no
//!   Python object made per key (it keeps a reference to each hash);
//! - a slice of it is a view of the same keys (a view also takes keys
//!   appended to it, as vLLM appends a partial tail's key to a slice),
//!   and `OffloadBooks`' lookups read a view's kvbm keys directly;
//! - a key read by index or by iteration becomes a `bytes` object equal to
//!   the one vLLM would have made, once; later reads return that object.

use std::sync::Arc;

use kvbm_block::SequenceHash;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySlice};

use crate::error::PyKvbmError;
use crate::offload::offload_key;

/// The keys of one request and group, shared by the list and its views.
struct Keys {
    /// The group index as the keys end with it.
    group: [u8; 4],
    /// The block hash of each key.
    hashes: Vec<Py<PyBytes>>,
    /// kvbm's key of each offload key.
    kvbm: Vec<SequenceHash>,
    /// The `bytes` object of each key read so far (empty until one is).
    made: Vec<Option<Py<PyBytes>>>,
}

impl Keys {
    /// The `bytes` of key `i` (made on its first read).
    fn bytes<'py>(&mut self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyBytes>> {
        if self.made.is_empty() {
            self.made.resize_with(self.kvbm.len(), || None);
        }
        if let Some(b) = &self.made[i] {
            return Ok(b.bind(py).clone());
        }
        let hash = self.hashes[i].bind(py).as_bytes();
        let group = self.group;
        let b = PyBytes::new_with(py, hash.len() + group.len(), |key| {
            key[..hash.len()].copy_from_slice(hash);
            key[hash.len()..].copy_from_slice(&group);
            Ok(())
        })?;
        self.made[i] = Some(b.clone().unbind());
        Ok(b)
    }
}

/// A request's offload keys of one KV cache group, or a slice of them
/// (see the module docs): a sequence of `bytes` to vLLM, read by
/// `OffloadBooks` without making them.
#[pyclass(module = "kvbm_py._kvbm", sequence)]
pub struct OffloadKeys {
    keys: Arc<Mutex<Keys>>,
    /// The slice viewed, `None` for the whole list (which grows).
    range: Option<(usize, usize)>,
    /// Keys appended to a view, after its range.
    appended: Vec<Py<PyAny>>,
}

impl OffloadKeys {
    /// Keys of the range of `keys` (this sequence's, locked), not counting
    /// appended ones.
    fn range_of(&self, keys: &Keys) -> (usize, usize) {
        self.range.unwrap_or((0, keys.kvbm.len()))
    }

    /// Keys of the range, not counting appended ones.
    fn base_len(&self) -> usize {
        let (start, end) = self.range_of(&self.keys.lock());
        end - start
    }

    fn start(&self) -> usize {
        self.range.map_or(0, |(start, _)| start)
    }

    /// The kvbm keys this sequence holds, in order; `None` when keys were
    /// appended to it (those are read as `bytes`).
    pub(crate) fn kvbm_keys(&self) -> Option<Vec<SequenceHash>> {
        if !self.appended.is_empty() {
            return None;
        }
        let keys = self.keys.lock();
        let (start, end) = self.range_of(&keys);
        Some(keys.kvbm[start..end].to_vec())
    }

    /// Item `i` (`0 <= i < len`).
    fn item<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        let base = self.base_len();
        if i < base {
            Ok(self.keys.lock().bytes(py, self.start() + i)?.into_any())
        } else {
            Ok(self.appended[i - base].bind(py).clone())
        }
    }

    /// Every item, as a list.
    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        {
            let mut keys = self.keys.lock();
            let (start, end) = self.range_of(&keys);
            for i in start..end {
                list.append(keys.bytes(py, i)?)?;
            }
        }
        for k in &self.appended {
            list.append(k.bind(py))?;
        }
        Ok(list)
    }
}

#[pymethods]
impl OffloadKeys {
    /// An empty list of the keys of KV cache group `group`.
    #[new]
    fn new(group: u32) -> Self {
        OffloadKeys {
            keys: Arc::new(Mutex::new(Keys {
                group: group.to_be_bytes(),
                hashes: Vec::new(),
                kvbm: Vec::new(),
                made: Vec::new(),
            })),
            range: None,
            appended: Vec::new(),
        }
    }

    /// Appends the keys of `hashes[start::step]` (vLLM's block hashes of
    /// a request: each chunk's last one). A list only, not a view.
    fn extend_hashes(&self, hashes: &Bound<'_, PyList>, start: usize, step: usize) -> PyResult<()> {
        if step == 0 {
            return Err(PyKvbmError::Invalid("offload keys of every 0th block hash".into()).into());
        }
        if self.range.is_some() {
            return Err(PyKvbmError::Invalid(
                "a slice of offload keys takes no block hashes: extend the list it came from"
                    .into(),
            )
            .into());
        }
        let mut keys = self.keys.lock();
        let keys = &mut *keys;
        let (had, new) = (
            keys.kvbm.len(),
            hashes.len().saturating_sub(start).div_ceil(step),
        );
        keys.hashes.reserve(new);
        keys.kvbm.reserve(new);
        let mut key = Vec::new();
        for i in (start..hashes.len()).step_by(step) {
            let made = hashes
                .get_item(i)
                .and_then(|h| Ok(h.cast_into::<PyBytes>()?))
                .and_then(|h| {
                    key.clear();
                    key.extend_from_slice(h.as_bytes());
                    key.extend_from_slice(&keys.group);
                    Ok((offload_key(&key)?, h))
                });
            match made {
                Ok((k, h)) => {
                    keys.kvbm.push(k);
                    keys.hashes.push(h.unbind());
                }
                Err(e) => {
                    // All or nothing: the keys stay as they were.
                    keys.kvbm.truncate(had);
                    keys.hashes.truncate(had);
                    return Err(e);
                }
            }
        }
        if !keys.made.is_empty() {
            keys.made.resize_with(keys.kvbm.len(), || None);
        }
        Ok(())
    }

    /// Appends `key` to a slice (vLLM appends a partial tail's key to the
    /// keys it loads). The list itself grows from block hashes only.
    fn append(&mut self, key: Py<PyAny>) -> PyResult<()> {
        if self.range.is_none() {
            return Err(PyKvbmError::Invalid(
                "a request's offload keys grow from its block hashes (extend_hashes), not by append"
                    .into(),
            )
            .into());
        }
        self.appended.push(key);
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.base_len() + self.appended.len()
    }

    /// Key `index` (negative counts from the end), or a slice: a view of
    /// the same keys for a step of 1, else a list.
    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let len = self.__len__();
        if let Ok(slice) = index.cast::<PySlice>() {
            let ix = slice.indices(len as isize)?;
            let (start, stop) = (ix.start as usize, (ix.start as usize) + ix.slicelength);
            if ix.step == 1 && stop <= self.base_len() {
                let base = self.start();
                let view = OffloadKeys {
                    keys: Arc::clone(&self.keys),
                    range: Some((base + start, base + stop)),
                    appended: Vec::new(),
                };
                return Ok(Bound::new(py, view)?.into_any());
            }
            let items = self.items(py)?;
            return items.as_any().get_item(index);
        }
        let i: isize = index.extract()?;
        let at = if i < 0 { i + len as isize } else { i };
        if at < 0 || at as usize >= len {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "offload key {i} of {len}"
            )));
        }
        self.item(py, at as usize)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.items(py)?.as_any().try_iter()?.into_any())
    }

    /// Equal to any sequence of the same keys (a list of `bytes`, another
    /// `OffloadKeys`).
    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Ok(iter) = other.try_iter() else {
            return Ok(false);
        };
        let other = iter.collect::<PyResult<Vec<_>>>()?;
        if other.len() != self.__len__() {
            return Ok(false);
        }
        for (a, b) in self.items(py)?.iter().zip(&other) {
            if !a.eq(b)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn __repr__(&self) -> String {
        format!("OffloadKeys({} keys)", self.__len__())
    }
}
