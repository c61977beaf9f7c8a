//! The NIXL rows of the transfer matrix (feature `nixl`).
//!
//! Disk: NIXL's POSIX plugin next to our io_uring backend, FC → FC with
//! the matrix's block sizes and batches, on the same file, in the same run,
//! repetitions interleaved (io_uring, NIXL, raw reference, in turn) so the
//! machine's noise lands on all three alike. Each is quoted as a ratio to
//! a raw sequential `O_DIRECT` write or read of the same file, and with its
//! CPU cost in CPU-seconds (user + system, whole process) per GiB moved —
//! NIXL completes by polling, io_uring by sleeping in the kernel.
//!
//! Remote: a G2 → G2 pull over UCX between two agents of this process
//! (loopback; set `UCX_TLS=tcp UCX_NET_DEVICES=lo UCX_MODULES=^ib` on a
//! CPU machine), next to one large memcpy of the same bytes.
//!
//! Without the NIXL runtime the rows say `skipped: NIXL runtime not found`.

use std::sync::Arc;
use std::time::Instant;

use kvbm_layout::{Layout, LayoutKind};
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::memory::{DiskAllocator, DiskOptions};
use kvbm_transfer::nixl::{NixlDiskBackend, NixlDiskConfig, NixlRemote, RemoteConfig};
use kvbm_transfer::{Executor, ExecutorConfig, ExecutorSpec, PhysicalLayout};

use super::error::{BenchError, Result};
use super::host_view::HostTier;
use super::matrix::{
    MatrixConfig, MatrixRow, gbps, reference_disk, reference_memcpy, scatter, timed_transfer,
};
use super::model::check_disk_alignment;
use super::stats::Spread;

/// Process CPU time (user + system) in seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: `getrusage` writes one `rusage` into the zeroed local.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid out-pointer has no other requirement.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Wall seconds and CPU seconds of `f`.
fn timed<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, f64, f64)> {
    let (c0, t0) = (cpu_seconds(), Instant::now());
    let v = f()?;
    Ok((v, t0.elapsed().as_secs_f64(), cpu_seconds() - c0))
}

const GIB: f64 = (1u64 << 30) as f64;

fn row(
    path: &'static str,
    reference: &'static str,
    tokens: usize,
    block_bytes: u64,
    per_batch: usize,
) -> MatrixRow {
    let zero = Spread::of(&[]);
    MatrixRow {
        path,
        src_layout: "FC",
        dst_layout: "FC",
        tokens_per_block: tokens,
        block_bytes,
        blocks_per_batch: per_batch,
        blocks: 0,
        bytes: 0,
        gbps: zero,
        reference,
        reference_gbps: zero,
        ratio: 0.0,
        verified: false,
        status: String::new(),
    }
}

#[derive(Default)]
struct Samples {
    gbps: Vec<f64>,
    cpu_per_gib: Vec<f64>,
}

impl Samples {
    fn push(&mut self, bytes: u64, secs: f64, cpu: f64) {
        self.gbps.push(gbps(bytes, secs));
        self.cpu_per_gib.push(cpu / (bytes as f64 / GIB));
    }

    /// Adds a reference rep that moved `bytes` at `gbps` for `cpu`
    /// CPU-seconds.
    fn push_reference(&mut self, gbps: f64, cpu: f64, bytes: u64) {
        self.gbps.push(gbps);
        self.cpu_per_gib.push(cpu / (bytes as f64 / GIB));
    }
}

fn finish(
    mut r: MatrixRow,
    blocks: usize,
    bytes: u64,
    s: &Samples,
    reference: &Samples,
    verified: bool,
) -> MatrixRow {
    r.blocks = blocks;
    r.bytes = bytes;
    r.gbps = Spread::of(&s.gbps);
    r.reference_gbps = Spread::of(&reference.gbps);
    r.ratio = if r.reference_gbps.median > 0.0 {
        r.gbps.median / r.reference_gbps.median
    } else {
        0.0
    };
    r.verified = verified;
    let cpu = Spread::of(&s.cpu_per_gib);
    r.status = format!(
        "ok; CPU {:.3} s/GiB ({:.3}–{:.3}); reference {:.3}",
        cpu.median,
        cpu.min,
        cpu.max,
        Spread::of(&reference.cpu_per_gib).median
    );
    r
}

