//! A worker's host tier for an engine that keeps the books itself.
//!
//! vLLM's offloading interface splits a backend in two: a manager in the
//! scheduler decides which slot of the host tier each block goes to or
//! comes from, and a worker in every rank copies its own share of the
//! bytes when the engine hands it a job. A [`PagedWorker`] is that worker:
//! the engine's KV cache groups as G1 (its page tensors, no copy), G2 as
//! `slots` host slots (pinned near a GPU), kvbm's executor between them,
//! and, in verify mode, a checksum of every slot written.
//!
//! **Groups.** A hybrid model keeps several KV cache groups (full
//! attention, sliding window, Mamba state): each group's layers have one
//! page per engine block, and one block of a group is the concatenation
//! of its layers' pages. Every group gets a G1 layout over its page
//! tensors (layer-separate, one region per layer) and a G2 view over the
//! one shared slot region (fully contiguous, slot stride the largest
//! group's block), so a slot can hold a block of any group.
//!
//! **Jobs.** [`PagedWorker::store`] and [`PagedWorker::load`] start every
//! group's copy at once and return; a thread of the worker settles each
//! job when all its copies ended, in verify mode records (store) or checks
//! (load) the slots' sums, and files a [`JobReport`] that
//! [`PagedWorker::finished`] hands out. A load whose slot fails its
//! checksum, or whose copy fails, names the engine blocks that must not be
//! served.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Instant;

use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind, LayoutStrides};
use kvbm_transfer::memory::{MemoryRegion, Owner, SystemAllocator};
use kvbm_transfer::{Executor, MemoryKind, PhysicalLayout, TransferHandle};
use parking_lot::{Condvar, Mutex};

use crate::error::{DistError, Result};
use crate::verify::block_sum;

/// One KV cache group of the engine: the page tensor of each of its
/// layers, in layer order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageGroup {
    /// Address of block 0's page in each layer's tensor.
    pub layers: Vec<u64>,
    /// Bytes of one layer's page that hold data (the copy length).
    pub page_bytes: u64,
    /// Bytes from one block's page to the next in every layer's tensor.
    pub block_stride: u64,
}

impl PageGroup {
    /// Bytes of one block of this group in a slot.
    pub fn block_bytes(&self) -> u64 {
        self.page_bytes * self.layers.len() as u64
    }
}

/// Where the engine's pages live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageMemory {
    /// Host memory (an engine running on the CPU).
    Host,
    /// Memory of the CUDA device with this ordinal (feature `cuda`).
    Device(u32),
}

/// What a [`PagedWorker`] is built from.
#[derive(Debug, Clone)]
pub struct PagedConfig {
    /// The engine's KV cache groups, in the engine's group order.
    pub groups: Vec<PageGroup>,
    /// Blocks in the engine's cache (every group's tensors have them).
    pub num_blocks: usize,
    /// Where the pages live.
    pub memory: PageMemory,
    /// Slots of G2 to allocate.
    pub slots: usize,
    /// Bytes of one slot; at least the largest group's block.
    pub slot_bytes: u64,
    /// Record a checksum of every stored slot and check it on each load.
    pub verify: bool,
}

/// Which way a job copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Engine pages into slots.
    Store,
    /// Slots into engine pages.
    Load,
}

/// One block of a job: engine block `block` of group `group`, and its
/// slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    /// The KV cache group.
    pub group: usize,
    /// The engine's block id in that group.
    pub block: usize,
    /// The G2 slot.
    pub slot: usize,
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq)]
pub struct JobReport {
    /// The engine's job id.
    pub job: u64,
    /// Which way it copied.
    pub direction: Direction,
    /// Bytes that landed.
    pub bytes: u64,
    /// Seconds from submission to the end of its last copy.
    pub seconds: f64,
    /// The copies whose destination must not be used: a failed copy, or a
    /// load from a slot that failed its checksum.
    pub failed: Vec<PageCopy>,
    /// The first error, when anything failed.
    pub error: Option<String>,
}

