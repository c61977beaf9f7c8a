//! Driver handles that release themselves: events, streams, mapped pinned
//! host allocations and host registrations.
//!
//! Each holds its device and makes the device's context current before
//! releasing the handle on drop, so a handle may be dropped on any thread.
//! The raw handles are lent (`raw`) only to the crate's own driver calls.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUdeviceptr, CUevent, CUstream};

use super::device::CudaDevice;
use super::error::{CudaError, CudaResult, check};

/// What an [`Event`] is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    /// Ordering between streams only: no timing, waiters spin.
    Order,
    /// A completion a host thread waits for: no timing, waiters sleep.
    Blocking,
    /// Diagnostics: records the GPU's clock.
    #[cfg_attr(not(feature = "diagnostics"), allow(dead_code))]
    Timing,
}

/// A CUDA event, destroyed on drop.
pub(crate) struct Event {
    raw: CUevent,
    device: CudaDevice,
}

// SAFETY: an event is a driver handle usable from any thread; every use
// makes the device's context current first or runs on a thread that did.
unsafe impl Send for Event {}
// SAFETY: as above; the driver serialises operations on one event.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event of `kind` on `device`.
    pub(crate) fn new(device: &CudaDevice, kind: EventKind) -> CudaResult<Self> {
        device.bind()?;
        let flags = match kind {
            EventKind::Order => sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            EventKind::Blocking => {
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
                    | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
            }
            EventKind::Timing => 0,
        };
        let mut raw: CUevent = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Event {
            raw,
            device: device.clone(),
        })
    }

    /// Records the event after the work queued on `stream` so far.
    pub(crate) fn record(&self, stream: &Stream) -> CudaResult<()> {
        // SAFETY: both handles are live and belong to the same context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw)
        })
    }

    /// Whether the work before the last recording is still running.
    pub(crate) fn is_pending(&self) -> bool {
        // SAFETY: the event is live.
        let rc = unsafe { sys::cuEventQuery(self.raw) };
        rc == sys::cudaError_enum::CUDA_ERROR_NOT_READY
    }

    /// Waits until the work before the last recording ended; its error if
    /// it failed.
    pub(crate) fn synchronize(&self) -> CudaResult<()> {
        // SAFETY: the event is live.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// Diagnostics: milliseconds on the GPU's clock from `start` to this
    /// event (both [`EventKind::Timing`]), once both fired.
    #[cfg(feature = "diagnostics")]
    pub(crate) fn elapsed_ms_since(&self, start: &Event) -> Option<f32> {
        self.synchronize().ok()?;
        let mut ms = 0f32;
        // SAFETY: both events are live and were recorded in this context;
        // `ms` is a valid out-pointer.
        let rc = unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.raw, self.raw) };
        check("cuEventElapsedTime", rc).ok().map(|()| ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: created in `new` and destroyed once, here; the driver
        // defers the release while recorded work is still pending.
        unsafe { sys::cuEventDestroy_v2(self.raw) };
    }
}

/// A non-blocking CUDA stream, destroyed on drop.
pub(crate) struct Stream {
    raw: CUstream,
    device: CudaDevice,
}

// SAFETY: a stream is a driver handle usable from any thread with its
// context current; the driver serialises work queued on it.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a non-blocking stream of `priority` (see
    /// [`Stream::priority_range`]) on `device`.
    pub(crate) fn new(device: &CudaDevice, priority: i32) -> CudaResult<Self> {
        device.bind()?;
        let mut raw: CUstream = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        check("cuStreamCreateWithPriority", unsafe {
            sys::cuStreamCreateWithPriority(
                &mut raw,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                priority,
            )
        })?;
        Ok(Stream {
            raw,
            device: device.clone(),
        })
    }

    /// The lowest and the highest stream priority of `device` (numerically
    /// the greatest and the least).
    pub(crate) fn priority_range(device: &CudaDevice) -> CudaResult<(i32, i32)> {
        device.bind()?;
        let (mut least, mut greatest) = (0i32, 0i32);
        // SAFETY: out-pointers are valid; the context is current.
        check("cuCtxGetStreamPriorityRange", unsafe {
            sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
        })?;
        Ok((least, greatest))
    }

    /// The driver's handle, for the crate's own calls that queue work.
    pub(crate) fn raw(&self) -> CUstream {
        self.raw
    }

    /// The device the stream belongs to.
    pub(crate) fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Makes later work on this stream wait for `event`'s last recording.
    pub(crate) fn wait(&self, event: &Event) -> CudaResult<()> {
        // SAFETY: both handles are live and belong to the same context.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.raw, event.raw, 0)
        })
    }

    /// Waits until the work queued so far ended (errors ignored: used
    /// where a caller is already reporting one, or tearing down).
    pub(crate) fn drain(&self) {
        let _ = self.device.bind();
        // SAFETY: the stream is live and its context current.
        unsafe { sys::cuStreamSynchronize(self.raw) };
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: created in `new` and destroyed once, here; the driver
        // lets queued work finish before it releases the stream.
        unsafe { sys::cuStreamDestroy_v2(self.raw) };
    }
}

