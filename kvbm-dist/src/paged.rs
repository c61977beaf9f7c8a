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
//! (load) each block's sum (taken on the GPU where the pages are device
//! memory), and files a [`JobReport`] that [`PagedWorker::finished`]
//! hands out. A load whose block fails its checksum, or whose copy fails,
//! names the engine blocks that must not be served.
//!
//! **G3.** With a [`PagedDisk`], a file of slots sits behind the region
//! (`paged/disk.rs`): a store can first move blocks from G2 slots to
//! G3 slots, and a load can read blocks held in G3. Slots are then padded
//! to the disk alignment, so a block moves to or from disk in one
//! `O_DIRECT` request. A G3 kept across restarts ([`PagedDisk::kept`]) is
//! a [`KeptStore`]: every block moved there is recorded with its checksum
//! once it landed, a restarted worker reports the blocks it found
//! ([`PagedWorker::kept`]) for the books to take up, and every read from
//! it is checked against its checksum.
//!
//! **Kept G2.** With [`PagedConfig::host_keep`] the slots live in a file
//! of a memory-backed file system (`/dev/shm`), mapped into the worker
//! (and pinned in place beside a GPU), with a record per slot
//! ([`KeptStore`]): a store empties its slots' records before its copies
//! start and names each block with the sum of its bytes once they landed,
//! a block that arrives from outside (G4) leaves its slot unrecorded, and
//! every load checks its slot's sum. A restarted worker reports the
//! blocks its records name ([`PagedWorker::kept_host`]); they outlive the
//! engine process, not a reboot.
//!
//! **G4.** A store that engines share moves blocks in and out of G2's
//! slots itself, each with its checksum right after it; the worker hands
//! it the slots' memory, writes those sums and checks what arrives
//! against the sum that came with it (`paged/outside.rs`).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvbm_transfer::completion::poll_until_due;
use kvbm_transfer::memory::{DISK_ALIGNMENT, Owner};
use kvbm_transfer::{Executor, PhysicalLayout};
use parking_lot::{Condvar, Mutex};

use crate::error::{DistError, Result};

mod assemble;
mod disk;
#[cfg(feature = "fault-injection")]
mod faults;
mod g1_sums;
mod layouts;
mod outside;
mod settle;

pub use assemble::{Piece, Shards};
pub use outside::SUM_BYTES;

use crate::kept::KeptStore;
use crate::verify::DeviceSums;
use disk::{Disk, STAGING_SLOTS, Stage, Staged};
use settle::{Earlier, Pending};

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

/// G3 behind the slots: a file of `slots` slots under `dir`, removed when
/// the worker drops unless it is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedDisk {
    /// The directory the file goes in; for a kept G3, the rank's kept
    /// directory (or, while another engine holds it, its first free
    /// sibling).
    pub dir: PathBuf,
    /// Slots of G3.
    pub slots: usize,
    /// Keeps G3 across restarts under this identity (what the bytes mean:
    /// model, dtype, hash scheme, parallelism; the slot geometry is added):
    /// a restarted worker of the same identity finds every block recorded
    /// in it. `None`: G3 starts empty and its file is removed on drop.
    pub kept: Option<String>,
}

/// G2 kept across restarts: where its slots and records live, and what
/// they hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedKeep {
    /// The rank's kept G2 directory in a memory-backed file system (or,
    /// while another engine holds it, its first free sibling).
    pub dir: PathBuf,
    /// What the bytes mean (model, dtype, hash scheme, parallelism; the
    /// slot geometry is added): a restarted worker of the same identity
    /// finds every block recorded in it.
    pub identity: String,
}

/// What a kept tier (G2 or G3) held when the worker opened it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeptFound {
    /// The directory opened.
    pub dir: PathBuf,
    /// `(slot, key)` of every block whose record is sound.
    pub blocks: Vec<(u32, u64)>,
    /// Records that were torn or damaged (their slots are free).
    pub rejected: u64,
    /// Why the directory was started afresh; `None`: reopened.
    pub started_fresh: Option<String>,
}

/// A block moved from a G2 slot to a G3 slot before the slot is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskMove {
    /// The G2 slot it leaves.
    pub from: usize,
    /// The G3 slot it enters.
    pub to: usize,
    /// Its KV cache group (in verify mode the group's block in its G2
    /// slot is checked before a kept G3 records it).
    pub group: usize,
    /// The books' key of the block, recorded in a kept G3.
    pub key: u64,
}

