//! `kept-g3`: what keeping G3 across restarts costs, as ratios measured in
//! one run.
//!
//! - **Reopen**: a kept G3 indexing `--index-blocks` blocks (51,200 by
//!   default: 100 GiB of 2 MiB blocks, the 8B model's 16-token block) is
//!   opened from a cold page cache; its index is rebuilt from the slot
//!   records. Reference: reading the same records file with `O_DIRECT`.
//! - **Write and read rates**: blocks of the 8B shape written G2 → G3 and
//!   read G3 → G1 by a leader and an in-process worker, with the G3 kept
//!   (records and checksums) and not kept, alternating, same file system.
//!   Each repetition runs both, one after the other; the ratio is the
//!   median over the repetitions of their ratios, with its quartiles.
//!
//! usage: kept-g3 [--dir DIR] [--blocks N] [--index-blocks N] [--reps N]

use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvbm_block::SequenceHash;
use kvbm_dist::auth::InstanceSecret;
use kvbm_dist::kept::{BlockLabel, KeptStore, Medium};
use kvbm_dist::leader::{Leader, LeaderConfig, PendingLeader};
use kvbm_dist::proto::ProbeOp;
use kvbm_dist::worker::{self, WorkerConfig};
use kvbm_layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_pool::Tier;
use kvbm_pool::tier::TierMover;
use kvbm_transfer::memory::{IoMode, SystemAllocator};
use kvbm_transfer::{CancelToken, PhysicalLayout};

type Error = Box<dyn std::error::Error>;

/// The 8B model's block: 32 layers, K and V, 16 tokens of 8 heads x 128, bf16.
fn block_shape(blocks: usize) -> Result<LayoutConfig, Error> {
    Ok(LayoutConfig::new(blocks, 32, 2, 16, 1024, 2)?)
}

struct Args {
    dir: PathBuf,
    blocks: usize,
    index_blocks: usize,
    reps: usize,
}

fn args() -> Result<Args, Error> {
    let mut a = Args {
        dir: std::env::temp_dir(),
        blocks: 512,
        index_blocks: 51_200,
        reps: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--dir" => a.dir = PathBuf::from(value()?),
            "--blocks" => a.blocks = value()?.parse()?,
            "--index-blocks" => a.index_blocks = value()?.parse()?,
            "--reps" => a.reps = value()?.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if a.blocks < 64 || a.reps == 0 || a.index_blocks == 0 {
        return Err("--blocks must be at least 64; --reps and --index-blocks at least 1".into());
    }
    Ok(a)
}

fn median(v: Vec<f64>) -> f64 {
    quantile(v, 0.5)
}

/// The value a fraction `q` of the way up `v` sorted (nearest rank).
fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i]
}

/// Drops `path` from the page cache.
fn evict(path: &Path) -> Result<(), Error> {
    let f = std::fs::File::open(path)?;
    // SAFETY: a valid descriptor of an open file; the call reads no memory.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(format!("posix_fadvise {}: error {rc}", path.display()).into());
    }
    Ok(())
}

