//! `kvbm-bench offload`: what a user of the tier engine gets when G1
//! blocks go to G2, idle and beside the model.
//!
//! The copier alone moves close to the host link's rate beside a GEMM
//! only when two copies are kept in flight (one at a time, each staged
//! copy's gather kernel waits alone for the SMs the GEMM holds). The tier
//! engine offloads in batches; `TierEngineBuilder::offload_in_flight` says
//! how many may be in flight. This bench times exactly what an engine
//! sees: `TierEngine::offload` of N registered G1 blocks through
//! `flush()`, over the engine's own mover (a `LocalMover` over the CUDA
//! executor), for each in-flight count and batch size, with the GPU idle
//! or running a bf16 8192³ GEMM loop on its own stream (the CUDA backend
//! then told `GpuLoad::Busy`).
//!
//! Every rep builds a fresh engine over the same G1 and G2 memory and the
//! row's executor (set up once, as an engine's is), so no block is skipped
//! as already present; G2 is cleared before each rep and
//! every offloaded block is checked byte for byte afterwards, so a block
//! that was never copied cannot pass. The engine's counters must say that
//! every block was copied and none skipped. The reference is one large
//! copy each way (pinned ↔ device) in the same run; every row gives its
//! ratio to the device → pinned one. Each row also reports the host CPU
//! each thread used over its timed reps (`thread_cpu`).

use std::sync::Arc;
use std::time::Instant;

use kvbm_layout::{BlockOrder, Layout, LayoutKind};
use kvbm_pool::tier::{LocalMover, OffloadMode, TierEngine, TierLayouts, TierPolicy};
use kvbm_transfer::{Executor, ExecutorSpec, PhysicalLayout};
use serde::Serialize;

use super::error::{BenchError, Result};
use super::host_view::{HostLayoutView, HostTier};
use super::model::KvModel;
use super::stats::Spread;
use super::thread_cpu::ThreadCpu;

#[cfg(feature = "cuda")]
mod gpu_side;
mod once;
mod sustained;

#[cfg(test)]
use self::once::check_g2;
use self::once::{Counted, offload_once, register_chain};

pub use sustained::Sustained;

/// Whether the model runs beside the offloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Load {
    /// Nothing else on the GPU.
    Idle,
    /// A bf16 8192³ GEMM loop for the whole timed window; the CUDA
    /// backend told `GpuLoad::Busy`.
    Busy,
}

impl Load {
    /// `idle` / `busy`.
    pub fn name(self) -> &'static str {
        match self {
            Load::Idle => "idle",
            Load::Busy => "busy",
        }
    }
}

/// The CUDA backend's copy path for the offloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuPath {
    /// The backend chooses per job (from the plan and the declared load).
    Auto,
    /// Forced: the device staging ring.
    Staged,
    /// Forced: the copy engines (no SMs).
    CopyEngine,
    /// Forced: the copy kernel reading and writing pinned memory.
    Kernel,
}

impl GpuPath {
    /// `auto` / `staged` / `copy-engine` / `kernel`.
    pub fn name(self) -> &'static str {
        match self {
            GpuPath::Auto => "auto",
            GpuPath::Staged => "staged",
            GpuPath::CopyEngine => "copy-engine",
            GpuPath::Kernel => "kernel",
        }
    }
}

