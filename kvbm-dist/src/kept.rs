//! Tiers that outlive their process: a worker's G3 (disk) or G2 (host
//! memory mapped from a file in `/dev/shm`) that a restarted engine of the
//! same identity opens again, with every block it held.
//!
//! One directory per rank and tier holds:
//! - `identity`: what the bytes mean (the engine's model, dtype, block
//!   size, hash scheme, parallelism, given by the caller) and the block
//!   geometry and format version added here. A directory of another
//!   identity never has a byte reused: it is emptied and started again.
//! - `blocks`: the data, one block after another: a disk file for G3
//!   ([`PhysicalLayout`] over it, as a G3 that is not kept), a file mapped
//!   shared into the worker for G2 (its host memory, pinned in place
//!   beside a GPU).
//! - `slots`: a header, then one [`RECORD_BYTES`] record per block slot:
//!   the block's sequence hash, its parent's, and the checksum of its bytes
//!   ([`kvbm_transfer::checksum`]), sealed by a check over the slot number
//!   and those fields. A record whose check fails is empty.
//! - `lock`: held (`flock`) for as long as the store is open; a second
//!   engine opening the same directory gets an error, never shared bytes.
//!
//! The order that keeps every served byte right, whatever moment a crash
//! (a `kill -9`, a power loss) picks:
//! 1. before a slot is written, its record is emptied ([`KeptStore::forget`]);
//! 2. the block's bytes are written;
//! 3. once they landed, the record names the block and its checksum
//!    ([`KeptStore::commit`]).
//!
//! So a record names either nothing or a block whose bytes were fully
//! written once; a torn write leaves an empty record. Bytes changed later
//! at rest (a bad disk, a stray write) still pass the record's check:
//! that is what the checksum is for, checked on every read out of a kept
//! tier, so such a block is refused and recomputed rather than served.
//!
//! Records go through the page cache, so a killed process loses none. For
//! G3 a thread of the store makes data and records durable (`fdatasync` of
//! both files) within [`SYNC_EVERY`] of a commit, off the copies' path, and
//! dropping the store does once more; a power loss costs the blocks
//! committed since (as misses: their records are empty or their bytes fail
//! their checksum). A kept G2 lives as long as the host's memory does: it
//! survives the engine process, not a reboot.

use std::fs::{File, OpenOptions};
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_layout::Layout;
use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::memory::{
    DiskAllocator, DiskFile, DiskOptions, IoMode, MemoryRegion, SystemBuffer, try_lock_exclusive,
};
use parking_lot::{Mutex, RwLock};

use crate::error::DistError;

/// The on-disk format this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes of one slot record.
pub const RECORD_BYTES: u64 = 32;
/// Bytes before the first record.
const HEADER_BYTES: u64 = 4096;
/// Marks a `slots` file.
const MAGIC: &[u8; 8] = b"KVBMG3SL";
/// Longest time a committed record stays only in the page cache.
pub const SYNC_EVERY: Duration = Duration::from_secs(1);

/// Most directories of one tier, identity and rank on one host.
pub const MAX_SIBLINGS: u32 = 16;

const IDENTITY_FILE: &str = "identity";
const BLOCKS_FILE: &str = "blocks";
const SLOTS_FILE: &str = "slots";
const LOCK_FILE: &str = "lock";

/// Where a kept tier's blocks live.
pub enum Medium<'a> {
    /// G3: a disk file, read and written with this I/O mode.
    Disk(IoMode),
    /// G2: a file in a memory-backed file system, mapped into this process.
    /// `pin`, where given, makes the mapping a region the copies use
    /// (page-locked for a GPU); without it the mapping is system memory.
    Memory {
        /// Pins the mapped buffer in place, keeping its bytes.
        pin: Option<&'a dyn Fn(Arc<SystemBuffer>) -> Result<MemoryRegion, DistError>>,
    },
}

impl std::fmt::Debug for Medium<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Medium::Disk(mode) => write!(f, "Disk({mode:?})"),
            Medium::Memory { pin } => write!(f, "Memory {{ pinned: {} }}", pin.is_some()),
        }
    }
}

impl Medium<'_> {
    fn tier(&self) -> &'static str {
        match self {
            Medium::Disk(_) => "G3",
            Medium::Memory { .. } => "G2",
        }
    }
}

