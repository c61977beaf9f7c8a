//! The machinery under the copier: lanes and descriptor buffers.
//!
//! A lane is what one stream of copies in one direction needs: a
//! high-priority kernel stream (so staging kernels get the next free SM
//! slots ahead of the model's work), a copy stream, an optional staging ring
//! whose slots are handed between the two streams with events, and the
//! watcher thread that resolves completions. Descriptor buffers hold a
//! kernel's run list and base tables in pinned host memory, mapped for the
//! GPU: the kernel path uploads them to the device (for a plan of more runs
//! than a launch carries in its parameters), the staged path lets its
//! kernels read them in place. They are pooled and returned only after
//! the copy using them completed.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::completion::Watcher;
use super::copier::CopierConfig;
use super::device::CudaDevice;
use super::error::{CudaResult, check};
use super::handles::{Event, EventKind, HostAlloc, Stream};
use super::memory::DeviceBuffer;
use super::plan::CopyRun;

/// A kernel stream (high priority), a copy stream, an optional staging ring
/// and the watcher resolving their copies. Field order matters on drop:
/// the watcher resolves every copy in flight, then the ring goes, then the
/// streams.
pub(crate) struct Lane {
    pub(crate) watcher: Watcher,
    pub(crate) state: Mutex<LaneState>,
    pub(crate) kernel_stream: Stream,
    pub(crate) copy_stream: Stream,
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
    pub(crate) filled: Event,
    /// Recorded when the consumer side is done with it.
    pub(crate) free: Event,
    pub(crate) used: bool,
}

impl Lane {
    pub(crate) fn new(
        device: &CudaDevice,
        config: &CopierConfig,
        staged: bool,
        poll_followed: bool,
        name: &str,
    ) -> CudaResult<Self> {
        let (least, greatest) = Stream::priority_range(device)?;
        let kernel_stream = Stream::new(device, greatest)?;
        let copy_stream = Stream::new(device, least)?;
        let ring = if staged {
            let buf = DeviceBuffer::new(device, config.staging_slot_bytes * config.staging_slots)?;
            let mut slots = Vec::with_capacity(config.staging_slots);
            for _ in 0..config.staging_slots {
                slots.push(Slot {
                    filled: Event::new(device, EventKind::Order)?,
                    free: Event::new(device, EventKind::Order)?,
                    used: false,
                });
            }
            Some(Ring {
                buf,
                slot_bytes: config.staging_slot_bytes,
                slots,
                next: 0,
            })
        } else {
            None
        };
        Ok(Lane {
            watcher: Watcher::spawn(device, name, poll_followed)?,
            state: Mutex::new(LaneState { ring }),
            kernel_stream,
            copy_stream,
            device: device.clone(),
        })
    }

    /// Waits until both streams are idle (errors ignored: the caller is
    /// already reporting one).
    pub(crate) fn drain(&self) {
        self.kernel_stream.drain();
        self.copy_stream.drain();
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // Nothing may use the ring when it is freed; the watcher then
        // resolves every copy in flight as it exits (field order).
        self.drain();
    }
}

/// Reusable descriptor buffers: pinned host staging plus device copy of a
/// kernel's run list and base tables.
pub(crate) struct DescPool {
    pub(crate) device: CudaDevice,
    pub(crate) free: Mutex<Vec<DescBuf>>,
}

pub(crate) struct DescBuf {
    /// Pinned and mapped: kernels may read descriptors in place, without
    /// an upload through a copy engine.
    host: HostAlloc,
    dev: DeviceBuffer,
}

/// A descriptor buffer lent to one copy; returns to the pool on drop (after
/// the copy completed, since the watcher holds it until then).
pub(crate) struct DescLease {
    pub(crate) buf: Option<DescBuf>,
    pool: Arc<DescPool>,
    runs_bytes: usize,
}

impl DescLease {
    pub(crate) fn runs_ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.dev.ptr())
    }
    pub(crate) fn table_ptr(&self, index: usize) -> u64 {
        self.runs_ptr() + (self.runs_bytes + index * 8) as u64
    }
    /// The pinned host side: CPU address, GPU address, capacity in bytes.
    pub(crate) fn host(&self) -> (*mut u8, u64, usize) {
        self.buf.as_ref().map_or((std::ptr::null_mut(), 0, 0), |b| {
            (b.host.host_ptr(), b.host.mapped(), b.host.len())
        })
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
    /// [`DescPool::upload_tables`] of `runs` and the base tables
    /// `src_bases` then `dst_bases`.
    ///
    /// # Safety
    /// As [`DescPool::upload_tables`].
    pub(crate) unsafe fn upload(
        self: &Arc<Self>,
        stream: &Stream,
        runs: &[CopyRun],
        src_bases: &[u64],
        dst_bases: &[u64],
    ) -> CudaResult<DescLease> {
        let mut tables = src_bases.to_vec();
        tables.extend_from_slice(dst_bases);
        // SAFETY: the caller's promise.
        unsafe { self.upload_tables(stream, runs, &tables) }
    }

    /// Writes `runs` then `tables` into a pinned buffer and enqueues their
    /// copy to the device on `stream`.
    ///
    /// # Safety
    /// The returned lease must be kept until the work queued on `stream`
    /// after this call completed: the copy reads the pinned buffer and
    /// later work reads the device one, and a returned lease lends both to
    /// the next copy.
    pub(crate) unsafe fn upload_tables(
        self: &Arc<Self>,
        stream: &Stream,
        runs: &[CopyRun],
        tables: &[u64],
    ) -> CudaResult<DescLease> {
        let runs_bytes = std::mem::size_of_val(runs);
        let need = runs_bytes + std::mem::size_of_val(tables);
        let buf = self.take(need)?;
        let host = buf.host.host_ptr();
        // SAFETY: `host` holds at least `need` bytes and is not in use by
        // any copy (leases return only after completion); the sources are
        // plain-old-data slices.
        unsafe {
            std::ptr::copy_nonoverlapping(runs.as_ptr().cast::<u8>(), host, runs_bytes);
            std::ptr::copy_nonoverlapping(
                tables.as_ptr().cast::<u8>(),
                host.add(runs_bytes),
                need - runs_bytes,
            );
        }
        let lease = DescLease {
            buf: Some(buf),
            pool: Arc::clone(self),
            runs_bytes,
        };
        let b = lease.buf.as_ref().map(|b| (b.dev.ptr(), b.host.host_ptr()));
        if let Some((dev, host)) = b {
            // SAFETY: both buffers hold `need` bytes; the pinned source
            // stays untouched until the lease returns after completion.
            check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dev, host.cast::<c_void>(), need, stream.raw())
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
            if let Some(i) = free.iter().position(|b| b.host.len() >= need) {
                return Ok(free.swap_remove(i));
            }
        }
        let cap = need.next_power_of_two().max(64 << 10);
        Ok(DescBuf {
            host: HostAlloc::new(&self.device, cap)?,
            dev: DeviceBuffer::new(&self.device, cap)?,
        })
    }
}