/// How the offload bench is set up.
#[derive(Debug, Clone)]
pub struct OffloadConfig {
    /// KV shape.
    pub model: KvModel,
    /// Tokens per block to sweep.
    pub tokens_per_block: Vec<usize>,
    /// `offload_in_flight` values to sweep.
    pub in_flight: Vec<usize>,
    /// `offload_batch` values to sweep.
    pub batches: Vec<usize>,
    /// `offload_batch_bytes` (`None`: the engine's default).
    pub batch_bytes: Option<u64>,
    /// Loads to sweep (busy rows need a GPU and feature `gemm`).
    pub loads: Vec<Load>,
    /// At least this many bytes per rep (more when 8 batches of the
    /// largest batch size need more).
    pub min_bytes_per_rep: u64,
    /// Timed reps per row (after one warm-up).
    pub reps: usize,
    /// Bytes of each single-copy reference.
    pub reference_bytes: u64,
    /// memcpy worker threads (host G1).
    pub memcpy_threads: usize,
    /// Refuse to allocate more host memory than this.
    pub max_host_bytes: u64,
    /// G1 in host memory (memcpy; idle rows only) even with a GPU.
    pub host_g1: bool,
    /// The CUDA backend's path (GPU G1 only).
    pub gpu_path: GpuPath,
    /// Busy rows: also stream offloads (the engine's queue never drains)
    /// for this long beside the GEMM, against windows as long of the GEMM
    /// alone (see [`Sustained`]).
    pub sustain: Option<std::time::Duration>,
    /// Diagnostics (GPU G1): record the staged copies' timelines and keep
    /// those of each row's last rep in the row.
    pub timeline: bool,
}

/// One measured row.
#[derive(Debug, Clone, Serialize)]
pub struct OffloadRow {
    /// Tokens per block.
    pub tokens_per_block: usize,
    /// Bytes per block (from the layout).
    pub block_bytes: u64,
    /// Bytes of one contiguous chunk (one layer's K or V of a block).
    pub chunk_bytes: u64,
    /// `offload_in_flight`.
    pub in_flight: usize,
    /// `offload_batch`.
    pub batch: usize,
    /// Blocks per batch as the engine ran them (`offload_batch` capped so
    /// that the batches in flight hold at most a quarter of G1 and G2).
    pub batch_run: usize,
    /// idle / busy.
    pub load: Load,
    /// Blocks offloaded per rep.
    pub blocks: usize,
    /// Bytes offloaded per rep (the engine's count).
    pub bytes_per_rep: u64,
    /// Offload GB/s over the timed reps: `offload` through `flush`.
    pub gbps: Spread,
    /// Median ÷ the device → pinned reference.
    pub ratio_to_d2h: f64,
    /// GEMM TFLOP/s alone (busy rows): in the same GEMM loop as each
    /// timed rep, over a window of the rep's length just before the
    /// offload starts and another just after it ends (the mean of the
    /// two), so that alone and during see the same clocks.
    pub gemm_alone_tflops: Option<Spread>,
    /// GEMM TFLOP/s during the timed windows (busy rows).
    pub gemm_during_tflops: Option<Spread>,
    /// Median over the timed reps of 100 × (1 − during ÷ alone), each rep
    /// against its own alone windows.
    pub gemm_loss_pct: Option<f64>,
    /// The GPU load the CUDA backend was told during the timed windows.
    pub backend_load: Option<String>,
    /// Blocks the engine reported copied G1 → G2, summed over all reps
    /// (warm-up included).
    pub copied_blocks: u64,
    /// Offloads the engine reported skipped, summed over all reps.
    pub skipped_blocks: u64,
    /// Blocks checked byte for byte in G2, summed over all reps.
    pub verified_blocks: u64,
    /// `ok`, or why the row failed or was skipped.
    pub status: String,
    /// The sustained measurement (busy rows with `sustain`).
    pub sustained: Option<Sustained>,
    /// The staged copies' timelines of the last rep (with `timeline`).
    pub timeline: Option<String>,
    /// CPU time per thread over the timed reps (Linux), to show what the
    /// offloads cost the host (completion polling, the engine's worker);
    /// busy rows include the GEMM loop's launching thread.
    pub cpu: Option<ThreadCpu>,
}

impl OffloadRow {
    /// True when the row failed (wrong bytes, blocks not copied).
    pub fn failed(&self) -> bool {
        self.status.starts_with("FAILED")
    }
}

/// One single-copy reference.
#[derive(Debug, Clone, Serialize)]
pub struct Reference {
    /// What was copied.
    pub what: String,
    /// Bytes per copy.
    pub bytes: u64,
    /// GB/s over the reps.
    pub gbps: Spread,
}

