//! Engine tensors as Python hands them over: any object with
//! `__dlpack__` (a torch tensor, a NumPy array, ...), read through the
//! DLPack capsule it exports.
//!
//! kvbm reads a tensor's address, shape, strides, element size and device
//! from the capsule's `DLTensor` and keeps the capsule, unconsumed, and the
//! object itself alive for as long as it may touch the memory
//! ([`TensorKeep`]): an unconsumed capsule keeps the producer's memory, and
//! frees its hold when it is collected. Nothing is copied.

use std::ffi::{CStr, c_void};
use std::sync::Arc;

use kvbm_transfer::memory::Owner;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::error::{PyKvbmError, Result};
use crate::tensors::{RawTensor, TensorMemory};

/// The name of a (legacy, unversioned) DLPack capsule.
const CAPSULE_NAME: &CStr = c"dltensor";

/// DLPack's device types kvbm reads: host memory, CUDA memory, and host
/// memory pinned by CUDA.
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;

/// DLPack's `DLDevice`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// DLPack's `DLTensor`, the first member of the `DLManagedTensor` an
/// unversioned capsule points at.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// One engine tensor as kvbm addresses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// Address, shape and strides (in elements).
    pub raw: RawTensor,
    /// Bytes of one element.
    pub elem_bytes: usize,
    /// Where its memory is.
    pub memory: TensorMemory,
}

