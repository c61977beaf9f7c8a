//! The bandwidth matrix: source tier × destination tier × layout pair ×
//! tokens per block × blocks per batch, each next to a reference measured
//! in the same run.
//!
//! A row moves a fixed amount of KV (`bytes_per_rep`) as randomly chosen,
//! non-adjacent block pairs — the shape of real offload and onboard
//! traffic — through kvbm-transfer's [`Executor`], in transfers of
//! `blocks_per_batch` blocks submitted together. Bytes are the copy
//! planner's count for the layouts, never a hand-written product. The
//! reference is the best the machine does with the same bytes and none of
//! kvbm's structure: one large copy on the same memcpy backend for memory
//! paths, a raw sequential `O_DIRECT` write or read of the same file for
//! disk paths. The ratio to it is the figure to quote; absolute GB/s move
//! with the machine's load.
//!
//! Every row's destination is checked against the pattern of its source
//! after the first repetition.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvbm_layout::{BlockOrder, Layout, LayoutKind};
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::memory::{DiskAllocator, DiskOptions};
use kvbm_transfer::{
    CancelToken, CopyRun, Executor, ExecutorConfig, ExecutorSpec, PhysicalLayout, TransferBackend,
    TransferJob,
};
use serde::Serialize;

use super::error::{BenchError, Result};
use super::host_view::HostTier;
use super::model::{KvModel, check_disk_alignment};
use super::stats::Spread;

/// A tier-to-tier direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum TierPath {
    /// Host memory to host memory (engine layout ↔ kvbm layout on the CPU).
    HostToHost,
    /// G2 host memory to the G3 disk tier.
    HostToDisk,
    /// G3 disk to G2 host memory.
    DiskToHost,
    /// G1 GPU memory to G2 pinned host memory.
    DeviceToHost,
    /// G2 pinned host memory to G1 GPU memory.
    HostToDevice,
}

impl TierPath {
    /// Short name for tables and plots.
    pub fn name(self) -> &'static str {
        match self {
            TierPath::HostToHost => "host->host",
            TierPath::HostToDisk => "G2->G3",
            TierPath::DiskToHost => "G3->G2",
            TierPath::DeviceToHost => "G1->G2",
            TierPath::HostToDevice => "G2->G1",
        }
    }
}

/// Layout kinds the matrix pairs up, with the names it prints.
fn kind_name(kind: LayoutKind) -> &'static str {
    match kind {
        LayoutKind::FullyContiguous => "FC",
        LayoutKind::LayerSeparate(BlockOrder::OuterFirst) => "LS-outer",
        LayoutKind::LayerSeparate(BlockOrder::BlockFirst) => "LS-block",
    }
}

const FC: LayoutKind = LayoutKind::FullyContiguous;
const LS_OUTER: LayoutKind = LayoutKind::LayerSeparate(BlockOrder::OuterFirst);
const LS_BLOCK: LayoutKind = LayoutKind::LayerSeparate(BlockOrder::BlockFirst);

/// The `(path, source layout, destination layout)` cells of the matrix.
pub fn matrix_cells() -> Vec<(TierPath, LayoutKind, LayoutKind)> {
    vec![
        (TierPath::HostToHost, LS_OUTER, FC),
        (TierPath::HostToHost, LS_BLOCK, FC),
        (TierPath::HostToHost, FC, FC),
        (TierPath::HostToHost, FC, LS_OUTER),
        (TierPath::HostToDisk, FC, FC),
        (TierPath::HostToDisk, LS_OUTER, FC),
        (TierPath::DiskToHost, FC, FC),
        (TierPath::DiskToHost, FC, LS_OUTER),
        (TierPath::DeviceToHost, LS_OUTER, FC),
        (TierPath::HostToDevice, FC, LS_OUTER),
    ]
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct MatrixConfig {
    /// KV shape.
    pub model: KvModel,
    /// Tokens per block to sweep.
    pub tokens_per_block: Vec<usize>,
    /// Blocks per transfer to sweep.
    pub blocks_per_batch: Vec<usize>,
    /// KV bytes moved per repetition (rounded to whole batches).
    pub bytes_per_rep: u64,
    /// Repetitions per row; the median is reported with the spread.
    pub reps: usize,
    /// memcpy worker threads.
    pub memcpy_threads: usize,
    /// Directory for the disk tier's file (on a file system that takes
    /// `O_DIRECT`, which the raw disk reference needs).
    pub disk_dir: PathBuf,
    /// Only run rows whose path name contains this.
    pub only: Option<String>,
}

/// One measured (or skipped) row.
#[derive(Debug, Clone, Serialize)]
pub struct MatrixRow {
    /// Tier path.
    pub path: &'static str,
    /// Source layout.
    pub src_layout: &'static str,
    /// Destination layout.
    pub dst_layout: &'static str,
    /// Tokens per block.
    pub tokens_per_block: usize,
    /// Bytes of one block, from the layout config.
    pub block_bytes: u64,
    /// Blocks per transfer.
    pub blocks_per_batch: usize,
    /// Blocks moved per repetition.
    pub blocks: usize,
    /// Bytes moved per repetition, as the copy planner counted them.
    pub bytes: u64,
    /// kvbm's GB/s (10^9 bytes per second).
    pub gbps: Spread,
    /// What the reference is.
    pub reference: &'static str,
    /// The reference's GB/s on the same bytes, measured in the same run.
    pub reference_gbps: Spread,
    /// Median ÷ reference median.
    pub ratio: f64,
    /// Whether the destination was checked byte for byte.
    pub verified: bool,
    /// `ok`, or why the row was skipped.
    pub status: String,
}

/// Deterministic shuffled destinations: block `i` of the source goes to
/// `perm[i]`, so consecutive source blocks never land adjacent (no
/// accidental coalescing into one long copy).
pub(crate) fn scatter(n: usize, seed: u64) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..n).collect();
    let mut s = seed;
    for i in (1..n).rev() {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        perm.swap(i, (z % (i as u64 + 1)) as usize);
    }
    perm
}