/// Everything the offload bench reports.
#[derive(Debug, Clone, Serialize)]
pub struct OffloadReport {
    /// KV shape.
    pub model: KvModel,
    /// What G1 and G2 are.
    pub memory: String,
    /// Host → device (or host → host) single copy.
    pub reference_h2d: Reference,
    /// Device → host (or host → host) single copy: the rows' ratios.
    pub reference_d2h: Reference,
    /// Timed reps per row.
    pub reps: usize,
    /// Notes (rows left out and why).
    pub notes: Vec<String>,
    /// The rows.
    pub rows: Vec<OffloadRow>,
}

impl OffloadReport {
    /// Rows that failed.
    pub fn failures(&self) -> usize {
        self.rows.iter().filter(|r| r.failed()).count()
    }
}

/// What the bench ran on, or why it did not run.
pub enum Outcome {
    /// The report.
    Ran(Box<OffloadReport>),
    /// No GPU and no `--host-g1`: nothing to measure.
    NoDevice,
}

/// The sequence hash of G1 block `block` of a shape (a chain in block
/// order; the bytes are a function of it).
fn hash_of(tokens: usize, block: usize) -> u64 {
    0x6f66_666c_0000_0000 ^ ((tokens as u64) << 40) ^ block as u64
}

/// Blocks per rep for a shape: 8 batches of the largest batch size, and
/// at least `min_bytes`.
pub fn blocks_per_rep(block_bytes: u64, max_batch: usize, min_bytes: u64) -> usize {
    let by_bytes = min_bytes.div_ceil(block_bytes.max(1)) as usize;
    (8 * max_batch).max(by_bytes).max(1)
}

/// G1 and G2 of one shape, and what the engine needs per rep.
struct Shape {
    g1: PhysicalLayout,
    g2: PhysicalLayout,
    g2_view: HostLayoutView,
    blocks: usize,
    tokens: usize,
    block_bytes: u64,
    chunk_bytes: u64,
}

/// What runs the copies: the host (memcpy) or a GPU.
enum Side {
    Host {
        threads: usize,
    },
    #[cfg(feature = "cuda")]
    Gpu(Box<gpu_side::GpuSide>),
}

impl Side {
    fn executor(&self) -> Result<(Executor, Option<Backend>)> {
        match self {
            Side::Host { threads } => {
                Ok((ExecutorSpec::host().memcpy_threads(*threads).build()?, None))
            }
            #[cfg(feature = "cuda")]
            Side::Gpu(g) => g.executor().map(|(e, b)| (e, Some(b))),
        }
    }
}

#[cfg(feature = "cuda")]
type Backend = Arc<kvbm_transfer::cuda::CudaBackend>;
#[cfg(not(feature = "cuda"))]
type Backend = std::convert::Infallible;

fn tier_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Tier(e.to_string())
}

/// The threads to check and clear host memory on.
fn cpu_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get().min(16))
}