impl DiskMove {
    /// A move of the block `key` of `group` from G2 slot `from` to G3 slot
    /// `to`.
    pub fn new(from: usize, to: usize, group: usize, key: u64) -> Self {
        DiskMove {
            from,
            to,
            group,
            key,
        }
    }
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
    /// G3 behind G2, if any.
    pub disk: Option<PagedDisk>,
    /// Record a checksum of every stored slot and check it on each load.
    pub verify: bool,
    /// Leave room after each slot's block for its checksum, so an outside
    /// store moves the two as one object (see `paged/outside.rs`).
    pub sum_tail: bool,
    /// What those checksums are combined with (exclusive or) on their way
    /// out and back: engines that lay a block's bytes out otherwise use
    /// other salts, so one never takes another's block for its own (its
    /// checksum fails). 0 for none.
    pub tail_salt: u64,
    /// Keeps G2 across restarts (checksums always on); `None`: G2 starts
    /// empty.
    pub host_keep: Option<PagedKeep>,
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
    /// The slot: of G2, or of G3 where `disk` is set.
    pub slot: usize,
    /// The block is read from G3 (loads only).
    pub disk: bool,
    /// The books' key of the block, recorded in a kept G2 once a store of
    /// it landed (stores only; `None`: not recorded).
    pub key: Option<u64>,
}

impl PageCopy {
    /// A copy between engine block `block` of `group` and G2 slot `slot`.
    pub fn g2(group: usize, block: usize, slot: usize) -> Self {
        PageCopy {
            group,
            block,
            slot,
            disk: false,
            key: None,
        }
    }

    /// A load of engine block `block` of `group` from G3 slot `slot`.
    pub fn g3(group: usize, block: usize, slot: usize) -> Self {
        PageCopy {
            group,
            block,
            slot,
            disk: true,
            key: None,
        }
    }

    /// This copy, naming the block `key` for a kept G2.
    pub fn keyed(self, key: u64) -> Self {
        PageCopy {
            key: Some(key),
            ..self
        }
    }
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq)]
pub struct JobReport {
    /// The engine's job id.
    pub job: u64,
    /// Which way it copied.
    pub direction: Direction,
    /// Bytes that landed in the engine's pages or the slots.
    pub bytes: u64,
    /// Seconds from submission to the end of its last copy.
    pub seconds: f64,
    /// The copies whose destination must not be used: a failed copy, a
    /// load from a slot that failed its checksum, or every copy of a
    /// store whose demotions failed.
    pub failed: Vec<PageCopy>,
    /// The first error, when anything failed.
    pub error: Option<String>,
}

#[derive(Default)]
struct Reports {
    done: Vec<JobReport>,
    in_flight: HashSet<u64>,
    /// When in-flight jobs whose copies said so are due, and how long a
    /// waiter polls after that (see [`kvbm_transfer::TransferHandle::due`]).
    due: HashMap<u64, (Instant, Duration)>,
}

/// What the worker's threads share.
struct Shared {
    g1: Vec<PhysicalLayout>,
    g2: Vec<PhysicalLayout>,
    /// The slot region as whole slots (G2's slots, the zero slot, the
    /// staging slots).
    region: PhysicalLayout,
    disk: Option<Disk>,
    /// Slots a job may name; slot `slots` is the zero slot.
    slots: usize,
    executor: Executor,
    /// The checksum of each slot's block (verify mode, or G2 kept).
    sums: Option<Mutex<Vec<Option<u64>>>>,
    /// Sums G1 blocks on the GPU, with checksums on and device pages.
    g1_sums: Option<DeviceSums>,
    /// The slots' records, when G2 is kept across restarts (a reset stops
    /// them for good: [`PagedWorker::stop_keeping`]).
    host_kept: Option<KeptStore>,
    reports: Mutex<Reports>,
    settled: Condvar,
    /// Reports filed so far, raised after each one is (so a poller looks
    /// at the reports only when there is something new to see).
    filed: AtomicU64,
}

impl Shared {
    /// The slot of zeros copied over the pages of a failed load.
    fn zero_slot(&self) -> usize {
        self.slots
    }

    /// Staging slot `i` of reads from G3.
    fn staging_slot(&self, i: usize) -> usize {
        self.slots + 1 + i
    }
}