/// What a kept block holds: its sequence hash and its parent's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockLabel {
    /// The block's sequence hash.
    pub hash: u64,
    /// The sequence hash of the block before it, if any.
    pub parent: Option<u64>,
}

/// A block found again when a store was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    /// Its slot.
    pub slot: u32,
    /// What it holds.
    pub label: BlockLabel,
    /// The checksum of its bytes, as written.
    pub sum: u64,
}

/// What opening a store found.
#[derive(Debug, Clone, Default)]
pub struct Recovery {
    /// Blocks whose records are sound, in slot order.
    pub blocks: Vec<Recovered>,
    /// Records that were neither empty nor sound (torn or damaged): their
    /// slots are free.
    pub rejected: u64,
    /// Why nothing was reused, when the directory was started afresh
    /// (`None`: reopened).
    pub started_fresh: Option<String>,
    /// Time spent opening, recovery included.
    pub took: Duration,
}

/// One rank's kept tier, open (see the module).
#[derive(Debug)]
pub struct KeptStore {
    dir: PathBuf,
    files: Arc<Files>,
    num_blocks: u32,
    /// Makes committed records durable in the background (G3).
    syncer: Arc<Syncer>,
    sync_thread: Option<std::thread::JoinHandle<()>>,
    /// Whether the store still records blocks ([`KeptStore::stop`] ends
    /// it); read while records are written, so a stop waits for them or
    /// they see it.
    keeping: RwLock<bool>,
    /// Held while open.
    _lock: File,
}

/// The files whose writes are made durable together.
#[derive(Debug)]
struct Files {
    slots: File,
    data: Data,
}

/// A store's data file.
#[derive(Debug)]
enum Data {
    /// G3's blocks on disk.
    Disk(Arc<DiskFile>),
    /// G2's blocks, a file in memory (nothing to make durable).
    Memory(File),
}