/// Runs the bench; `progress(row)` is called after each row.
pub fn run_offload(cfg: &OffloadConfig, mut progress: impl FnMut(&OffloadRow)) -> Result<Outcome> {
    if cfg.reps == 0 || cfg.in_flight.contains(&0) || cfg.batches.contains(&0) {
        return Err(BenchError::Config(
            "reps, in-flight counts and batch sizes must be at least 1".into(),
        ));
    }
    let mut notes = Vec::new();
    #[cfg(feature = "cuda")]
    let side = match (cfg.host_g1, super::replay::gpu::device()) {
        (false, Some(dev)) => Side::Gpu(Box::new(gpu_side::GpuSide::new(dev, cfg)?)),
        (false, None) => return Ok(Outcome::NoDevice),
        (true, _) => Side::Host {
            threads: cfg.memcpy_threads,
        },
    };
    #[cfg(not(feature = "cuda"))]
    let side = if cfg.host_g1 {
        Side::Host {
            threads: cfg.memcpy_threads,
        }
    } else {
        return Ok(Outcome::NoDevice);
    };
    let (memory, reference_h2d, reference_d2h) = match &side {
        Side::Host { .. } => {
            notes.push("host G1 (memcpy): idle rows only".into());
            let (h2d, d2h) = host_references(cfg)?;
            (
                "G1 host memory (engine layout, layer-separate K/V), G2 host memory, memcpy"
                    .to_string(),
                h2d,
                d2h,
            )
        }
        #[cfg(feature = "cuda")]
        Side::Gpu(g) => {
            if cfg.gpu_path != GpuPath::Auto {
                notes.push(format!("CUDA copy path forced: {}", cfg.gpu_path.name()));
            }
            let (h2d, d2h) = g.references(cfg)?;
            (g.memory(), h2d, d2h)
        }
    };
    let max_batch = cfg.batches.iter().copied().max().unwrap_or(1);
    let mut rows = Vec::new();
    for &tokens in &cfg.tokens_per_block {
        let layout_cfg = cfg.model.layout_config(1, tokens)?;
        let block_bytes = layout_cfg.block_bytes();
        let blocks = blocks_per_rep(block_bytes, max_batch, cfg.min_bytes_per_rep);
        let shape = allocate_shape(cfg, &side, tokens, blocks)?;
        for &load in &cfg.loads {
            if load == Load::Busy && matches!(side, Side::Host { .. }) {
                continue;
            }
            for &batch in &cfg.batches {
                for &in_flight in &cfg.in_flight {
                    let row = run_row(cfg, &side, &shape, in_flight, batch, load, &reference_d2h)?;
                    progress(&row);
                    rows.push(row);
                }
            }
        }
    }
    Ok(Outcome::Ran(Box::new(OffloadReport {
        model: cfg.model,
        memory,
        reference_h2d,
        reference_d2h,
        reps: cfg.reps,
        notes,
        rows,
    })))
}

fn allocate_shape(cfg: &OffloadConfig, side: &Side, tokens: usize, blocks: usize) -> Result<Shape> {
    let lc = cfg.model.layout_config(blocks, tokens)?;
    let g1_layout = Layout::new(lc, LayoutKind::LayerSeparate(BlockOrder::OuterFirst))?;
    let g2_layout = Layout::new(lc, LayoutKind::FullyContiguous)?;
    let bytes = lc.block_bytes() * blocks as u64;
    let host_bytes = match side {
        Side::Host { .. } => 2 * bytes,
        #[cfg(feature = "cuda")]
        Side::Gpu(_) => bytes,
    };
    if host_bytes > cfg.max_host_bytes {
        return Err(BenchError::Config(format!(
            "{tokens} tokens per block: {blocks} blocks need {:.2} GiB of host memory (limit {:.2} GiB): lower --mib or the batch sizes, or raise --max-host-gib",
            host_bytes as f64 / (1u64 << 30) as f64,
            cfg.max_host_bytes as f64 / (1u64 << 30) as f64
        )));
    }
    let hash = |b: usize| hash_of(tokens, b);
    let (g1, g2) = match side {
        Side::Host { .. } => {
            let g1 = HostTier::allocate(g1_layout)?;
            for b in 0..blocks {
                // SAFETY: the memory was just allocated; no transfer and no
                // other thread can see it yet.
                unsafe { g1.fill(b, hash(b))? };
            }
            let g2 = HostTier::allocate(g2_layout)?;
            (g1.physical().clone(), g2.physical().clone())
        }
        #[cfg(feature = "cuda")]
        Side::Gpu(g) => g.shape(g1_layout, g2_layout, hash)?,
    };
    Ok(Shape {
        g2_view: HostLayoutView::new(g2.clone())?,
        g1,
        g2,
        blocks,
        tokens,
        block_bytes: lc.block_bytes(),
        chunk_bytes: lc.chunk_bytes(),
    })
}

