//! Bounce buffers: a bounded pool of equal slots for two-hop transfers.
//!
//! The pool is the only memory a two-hop transfer may use in between, so
//! its size bounds what all two-hop transfers together hold. Acquiring a
//! slot never blocks or spins: the caller passes a callback that runs at
//! once if a slot is free, or later on the thread that returns one. A slot
//! goes back to the pool when its [`BounceSlot`] is dropped.
//!
//! Sizing: the slower hop wants its own bytes in flight. A disk hop keeps
//! queue depth × request size in flight (8 × 2 MiB by default), so the
//! slots a batch may hold should add up to more than that: with slots
//! smaller than a request the O_DIRECT writer of a disk → disk copy sits
//! idle for lack of slots much of the time, and slots several requests
//! large keep it fed. Small slots that stay in the CPU cache cost a
//! cross-CPU wake-up per chunk, which on a small VM costs more CPU than the
//! cache saves.
//!
//! `trace` (feature `diagnostics`) records how chunks move through the
//! slots and the two hops, to find where a pipeline sits idle.

#[cfg(feature = "diagnostics")]
pub mod trace;

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Result, TransferError};
use crate::memory::{DISK_ALIGNMENT, HugePages, MemoryKind, MemoryRegion, SystemAllocator};

type Waiter = Box<dyn FnOnce(BounceSlot) + Send>;

/// A fixed set of bounce slots carved out of one host region.
pub struct BouncePool {
    region: MemoryRegion,
    slot_regions: Vec<MemoryRegion>,
    slot_bytes: u64,
    slots: usize,
    state: Mutex<(Vec<usize>, VecDeque<Waiter>)>,
}

impl std::fmt::Debug for BouncePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BouncePool")
            .field("kind", &self.region.kind())
            .field("slots", &self.slots)
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

impl BouncePool {
    /// Cuts `region` (host memory) into slots of `slot_bytes` (a multiple of
    /// 4096, so slots can serve O_DIRECT I/O).
    pub fn new(region: MemoryRegion, slot_bytes: u64) -> Result<Arc<Self>> {
        if !region.kind().is_host() || region.addr().is_none() {
            return Err(TransferError::InvalidRequest(
                "bounce buffers must be host memory".into(),
            ));
        }
        if slot_bytes == 0 || !slot_bytes.is_multiple_of(DISK_ALIGNMENT) {
            return Err(TransferError::InvalidRequest(format!(
                "bounce slot size {slot_bytes} is not a positive multiple of {DISK_ALIGNMENT}"
            )));
        }
        let slots = (region.len() / slot_bytes) as usize;
        if slots == 0 {
            return Err(TransferError::InvalidRequest(
                "bounce region is smaller than one slot".into(),
            ));
        }
        let slot_regions = (0..slots)
            .map(|i| region.slice(i as u64 * slot_bytes, slot_bytes))
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(BouncePool {
            region,
            slot_regions,
            slot_bytes,
            slots,
            state: Mutex::new(((0..slots).rev().collect(), VecDeque::new())),
        }))
    }

    /// A pool of `slots` slots of system memory, on transparent huge pages
    /// (fewer TLB misses on both hops) and pre-faulted.
    pub fn system(slots: usize, slot_bytes: u64) -> Result<Arc<Self>> {
        let buf = SystemAllocator::new()
            .huge_pages(HugePages::Transparent)
            .populate(true)
            .allocate(slots as u64 * slot_bytes)?;
        Self::new(buf.region(), slot_bytes)
    }

    /// The kind of memory the slots are.
    pub fn kind(&self) -> MemoryKind {
        self.region.kind()
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.slots
    }

    /// Slots free right now.
    pub fn available(&self) -> usize {
        self.state.lock().0.len()
    }

    /// The whole backing region (for registering it with an I/O engine).
    pub fn region(&self) -> &MemoryRegion {
        &self.region
    }

    /// Calls `f` with a slot: now if one is free, otherwise when one is
    /// returned (on the returning thread). Waiters are served in order.
    pub fn acquire(self: &Arc<Self>, f: impl FnOnce(BounceSlot) + Send + 'static) {
        let slot = {
            let mut st = self.state.lock();
            match st.0.pop() {
                Some(i) => i,
                None => {
                    st.1.push_back(Box::new(f));
                    return;
                }
            }
        };
        f(BounceSlot {
            pool: self.clone(),
            index: slot,
        });
    }

    fn release(self: &Arc<Self>, index: usize) {
        let waiter = {
            let mut st = self.state.lock();
            match st.1.pop_front() {
                Some(w) => w,
                None => {
                    st.0.push(index);
                    return;
                }
            }
        };
        waiter(BounceSlot {
            pool: self.clone(),
            index,
        });
    }
}

/// One acquired slot; dropping it returns it to the pool.
pub struct BounceSlot {
    pool: Arc<BouncePool>,
    index: usize,
}

impl BounceSlot {
    /// The slot's index in its pool.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The slot's memory.
    pub fn region(&self) -> MemoryRegion {
        // Slot indices come from `0..slots`, the length of `slot_regions`.
        self.pool.slot_regions[self.index].clone()
    }
}

impl Drop for BounceSlot {
    fn drop(&mut self) {
        self.pool.release(self.index);
    }
}
