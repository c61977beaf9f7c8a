//! Host memory standing in for a GPU, for two-hop tests and benches on
//! machines without one.
//!
//! [`HostAsDevice`] claims the CUDA row of kvbm-transfer's strategy table
//! and moves bytes with the memcpy backend, so device ↔ disk transfers take
//! the same bounce pipeline they take with a real GPU; like a device,
//! `submit` returns at once and an optional delay makes the "device" slow.
//! [`host_device_layout`] and [`pinned_stand_in_pool`] give it memory
//! labelled `Device(0)` and `Pinned` that is plain system memory;
//! [`gated_stand_in_executor`] an executor whose copies wait at a gate.

use std::sync::Arc;
use std::time::Duration;

use kvbm_layout::Layout;
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::memory::SystemAllocator;
use kvbm_transfer::{
    BackendKind, BouncePool, Completion, Executor, ExecutorConfig, MemoryKind, MemoryRegion,
    PhysicalLayout, Result, TransferBackend, TransferJob,
};

use crate::gate::{Gate, GatedBackend};

/// A memcpy backend that answers for device memory (see the module docs).
pub struct HostAsDevice {
    inner: Arc<MemcpyBackend>,
    delay: Duration,
}

impl HostAsDevice {
    /// A stand-in copying on `threads` memcpy threads, with no delay.
    pub fn new(threads: usize) -> Result<Self> {
        Ok(Self {
            inner: Arc::new(MemcpyBackend::new(threads)?),
            delay: Duration::ZERO,
        })
    }

    /// Runs every copy `delay` after its submission, on a thread of its
    /// own (sleeping in `submit` would stall whichever thread submits).
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

/// The same regions labelled pinned, so the memcpy backend accepts them.
fn as_pinned(regions: &[MemoryRegion]) -> Arc<[MemoryRegion]> {
    regions
        .iter()
        .map(|r| {
            let addr = r
                .addr()
                .expect("HostAsDevice moves host memory only (a file region reached it)");
            // SAFETY: the stand-in's "device" regions are system
            // allocations kept alive by their owner, which the new region
            // carries too.
            unsafe { MemoryRegion::from_raw(addr, r.len(), MemoryKind::Pinned, r.owner().cloned()) }
        })
        .collect()
}

impl TransferBackend for HostAsDevice {
    fn name(&self) -> &'static str {
        "host-as-device"
    }
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }
    fn supports(&self, _src: MemoryKind, _dst: MemoryKind) -> bool {
        true
    }
    fn submit(&self, job: TransferJob) -> Completion {
        let job = TransferJob::new(
            as_pinned(&job.src),
            as_pinned(&job.dst),
            job.runs.clone(),
            job.cancel.clone(),
        );
        if self.delay.is_zero() {
            return self.inner.submit(job);
        }
        let (tx, rx) = kvbm_transfer::completion_pair();
        let (inner, delay) = (self.inner.clone(), self.delay);
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            tx.complete(inner.submit(job).wait());
        });
        rx
    }
}

/// `layout` in system memory labelled `Device(0)` (pages touched up front
/// when `populate`).
pub fn host_device_layout(layout: Layout, populate: bool) -> Result<PhysicalLayout> {
    let alloc = SystemAllocator::new().populate(populate);
    let regions = (0..layout.num_regions())
        .map(|r| {
            let buf = alloc.allocate(layout.region_size(r)?)?;
            // SAFETY: a live system allocation, owned by the region.
            Ok(unsafe {
                MemoryRegion::from_raw(buf.addr(), buf.len(), MemoryKind::Device(0), Some(buf))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    PhysicalLayout::new(layout, regions)
}

/// A bounce pool of `slots` × `slot_bytes` in system memory labelled
/// pinned.
pub fn pinned_stand_in_pool(slots: usize, slot_bytes: u64) -> Result<Arc<BouncePool>> {
    let buf = SystemAllocator::new().allocate(slots as u64 * slot_bytes)?;
    // SAFETY: a live system allocation, owned by the region.
    let region =
        unsafe { MemoryRegion::from_raw(buf.addr(), buf.len(), MemoryKind::Pinned, Some(buf)) };
    BouncePool::new(region, slot_bytes)
}

/// An executor whose one backend is a [`HostAsDevice`] behind `gate`:
/// host ↔ "device" transfers in batches of `batch` blocks, at most
/// `in_flight` batches in flight each way, each copy held at the gate
/// until the test lets it through.
pub fn gated_stand_in_executor(
    gate: &Arc<Gate>,
    batch: usize,
    in_flight: usize,
) -> Result<Executor> {
    Executor::builder()
        .backend(Arc::new(GatedBackend::new(
            HostAsDevice::new(1)?,
            gate.clone(),
        )))
        .config(ExecutorConfig {
            max_blocks_per_batch: batch,
            max_batches_in_flight: in_flight,
            bounce_slots_per_batch: 1,
        })
        .build()
}