impl Files {
    fn sync(&self) -> io::Result<()> {
        let Data::Disk(data) = &self.data else {
            return Ok(());
        };
        // SAFETY: the descriptor is the data file's, open while `data`
        // lives; fdatasync reads nothing from memory.
        let rc = unsafe { libc::fdatasync(data.raw_fd()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        self.slots.sync_data()
    }
}

/// Whether records were committed since the last sync, and whether the
/// store is closing.
#[derive(Debug, Default)]
struct Syncer {
    state: Mutex<SyncState>,
    wake: parking_lot::Condvar,
}

#[derive(Debug, Default)]
struct SyncState {
    dirty: bool,
    stop: bool,
}

/// Every [`SYNC_EVERY`], makes what was committed durable (off the copies'
/// path: a flush of the device cache can take milliseconds).
fn sync_loop(files: Arc<Files>, syncer: Arc<Syncer>, dir: PathBuf) {
    let warn = kvbm_pool::rate_limit::RateLimit::new(kvbm_pool::rate_limit::WARN_EVERY);
    loop {
        let mut st = syncer.state.lock();
        if !st.stop {
            syncer.wake.wait_for(&mut st, SYNC_EVERY);
        }
        if st.stop {
            return;
        }
        if !std::mem::take(&mut st.dirty) {
            continue;
        }
        drop(st);
        if let Err(e) = files.sync()
            && let Some(held_back) = warn.check()
        {
            tracing::warn!(dir = %dir.display(), held_back, "G3 records not made durable: {e}");
        }
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> DistError {
    let what = what.into();
    move |source| DistError::File { what, source }
}

/// The full identity a directory is written under: the caller's, the tier,
/// the block geometry and the format.
fn full_identity(identity: &str, tier: &str, layout: &Layout) -> String {
    let c = layout.config();
    format!(
        "{}\nkvbm-kept-format: {FORMAT_VERSION}\ntier: {tier}\nblocks: {}\nlayers: {}\nouter: {}\npage_size: {}\ninner: {}\ndtype_bytes: {}\nalignment: {}\nkind: {:?}\n",
        identity.trim_end(),
        c.num_blocks(),
        c.num_layers(),
        c.outer_dim(),
        c.page_size(),
        c.inner_dim(),
        c.dtype_bytes(),
        c.alignment(),
        layout.kind(),
    )
}

/// Bytes of the `slots` file of a store of `num_blocks` blocks: its
/// header and one record per block.
pub fn record_file_bytes(num_blocks: u64) -> u64 {
    HEADER_BYTES + num_blocks * RECORD_BYTES
}

fn header(num_blocks: u32) -> Vec<u8> {
    let mut h = vec![0u8; HEADER_BYTES as usize];
    h[0..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&num_blocks.to_le_bytes());
    h
}

/// The blocks a kept tier of `layout` holds, checking that it can be kept:
/// one region, and a block count that fits a record file's header.
fn kept_blocks(layout: &Layout, tier: &str) -> Result<u32, DistError> {
    let num_blocks = u32::try_from(layout.config().num_blocks()).map_err(|_| {
        DistError::InvalidConfig(format!(
            "{} {tier} blocks: at most {} can be kept",
            layout.config().num_blocks(),
            u32::MAX
        ))
    })?;
    if layout.num_regions() != 1 {
        return Err(DistError::InvalidConfig(format!(
            "a kept {tier} is one region, its layout has {}",
            layout.num_regions()
        )));
    }
    Ok(num_blocks)
}

/// What a kept tier's directory holds once opened: its data and record
/// files, the blocks found again, and why it started afresh (if it did).
struct Contents {
    /// The data file.
    data: Data,
    /// The record (`slots`) file.
    slots: File,
    /// Blocks whose records are sound, in slot order.
    blocks: Vec<Recovered>,
    /// Records that were neither empty nor sound.
    rejected: u64,
    /// Why nothing was reused (`None`: reopened).
    started_fresh: Option<String>,
}

/// The tier's memory over its data file: the disk file itself for G3, the
/// shared mapping of the memory file for G2 (made a region the copies use
/// by the medium's `pin`, where it has one).
fn tier_memory(
    layout: Layout,
    data: &Data,
    medium: &Medium<'_>,
    bytes: u64,
) -> Result<PhysicalLayout, DistError> {
    let pin = match medium {
        Medium::Memory { pin } => *pin,
        Medium::Disk(_) => None,
    };
    Ok(match data {
        Data::Disk(file) => PhysicalLayout::on_disk_file(layout, Arc::clone(file))?,
        Data::Memory(file) => {
            let buffer = SystemBuffer::map_shared(file, bytes)?;
            let region = match pin {
                Some(pin) => pin(buffer)?,
                None => buffer.region(),
            };
            PhysicalLayout::new(layout, vec![region])?
        }
    })
}

/// Starts the thread that makes a G3's records and data durable in the
/// background (see [`sync_loop`]).
fn start_sync_thread(
    files: &Arc<Files>,
    syncer: &Arc<Syncer>,
    dir: &Path,
) -> Result<std::thread::JoinHandle<()>, DistError> {
    let (files, syncer, dir) = (Arc::clone(files), Arc::clone(syncer), dir.to_path_buf());
    std::thread::Builder::new()
        .name("kvbm-g3-sync".into())
        .spawn(move || sync_loop(files, syncer, dir))
        .map_err(io_err("start the G3 sync thread"))
}

impl KeptStore {
    /// Opens the store in `dir` (created if missing) for blocks of
    /// `layout` (one region; a G3's aligned for the disk) on `medium`,
    /// under `identity`. Reopens what a process of the same identity and
    /// geometry left there; otherwise empties the directory first, saying
    /// why in [`Recovery::started_fresh`] and a log line. Returns the store,
    /// the tier's memory over its data file, and what was found.
    pub fn open(
        dir: &Path,
        identity: &str,
        layout: Layout,
        medium: &Medium<'_>,
    ) -> Result<(KeptStore, PhysicalLayout, Recovery), DistError> {
        let started = Instant::now();
        let tier = medium.tier();
        let num_blocks = kept_blocks(&layout, tier)?;
        std::fs::create_dir_all(dir).map_err(io_err(format!("directory {}", dir.display())))?;
        let lock = lock_dir(dir)?;
        let identity = full_identity(identity, tier, &layout);
        let bytes = match medium {
            Medium::Disk(_) => PhysicalLayout::disk_bytes(&layout, dir)?,
            Medium::Memory { .. } => layout.region_size(0)?,
        };
        let Contents {
            data,
            slots,
            blocks,
            rejected,
            started_fresh,
        } = Self::reopen_or_create(dir, medium, &identity, bytes, num_blocks)?;
        let memory = tier_memory(layout, &data, medium, bytes)?;
        let files = Arc::new(Files { slots, data });
        let syncer = Arc::new(Syncer::default());
        let sync_thread = match medium {
            Medium::Disk(_) => Some(start_sync_thread(&files, &syncer, dir)?),
            Medium::Memory { .. } => None,
        };
        let store = KeptStore {
            dir: dir.to_path_buf(),
            files,
            num_blocks,
            syncer,
            sync_thread,
            keeping: RwLock::new(true),
            _lock: lock,
        };
        let recovery = Recovery {
            blocks,
            rejected,
            started_fresh,
            took: started.elapsed(),
        };
        tracing::info!(
            dir = %dir.display(),
            recovered = recovery.blocks.len(),
            rejected = recovery.rejected,
            took_ms = recovery.took.as_secs_f64() * 1e3,
            fresh = recovery.started_fresh.as_deref().unwrap_or("no"),
            "{tier} opened"
        );
        Ok((store, memory, recovery))
    }

    /// The files in `dir` and what they hold: reopened when they were
    /// written under `identity` (the full one) for this geometry, else
    /// created empty, saying why (and logging it when something was
    /// thrown away).
    fn reopen_or_create(
        dir: &Path,
        medium: &Medium<'_>,
        identity: &str,
        bytes: u64,
        num_blocks: u32,
    ) -> Result<Contents, DistError> {
        let tier = medium.tier();
        let reason = match std::fs::read_to_string(dir.join(IDENTITY_FILE)) {
            Ok(found) if found == identity => None,
            Ok(_) => Some("it was written under another identity".to_string()),
            Err(e) if e.kind() == ErrorKind::NotFound => Some(String::new()),
            Err(e) => Some(format!("its identity cannot be read ({e})")),
        };
        let reopened = match reason {
            None => Self::reopen(dir, medium, bytes, num_blocks),
            Some(r) => Err(r),
        };
        Ok(match reopened {
            Ok((data, slots, blocks, rejected)) => Contents {
                data,
                slots,
                blocks,
                rejected,
                started_fresh: None,
            },
            Err(reason) => {
                if !reason.is_empty() {
                    tracing::warn!(dir = %dir.display(), "{tier} directory emptied: {reason}");
                }
                let (data, slots) = Self::create(dir, medium, identity, bytes, num_blocks)?;
                let reason = if reason.is_empty() {
                    format!("the directory held no {tier}")
                } else {
                    reason
                };
                Contents {
                    data,
                    slots,
                    blocks: Vec::new(),
                    rejected: 0,
                    started_fresh: Some(reason),
                }
            }
        })
    }

    /// [`KeptStore::open`] on `dir`, or, while another engine of the same
    /// identity holds it, on `dir.2`, `dir.3`, ... (up to [`MAX_SIBLINGS`]):
    /// engines of one identity on one host each keep a tier of their own,
    /// and a restarted one takes the first that is free.
    pub fn open_free(
        dir: &Path,
        identity: &str,
        layout: Layout,
        medium: &Medium<'_>,
    ) -> Result<(KeptStore, PhysicalLayout, Recovery), DistError> {
        let mut last = None;
        for n in 1..=MAX_SIBLINGS {
            let candidate = if n == 1 {
                dir.to_path_buf()
            } else {
                let mut name = dir.as_os_str().to_owned();
                name.push(format!(".{n}"));
                PathBuf::from(name)
            };
            match Self::open(&candidate, identity, layout.clone(), medium) {
                Err(DistError::KeptInUse(p)) => last = Some(p),
                other => return other,
            }
        }
        Err(DistError::KeptInUse(
            last.unwrap_or_else(|| dir.to_path_buf()),
        ))
    }

    /// Opens the files of a directory of the right identity and reads its
    /// records; `Err(reason)` when they do not fit.
    #[allow(clippy::type_complexity)]
    fn reopen(
        dir: &Path,
        medium: &Medium<'_>,
        bytes: u64,
        num_blocks: u32,
    ) -> Result<(Data, File, Vec<Recovered>, u64), String> {
        let data = match medium {
            Medium::Disk(io_mode) => {
                let data = DiskFile::open(dir.join(BLOCKS_FILE), *io_mode)
                    .map_err(|e| format!("its data file cannot be opened ({e})"))?;
                if data.len() < bytes {
                    data.set_persist(false);
                    return Err(format!(
                        "its data file holds {} bytes, {bytes} are needed",
                        data.len()
                    ));
                }
                Data::Disk(data)
            }
            Medium::Memory { .. } => {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(dir.join(BLOCKS_FILE))
                    .map_err(|e| format!("its data file cannot be opened ({e})"))?;
                let len = file.metadata().map(|m| m.len()).unwrap_or(0);
                if len < bytes {
                    return Err(format!(
                        "its data file holds {len} bytes, {bytes} are needed"
                    ));
                }
                Data::Memory(file)
            }
        };
        let slots = OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join(SLOTS_FILE))
            .map_err(|e| format!("its slot records cannot be opened ({e})"))?;
        let mut all = vec![0u8; (HEADER_BYTES + u64::from(num_blocks) * RECORD_BYTES) as usize];
        slots
            .read_exact_at(&mut all, 0)
            .map_err(|e| format!("its slot records cannot be read ({e})"))?;
        if all[..HEADER_BYTES as usize] != header(num_blocks)[..] {
            return Err("its slot records have another format or size".into());
        }
        let mut blocks = Vec::new();
        let mut rejected = 0u64;
        for (slot, r) in all[HEADER_BYTES as usize..]
            .chunks_exact(RECORD_BYTES as usize)
            .enumerate()
        {
            let slot = slot as u32;
            match decode(slot, r) {
                Ok(None) => {}
                Ok(Some((label, sum))) => blocks.push(Recovered { slot, label, sum }),
                Err(()) => rejected += 1,
            }
        }
        Ok((data, slots, blocks, rejected))
    }

    /// Empties `dir` and writes a new store: data and records first, the
    /// identity last, so a crash while creating leaves a directory that is
    /// started afresh again.
    fn create(
        dir: &Path,
        medium: &Medium<'_>,
        identity: &str,
        bytes: u64,
        num_blocks: u32,
    ) -> Result<(Data, File), DistError> {
        for name in [IDENTITY_FILE, BLOCKS_FILE, SLOTS_FILE] {
            match std::fs::remove_file(dir.join(name)) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(format!("remove {}", dir.join(name).display()))(e)),
            }
        }
        let data = match medium {
            Medium::Disk(io_mode) => {
                let options = DiskOptions {
                    io_mode: *io_mode,
                    persist: true,
                };
                Data::Disk(DiskAllocator::new(dir, options)?.allocate_named(BLOCKS_FILE, bytes)?)
            }
            Medium::Memory { .. } => {
                let path = dir.join(BLOCKS_FILE);
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .and_then(|f| reserve(&f, bytes).map(|()| f))
                    .map_err(io_err(format!(
                        "reserve {bytes} bytes of memory for {}",
                        path.display()
                    )))?;
                Data::Memory(file)
            }
        };
        let path = dir.join(SLOTS_FILE);
        let slots = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err(format!("create {}", path.display())))?;
        let len = HEADER_BYTES + u64::from(num_blocks) * RECORD_BYTES;
        slots
            .set_len(len)
            .and_then(|()| slots.write_all_at(&header(num_blocks), 0))
            .and_then(|()| slots.sync_all())
            .map_err(io_err(format!("write {}", path.display())))?;
        let tmp = dir.join(format!("{IDENTITY_FILE}.tmp"));
        std::fs::write(&tmp, identity)
            .and_then(|()| File::open(&tmp)?.sync_all())
            .and_then(|()| std::fs::rename(&tmp, dir.join(IDENTITY_FILE)))
            .and_then(|()| File::open(dir)?.sync_all())
            .map_err(io_err(format!(
                "write {}",
                dir.join(IDENTITY_FILE).display()
            )))?;
        Ok((data, slots))
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Blocks the store holds room for.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    fn write_record(&self, slot: u32, record: &[u8]) -> io::Result<()> {
        if slot >= self.num_blocks {
            return Err(io::Error::new(
                ErrorKind::InvalidInput,
                format!("G3 slot {slot} beyond {} slots", self.num_blocks),
            ));
        }
        self.files
            .slots
            .write_all_at(record, HEADER_BYTES + u64::from(slot) * RECORD_BYTES)
    }

    /// Empties the records of `slots`: call before writing them.
    /// A no-op once the store stopped (no record names anything).
    pub fn forget(&self, slots: &[u32]) -> io::Result<()> {
        if !*self.keeping.read() {
            return Ok(());
        }
        let empty = [0u8; RECORD_BYTES as usize];
        slots.iter().try_for_each(|&s| self.write_record(s, &empty))
    }

    /// Empties every record, and from now on records nothing: the engine's
    /// cache was reset, and the blocks it holds may come from other
    /// weights than those a restarted engine loads. A commit that ran
    /// before is emptied here; one that runs after writes nothing.
    pub fn stop(&self) -> io::Result<()> {
        let mut keeping = self.keeping.write();
        *keeping = false;
        let zeros = vec![0u8; (u64::from(self.num_blocks) * RECORD_BYTES) as usize];
        self.files.slots.write_all_at(&zeros, HEADER_BYTES)?;
        self.syncer.state.lock().dirty = true;
        Ok(())
    }

    /// Records that each `(slot, label, sum)` block landed: call once its
    /// bytes are written. A thread of the store makes them durable within
    /// [`SYNC_EVERY`].
    /// A no-op once the store stopped.
    pub fn commit(&self, blocks: &[(u32, BlockLabel, u64)]) -> io::Result<()> {
        let keeping = self.keeping.read();
        if !*keeping {
            return Ok(());
        }
        for &(slot, label, sum) in blocks {
            self.write_record(slot, &encode(slot, label, sum))?;
        }
        if !blocks.is_empty() {
            self.syncer.state.lock().dirty = true;
        }
        Ok(())
    }

    /// Makes every written block and record durable now.
    pub fn sync(&self) -> io::Result<()> {
        self.files.sync()
    }

    /// Writes a record torn after `bytes` of its bytes, as a crash in the
    /// middle of [`KeptStore::commit`] can leave it.
    #[cfg(test)]
    pub(crate) fn commit_torn(&self, slot: u32, label: BlockLabel, sum: u64, bytes: usize) {
        let r = encode(slot, label, sum);
        self.write_record(slot, &r[..bytes.min(r.len())]).unwrap();
    }
}

impl Drop for KeptStore {
    fn drop(&mut self) {
        self.syncer.state.lock().stop = true;
        self.syncer.wake.notify_all();
        if let Some(t) = self.sync_thread.take() {
            let _ = t.join();
        }
        if let Err(e) = self.sync() {
            tracing::warn!(dir = %self.dir.display(), "G3 records not made durable: {e}");
        }
    }
}

/// Gives `file` all of its `bytes` now (`posix_fallocate`): in a
/// memory-backed file system a mapping that outgrew the memory left would
/// fault with `SIGBUS` on first use; this fails with `ENOSPC` instead.
fn reserve(file: &File, bytes: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(bytes)
        .map_err(|_| io::Error::new(ErrorKind::InvalidInput, "too many bytes"))?;
    // SAFETY: the descriptor is `file`'s, open for writing while it lives;
    // posix_fallocate only allocates the file's blocks.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// Takes `dir`'s lock: an error naming the directory when another process
/// holds it.
fn lock_dir(dir: &Path) -> Result<File, DistError> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io_err(format!("open {}", path.display())))?;
    match try_lock_exclusive(&file) {
        Ok(true) => Ok(file),
        Ok(false) => Err(DistError::KeptInUse(dir.to_path_buf())),
        Err(e) => Err(io_err(format!("lock {}", path.display()))(e)),
    }
}

/// Whether `dir` holds a G3 store that no process has open.
pub fn is_unused_store(dir: &Path) -> bool {
    if !dir.join(SLOTS_FILE).exists() && !dir.join(IDENTITY_FILE).exists() {
        return false;
    }
    match File::open(dir.join(LOCK_FILE)) {
        Ok(f) => try_lock_exclusive(&f).unwrap_or(false),
        Err(_) => true,
    }
}

mod history;
mod inspect;
mod record;
pub use history::{HISTORY_EVERY, HistoryKeeper, HistoryWriter};
pub use inspect::{Inspection, inspect};
use record::{decode, encode};

#[cfg(test)]
pub(crate) mod tests;