/// The worker side of a host tier whose books the engine keeps; see the
/// module docs.
pub struct PagedWorker {
    shared: Arc<Shared>,
    settle: Option<Sender<Pending>>,
    stage: Option<Sender<Stage>>,
    threads: Vec<JoinHandle<()>>,
    /// What a kept G3 held when it was opened.
    kept: Option<KeptFound>,
    /// What a kept G2 held when it was opened.
    kept_host: Option<KeptFound>,
    stride: u64,
    /// Bytes of one block of each KV cache group.
    block_bytes: Vec<u64>,
    /// Each slot has room for a checksum after its block.
    sum_tail: bool,
    /// What the checksums after the blocks are salted with.
    tail_salt: u64,
    /// Where shards published by another parallelism are assembled.
    assembly: assemble::Assembly,
}

fn invalid(what: impl Into<String>) -> DistError {
    DistError::InvalidConfig(what.into())
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| invalid(format!("cannot start a thread: {e}")))
}

/// Bytes from one slot to the next: a slot's bytes (with room for a
/// checksum after the widest block where `sum_tail` asks, padded to
/// [`outside::TAIL_ALIGNMENT`]), padded to the disk alignment where G3 is
/// on. Errors when `config` has no groups or no slots, or slots too small
/// for some group's blocks.
fn slot_stride(config: &PagedConfig) -> Result<u64> {
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
    if config.slots == 0 || config.disk.as_ref().is_some_and(|d| d.slots == 0) {
        return Err(invalid("no slots"));
    }
    let bytes = if config.sum_tail {
        config
            .slot_bytes
            .max(widest + outside::SUM_BYTES)
            .next_multiple_of(outside::TAIL_ALIGNMENT)
    } else {
        config.slot_bytes
    };
    Ok(match config.disk {
        Some(_) => bytes.next_multiple_of(DISK_ALIGNMENT),
        None => bytes,
    })
}

impl PagedWorker {
    /// Wraps the engine's page tensors, allocates the slots (and G3's
    /// file), builds the executor for the pages' memory and starts the
    /// worker's threads.
    ///
    /// # Safety
    /// Every group's page tensors (`num_blocks * block_stride` bytes from
    /// each `layers[i]`) must stay valid memory of `memory` for as long
    /// as the worker exists (`owner` is kept alive that long), and the
    /// engine must not touch a block's pages while a job copies them.
    pub unsafe fn new(config: PagedConfig, owner: Owner) -> Result<Self> {
        let stride = slot_stride(&config)?;
        let g1 = config
            .groups
            .iter()
            // SAFETY: forwarded from the caller.
            .map(|g| unsafe { layouts::group_g1(g, config.num_blocks, config.memory, &owner) })
            .collect::<Result<Vec<_>>>()?;
        let executor = crate::worker::executor_spec(&g1[0])?
            .disk(config.disk.is_some())
            .build()?;
        // Past G2's slots: the zero slot, copied over the pages of a
        // failed load, and with G3 the staging slots of its reads.
        let staging = if config.disk.is_some() {
            STAGING_SLOTS
        } else {
            0
        };
        let all_slots = config.slots + 1 + staging;
        let (region, host_kept, kept_host, kept_sums) = match &config.host_keep {
            Some(keep) => {
                let k = layouts::kept_slot_region(
                    keep,
                    config.memory,
                    config.slots,
                    all_slots,
                    stride,
                )?;
                (k.region, Some(k.store), Some(k.found), Some(k.sums))
            }
            None => (
                layouts::slot_region(config.memory, all_slots, stride)?,
                None,
                None,
                None,
            ),
        };
        layouts::zero_slot(&region, config.slots, stride)?;
        executor.register(&region)?;
        let g2 = config
            .groups
            .iter()
            .map(|g| layouts::group_g2(g, &region, stride))
            .collect::<Result<Vec<_>>>()?;
        let (disk, kept) = match &config.disk {
            Some(d) => {
                let (disk, kept) = disk::open(d, stride, config.verify)?;
                (Some(disk), kept)
            }
            None => (None, None),
        };
        let sums = match kept_sums {
            Some(sums) => Some(Mutex::new(sums)),
            None => config.verify.then(|| Mutex::new(vec![None; config.slots])),
        };
        let g1_sums = sums.as_ref().and_then(|_| DeviceSums::for_g1(&g1[0]));
        let shared = Arc::new(Shared {
            g1,
            g2,
            region,
            disk,
            slots: config.slots,
            executor,
            sums,
            g1_sums,
            host_kept,
            reports: Mutex::new(Reports::default()),
            settled: Condvar::new(),
            filed: AtomicU64::new(0),
        });
        let block_bytes = config.groups.iter().map(PageGroup::block_bytes).collect();
        let mut worker = Self::start(
            shared,
            stride,
            block_bytes,
            config.sum_tail,
            config.tail_salt,
        )?;
        worker.kept = kept;
        worker.kept_host = kept_host;
        Ok(worker)
    }

