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
    /// The driver allocation this region lies in, as `[start, end)` device
    /// addresses, where known. The copy engines may move a family of runs
    /// that spans several regions as one descriptor only inside one
    /// allocation; `None` (the default) treats the region as its own.
    fn allocation(&self) -> Option<(u64, u64)> {
        None
    }
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
        })?;
        // From pageable memory the call returns once `data` is staged, its
        // DMA to the buffer maybe still running on the default stream; a
        // copy on another stream right after could be overwritten by it.
        // SAFETY: the context is current (bound above); the null stream is
        // the default stream the copy ran on.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(std::ptr::null_mut())
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
    fn allocation(&self) -> Option<(u64, u64)> {
        Some((self.ptr, self.ptr + self.len as u64))
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
    allocation: Option<(u64, u64)>,
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
            allocation: allocation_range(ptr, len),
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
    fn allocation(&self) -> Option<(u64, u64)> {
        self.allocation
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

/// The driver allocation holding `[ptr, ptr + len)`
/// (`CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` / `_SIZE`), asked once when an
/// engine's tensor is wrapped, so layer tensors carved out of one
/// allocation count as one. `None` where the driver cannot say. The caller
/// made the context current.
fn allocation_range(ptr: u64, len: usize) -> Option<(u64, u64)> {
    let mut start: CUdeviceptr = 0;
    let mut size: usize = 0;
    let mut attrs = [
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    let mut data: [*mut c_void; 2] = [
        (&mut start as *mut CUdeviceptr).cast::<c_void>(),
        (&mut size as *mut usize).cast::<c_void>(),
    ];
    // SAFETY: two attributes, two out-pointers of the attributes'
    // documented sizes (CUdeviceptr, size_t), all live across the call; the
    // context is current.
    let rc = unsafe { sys::cuPointerGetAttributes(2, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
    let end = start.checked_add(size as u64)?;
    (rc == sys::CUresult::CUDA_SUCCESS && start <= ptr && end >= ptr + len as u64)
        .then_some((start, end))
}

/// The start and end of every allocation the device regions in `regions`
/// lie in, sorted: the boundaries no single DMA descriptor may cross.
/// Regions that do not know their allocation count as their own.
pub(crate) fn allocation_bounds(regions: &[std::sync::Arc<dyn CudaRegion>]) -> Vec<u64> {
    let mut out = Vec::with_capacity(regions.len() * 2);
    for r in regions.iter().filter(|r| r.location() == Location::Device) {
        let base = r.device_ptr();
        let (start, end) = r.allocation().unwrap_or((base, base + r.len() as u64));
        out.extend([start, end]);
    }
    out.sort_unstable();
    out.dedup();
    out
}