/// Seconds to read `path` whole with `O_DIRECT`, 1 MiB at a time.
fn raw_read(path: &Path) -> Result<f64, Error> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    let len = f.metadata()?.len();
    let buf = SystemAllocator::new().allocate(1 << 20)?;
    // SAFETY: the buffer is 1 MiB of page-aligned, mapped memory that
    // `buf` keeps alive until this function returns; nothing else touches
    // it (no transfer uses it).
    let bytes = unsafe { std::slice::from_raw_parts_mut(buf.addr() as *mut u8, 1 << 20) };
    let started = Instant::now();
    let mut at = 0;
    while at < len {
        let n = f.read_at(bytes, at)?;
        if n == 0 {
            break;
        }
        at += n as u64;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Reopen of a kept G3 of `blocks` blocks against reading its records.
fn reopen(dir: &Path, blocks: usize, reps: usize) -> Result<(f64, f64, usize), Error> {
    let store_dir = dir.join("kept-g3-reopen");
    let _ = std::fs::remove_dir_all(&store_dir);
    // Blocks of 4 KiB: the reopen reads records, not blocks; the data file
    // only has to exist.
    let layout = || -> Result<Layout, Error> {
        let c = LayoutConfig::new(blocks, 1, 1, 1, 2048, 2)?;
        Ok(Layout::new(c, LayoutKind::FullyContiguous)?)
    };
    {
        let (store, _, _) =
            KeptStore::open(&store_dir, "study", layout()?, &Medium::Disk(IoMode::Auto))?;
        let records: Vec<(u32, BlockLabel, u64)> = (0..blocks as u32)
            .map(|s| {
                let label = BlockLabel {
                    hash: u64::from(s) * 7 + 1,
                    parent: s.checked_sub(1).map(|p| u64::from(p) * 7 + 1),
                };
                (s, label, u64::from(s))
            })
            .collect();
        store.commit(&records)?;
        store.sync()?;
    }
    let (mut opens, mut reads, mut found) = (Vec::new(), Vec::new(), 0);
    for _ in 0..reps {
        for f in ["slots", "identity", "blocks"] {
            evict(&store_dir.join(f))?;
        }
        let started = Instant::now();
        let (_, _, r) =
            KeptStore::open(&store_dir, "study", layout()?, &Medium::Disk(IoMode::Auto))?;
        opens.push(started.elapsed().as_secs_f64());
        found = r.blocks.len();
        evict(&store_dir.join("slots"))?;
        reads.push(raw_read(&store_dir.join("slots"))?);
    }
    std::fs::remove_dir_all(&store_dir)?;
    Ok((median(opens), median(reads), found))
}

/// A leader and its in-process worker over a host G1 of 64 blocks, a G2 of
/// 128 and a G3 of `blocks` in `g3_dir`, kept when `identity` is given.
struct Instance {
    leader: Leader,
    worker: std::thread::JoinHandle<kvbm_dist::Result<()>>,
    _dir: TempDir,
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn start(g3_dir: &Path, blocks: usize, identity: Option<&str>) -> Result<Instance, Error> {
    let block = block_shape(1)?.block_bytes();
    let sock = TempDir(std::env::temp_dir().join(format!(
        "kept-g3-{}-{}",
        std::process::id(),
        identity.is_some()
    )));
    std::fs::create_dir_all(&sock.0)?;
    let secret = InstanceSecret::from_bytes([9; 32]);
    let endpoint = format!("ipc://{}", sock.0.join("leader").display());
    let mut c = LeaderConfig::new(endpoint, 1, 1, 128 * block, blocks as u64 * block);
    c.secret = Some(secret.clone());
    let pending = PendingLeader::bind(c)?;
    let g1 = PhysicalLayout::allocate_system(
        Layout::new(block_shape(64)?, LayoutKind::FullyContiguous)?,
        &SystemAllocator::new(),
    )?;
    let mut wc = WorkerConfig::new(pending.endpoint(), 1, 0, 1, g1, secret);
    wc.g3_dir = Some(g3_dir.to_path_buf());
    wc.kept_identity = identity.map(str::to_string);
    wc.probe = Some(Box::new(worker::probe::HostProbe));
    wc.leader_timeout = Duration::from_secs(60);
    let worker = std::thread::spawn(move || worker::run(wc));
    let leader = pending.handshake()?;
    let seeds: Vec<(u32, u64)> = (0..64u32).map(|b| (b, u64::from(b) + 1)).collect();
    leader.probe(ProbeOp::Fill, seeds)?;
    let mover = leader.mover();
    for half in 0..2usize {
        let pairs = (0..64).map(|b| (b, b + 64 * half)).collect();
        mover
            .copy(Tier::G1, Tier::G2, pairs, CancelToken::new())
            .wait()
            .map_err(|f| f.to_string())?;
    }
    Ok(Instance {
        leader,
        worker,
        _dir: sock,
    })
}

/// Seconds to write every G3 block from G2 (64 per copy), then to read
/// them all into G1.
fn write_and_read(i: &Instance, blocks: usize) -> Result<(f64, f64), Error> {
    let mover = i.leader.mover();
    let started = Instant::now();
    for first in (0..blocks).step_by(64) {
        let range = first..(first + 64).min(blocks);
        let pairs = range.clone().map(|b| (b % 128, b)).collect();
        let labels = range.map(|b| (SequenceHash(b as u64 + 1), None)).collect();
        mover
            .copy_labelled(Tier::G2, Tier::G3, pairs, labels, CancelToken::new())
            .wait()
            .map_err(|f| f.to_string())?;
    }
    let write = started.elapsed().as_secs_f64();
    let started = Instant::now();
    for first in (0..blocks).step_by(64) {
        let pairs = (first..(first + 64).min(blocks))
            .map(|b| (b, b % 64))
            .collect();
        mover
            .copy(Tier::G3, Tier::G1, pairs, CancelToken::new())
            .wait()
            .map_err(|f| f.to_string())?;
    }
    Ok((write, started.elapsed().as_secs_f64()))
}

fn main() -> Result<(), Error> {
    let a = args()?;
    let (open, read, found) = reopen(&a.dir, a.index_blocks, a.reps)?;
    let gib_2m = a.index_blocks as f64 * 2.0 / 1024.0;
    println!(
        "reopen of a kept G3 indexing {} blocks ({gib_2m:.0} GiB of 2 MiB blocks), cold: {:.1} ms (found {found}); O_DIRECT read of its records: {:.1} ms; ratio {:.2}; {:.3} s per 100 GiB",
        a.index_blocks,
        open * 1e3,
        read * 1e3,
        read / open,
        open * 100.0 / gib_2m,
    );
    let bytes = a.blocks as f64 * block_shape(1)?.block_bytes() as f64;
    let mut rates: [[Vec<f64>; 2]; 2] = Default::default();
    for rep in 0..a.reps {
        for (k, kept) in [(0, false), (1, true)] {
            let kept = if rep % 2 == 0 { kept } else { !kept };
            let k = if rep % 2 == 0 { k } else { 1 - k };
            let dir = TempDir(a.dir.join(format!("kept-g3-rates-{k}")));
            let _ = std::fs::remove_dir_all(&dir.0);
            let i = start(&dir.0, a.blocks, kept.then_some("study"))?;
            let (w, r) = write_and_read(&i, a.blocks)?;
            i.leader.shutdown();
            i.worker.join().map_err(|_| "worker panicked")??;
            rates[k][0].push(bytes / w / 1e9);
            rates[k][1].push(bytes / r / 1e9);
        }
    }
    for (what, p) in [("G2 -> G3 write", 0), ("G3 -> G1 read", 1)] {
        let plain = median(rates[0][p].clone());
        let kept = median(rates[1][p].clone());
        // Each repetition's two runs are neighbours in time: their ratio
        // cancels the disk's drift between repetitions.
        let pairs: Vec<f64> = rates[1][p]
            .iter()
            .zip(&rates[0][p])
            .map(|(k, n)| k / n)
            .collect();
        let (low, mid, high) = (
            quantile(pairs.clone(), 0.25),
            median(pairs.clone()),
            quantile(pairs, 0.75),
        );
        println!(
            "{what}, {} blocks of 2 MiB: kept {kept:.2} GB/s, not kept {plain:.2} GB/s; ratio per repetition: median {mid:.3} (cost {:.1} %), quartiles {low:.3}-{high:.3}",
            a.blocks,
            (1.0 - mid) * 100.0
        );
    }
    Ok(())
}