    /// Starts the worker's threads over `shared`: the one that settles
    /// jobs and, with G3, the one that stages G3's reads and writes.
    /// `sum_tail` and `tail_salt` as [`PagedConfig`] says.
    fn start(
        shared: Arc<Shared>,
        stride: u64,
        block_bytes: Vec<u64>,
        sum_tail: bool,
        tail_salt: u64,
    ) -> Result<Self> {
        let (settle, settle_rx) = channel();
        let s = Arc::clone(&shared);
        let mut threads = vec![spawn("kvbm-paged", move || {
            settle::settle_loop(&s, settle_rx)
        })?];
        let stage = match shared.disk {
            Some(_) => {
                let (stage, stage_rx) = channel();
                let (s, to_settle) = (Arc::clone(&shared), settle.clone());
                threads.push(spawn("kvbm-paged-g3", move || {
                    disk::stage_loop(&s, stage_rx, to_settle)
                })?);
                Some(stage)
            }
            None => None,
        };
        Ok(PagedWorker {
            shared,
            settle: Some(settle),
            stage,
            threads,
            kept: None,
            kept_host: None,
            stride,
            block_bytes,
            sum_tail,
            tail_salt,
            assembly: Default::default(),
        })
    }

    /// Bytes from one slot to the next (a slot's bytes, padded to the
    /// disk alignment where G3 is on).
    pub fn slot_stride(&self) -> u64 {
        self.stride
    }

    /// Slots of G2.
    pub fn slots(&self) -> usize {
        self.shared.slots
    }

    /// Slots of G3 (0 without one).
    pub fn disk_slots(&self) -> usize {
        self.shared.disk.as_ref().map_or(0, |d| d.slots)
    }

    /// What the kept G3 held when the worker opened it (`None` without a
    /// kept G3): the books take these blocks up before the first job.
    pub fn kept(&self) -> Option<&KeptFound> {
        self.kept.as_ref()
    }

    /// What the kept G2 held when the worker opened it (`None` without a
    /// kept G2): the books take these blocks up before the first job.
    pub fn kept_host(&self) -> Option<&KeptFound> {
        self.kept_host.as_ref()
    }

    /// Empties every record of a kept G2 and G3 and records nothing in
    /// them from now on, for jobs submitted before as well: the engine's
    /// cache was reset, and what it computes after a reset may come from
    /// other weights than those a restarted engine loads (vLLM resets the
    /// cache around an in-place weight update). A restarted worker finds
    /// none of the blocks; the tiers go on serving this engine. A no-op
    /// without a kept tier.
    pub fn stop_keeping(&self) -> Result<()> {
        if let Some(kept) = &self.shared.host_kept {
            // A store that landed before wrote its records (emptied here),
            // one that lands after records nothing (see `KeptStore::stop`).
            kept.stop()
                .map_err(|e| invalid(format!("emptying the G2 records: {e}")))?;
        }
        if self.kept.is_none() {
            return Ok(());
        }
        // G3's records are emptied on the staging thread, after the moves
        // handed to it before.
        match self.stage.as_ref() {
            Some(q) if q.send(Stage::ForgetKept).is_ok() => Ok(()),
            _ => Err(invalid("the worker is shut down")),
        }
    }

    /// Starts copying engine pages into G2 slots, after moving the blocks
    /// of `demote` to G3.
    pub fn store(&self, job: u64, copies: Vec<PageCopy>, demote: Vec<DiskMove>) -> Result<()> {
        self.submit(job, Direction::Store, copies, demote)
    }

    /// Starts copying slots (of G2, or of G3 where a copy says so) into
    /// engine pages.
    pub fn load(&self, job: u64, copies: Vec<PageCopy>) -> Result<()> {
        self.submit(job, Direction::Load, copies, Vec::new())
    }

    fn check(
        &self,
        job: u64,
        direction: Direction,
        copies: &[PageCopy],
        demote: &[DiskMove],
    ) -> Result<()> {
        let (groups, slots, disk) = (self.shared.g1.len(), self.slots(), self.disk_slots());
        for c in copies {
            let bound = if c.disk { disk } else { slots };
            if c.group >= groups || c.slot >= bound || (c.disk && direction == Direction::Store) {
                return Err(invalid(format!(
                    "job {job}: a {direction:?} of group {} from {} slot {} beyond {groups} groups / {bound} slots",
                    c.group,
                    if c.disk { "G3" } else { "G2" },
                    c.slot
                )));
            }
        }
        match self.bad_move(demote) {
            Some(why) => Err(invalid(format!("job {job}: {why}"))),
            None => Ok(()),
        }
    }