/// Pinned host memory from `cuMemHostAlloc`, mapped for the GPU; freed on
/// drop.
pub(crate) struct HostAlloc {
    host: *mut u8,
    mapped: CUdeviceptr,
    len: usize,
    device: CudaDevice,
}

// SAFETY: the allocation is plain memory owned by this value; who writes
// it (one copy at a time) is the owner's business.
unsafe impl Send for HostAlloc {}

impl HostAlloc {
    /// Allocates `len` bytes of pinned, mapped, portable host memory.
    pub(crate) fn new(device: &CudaDevice, len: usize) -> CudaResult<Self> {
        device.bind()?;
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                len,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        })?;
        // Owned from here: an error below frees it.
        let mut alloc = HostAlloc {
            host: host.cast::<u8>(),
            mapped: 0,
            len,
            device: device.clone(),
        };
        // SAFETY: `host` was just allocated as mapped pinned memory; the
        // out-pointer is valid.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut alloc.mapped, host, 0)
        })?;
        Ok(alloc)
    }

    /// The CPU address of byte 0.
    pub(crate) fn host_ptr(&self) -> *mut u8 {
        self.host
    }

    /// The GPU address of byte 0.
    pub(crate) fn mapped(&self) -> CUdeviceptr {
        self.mapped
    }

    /// Bytes allocated.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: allocated in `new` and freed once, here; whoever lent it
        // to a copy keeps it until the copy completed.
        unsafe { sys::cuMemFreeHost(self.host.cast::<c_void>()) };
    }
}

/// A range of host memory page-locked with `cuMemHostRegister`,
/// unregistered on drop.
#[derive(Debug)]
pub(crate) struct HostRegistration {
    addr: usize,
    len: usize,
    device: CudaDevice,
}

impl HostRegistration {
    /// Registers `[addr, addr + len)` with `flags` (`CU_MEMHOSTREGISTER_*`).
    ///
    /// # Safety
    /// The range must be mapped memory (read-only only with
    /// `CU_MEMHOSTREGISTER_READ_ONLY`) that stays mapped until the
    /// registration is dropped, and no other registration may overlap it.
    pub(crate) unsafe fn new(
        device: &CudaDevice,
        addr: usize,
        len: usize,
        flags: u32,
    ) -> CudaResult<Self> {
        device.bind()?;
        // SAFETY: the caller guarantees the range; the context is current.
        let rc = unsafe { sys::cuMemHostRegister_v2(addr as *mut c_void, len, flags) };
        if rc != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(CudaError::driver("cuMemHostRegister", rc));
        }
        Ok(HostRegistration {
            addr,
            len,
            device: device.clone(),
        })
    }

    /// The first byte registered.
    pub(crate) fn addr(&self) -> usize {
        self.addr
    }

    /// Bytes registered.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: registered once at this address by `new`; the memory is
        // still mapped (its owner drops the registration first) and no copy
        // reads it any more (copies keep their regions alive).
        let rc = unsafe { sys::cuMemHostUnregister(self.addr as *mut c_void) };
        if rc != sys::cudaError_enum::CUDA_SUCCESS {
            tracing::warn!(code = ?rc, "cuMemHostUnregister failed");
        }
    }
}
