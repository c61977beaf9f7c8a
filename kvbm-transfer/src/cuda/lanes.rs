//! The machinery under the copier: lanes and descriptor buffers.
//!
//! A lane is what one stream of copies in one direction needs: a
//! high-priority kernel stream (so staging kernels get the next free SM
//! slots ahead of the model's work), a copy stream, an optional staging ring
//! whose slots are handed between the two streams with events, and the
//! watcher thread that resolves completions. Descriptor buffers hold a
//! kernel's run list and base tables in pinned host memory, mapped for the
//! GPU: the kernel path uploads them to the device, the staged path lets
//! its kernels read them in place. They are pooled and returned only after
//! the copy using them completed.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUdeviceptr, CUevent, CUstream};

use super::completion::{Watcher, destroy_event, new_event};
use super::copier::{CopierConfig, FollowedWait};
use super::device::CudaDevice;
use super::error::{CudaResult, check};
use super::memory::DeviceBuffer;
use super::plan::CopyRun;

/// A kernel stream (high priority), a copy stream, an optional staging ring
/// and the watcher resolving their copies.
pub(crate) struct Lane {
    pub(crate) watcher: Watcher,
    pub(crate) kernel_stream: CUstream,
    pub(crate) copy_stream: CUstream,
    pub(crate) state: Mutex<LaneState>,
    pub(crate) device: CudaDevice,
}

pub(crate) struct LaneState {
    pub(crate) ring: Option<Ring>,
}

pub(crate) struct Ring {
    pub(crate) buf: DeviceBuffer,
    pub(crate) slot_bytes: usize,
    pub(crate) slots: Vec<Slot>,
    pub(crate) next: usize,
}

pub(crate) struct Slot {
    /// Recorded when the producer side filled the slot.
    pub(crate) filled: CUevent,
    /// Recorded when the consumer side is done with it.
    pub(crate) free: CUevent,
    pub(crate) used: bool,
}

// SAFETY: streams and events are driver handles usable from any thread with
// the context current; ring state is behind the lane's mutex.
unsafe impl Send for Lane {}
// SAFETY: as above.
unsafe impl Sync for Lane {}

impl Lane {
    pub(crate) fn new(
        device: &CudaDevice,
        config: &CopierConfig,
        staged: bool,
        followed: FollowedWait,
        name: &str,
    ) -> CudaResult<Self> {
        let (mut least, mut greatest) = (0i32, 0i32);
        // SAFETY: out-pointers are valid; context is current.
        check("cuCtxGetStreamPriorityRange", unsafe {
            sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
        })?;
        let kernel_stream = new_stream(greatest)?;
        let copy_stream = match new_stream(least) {
            Ok(s) => s,
            Err(e) => {
                destroy_stream(kernel_stream);
                return Err(e);
            }
        };
        let mut lane = Lane {
            watcher: Watcher::spawn(device, name, followed)?,
            kernel_stream,
            copy_stream,
            state: Mutex::new(LaneState { ring: None }),
            device: device.clone(),
        };
        if staged {
            let buf = DeviceBuffer::new(device, config.staging_slot_bytes * config.staging_slots)?;
            let mut slots = Vec::with_capacity(config.staging_slots);
            for _ in 0..config.staging_slots {
                slots.push(Slot {
                    filled: new_event(false)?,
                    free: new_event(false)?,
                    used: false,
                });
            }
            lane.state.get_mut().unwrap_or_else(|p| p.into_inner()).ring = Some(Ring {
                buf,
                slot_bytes: config.staging_slot_bytes,
                slots,
                next: 0,
            });
        }
        Ok(lane)
    }
}