struct Pending {
    job: u64,
    direction: Direction,
    copies: Vec<PageCopy>,
    /// One transfer per group the job touches, with that group's index.
    transfers: Vec<(usize, TransferHandle)>,
    started: Instant,
}

#[derive(Default)]
struct Reports {
    done: Vec<JobReport>,
    in_flight: HashSet<u64>,
}

struct Shared {
    g1: Vec<PhysicalLayout>,
    g2: Vec<PhysicalLayout>,
    /// Slots a job may name; slot `slots` is the zero slot.
    slots: usize,
    /// The executor's clone that wipes the pages of failed loads.
    executor: Executor,
    /// The checksum of each slot's block (verify mode).
    sums: Option<Mutex<Vec<Option<u64>>>>,
    reports: Mutex<Reports>,
    settled: Condvar,
}

/// The worker side of a host tier whose books the engine keeps; see the
/// module docs.
pub struct PagedWorker {
    shared: Arc<Shared>,
    executor: Executor,
    queue: Option<Sender<Pending>>,
    settler: Option<JoinHandle<()>>,
    slot_bytes: u64,
}

fn invalid(what: impl Into<String>) -> DistError {
    DistError::InvalidConfig(what.into())
}

/// A group's pages as a G1 layout: one region per layer, block-first, one
/// chunk of `page_bytes` per block.
///
/// # Safety
/// As [`PagedWorker::new`].
unsafe fn group_g1(
    group: &PageGroup,
    num_blocks: usize,
    memory: PageMemory,
    owner: &Owner,
) -> Result<PhysicalLayout> {
    if group.layers.is_empty() || group.page_bytes == 0 {
        return Err(invalid(
            "a KV cache group without layers or with empty pages",
        ));
    }
    if group.block_stride < group.page_bytes {
        return Err(invalid(format!(
            "block stride {} is below the page size {}",
            group.block_stride, group.page_bytes
        )));
    }
    if group.layers.contains(&0) {
        return Err(invalid("a page tensor at address 0"));
    }
    let page = usize::try_from(group.page_bytes).map_err(|_| invalid("page too large"))?;
    let config = LayoutConfig::new(num_blocks, group.layers.len(), 1, 1, page, 1)?;
    let strides = LayoutStrides {
        block: group.block_stride,
        layer: 0,
        outer: group.page_bytes,
    };
    let layout = Layout::with_strides(
        config,
        LayoutKind::LayerSeparate(BlockOrder::BlockFirst),
        strides,
    )?;
    let span = layout.region_size(0)?;
    let kind = match memory {
        PageMemory::Host => MemoryKind::System,
        PageMemory::Device(ordinal) => device_kind(ordinal)?,
    };
    let regions = group
        .layers
        .iter()
        // SAFETY: the caller guarantees `num_blocks` blocks of
        // `block_stride` bytes of `memory` from each address, alive while
        // `owner` is.
        .map(|&addr| unsafe { MemoryRegion::from_raw(addr, span, kind, Some(owner.clone())) })
        .collect();
    Ok(PhysicalLayout::new(layout, regions)?)
}

#[cfg(feature = "cuda")]
fn device_kind(ordinal: u32) -> Result<MemoryKind> {
    Ok(MemoryKind::Device(ordinal))
}

#[cfg(not(feature = "cuda"))]
fn device_kind(_ordinal: u32) -> Result<MemoryKind> {
    Err(invalid("device pages need kvbm built with feature `cuda`"))
}