/// Keeps the tensors' Python objects and their capsules alive as long as
/// kvbm's regions over them.
pub struct TensorKeep(#[allow(dead_code)] Vec<Py<PyAny>>);

/// Reads `tensors` (objects with `__dlpack__`) and returns them with what
/// keeps their memory alive. Every tensor must be in the same memory (all
/// on the host, or all on one CUDA device); none may be empty.
pub fn read_all(tensors: &[Bound<'_, PyAny>]) -> Result<(Vec<Tensor>, Owner)> {
    let mut out = Vec::with_capacity(tensors.len());
    let mut keep = Vec::with_capacity(2 * tensors.len());
    for (i, obj) in tensors.iter().enumerate() {
        let (tensor, capsule) =
            read(obj).map_err(|e| PyKvbmError::Invalid(format!("KV tensor {i}: {e}")))?;
        if let Some(first) = out.first().map(|t: &Tensor| t.memory)
            && first != tensor.memory
        {
            return Err(PyKvbmError::Invalid(format!(
                "KV tensor {i} is in {:?} memory, tensor 0 in {first:?} memory",
                tensor.memory
            )));
        }
        out.push(tensor);
        keep.push(obj.clone().unbind());
        keep.push(capsule);
    }
    Ok((out, Arc::new(TensorKeep(keep))))
}

/// Reads one tensor; returns it and its capsule.
fn read(obj: &Bound<'_, PyAny>) -> std::result::Result<(Tensor, Py<PyAny>), String> {
    let py = obj.py();
    let export = obj.getattr(intern!(py, "__dlpack__")).map_err(|_| {
        format!(
            "{} has no __dlpack__: not a tensor",
            obj.get_type()
                .name()
                .map_or_else(|_| "?".to_owned(), |n| n.to_string())
        )
    })?;
    // No stream: the engine's memory is only addressed here, nothing is
    // read or written, so no stream needs to wait for another.
    let capsule = export
        .call0()
        .map_err(|e| format!("__dlpack__ failed: {e}"))?;
    let c = capsule
        .cast::<PyCapsule>()
        .map_err(|_| "__dlpack__ returned no capsule".to_owned())?;
    let ptr = c
        .pointer_checked(Some(CAPSULE_NAME))
        .map_err(|_| "__dlpack__ returned a capsule that is not an unversioned DLPack tensor")?;
    // SAFETY: a capsule named "dltensor" points at a `DLManagedTensor`
    // (DLPack's protocol), whose first member is the `DLTensor`; the
    // capsule is unconsumed and alive (held here), so the producer keeps
    // the managed tensor, its shape and its strides valid.
    let t = unsafe { &*ptr.as_ptr().cast::<DlTensor>() };
    // SAFETY: as above, `t`'s shape and strides are the producer's,
    // valid while the capsule is held.
    let tensor = unsafe { describe(t) }?;
    Ok((tensor, capsule.unbind()))
}

/// The tensor `t` describes, checked.
///
/// # Safety
/// `t.shape` and (when not null) `t.strides` must point at `t.ndim`
/// valid `i64`s each, as DLPack's producers guarantee.
unsafe fn describe(t: &DlTensor) -> std::result::Result<Tensor, String> {
    let ndim = usize::try_from(t.ndim).map_err(|_| format!("{} dimensions", t.ndim))?;
    if ndim == 0 || t.shape.is_null() {
        return Err("a tensor of no dimensions".into());
    }
    // SAFETY: `shape` holds `ndim` extents (the caller's promise).
    let shape = unsafe { std::slice::from_raw_parts(t.shape, ndim) };
    let shape: Vec<usize> = shape
        .iter()
        .map(|&n| usize::try_from(n).map_err(|_| format!("an extent of {n}")))
        .collect::<std::result::Result<_, _>>()?;
    let strides: Vec<usize> = if t.strides.is_null() {
        // No strides: compact, row-major.
        let mut strides = vec![0usize; ndim];
        let mut step = 1usize;
        for (s, &n) in strides.iter_mut().zip(&shape).rev() {
            *s = step;
            step = step.saturating_mul(n);
        }
        strides
    } else {
        // SAFETY: as `shape`, `strides` holds `ndim` entries when set.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        strides
            .iter()
            .map(|&s| usize::try_from(s).map_err(|_| format!("a stride of {s} (reversed axes)")))
            .collect::<std::result::Result<_, _>>()?
    };
    let DlDataType { code, bits, lanes } = t.dtype;
    let elem_bits = usize::from(bits) * usize::from(lanes);
    if elem_bits == 0 || elem_bits % 8 != 0 {
        return Err(format!(
            "elements of {bits} bits x {lanes} lanes (type code {code}): not whole bytes"
        ));
    }
    let memory = match t.device.device_type {
        DL_CPU | DL_CUDA_HOST => TensorMemory::Host,
        DL_CUDA => TensorMemory::Device(
            u32::try_from(t.device.device_id)
                .map_err(|_| format!("CUDA device {}", t.device.device_id))?,
        ),
        other => {
            return Err(format!(
                "memory of DLPack device type {other}: kvbm addresses host and CUDA memory"
            ));
        }
    };
    if shape.contains(&0) {
        return Err(format!("an empty tensor of shape {shape:?}"));
    }
    let addr = (t.data as u64)
        .checked_add(t.byte_offset)
        .filter(|&a| a != 0)
        .ok_or("a tensor at address 0")?;
    Ok(Tensor {
        raw: RawTensor {
            addr,
            shape,
            strides,
        },
        elem_bytes: elem_bits / 8,
        memory,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `DLTensor` over `shape` and `strides`, which must outlive it.
    fn dl(shape: &[i64], strides: Option<&[i64]>, device: (i32, i32), bits: u8) -> DlTensor {
        DlTensor {
            data: 0x1000 as *mut c_void,
            device: DlDevice {
                device_type: device.0,
                device_id: device.1,
            },
            ndim: shape.len() as i32,
            dtype: DlDataType {
                code: 2,
                bits,
                lanes: 1,
            },
            shape: shape.as_ptr(),
            strides: strides.map_or(std::ptr::null(), <[i64]>::as_ptr),
            byte_offset: 16,
        }
    }

    /// [`describe`] of [`dl`]'s tensor.
    fn read_dl(
        shape: &[i64],
        strides: Option<&[i64]>,
        device: (i32, i32),
        bits: u8,
    ) -> std::result::Result<Tensor, String> {
        // SAFETY: `shape` and `strides` are `ndim` long and outlive the call.
        unsafe { describe(&dl(shape, strides, device, bits)) }
    }

    #[test]
    fn reads_a_compact_tensor_without_strides() {
        let shape = [4, 2, 16, 8];
        let t = read_dl(&shape, None, (DL_CPU, 0), 16).unwrap();
        assert_eq!(t.raw.addr, 0x1010);
        assert_eq!(t.raw.shape, vec![4, 2, 16, 8]);
        assert_eq!(t.raw.strides, vec![256, 128, 8, 1]);
        assert_eq!((t.elem_bytes, t.memory), (2, TensorMemory::Host));
    }

    #[test]
    fn reads_strides_and_devices() {
        let shape = [4, 64];
        let strides = [128, 1];
        let t = read_dl(&shape, Some(&strides), (DL_CUDA, 3), 8).unwrap();
        assert_eq!(t.raw.strides, vec![128, 1]);
        assert_eq!((t.elem_bytes, t.memory), (1, TensorMemory::Device(3)));
        let t = read_dl(&shape, Some(&strides), (DL_CUDA_HOST, 0), 8).unwrap();
        assert_eq!(t.memory, TensorMemory::Host);
    }

    #[test]
    fn refuses_what_kvbm_cannot_address() {
        let shape = [4, 64];
        let e = read_dl(&shape, Some(&[-64, 1]), (DL_CPU, 0), 16).unwrap_err();
        assert!(e.contains("stride of -64"), "{e}");
        let e = read_dl(&shape, None, (7, 0), 16).unwrap_err();
        assert!(e.contains("device type 7"), "{e}");
        let e = read_dl(&shape, None, (DL_CPU, 0), 4).unwrap_err();
        assert!(e.contains("whole bytes"), "{e}");
        let e = read_dl(&[4, 0], None, (DL_CPU, 0), 16).unwrap_err();
        assert!(e.contains("empty"), "{e}");
        let e = read_dl(&[], None, (DL_CPU, 0), 16).unwrap_err();
        assert!(e.contains("no dimensions"), "{e}");
    }
}