pub(crate) fn gbps(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

/// Runs every transfer of `pairs` in transfers of `per_batch` blocks,
/// all submitted before any is waited on; returns bytes and seconds.
pub(crate) fn timed_transfer(
    exec: &Executor,
    src: &PhysicalLayout,
    dst: &PhysicalLayout,
    pairs: &[(usize, usize)],
    per_batch: usize,
    path: &str,
) -> Result<(u64, f64)> {
    let start = Instant::now();
    let handles: Vec<_> = pairs
        .chunks(per_batch)
        .map(|c| exec.transfer(src, dst, c))
        .collect();
    let mut bytes = 0;
    let mut first_err = None;
    for h in handles {
        match h.wait() {
            Ok(r) => bytes += r.bytes,
            Err(f) => {
                first_err.get_or_insert_with(|| f.to_string());
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    match first_err {
        Some(detail) => Err(BenchError::TransferFailed {
            path: path.to_string(),
            detail,
        }),
        None => Ok((bytes, secs)),
    }
}

/// One large copy of `bytes` on the memcpy backend: the memory reference.
pub(crate) fn reference_memcpy(
    backend: &MemcpyBackend,
    src: &HostTier,
    dst: &HostTier,
    bytes: u64,
) -> Result<f64> {
    let s = src.physical().regions()[0].slice(0, bytes)?;
    let d = dst.physical().regions()[0].slice(0, bytes)?;
    let job = TransferJob::new(
        vec![s].into(),
        vec![d].into(),
        vec![CopyRun {
            src_region: 0,
            src_offset: 0,
            dst_region: 0,
            dst_offset: 0,
            len: bytes,
        }]
        .into(),
        CancelToken::new(),
    );
    let start = Instant::now();
    backend.submit(job).wait()?;
    Ok(gbps(bytes, start.elapsed().as_secs_f64()))
}

/// A raw sequential `O_DIRECT` write or read of `bytes` of the file at
/// `path` in 2 MiB requests, one at a time: the disk reference.
pub(crate) fn reference_disk(path: &std::path::Path, bytes: u64, write: bool) -> Result<f64> {
    const REQ: usize = 2 << 20;
    let io_err = |source| BenchError::Output {
        path: path.to_path_buf(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(io_err)?;
    let mut raw = vec![0x5au8; REQ + 4096];
    let off = raw.as_ptr().align_offset(4096);
    let buf = &mut raw[off..off + REQ];
    let start = Instant::now();
    let mut pos = 0u64;
    while pos < bytes {
        let n = REQ.min((bytes - pos) as usize);
        let done = if write {
            file.write_at(&buf[..n], pos)
        } else {
            file.read_at(&mut buf[..n], pos)
        }
        .map_err(io_err)?;
        if done == 0 {
            break;
        }
        pos += done as u64;
    }
    Ok(gbps(pos, start.elapsed().as_secs_f64()))
}

struct Cell {
    path: TierPath,
    src_kind: LayoutKind,
    dst_kind: LayoutKind,
    tokens: usize,
    per_batch: usize,
}

impl Cell {
    fn row(&self, block_bytes: u64, status: String) -> MatrixRow {
        let zero = Spread::of(&[]);
        MatrixRow {
            path: self.path.name(),
            src_layout: kind_name(self.src_kind),
            dst_layout: kind_name(self.dst_kind),
            tokens_per_block: self.tokens,
            block_bytes,
            blocks_per_batch: self.per_batch,
            blocks: 0,
            bytes: 0,
            gbps: zero,
            reference: match self.path {
                TierPath::HostToDisk => "raw O_DIRECT write",
                TierPath::DiskToHost => "raw O_DIRECT read",
                TierPath::DeviceToHost | TierPath::HostToDevice => "one large DMA copy",
                _ => "one large copy",
            },
            reference_gbps: zero,
            ratio: 0.0,
            verified: false,
            status,
        }
    }
}

/// Runs the matrix, calling `progress` after each row.
pub fn run_matrix(
    config: &MatrixConfig,
    mut progress: impl FnMut(&MatrixRow),
) -> Result<Vec<MatrixRow>> {
    if config.reps == 0 || config.tokens_per_block.is_empty() || config.blocks_per_batch.is_empty()
    {
        return Err(BenchError::Config(
            "need at least one repetition, one block size and one batch size".into(),
        ));
    }
    if config.blocks_per_batch.contains(&0) || config.tokens_per_block.contains(&0) {
        return Err(BenchError::Config(
            "block and batch sizes must be positive".into(),
        ));
    }
    let memcpy = Arc::new(MemcpyBackend::new(config.memcpy_threads)?);
    let gpu = open_gpu();
    let mut rows = Vec::new();
    for (path, src_kind, dst_kind) in matrix_cells() {
        if config
            .only
            .as_deref()
            .is_some_and(|o| !path.name().contains(o))
        {
            continue;
        }
        for &tokens in &config.tokens_per_block {
            for &per_batch in &config.blocks_per_batch {
                let cell = Cell {
                    path,
                    src_kind,
                    dst_kind,
                    tokens,
                    per_batch,
                };
                let row = measure(config, &memcpy, &gpu, &cell)?;
                progress(&row);
                rows.push(row);
            }
        }
    }
    #[cfg(feature = "nixl")]
    rows.extend(super::nixl_rows::run(config, &memcpy, &mut progress)?);
    Ok(rows)
}

#[cfg(feature = "cuda")]
type GpuState = std::result::Result<super::cuda_rows::Gpu, String>;
#[cfg(not(feature = "cuda"))]
type GpuState = std::result::Result<(), String>;

fn open_gpu() -> GpuState {
    #[cfg(feature = "cuda")]
    {
        super::cuda_rows::open()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("no CUDA device (built without feature `cuda`)".into())
    }
}

#[cfg(feature = "cuda")]
fn measure_cuda(
    config: &MatrixConfig,
    gpu: &super::cuda_rows::Gpu,
    cell: &Cell,
    block_bytes: u64,
) -> Result<MatrixRow> {
    let batches = (config.bytes_per_rep / (block_bytes * cell.per_batch as u64)).max(1) as usize;
    let n = batches * cell.per_batch;
    let cfg = config.model.layout_config(n, cell.tokens)?;
    let perm = scatter(n, (cell.tokens * 31 + cell.per_batch) as u64);
    let pairs: Vec<(usize, usize)> = (0..n).map(|i| (i, perm[i])).collect();
    let m = super::cuda_rows::measure(
        gpu,
        cfg,
        cell.src_kind,
        cell.dst_kind,
        cell.path == TierPath::HostToDevice,
        &pairs,
        cell.per_batch,
        config.reps,
        cell.path.name(),
    )?;
    let row = cell.row(block_bytes, format!("ok ({:?} path)", m.path));
    Ok(finish(row, n, m.bytes, &m.samples, &m.refs, true))
}

fn measure(
    config: &MatrixConfig,
    memcpy: &Arc<MemcpyBackend>,
    gpu: &GpuState,
    cell: &Cell,
) -> Result<MatrixRow> {
    let block_bytes = config.model.layout_config(1, cell.tokens)?.block_bytes();
    let disk = matches!(cell.path, TierPath::HostToDisk | TierPath::DiskToHost);
    if matches!(cell.path, TierPath::DeviceToHost | TierPath::HostToDevice) {
        return match gpu {
            Err(why) => Ok(cell.row(block_bytes, format!("skipped: {why}"))),
            #[cfg(feature = "cuda")]
            Ok(gpu) => measure_cuda(config, gpu, cell, block_bytes),
            #[cfg(not(feature = "cuda"))]
            Ok(()) => Ok(cell.row(block_bytes, "skipped: no CUDA device".into())),
        };
    }
    if disk && let Err(e) = check_disk_alignment(&config.model, cell.tokens) {
        return Ok(cell.row(block_bytes, format!("skipped: {e}")));
    }
    let bench = HostBench::new(config, cell, block_bytes)?;
    if disk {
        bench.disk(block_bytes)
    } else {
        bench.host(memcpy, block_bytes)
    }
}

/// A host or disk cell ready to time: its executor, the source filled
/// with the pattern, and the block pairs each rep copies.
struct HostBench<'a> {
    config: &'a MatrixConfig,
    cell: &'a Cell,
    /// The layout config of `n` blocks.
    cfg: kvbm_layout::LayoutConfig,
    /// Blocks per rep: whole batches covering about `bytes_per_rep`.
    n: usize,
    src: HostTier,
    exec: Executor,
    /// `(source block, destination block)`, destinations scattered.
    pairs: Vec<(usize, usize)>,
}

impl<'a> HostBench<'a> {
    /// Sets up `cell`, whose blocks are `block_bytes` long.
    fn new(config: &'a MatrixConfig, cell: &'a Cell, block_bytes: u64) -> Result<Self> {
        // Whole batches covering about `bytes_per_rep`.
        let batches =
            (config.bytes_per_rep / (block_bytes * cell.per_batch as u64)).max(1) as usize;
        let n = batches * cell.per_batch;
        let cfg = config.model.layout_config(n, cell.tokens)?;
        let exec = ExecutorSpec::host()
            .memcpy_threads(config.memcpy_threads)
            .disk(true)
            .config(ExecutorConfig {
                max_blocks_per_batch: cell.per_batch,
                ..ExecutorConfig::default()
            })
            .build()?;
        let perm = scatter(n, (cell.tokens * 31 + cell.per_batch) as u64);
        let pairs: Vec<(usize, usize)> = (0..n).map(|i| (i, perm[i])).collect();
        let src = HostTier::allocate(Layout::new(cfg, cell.src_kind)?)?;
        for b in 0..n {
            // SAFETY: no transfer has been started on `src` yet.
            unsafe { src.fill(b, b as u64)? };
        }
        Ok(HostBench {
            config,
            cell,
            cfg,
            n,
            src,
            exec,
            pairs,
        })
    }

    /// Copies `pairs` from `src` to `dst`; bytes and seconds.
    fn copy(
        &self,
        src: &PhysicalLayout,
        dst: &PhysicalLayout,
        pairs: &[(usize, usize)],
    ) -> Result<(u64, f64)> {
        let name = self.cell.path.name();
        timed_transfer(&self.exec, src, dst, pairs, self.cell.per_batch, name)
    }

    /// The pairs the other way round: destination to source.
    fn inverse(&self) -> Vec<(usize, usize)> {
        self.pairs.iter().map(|&(s, d)| (d, s)).collect()
    }

    /// Times the cell between host memory and a G3 file, each rep next to
    /// a raw read or write of the file's size.
    fn disk(&self, block_bytes: u64) -> Result<MatrixRow> {
        let alloc = DiskAllocator::new(&self.config.disk_dir, DiskOptions::default())?;
        let file = PhysicalLayout::allocate_disk(Layout::new(self.cfg, FC)?, &alloc)?;
        let file_path = file.regions()[0]
            .file_location()
            .map(|(f, _)| f.path().to_path_buf())
            .ok_or_else(|| BenchError::Config("disk layout without a file".into()))?;
        let direct = file.regions()[0]
            .file_location()
            .is_some_and(|(f, _)| f.is_direct());
        let total = file.regions()[0].len();
        // Fill the file from `src` so reads hit written extents, never holes.
        let (bytes, _) = self.copy(self.src.physical(), &file, &self.pairs)?;
        let (samples, refs, verified) = if self.cell.path == TierPath::HostToDisk {
            self.disk_writes(&file, &file_path, total)?
        } else {
            self.disk_reads(&file, &file_path, total)?
        };
        let mut row = self.cell.row(block_bytes, "ok".into());
        if !direct {
            row.status = "ok (buffered: no O_DIRECT on this file system)".into();
        }
        Ok(finish(row, self.n, bytes, &samples, &refs, verified))
    }

    /// The write reps into `file` (at `file_path`, `total` bytes), then
    /// one more read back and checked: GB/s, raw GB/s, whether checked.
    fn disk_writes(
        &self,
        file: &PhysicalLayout,
        file_path: &std::path::Path,
        total: u64,
    ) -> Result<(Vec<f64>, Vec<f64>, bool)> {
        let mut samples = Vec::with_capacity(self.config.reps);
        let mut refs = Vec::with_capacity(self.config.reps);
        for _ in 0..self.config.reps {
            let (b, secs) = self.copy(self.src.physical(), file, &self.pairs)?;
            samples.push(gbps(b, secs));
            refs.push(reference_disk(file_path, total, true)?);
        }
        // The reference overwrote the file: write it once more, read it
        // back and check it.
        self.copy(self.src.physical(), file, &self.pairs)?;
        let back = HostTier::allocate(Layout::new(self.cfg, FC)?)?;
        self.copy(file, back.physical(), &self.inverse())?;
        let verified = check_all(&back, &identity(self.n), self.cell.path.name())?;
        Ok((samples, refs, verified))
    }

    /// The read reps from `file` (at `file_path`, `total` bytes), the
    /// first checked: GB/s, raw GB/s, whether checked.
    fn disk_reads(
        &self,
        file: &PhysicalLayout,
        file_path: &std::path::Path,
        total: u64,
    ) -> Result<(Vec<f64>, Vec<f64>, bool)> {
        let mut samples = Vec::with_capacity(self.config.reps);
        let mut refs = Vec::with_capacity(self.config.reps);
        let dst = HostTier::allocate(Layout::new(self.cfg, self.cell.dst_kind)?)?;
        let inverse = self.inverse();
        let mut checked = false;
        for _ in 0..self.config.reps {
            let (b, secs) = self.copy(file, dst.physical(), &inverse)?;
            samples.push(gbps(b, secs));
            if !checked {
                checked = check_all(&dst, &identity(self.n), self.cell.path.name())?;
            }
            refs.push(reference_disk(file_path, total, false)?);
        }
        Ok((samples, refs, checked))
    }

    /// Times the cell host to host, each rep next to a memcpy of the same
    /// bytes between two flat buffers.
    fn host(&self, memcpy: &Arc<MemcpyBackend>, block_bytes: u64) -> Result<MatrixRow> {
        let mut samples = Vec::with_capacity(self.config.reps);
        let mut refs = Vec::with_capacity(self.config.reps);
        let mut bytes = 0;
        let dst = HostTier::allocate(Layout::new(self.cfg, self.cell.dst_kind)?)?;
        let mut checked = false;
        for _ in 0..self.config.reps {
            let (b, secs) = self.copy(self.src.physical(), dst.physical(), &self.pairs)?;
            bytes = b;
            samples.push(gbps(b, secs));
            if !checked {
                checked = check_all(&dst, &self.pairs, self.cell.path.name())?;
            }
        }
        // The reference copies the same number of bytes between two flat buffers.
        let flat = self.config.model.layout_config(self.n, self.cell.tokens)?;
        let a = HostTier::allocate(Layout::new(flat, FC)?)?;
        let b = HostTier::allocate(Layout::new(flat, FC)?)?;
        let ref_bytes = bytes.min(a.physical().regions()[0].len());
        for _ in 0..self.config.reps {
            refs.push(reference_memcpy(memcpy, &a, &b, ref_bytes)?);
        }
        Ok(finish(
            self.cell.row(block_bytes, "ok".into()),
            self.n,
            bytes,
            &samples,
            &refs,
            checked,
        ))
    }
}

fn identity(n: usize) -> Vec<(usize, usize)> {
    (0..n).map(|i| (i, i)).collect()
}

/// Checks, for every `(s, d)`, that block `d` of `dst` holds the pattern
/// of source block `s` (sources are filled with hash = block index).
fn check_all(dst: &HostTier, pairs: &[(usize, usize)], path: &str) -> Result<bool> {
    for &(s, d) in pairs {
        // SAFETY: called only after every transfer into `dst` was waited on.
        if let Some(m) = unsafe { dst.check(d, s as u64)? } {
            return Err(BenchError::Corrupt {
                block: s as u64,
                path: path.to_string(),
                layer: m.layer,
                outer: m.outer,
                offset: m.offset,
            });
        }
    }
    Ok(true)
}

fn finish(
    mut row: MatrixRow,
    blocks: usize,
    bytes: u64,
    samples: &[f64],
    refs: &[f64],
    verified: bool,
) -> MatrixRow {
    row.blocks = blocks;
    row.bytes = bytes;
    row.gbps = Spread::of(samples);
    row.reference_gbps = Spread::of(refs);
    row.ratio = if row.reference_gbps.median > 0.0 {
        row.gbps.median / row.reference_gbps.median
    } else {
        0.0
    };
    row.verified = verified;
    row
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_is_a_permutation() {
        let mut p = scatter(1000, 7);
        assert_ne!(p, (0..1000).collect::<Vec<_>>());
        p.sort_unstable();
        assert_eq!(p, (0..1000).collect::<Vec<_>>());
    }
}