/// The slot region: `slots * slot_bytes` of pinned memory near a GPU, or
/// of system memory beside host pages.
fn slot_region(memory: PageMemory, slots: usize, slot_bytes: u64) -> Result<PhysicalLayout> {
    let config = LayoutConfig::new(slots, 1, 1, 1, slot_bytes as usize, 1)?;
    let layout = Layout::new(config, LayoutKind::FullyContiguous)?;
    match memory {
        PageMemory::Host => Ok(PhysicalLayout::allocate_system(
            layout,
            &SystemAllocator::new(),
        )?),
        PageMemory::Device(_ordinal) => {
            #[cfg(feature = "cuda")]
            {
                let device = kvbm_transfer::cuda::CudaDevice::open(_ordinal as usize)
                    .map_err(kvbm_transfer::cuda::backend::to_transfer_error)?;
                Ok(PhysicalLayout::allocate_pinned(layout, &device)?)
            }
            #[cfg(not(feature = "cuda"))]
            Err(invalid("device pages need kvbm built with feature `cuda`"))
        }
    }
}

/// A group's view of the slot region: `[slot][layer][page]`, slot stride
/// `slot_bytes`.
fn group_g2(group: &PageGroup, region: &PhysicalLayout, slot_bytes: u64) -> Result<PhysicalLayout> {
    let slots = region.layout().config().num_blocks();
    let config = LayoutConfig::new(
        slots,
        group.layers.len(),
        1,
        1,
        group.page_bytes as usize,
        1,
    )?;
    let strides = LayoutStrides {
        block: slot_bytes,
        layer: group.page_bytes,
        outer: group.page_bytes,
    };
    let layout = Layout::with_strides(config, LayoutKind::FullyContiguous, strides)?;
    Ok(PhysicalLayout::new(layout, region.regions().to_vec())?)
}

