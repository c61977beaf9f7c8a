//! Device memory: buffers kvbm allocates, and an engine's KV tensors wrapped
//! in place.
//!
//! Every piece of memory a copy can touch implements [`CudaRegion`]: a base
//! address the GPU can use, a length, and where it lives. Copies hold an
//! `Arc` of each region they touch until the copy completes, so memory
//! cannot be freed under an in-flight DMA or kernel.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr, CUmemorytype, CUpointer_attribute};

use super::device::CudaDevice;
use super::error::{CudaError, CudaResult, check};

/// Where a region's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Location {
    /// GPU memory (G1).
    Device,
    /// Page-locked host memory registered with the driver (G2).
    PinnedHost,
}

/// Memory the CUDA copy paths can address.
pub trait CudaRegion: Send + Sync {
    /// The address of byte 0 as the GPU sees it (for pinned host memory on a
    /// unified-addressing system this equals the host address).
    fn device_ptr(&self) -> u64;
    /// Bytes addressable from `device_ptr()` (for memory still being pinned
    /// in the background: the bytes pinned so far).
    fn len(&self) -> usize;
    /// True when no byte is addressable.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the bytes live.
    fn location(&self) -> Location;
}

/// Device memory allocated by kvbm (`cuMemAlloc`), freed on drop.
pub struct DeviceBuffer {
    device: CudaDevice,
    ptr: CUdeviceptr,
    len: usize,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceBuffer {
    /// Allocates `len` bytes of device memory (contents undefined).
    pub fn new(device: &CudaDevice, len: usize) -> CudaResult<Self> {
        if len == 0 {
            return Err(CudaError::InvalidCopy(
                "zero-length device allocation".into(),
            ));
        }
        device.bind()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the context is current; `ptr` is a valid out-pointer.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len) })?;
        Ok(DeviceBuffer {
            device: device.clone(),
            ptr,
            len,
        })
    }

    /// The device address of byte 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The ordinal of the device holding the buffer.
    pub fn device_ordinal(&self) -> usize {
        self.device.ordinal()
    }

    /// Copies `data` to `offset` and waits (for set-up and checks, not the
    /// data path).
    pub fn write(&self, offset: usize, data: &[u8]) -> CudaResult<()> {
        bounds(offset, data.len(), self.len)?;
        self.device.bind()?;
        // SAFETY: the range was bounds-checked against the allocation; `data`
        // is valid for reads of its length during this synchronous copy.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(
                self.ptr + offset as u64,
                data.as_ptr().cast::<c_void>(),
                data.len(),
            )
        })
    }

    /// Copies bytes from `offset` into `out` and waits.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> CudaResult<()> {
        bounds(offset, out.len(), self.len)?;
        self.device.bind()?;
        // SAFETY: as in `write`, with `out` valid for writes.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(
                out.as_mut_ptr().cast::<c_void>(),
                self.ptr + offset as u64,
                out.len(),
            )
        })
    }
}

impl CudaRegion for DeviceBuffer {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> Location {
        Location::Device
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc and is freed once; copies
            // using it hold an Arc of this buffer, so none is in flight.
            unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Device memory owned by someone else (an engine's KV tensor), wrapped
/// without copying or owning it. The owner must keep it alive while kvbm
/// uses it; kvbm never frees it.
pub struct ExternalDeviceMemory {
    ptr: CUdeviceptr,
    len: usize,
    ordinal: usize,
}

impl std::fmt::Debug for ExternalDeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalDeviceMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl ExternalDeviceMemory {
    /// Wraps `len` bytes at device address `ptr`, checking with the driver
    /// that both ends of the range are device memory.
    ///
    /// # Safety
    /// The memory must stay allocated for as long as this value (and any copy
    /// holding it) lives.
    pub unsafe fn wrap(device: &CudaDevice, ptr: u64, len: usize) -> CudaResult<Self> {
        if len == 0 {
            return Err(CudaError::InvalidCopy("zero-length tensor".into()));
        }
        device.bind()?;
        for probe_at in [ptr, ptr + len as u64 - 1] {
            let mut kind: u32 = 0;
            // SAFETY: `kind` is a valid out-pointer of the attribute's size.
            let rc = unsafe {
                sys::cuPointerGetAttribute(
                    (&mut kind as *mut u32).cast::<c_void>(),
                    CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    probe_at,
                )
            };
            check("cuPointerGetAttribute", rc)?;
            if kind != CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
                return Err(CudaError::InvalidCopy(format!(
                    "address {probe_at:#x} is not device memory (memory type {kind})"
                )));
            }
        }
        Ok(ExternalDeviceMemory {
            ptr,
            len,
            ordinal: device.ordinal(),
        })
    }

    /// The ordinal of the device the memory is on.
    pub fn device_ordinal(&self) -> usize {
        self.ordinal
    }

    /// Wraps each tensor of an engine's KV cache (one per layer in vLLM's
    /// layout), given as (device pointer, byte length), as memory regions in
    /// tensor order: with the layout kvbm-layout's `recognise_kv_tensors`
    /// finds for the same tensors, they make a `PhysicalLayout`.
    ///
    /// # Safety
    /// As [`ExternalDeviceMemory::wrap`], for every tensor.
    pub unsafe fn wrap_all(
        device: &CudaDevice,
        tensors: &[(u64, usize)],
    ) -> CudaResult<Vec<crate::memory::MemoryRegion>> {
        tensors
            .iter()
            .map(|&(ptr, len)| {
                // SAFETY: forwarded from the caller.
                unsafe { Self::wrap(device, ptr, len) }.map(|m| Arc::new(m).region())
            })
            .collect()
    }
}

impl CudaRegion for ExternalDeviceMemory {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> Location {
        Location::Device
    }
}

pub(crate) fn bounds(offset: usize, len: usize, cap: usize) -> CudaResult<()> {
    match offset.checked_add(len) {
        Some(end) if end <= cap => Ok(()),
        _ => Err(CudaError::InvalidCopy(format!(
            "range {offset}+{len} outside a region of {cap} bytes"
        ))),
    }
}