/// What one rep measured.
struct Rep {
    /// The timed window: `offload` called, `flush` returned (read for
    /// the GEMM's rate inside it).
    #[cfg_attr(not(all(feature = "cuda", feature = "gemm")), allow(dead_code))]
    window: (Instant, Instant),
    secs: f64,
    bytes: u64,
    copied: u64,
    skipped: u64,
    verified: u64,
    /// Rounds of offloads in the window (1 but in sustained measurements,
    /// which need a GPU).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    rounds: u64,
    /// GEMM TFLOP/s inside the window (busy reps).
    gemm_tflops: Option<f64>,
    /// GEMM TFLOP/s in the windows just before and after it (busy reps).
    gemm_alone_tflops: Option<f64>,
    backend_load: Option<String>,
    failure: Option<String>,
    /// CPU time per thread over the window.
    cpu: Option<ThreadCpu>,
}

/// What every rep of one row runs with.
struct RowRun<'a> {
    cfg: &'a OffloadConfig,
    shape: &'a Shape,
    in_flight: usize,
    batch: usize,
    load: Load,
    /// The row's executor, shared by every rep's engine.
    executor: Executor,
    /// The CUDA backend behind `executor` (none on the host).
    backend: Option<Backend>,
    /// The GEMM busy rows run beside.
    #[cfg(feature = "cuda")]
    gemm: Option<&'a gpu_side::Gemm>,
}

/// What a row's reps measured, rep by rep.
#[derive(Default)]
struct Seen {
    /// Each rep's offload seconds, the warm-up's too: the GEMM's alone
    /// windows last as long as the last offload did (50 ms before the
    /// first).
    secs: Vec<f64>,
    /// GB/s of each timed rep.
    gbps: Vec<f64>,
    /// GEMM TFLOP/s inside each timed window (busy reps).
    tflops: Vec<f64>,
    /// GEMM TFLOP/s around each timed window (busy reps).
    alone: Vec<f64>,
    /// The GEMM's loss to the offload in each timed window, percent.
    losses: Vec<f64>,
}

impl Seen {
    /// Adds timed rep `r`; its CPU time goes to `row`.
    fn add(&mut self, r: &Rep, row: &mut OffloadRow) {
        self.gbps.push(r.bytes as f64 / r.secs / 1e9);
        if let Some(c) = &r.cpu {
            row.cpu.get_or_insert_with(ThreadCpu::default).merge(c);
        }
        self.tflops.extend(r.gemm_tflops);
        self.alone.extend(r.gemm_alone_tflops);
        if let (Some(d), Some(a)) = (r.gemm_tflops, r.gemm_alone_tflops.filter(|a| *a > 0.0)) {
            self.losses.push(100.0 * (1.0 - d / a));
        }
    }

    /// Sets `row`'s GEMM figures from the timed reps (none when idle).
    fn gemm_figures(&self, row: &mut OffloadRow) {
        if !self.tflops.is_empty() {
            row.gemm_during_tflops = Some(Spread::of(&self.tflops));
        }
        if !self.alone.is_empty() {
            row.gemm_alone_tflops = Some(Spread::of(&self.alone));
        }
        if !self.losses.is_empty() {
            row.gemm_loss_pct = Some(Spread::of(&self.losses).median);
        }
    }
}

/// A row of `shape` with nothing measured yet, status "ok".
fn empty_row(shape: &Shape, in_flight: usize, batch: usize, load: Load) -> OffloadRow {
    OffloadRow {
        tokens_per_block: shape.tokens,
        block_bytes: shape.block_bytes,
        chunk_bytes: shape.chunk_bytes,
        in_flight,
        batch,
        batch_run: 0,
        load,
        blocks: shape.blocks,
        bytes_per_rep: 0,
        gbps: Spread::of(&[]),
        ratio_to_d2h: 0.0,
        gemm_alone_tflops: None,
        gemm_during_tflops: None,
        gemm_loss_pct: None,
        backend_load: None,
        copied_blocks: 0,
        skipped_blocks: 0,
        verified_blocks: 0,
        status: "ok".into(),
        sustained: None,
        timeline: None,
        cpu: None,
    }
}