/// Runs every transfer of `pairs` in transfers of `per_batch` blocks, all
/// submitted before any is waited on; returns the bytes moved.
fn run_batches(
    exec: &Executor,
    src: &PhysicalLayout,
    dst: &PhysicalLayout,
    pairs: &[(usize, usize)],
    per_batch: usize,
    path: &str,
) -> Result<u64> {
    timed_transfer(exec, src, dst, pairs, per_batch, path).map(|(bytes, _)| bytes)
}

fn check_all(dst: &HostTier, n: usize, path: &str) -> Result<bool> {
    for b in 0..n {
        // SAFETY: called only after every transfer into `dst` was waited on.
        if let Some(m) = unsafe { dst.check(b, b as u64)? } {
            return Err(BenchError::Corrupt {
                block: b as u64,
                path: path.to_string(),
                layer: m.layer,
                outer: m.outer,
                offset: m.offset,
            });
        }
    }
    Ok(true)
}

/// The disk rows for one block size and batch: io_uring and NIXL POSIX,
/// writes then reads.
fn disk_rows(config: &MatrixConfig, tokens: usize, per_batch: usize) -> Result<Vec<MatrixRow>> {
    let block_bytes = config.model.layout_config(1, tokens)?.block_bytes();
    let names = [
        ("G2->G3 io_uring", "G3->G2 io_uring"),
        ("G2->G3 nixl-posix", "G3->G2 nixl-posix"),
    ];
    let skipped = |why: String| -> Vec<MatrixRow> {
        names
            .iter()
            .flat_map(|&(w, r)| [w, r])
            .map(|p| {
                let mut r = row(p, "raw O_DIRECT", tokens, block_bytes, per_batch);
                r.status = format!("skipped: {why}");
                r
            })
            .collect()
    };
    if let Err(e) = check_disk_alignment(&config.model, tokens) {
        return Ok(skipped(e.to_string()));
    }
    let nixl = match NixlDiskBackend::new(&NixlDiskConfig::default()) {
        Ok(b) => Arc::new(b),
        Err(e) => return Ok(skipped(e.to_string())),
    };
    let d = DiskBench::new(config, tokens, per_batch, block_bytes, nixl)?;
    // Writes, interleaved; the reference overwrites the file, so each
    // backend's last write is read back and checked by the same backend.
    let (w, w_ref, bytes) = d.writes(config.reps)?;
    let mut verified = [false, false];
    for (v, e) in verified.iter_mut().zip(d.execs()) {
        d.run(e, true)?;
        d.run(e, false)?;
        *v = check_all(&d.dst, d.n, "G2->G3->G2")?;
    }
    // Reads of the (now valid) file, interleaved.
    let (r, r_ref) = d.reads(config.reps)?;
    let mut rows = Vec::new();
    for (i, (wname, rname)) in names.into_iter().enumerate() {
        let base = |p| row(p, "raw O_DIRECT", tokens, block_bytes, per_batch);
        rows.push(finish(base(wname), d.n, bytes, &w[i], &w_ref, verified[i]));
        rows.push(finish(base(rname), d.n, bytes, &r[i], &r_ref, verified[i]));
    }
    Ok(rows)
}

/// A disk cell set up for both backends: io_uring and NIXL POSIX
/// executors, host memory registered with both, the file, and the block
/// pairs each way. The file and the host memory drop before the
/// executors they are registered with.
struct DiskBench {
    file: PhysicalLayout,
    dst: HostTier,
    src: HostTier,
    nixl: Executor,
    uring: Executor,
    /// Blocks per rep.
    n: usize,
    per_batch: usize,
    file_path: std::path::PathBuf,
    /// The file's bytes.
    total: u64,
    /// `(host block, file block)` out; the same pairs back.
    out: Vec<(usize, usize)>,
    back: Vec<(usize, usize)>,
}