impl PagedWorker {
    /// Wraps the engine's page tensors, allocates the slots, builds the
    /// executor for the pages' memory and starts the settling thread.
    ///
    /// # Safety
    /// Every group's page tensors (`num_blocks * block_stride` bytes from
    /// each `layers[i]`) must stay valid memory of `memory` for as long
    /// as the worker exists (`owner` is kept alive that long), and the
    /// engine must not touch a block's pages while a job copies them.
    pub unsafe fn new(config: PagedConfig, owner: Owner) -> Result<Self> {
        if config.groups.is_empty() {
            return Err(invalid("no KV cache groups"));
        }
        let widest = config
            .groups
            .iter()
            .map(PageGroup::block_bytes)
            .max()
            .unwrap_or(0);
        if config.slot_bytes < widest {
            return Err(invalid(format!(
                "a slot of {} bytes cannot hold a block of {widest}",
                config.slot_bytes
            )));
        }
        if config.slots == 0 {
            return Err(invalid("no slots"));
        }
        let g1 = config
            .groups
            .iter()
            // SAFETY: forwarded from the caller.
            .map(|g| unsafe { group_g1(g, config.num_blocks, config.memory, &owner) })
            .collect::<Result<Vec<_>>>()?;
        let executor = crate::worker::executor_spec(&g1[0])?.build()?;
        // One slot more than asked: the zero slot, copied over the pages
        // of a failed load.
        let region = slot_region(config.memory, config.slots + 1, config.slot_bytes)?;
        zero_last_slot(&region, config.slot_bytes)?;
        executor.register(&region)?;
        let g2 = config
            .groups
            .iter()
            .map(|g| group_g2(g, &region, config.slot_bytes))
            .collect::<Result<Vec<_>>>()?;
        let shared = Arc::new(Shared {
            g1,
            g2,
            slots: config.slots,
            executor: executor.clone(),
            sums: config.verify.then(|| Mutex::new(vec![None; config.slots])),
            reports: Mutex::new(Reports::default()),
            settled: Condvar::new(),
        });
        let (queue, rx) = channel();
        let s = Arc::clone(&shared);
        let settler = std::thread::Builder::new()
            .name("kvbm-paged".into())
            .spawn(move || settle_loop(&s, rx))
            .map_err(|e| invalid(format!("cannot start the settling thread: {e}")))?;
        Ok(PagedWorker {
            shared,
            executor,
            queue: Some(queue),
            settler: Some(settler),
            slot_bytes: config.slot_bytes,
        })
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Slots of G2.
    pub fn slots(&self) -> usize {
        self.shared.slots
    }

    /// Starts copying engine pages into slots.
    pub fn store(&self, job: u64, copies: Vec<PageCopy>) -> Result<()> {
        self.submit(job, Direction::Store, copies)
    }

    /// Starts copying slots into engine pages.
    pub fn load(&self, job: u64, copies: Vec<PageCopy>) -> Result<()> {
        self.submit(job, Direction::Load, copies)
    }

    fn submit(&self, job: u64, direction: Direction, copies: Vec<PageCopy>) -> Result<()> {
        let groups = self.shared.g1.len();
        let slots = self.slots();
        for c in &copies {
            if c.group >= groups || c.slot >= slots {
                return Err(invalid(format!(
                    "job {job}: group {} / slot {} beyond {groups} groups / {slots} slots",
                    c.group, c.slot
                )));
            }
        }
        if !self.shared.reports.lock().in_flight.insert(job) {
            return Err(invalid(format!("job {job} is already in flight")));
        }
        let started = Instant::now();
        let mut transfers = Vec::new();
        for group in 0..groups {
            let pairs: Vec<(usize, usize)> = copies
                .iter()
                .filter(|c| c.group == group)
                .map(|c| match direction {
                    Direction::Store => (c.block, c.slot),
                    Direction::Load => (c.slot, c.block),
                })
                .collect();
            if pairs.is_empty() {
                continue;
            }
            let (g1, g2) = (&self.shared.g1[group], &self.shared.g2[group]);
            let handle = match direction {
                Direction::Store => self.executor.transfer(g1, g2, &pairs),
                Direction::Load => self.executor.transfer(g2, g1, &pairs),
            };
            transfers.push((group, handle));
        }
        let pending = Pending {
            job,
            direction,
            copies,
            transfers,
            started,
        };
        match &self.queue {
            Some(q) if q.send(pending).is_ok() => Ok(()),
            _ => Err(invalid("the worker is shut down")),
        }
    }

    /// Jobs settled since the last call.
    pub fn finished(&self) -> Vec<JobReport> {
        std::mem::take(&mut self.shared.reports.lock().done)
    }

    /// Blocks until none of `jobs` is in flight.
    pub fn wait(&self, jobs: &[u64]) {
        let mut r = self.shared.reports.lock();
        while jobs.iter().any(|j| r.in_flight.contains(j)) {
            self.shared.settled.wait(&mut r);
        }
    }

    /// Changes every byte of `slot` (a test's stand-in for memory that
    /// changed at rest; each call moves the bytes further from what was
    /// stored).
    #[cfg(feature = "fault-injection")]
    pub fn corrupt_slot(&self, slot: usize) -> Result<()> {
        let region = &self.shared.g2[0].regions()[0];
        let addr = region
            .addr()
            .ok_or_else(|| invalid("slots without an address"))?;
        if slot >= self.slots() {
            return Err(invalid(format!("slot {slot} beyond {}", self.slots())));
        }
        // SAFETY: the slot lies inside the region (checked), host memory
        // the region owns; a test calls this while no job copies the slot.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                (addr + slot as u64 * self.slot_bytes) as *mut u8,
                self.slot_bytes as usize,
            )
        };
        for b in bytes {
            *b = b.wrapping_add(0x41);
        }
        Ok(())
    }
}

impl Drop for PagedWorker {
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(t) = self.settler.take() {
            let _ = t.join();
        }
    }
}

/// Settles jobs in submission order until the worker drops its sender.
fn settle_loop(shared: &Shared, rx: Receiver<Pending>) {
    for pending in rx {
        let report = settle(shared, pending);
        let mut r = shared.reports.lock();
        r.in_flight.remove(&report.job);
        r.done.push(report);
        shared.settled.notify_all();
    }
}