impl Lane {
    /// Waits until both streams are idle (errors ignored: the caller is
    /// already reporting one).
    pub(crate) fn drain(&self) {
        // SAFETY: both streams belong to this lane's context, which the
        // submitting thread made current.
        unsafe {
            sys::cuStreamSynchronize(self.kernel_stream);
            sys::cuStreamSynchronize(self.copy_stream);
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // Drain: the watcher resolves every copy in flight before it exits.
        let _ = self.device.bind();
        // SAFETY: streams belong to this lane's context; synchronising them
        // makes sure nothing uses the ring when it is freed.
        unsafe {
            sys::cuStreamSynchronize(self.kernel_stream);
            sys::cuStreamSynchronize(self.copy_stream);
        }
        if let Some(ring) = self
            .state
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .ring
            .take()
        {
            for s in &ring.slots {
                destroy_event(s.filled);
                destroy_event(s.free);
            }
        }
        destroy_stream(self.kernel_stream);
        destroy_stream(self.copy_stream);
    }
}

fn new_stream(priority: i32) -> CudaResult<CUstream> {
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: `s` is a valid out-pointer; context is current.
    check("cuStreamCreateWithPriority", unsafe {
        sys::cuStreamCreateWithPriority(
            &mut s,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            priority,
        )
    })?;
    Ok(s)
}

fn destroy_stream(s: CUstream) {
    // SAFETY: the stream was created by `new_stream` and is destroyed once.
    unsafe { sys::cuStreamDestroy_v2(s) };
}

/// Reusable descriptor buffers: pinned host staging plus device copy of a
/// kernel's run list and base tables.
pub(crate) struct DescPool {
    pub(crate) device: CudaDevice,
    pub(crate) free: Mutex<Vec<DescBuf>>,
}

pub(crate) struct DescBuf {
    host: *mut u8,
    /// `host` as the GPU addresses it (kernels may read descriptors in
    /// place, without an upload through a copy engine).
    mapped: CUdeviceptr,
    dev: CUdeviceptr,
    cap: usize,
}

// SAFETY: plain driver allocations, used by one copy at a time.
unsafe impl Send for DescBuf {}

/// A descriptor buffer lent to one copy; returns to the pool on drop (after
/// the copy completed, since the watcher holds it until then).
pub(crate) struct DescLease {
    pub(crate) buf: Option<DescBuf>,
    pool: Arc<DescPool>,
    runs_bytes: usize,
}

// SAFETY: see DescBuf.
unsafe impl Send for DescLease {}

impl DescLease {
    pub(crate) fn runs_ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.dev)
    }
    pub(crate) fn table_ptr(&self, index: usize) -> u64 {
        self.runs_ptr() + (self.runs_bytes + index * 8) as u64
    }
    /// The pinned host side: CPU address, GPU address, capacity in bytes.
    pub(crate) fn host(&self) -> (*mut u8, u64, usize) {
        self.buf
            .as_ref()
            .map_or((std::ptr::null_mut(), 0, 0), |b| (b.host, b.mapped, b.cap))
    }
}

impl Drop for DescLease {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool
                .free
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(b);
        }
    }
}

impl DescPool {
    pub(crate) fn upload(
        self: &Arc<Self>,
        stream: CUstream,
        runs: &[CopyRun],
        src_bases: &[u64],
        dst_bases: &[u64],
    ) -> CudaResult<DescLease> {
        let mut tables = src_bases.to_vec();
        tables.extend_from_slice(dst_bases);
        self.upload_tables(stream, runs, &tables)
    }

    /// Writes `runs` then `tables` into a pinned buffer and enqueues their
    /// copy to the device on `stream`.
    pub(crate) fn upload_tables(
        self: &Arc<Self>,
        stream: CUstream,
        runs: &[CopyRun],
        tables: &[u64],
    ) -> CudaResult<DescLease> {
        let runs_bytes = std::mem::size_of_val(runs);
        let need = runs_bytes + std::mem::size_of_val(tables);
        let buf = self.take(need)?;
        // SAFETY: `buf.host` holds `cap >= need` bytes and is not in use by
        // any copy (leases return only after completion); the sources are
        // plain-old-data slices.
        unsafe {
            std::ptr::copy_nonoverlapping(runs.as_ptr().cast::<u8>(), buf.host, runs_bytes);
            std::ptr::copy_nonoverlapping(
                tables.as_ptr().cast::<u8>(),
                buf.host.add(runs_bytes),
                need - runs_bytes,
            );
        }
        let lease = DescLease {
            buf: Some(buf),
            pool: Arc::clone(self),
            runs_bytes,
        };
        let b = lease.buf.as_ref().map(|b| (b.dev, b.host));
        if let Some((dev, host)) = b {
            // SAFETY: both buffers hold `need` bytes; the pinned source
            // stays untouched until the lease returns after completion.
            check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dev, host.cast::<c_void>(), need, stream)
            })?;
        }
        Ok(lease)
    }

    /// Lends a buffer of at least `need` bytes whose pinned host side the
    /// caller fills and the GPU reads in place.
    pub(crate) fn lease(self: &Arc<Self>, need: usize) -> CudaResult<DescLease> {
        Ok(DescLease {
            buf: Some(self.take(need)?),
            pool: Arc::clone(self),
            runs_bytes: 0,
        })
    }

    fn take(&self, need: usize) -> CudaResult<DescBuf> {
        {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = free.iter().position(|b| b.cap >= need) {
                return Ok(free.swap_remove(i));
            }
        }
        let cap = need.next_power_of_two().max(64 << 10);
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; context is current (the copier bound it).
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                cap,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        })?;
        let mut mapped: CUdeviceptr = 0;
        // SAFETY: `host` was just allocated as mapped pinned memory.
        if let Err(e) = check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut mapped, host, 0)
        }) {
            // SAFETY: `host` was just allocated and is not shared.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        let mut dev: CUdeviceptr = 0;
        // SAFETY: as above.
        if let Err(e) = check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut dev, cap) }) {
            // SAFETY: `host` was just allocated and is not shared.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        Ok(DescBuf {
            host: host.cast::<u8>(),
            mapped,
            dev,
            cap,
        })
    }
}

impl Drop for DescPool {
    fn drop(&mut self) {
        if self.device.bind().is_err() {
            return;
        }
        for b in self
            .free
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            // SAFETY: allocated in `take`, freed once; no copy holds it (all
            // leases have returned, since they hold an Arc of the pool).
            unsafe {
                sys::cuMemFreeHost(b.host.cast::<c_void>());
                sys::cuMemFree_v2(b.dev);
            }
        }
    }
}