impl DiskBench {
    /// Sets up the cell of `tokens` per block, `block_bytes` each.
    fn new(
        config: &MatrixConfig,
        tokens: usize,
        per_batch: usize,
        block_bytes: u64,
        nixl: Arc<NixlDiskBackend>,
    ) -> Result<DiskBench> {
        let batches = (config.bytes_per_rep / (block_bytes * per_batch as u64)).max(1) as usize;
        let n = batches * per_batch;
        let cfg = config.model.layout_config(n, tokens)?;
        let exec_cfg = ExecutorConfig {
            max_blocks_per_batch: per_batch,
            ..ExecutorConfig::default()
        };
        let uring = ExecutorSpec::host()
            .memcpy_threads(config.memcpy_threads)
            .disk(true)
            .config(exec_cfg.clone())
            .build()?;
        let nixl = Executor::builder()
            .backend(Arc::new(MemcpyBackend::new(config.memcpy_threads)?))
            .backend(nixl)
            .config(exec_cfg)
            .build()?;
        let src = HostTier::allocate(Layout::new(cfg, LayoutKind::FullyContiguous)?)?;
        let dst = HostTier::allocate(Layout::new(cfg, LayoutKind::FullyContiguous)?)?;
        for b in 0..n {
            // SAFETY: no transfer has been started on `src` yet.
            unsafe { src.fill(b, b as u64)? };
        }
        for e in [&uring, &nixl] {
            e.register(src.physical())?;
            e.register(dst.physical())?;
        }
        let alloc = DiskAllocator::new(&config.disk_dir, DiskOptions::default())?;
        let file =
            PhysicalLayout::allocate_disk(Layout::new(cfg, LayoutKind::FullyContiguous)?, &alloc)?;
        let (file_path, total) = match file.regions()[0].file_location() {
            Some((f, _)) => (f.path().to_path_buf(), file.regions()[0].len()),
            None => return Err(BenchError::Config("disk layout without a file".into())),
        };
        let perm = scatter(n, (tokens * 31 + per_batch) as u64);
        let out: Vec<(usize, usize)> = (0..n).map(|i| (i, perm[i])).collect();
        let back: Vec<(usize, usize)> = out.iter().map(|&(s, d)| (d, s)).collect();
        Ok(DiskBench {
            file,
            dst,
            src,
            nixl,
            uring,
            n,
            per_batch,
            file_path,
            total,
            out,
            back,
        })
    }

    /// The two executors, io_uring first.
    fn execs(&self) -> [&Executor; 2] {
        [&self.uring, &self.nixl]
    }

    /// One pass of every block through `e`: host to file (`write`) or
    /// file to host; returns the bytes moved.
    fn run(&self, e: &Executor, write: bool) -> Result<u64> {
        let (sp, dp) = (self.src.physical(), self.dst.physical());
        if write {
            run_batches(e, sp, &self.file, &self.out, self.per_batch, "G2->G3")
        } else {
            run_batches(e, &self.file, dp, &self.back, self.per_batch, "G3->G2")
        }
    }

    /// `reps` rounds of writes, each backend then the raw reference in
    /// turn: each backend's samples, the reference's, and the bytes of
    /// one write.
    fn writes(&self, reps: usize) -> Result<([Samples; 2], Samples, u64)> {
        let mut w = [Samples::default(), Samples::default()];
        let mut w_ref = Samples::default();
        let mut bytes = 0;
        for _ in 0..reps {
            for (s, e) in w.iter_mut().zip(self.execs()) {
                let (b, secs, cpu) = timed(|| self.run(e, true))?;
                bytes = b;
                s.push(b, secs, cpu);
            }
            let (g, _, cpu) = timed(|| reference_disk(&self.file_path, self.total, true))?;
            w_ref.push_reference(g, cpu, self.total);
        }
        Ok((w, w_ref, bytes))
    }

    /// `reps` rounds of reads, each backend then the raw reference in
    /// turn: each backend's samples and the reference's.
    fn reads(&self, reps: usize) -> Result<([Samples; 2], Samples)> {
        let mut r = [Samples::default(), Samples::default()];
        let mut r_ref = Samples::default();
        for _ in 0..reps {
            for (s, e) in r.iter_mut().zip(self.execs()) {
                let (b, secs, cpu) = timed(|| self.run(e, false))?;
                s.push(b, secs, cpu);
            }
            let (g, _, cpu) = timed(|| reference_disk(&self.file_path, self.total, false))?;
            r_ref.push_reference(g, cpu, self.total);
        }
        Ok((r, r_ref))
    }
}