/// Measures one row: a warm-up rep and `cfg.reps` timed ones, each over a
/// fresh engine, then (with `--sustain`, busy) the sustained offload.
#[allow(clippy::too_many_arguments)]
fn run_row(
    cfg: &OffloadConfig,
    side: &Side,
    shape: &Shape,
    in_flight: usize,
    batch: usize,
    load: Load,
    d2h: &Reference,
) -> Result<OffloadRow> {
    let mut row = empty_row(shape, in_flight, batch, load);
    #[cfg(feature = "cuda")]
    let gemm = match (load, side) {
        (Load::Busy, Side::Gpu(g)) => match g.gemm() {
            Ok(gemm) => {
                gpu_side::warm_up(gemm);
                Some(gemm)
            }
            Err(why) => {
                row.status = format!("skipped: {why}");
                return Ok(row);
            }
        },
        _ => None,
    };
    // One executor for the row, as an engine keeps one: the CUDA copier's
    // pinned descriptor buffers and staging ring are set up by the warm-up
    // rep, not in every timed one (a fresh copier spent 1.5 ms on its first
    // copy on the H200 machine, 7 % of a 1 GiB rep).
    let (executor, backend) = side.executor()?;
    let run = RowRun {
        cfg,
        shape,
        in_flight,
        batch,
        load,
        executor,
        backend,
        #[cfg(feature = "cuda")]
        gemm,
    };
    let mut seen = Seen::default();
    for rep in 0..=cfg.reps {
        if !run.rep(rep, &mut row, &mut seen)? {
            break;
        }
    }
    row.gbps = Spread::of(&seen.gbps);
    if d2h.gbps.median > 0.0 {
        row.ratio_to_d2h = row.gbps.median / d2h.gbps.median;
    }
    #[cfg(feature = "cuda")]
    run.sustain(&mut row, d2h)?;
    seen.gemm_figures(&mut row);
    Ok(row)
}

impl RowRun<'_> {
    /// A fresh engine over the row's shape and executor.
    fn engine(&self) -> Result<TierEngine> {
        engine_for(
            self.executor.clone(),
            self.shape,
            self.in_flight,
            self.batch,
            self.cfg.batch_bytes,
        )
    }

    /// Runs rep `rep` (0: the warm-up) and adds what it did to `row` and
    /// `seen`; false when it failed, which ends the row.
    fn rep(&self, rep: usize, row: &mut OffloadRow, seen: &mut Seen) -> Result<bool> {
        let engine = self.engine()?;
        row.batch_run = engine.offload_batch_limit();
        // SAFETY: the previous rep's engine is gone (its worker joined on
        // drop, after its flush), so nothing writes G2 now.
        unsafe { self.shape.g2_view.zero(cpu_threads()) };
        let r = self.timed(&engine, seen)?;
        // The engine goes at the end of the rep (its worker joined, every
        // copy landed), before the next rep clears G2.
        if self.cfg.timeline {
            row.timeline = self.backend.as_ref().and_then(take_timeline);
        }
        row.bytes_per_rep = r.bytes;
        row.copied_blocks += r.copied;
        row.skipped_blocks += r.skipped;
        row.verified_blocks += r.verified;
        if r.backend_load.is_some() {
            row.backend_load = r.backend_load.clone();
        }
        if let Some(f) = &r.failure {
            row.status = format!("FAILED (rep {rep}): {f}");
            return Ok(false);
        }
        seen.secs.push(r.secs);
        if rep > 0 {
            seen.add(&r, row);
        }
        Ok(true)
    }

    /// One timed offload through `engine`, idle or beside the GEMM.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn timed(&self, engine: &TierEngine, seen: &Seen) -> Result<Rep> {
        let timed = || offload_once(engine, self.shape);
        match self.load {
            Load::Idle => {
                let mut r = timed()?;
                r.backend_load = self.backend.as_ref().map(backend_load_name);
                Ok(r)
            }
            #[cfg(feature = "cuda")]
            Load::Busy => match (self.gemm, self.backend.as_ref()) {
                (Some(g), Some(b)) => {
                    let window = std::time::Duration::from_secs_f64(
                        seen.secs
                            .last()
                            .copied()
                            .unwrap_or(0.05f64)
                            .clamp(0.03, 1.0),
                    );
                    gpu_side::beside_gemm(g, b, window, timed)
                }
                _ => unreachable_busy(),
            },
            #[cfg(not(feature = "cuda"))]
            Load::Busy => unreachable_busy(),
        }
    }

    /// With `--sustain`, on a busy row that has not failed: offloads for
    /// the span beside the GEMM and records the sustained figures.
    #[cfg(feature = "cuda")]
    fn sustain(&self, row: &mut OffloadRow, d2h: &Reference) -> Result<()> {
        if let (Some(span), Some(g), false) = (self.cfg.sustain, self.gemm, row.failed()) {
            let engine = self.engine()?;
            if let Some(b) = self.backend.as_ref() {
                let r = gpu_side::beside_gemm(g, b, span, || {
                    sustained::offload_for(&engine, self.shape, span)
                })?;
                match sustained::Sustained::of(&r, d2h) {
                    Ok(s) => row.sustained = Some(s),
                    Err(why) => row.status = format!("FAILED (sustained): {why}"),
                }
            }
        }
        Ok(())
    }
}