fn settle(shared: &Shared, p: Pending) -> JobReport {
    let mut bytes = 0;
    let mut failed = Vec::new();
    let mut error = None;
    for (group, handle) in p.transfers {
        match handle.wait() {
            Ok(report) => bytes += report.bytes,
            Err(f) => {
                error.get_or_insert_with(|| f.to_string());
                let landed: HashSet<(usize, usize)> = f.completed.iter().copied().collect();
                failed.extend(p.copies.iter().filter(|c| {
                    let pair = match p.direction {
                        Direction::Store => (c.block, c.slot),
                        Direction::Load => (c.slot, c.block),
                    };
                    c.group == group && !landed.contains(&pair)
                }));
            }
        }
    }
    if let Some(sums) = &shared.sums {
        judge(
            shared,
            sums,
            p.direction,
            &p.copies,
            &mut failed,
            &mut error,
        );
    }
    if p.direction == Direction::Load && !failed.is_empty() {
        wipe(shared, &failed, &mut error);
    }
    let seconds = p.started.elapsed().as_secs_f64();
    JobReport {
        job: p.job,
        direction: p.direction,
        bytes,
        seconds,
        failed,
        error,
    }
}

/// Overwrites the pages a failed load wrote with zeros (from the zero
/// slot), so bytes that failed their check never stay where the engine
/// might read them: a request recomputed after a failed load may reuse
/// those blocks, and a partly filled block is read whole by attention
/// kernels that mask, not skip, the tokens beyond its end.
fn wipe(shared: &Shared, failed: &[PageCopy], error: &mut Option<String>) {
    for (group, (g1, g2)) in shared.g1.iter().zip(&shared.g2).enumerate() {
        let pairs: Vec<(usize, usize)> = failed
            .iter()
            .filter(|c| c.group == group)
            .map(|c| (shared.slots, c.block))
            .collect();
        if pairs.is_empty() {
            continue;
        }
        if let Err(f) = shared.executor.transfer(g2, g1, &pairs).wait() {
            tracing::error!("kvbm: wiping the pages of a failed load failed: {f}");
            error.get_or_insert_with(|| format!("wiping a failed load's pages: {f}"));
        }
    }
}

/// Writes zeros over the last slot of `region` (host-addressable memory:
/// system or pinned).
fn zero_last_slot(region: &PhysicalLayout, slot_bytes: u64) -> Result<()> {
    let slots = region.layout().config().num_blocks() as u64;
    let r = &region.regions()[0];
    let addr = r
        .addr()
        .ok_or_else(|| invalid("a slot region without an address"))?;
    // SAFETY: the region holds `slots` slots of `slot_bytes` (its layout),
    // host-addressable memory it owns; nothing else uses it yet.
    unsafe {
        std::ptr::write_bytes(
            (addr + (slots - 1) * slot_bytes) as *mut u8,
            0,
            slot_bytes as usize,
        );
    }
    Ok(())
}

/// Verify mode: records the sums of stored slots, and checks the slot a
/// load read once the load ended (a slot is not written while a load
/// reads it: the books hold it), so bytes that changed at rest in host
/// memory are never served. The engine's pages are not read: once a
/// load ended the engine may use them.
fn judge(
    shared: &Shared,
    sums: &Mutex<Vec<Option<u64>>>,
    direction: Direction,
    copies: &[PageCopy],
    failed: &mut Vec<PageCopy>,
    error: &mut Option<String>,
) {
    let broken: HashSet<(usize, usize)> = failed.iter().map(|c| (c.group, c.slot)).collect();
    for c in copies {
        if broken.contains(&(c.group, c.slot)) {
            if direction == Direction::Store {
                sums.lock()[c.slot] = None;
            }
            continue;
        }
        let g2 = &shared.g2[c.group];
        match direction {
            Direction::Store => sums.lock()[c.slot] = block_sum(g2, c.slot).ok(),
            Direction::Load => {
                let got = block_sum(g2, c.slot);
                let want = sums.lock()[c.slot];
                if got.ok() != want || want.is_none() {
                    failed.push(*c);
                    error.get_or_insert_with(|| {
                        format!(
                            "slot {} failed its checksum: its bytes changed since they were stored",
                            c.slot
                        )
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