/// The UCX row for one block size and batch: a pull of the matrix's
/// bytes between two agents of this process.
fn remote_row(
    config: &MatrixConfig,
    memcpy: &MemcpyBackend,
    tokens: usize,
    per_batch: usize,
) -> Result<MatrixRow> {
    let block_bytes = config.model.layout_config(1, tokens)?.block_bytes();
    let mut r = row(
        "G2->G2 nixl-ucx",
        "one large copy",
        tokens,
        block_bytes,
        per_batch,
    );
    let batches = (config.bytes_per_rep / (block_bytes * per_batch as u64)).max(1) as usize;
    let n = batches * per_batch;
    let cfg = config.model.layout_config(n, tokens)?;
    let src = HostTier::allocate(Layout::new(cfg, LayoutKind::FullyContiguous)?)?;
    let dst = HostTier::allocate(Layout::new(cfg, LayoutKind::FullyContiguous)?)?;
    for b in 0..n {
        // SAFETY: no transfer has been started on `src` yet.
        unsafe { src.fill(b, b as u64)? };
    }
    let remote_cfg = RemoteConfig {
        batch_blocks: per_batch,
    };
    let serving = NixlRemote::new("kvbm-bench-a", src.physical().clone(), remote_cfg.clone());
    let pulling = NixlRemote::new("kvbm-bench-b", dst.physical().clone(), remote_cfg);
    let (serving, pulling) = match (serving, pulling) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            r.status = format!("skipped: {e}");
            return Ok(r);
        }
    };
    let tb = |e: kvbm_transfer::nixl::RemoteError| BenchError::TransferFailed {
        path: "G2->G2".into(),
        detail: e.to_string(),
    };
    let peer = pulling.import(&serving.export().map_err(tb)?).map_err(tb)?;
    let perm = scatter(n, (tokens * 37 + per_batch) as u64);
    let pairs: Vec<(usize, usize)> = (0..n).map(|i| (perm[i], i)).collect();
    let mut s = Samples::default();
    let mut refs = Samples::default();
    let mut bytes = 0;
    let mut verified = false;
    for _ in 0..config.reps {
        let (b, secs, cpu) = timed(|| {
            let report = pulling
                .pull(&peer, &pairs)
                .map_err(tb)?
                .wait()
                .map_err(|f| BenchError::TransferFailed {
                    path: "G2->G2".into(),
                    detail: f.to_string(),
                })?;
            Ok(report.bytes)
        })?;
        bytes = b;
        s.push(b, secs, cpu);
        if !verified {
            check_pulled(&dst, &perm)?;
            verified = true;
        }
        let (g, _, cpu) = timed(|| reference_memcpy(memcpy, &src, &dst, bytes))?;
        refs.push_reference(g, cpu, bytes);
    }
    drop(pulling);
    drop(serving);
    Ok(finish(r, n, bytes, &s, &refs, verified))
}

/// Checks that every local block `i` of `dst`, pulled from remote block
/// `perm[i]`, holds the pattern of hash `perm[i]`.
fn check_pulled(dst: &HostTier, perm: &[usize]) -> Result<()> {
    for (i, &p) in perm.iter().enumerate() {
        // SAFETY: the pull was waited on; nothing writes `dst`.
        if let Some(m) = unsafe { dst.check(i, p as u64)? } {
            return Err(BenchError::Corrupt {
                block: p as u64,
                path: "G2->G2".into(),
                layer: m.layer,
                outer: m.outer,
                offset: m.offset,
            });
        }
    }
    Ok(())
}

/// Every NIXL row for the matrix's block sizes and batches.
pub fn run(
    config: &MatrixConfig,
    memcpy: &MemcpyBackend,
    progress: &mut dyn FnMut(&MatrixRow),
) -> Result<Vec<MatrixRow>> {
    let wanted = |p: &str| config.only.as_deref().is_none_or(|o| p.contains(o));
    let mut rows = Vec::new();
    for &tokens in &config.tokens_per_block {
        for &per_batch in &config.blocks_per_batch {
            if wanted("G2->G3 nixl-posix") || wanted("G3->G2 nixl-posix") {
                for r in disk_rows(config, tokens, per_batch)? {
                    progress(&r);
                    rows.push(r);
                }
            }
            if wanted("G2->G2 nixl-ucx") {
                let r = remote_row(config, memcpy, tokens, per_batch)?;
                progress(&r);
                rows.push(r);
            }
        }
    }
    Ok(rows)
}