    /// What is wrong with the first move beyond the tiers or the groups,
    /// if any.
    fn bad_move(&self, moves: &[DiskMove]) -> Option<String> {
        let (slots, disk, groups) = (self.slots(), self.disk_slots(), self.shared.g2.len());
        let m = moves
            .iter()
            .find(|m| m.from >= slots || m.to >= disk || m.group >= groups)?;
        Some(format!(
            "a move of group {} from G2 slot {} to G3 slot {} beyond {groups} groups / {slots} / {disk} slots",
            m.group, m.from, m.to
        ))
    }

    fn submit(
        &self,
        job: u64,
        direction: Direction,
        copies: Vec<PageCopy>,
        demote: Vec<DiskMove>,
    ) -> Result<()> {
        self.check(job, direction, &copies, &demote)?;
        if !self.shared.reports.lock().in_flight.insert(job) {
            return Err(invalid(format!("job {job} is already in flight")));
        }
        if direction == Direction::Store
            && let Some(kept) = &self.shared.host_kept
        {
            // Before any byte of a slot is written, its record names
            // nothing (once the tier stopped keeping, no record does and
            // this writes none).
            let slots: Vec<u32> = copies.iter().map(|c| c.slot as u32).collect();
            if let Err(e) = kept.forget(&slots) {
                let mut r = self.shared.reports.lock();
                r.in_flight.remove(&job);
                return Err(invalid(format!(
                    "job {job}: emptying {} G2 records: {e}",
                    slots.len()
                )));
            }
        }
        let started = Instant::now();
        let sent = if demote.is_empty() && !copies.iter().any(|c| c.disk) {
            let transfers = settle::start(&self.shared, &self.shared.executor, direction, &copies);
            let due = transfers.iter().filter_map(|(_, t)| t.due()).max();
            if let Some(due) = due {
                self.shared.reports.lock().due.insert(job, due);
            }
            let pending = Pending {
                job,
                direction,
                copies,
                transfers,
                earlier: Earlier::default(),
                started,
            };
            self.settle
                .as_ref()
                .is_some_and(|q| q.send(pending).is_ok())
        } else {
            let staged = Staged {
                job,
                direction,
                copies,
                demote,
                started,
            };
            self.stage
                .as_ref()
                .is_some_and(|q| q.send(Stage::Job(staged)).is_ok())
        };
        if sent {
            Ok(())
        } else {
            let mut r = self.shared.reports.lock();
            r.in_flight.remove(&job);
            r.due.remove(&job);
            Err(invalid("the worker is shut down"))
        }
    }

    /// Jobs settled since the last call.
    pub fn finished(&self) -> Vec<JobReport> {
        std::mem::take(&mut self.shared.reports.lock().done)
    }

    /// Blocks until none of `jobs` is in flight. Where their copies said
    /// when they are due, polls from shortly before then instead of
    /// sleeping until the settling thread wakes this one.
    pub fn wait(&self, jobs: &[u64]) {
        let pending = |r: &Reports| jobs.iter().any(|j| r.in_flight.contains(j));
        let due = {
            let r = self.shared.reports.lock();
            jobs.iter().filter_map(|j| r.due.get(j)).max().copied()
        };
        // The poll looks at the reports only when one was filed since it
        // last did, and only tries their lock: a poller that blocked on it
        // while the settling thread files a report would sleep until woken,
        // which costs more than the copy's wait.
        let seen = std::cell::Cell::new(None);
        let settled = || {
            let filed = Some(self.shared.filed.load(Ordering::Acquire));
            if filed == seen.get() {
                return false;
            }
            let Some(r) = self.shared.reports.try_lock() else {
                return false;
            };
            seen.set(filed);
            !pending(&r)
        };
        if let Some((at, spin)) = due
            && poll_until_due(at, spin, settled)
        {
            return;
        }
        let mut r = self.shared.reports.lock();
        while pending(&r) {
            self.shared.settled.wait(&mut r);
        }
    }
}

impl Drop for PagedWorker {
    fn drop(&mut self) {
        // The staging thread goes first: it hands jobs to the settling
        // thread, which ends once every sender is gone.
        drop(self.stage.take());
        drop(self.settle.take());
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod assemble_tests;
#[cfg(test)]
mod host_kept_tests;
#[cfg(test)]
mod tests;