/// A fresh engine over the shape's G1 and G2 (WriteThrough, no G3), moved
/// by `executor`.
fn engine_for(
    executor: Executor,
    shape: &Shape,
    in_flight: usize,
    batch: usize,
    batch_bytes: Option<u64>,
) -> Result<TierEngine> {
    let layouts = TierLayouts {
        g1: shape.g1.clone(),
        g2: Some(shape.g2.clone()),
        g3: None,
    };
    let mover = LocalMover::new(layouts, executor).map_err(tier_err)?;
    let mut builder = TierEngine::builder_with_mover(Arc::new(mover), shape.tokens)
        .offload_mode(OffloadMode::WriteThrough)
        .g2_policy(TierPolicy::WriteThrough)
        .offload_in_flight(in_flight)
        .offload_limits(batch, shape.blocks);
    if let Some(bytes) = batch_bytes {
        builder = builder.offload_batch_bytes(bytes);
    }
    builder.build().map_err(tier_err)
}

/// The staged copies' timelines recorded since the last call.
#[cfg(feature = "cuda")]
fn take_timeline(backend: &Backend) -> Option<String> {
    backend.copier().take_timeline()
}

#[cfg(not(feature = "cuda"))]
fn take_timeline(backend: &Backend) -> Option<String> {
    match *backend {}
}

#[cfg(feature = "cuda")]
fn backend_load_name(backend: &Backend) -> String {
    gpu_side::load_name(backend)
}

#[cfg(not(feature = "cuda"))]
fn backend_load_name(backend: &Backend) -> String {
    match *backend {}
}

fn unreachable_busy() -> Result<Rep> {
    Err(BenchError::Config(
        "busy rows need a GPU and the GEMM (feature gemm)".into(),
    ))
}

/// Host references: one large copy between two host buffers, each way
/// (the same thing both ways; kept as two for the report's shape).
fn host_references(cfg: &OffloadConfig) -> Result<(Reference, Reference)> {
    let bytes = cfg.reference_bytes.max(1) as usize;
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut dst = vec![0u8; bytes];
    let mut samples = Vec::new();
    for rep in 0..=cfg.reps {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        let secs = t.elapsed().as_secs_f64().max(1e-9);
        std::hint::black_box(&dst);
        if rep > 0 {
            samples.push(bytes as f64 / secs / 1e9);
        }
    }
    let r = |what: &str| Reference {
        what: what.into(),
        bytes: bytes as u64,
        gbps: Spread::of(&samples),
    };
    Ok((
        r("one host -> host copy (one thread)"),
        r("one host -> host copy (one thread)"),
    ))
}

#[cfg(test)]
mod tests;
