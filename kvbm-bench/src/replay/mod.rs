//! The trace replay: a workload driven through real tiers with real bytes,
//! next to LRU and Belady's optimum at the same capacities.
//!
//! Capacities are fractions of the workload's distinct blocks, as in the
//! simulators ([`crate::sim::capacity_for`]). Hit rates count the trace's
//! blocks (e.g. 512 tokens each); the bytes that move are those of the
//! model's KV for `block_tokens / scale` tokens, so a trace whose real KV
//! would need terabytes still runs on a small machine. What the report
//! calls "tokens of prefill avoided" are trace tokens; the modelled TTFT
//! saving divides them by a prefill rate the user states.
//!
//! The data plane is kvbm-pool's tier engine, driven by
//! [`engine::EngineDriver`]; the simulators give the references. The
//! tensor-parallel replay can crash and restart its whole instance over a
//! kept G3 ([`restart`]), next to an uninterrupted run of the same
//! configuration.

pub mod dist;
pub mod engine;
pub mod failures;
#[cfg(feature = "cuda")]
pub mod gpu;
mod knobs;
pub mod latency;
mod local;
mod refs;
pub mod restart;

use std::path::PathBuf;
use std::time::Instant;

use kvbm_layout::{BlockOrder, Layout, LayoutKind};
use kvbm_pool::tier::{LoadCost, OffloadMode, TierPolicy};
use serde::Serialize;

use self::engine::{EngineDriver, PATHS, RequestOutcome};
pub use self::failures::{FailureRow, G3Faults};
pub use self::knobs::TierKnobs;
pub use self::restart::{RestartReport, Restarts};
use super::error::{BenchError, Result};
use super::model::{KvModel, check_disk_alignment};
use super::stats::percentile;
use crate::sim::{Tier, capacity_for};
use kvbm_testkit::trace::{Request, TraceFacts};

/// How a replay is set up.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// What the workload is, for the report.
    pub workload: String,
    /// The requests, in arrival order.
    pub requests: Vec<Request>,
    /// Tokens per trace block.
    pub block_tokens: u32,
    /// KV shape.
    pub model: KvModel,
    /// Blocks are stored with `block_tokens / scale` tokens.
    pub scale: u32,
    /// G1, G2, G3 capacities as fractions of the distinct blocks.
    pub fractions: [f64; 3],
    /// Prefill rate for the modelled TTFT saving, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// memcpy worker threads.
    pub memcpy_threads: usize,
    /// Directory for the G3 file.
    pub disk_dir: PathBuf,
    /// Refuse to allocate more host memory than this (bytes).
    pub max_host_bytes: u64,
    /// Admission and eviction in G2 and G3.
    pub policy: TierPolicy,
    /// When G1's blocks are copied to G2: as G1 evicts them (the engine's
    /// default) or as they are registered.
    pub offload_mode: OffloadMode,
    /// Keep G1 in host memory even when a GPU is present.
    pub host_g1: bool,
    /// Total capacities (fractions of distinct blocks) to sweep with the
    /// simulators; empty for none.
    pub sweep: Vec<f64>,
    /// Tensor-parallel ranks: 0 runs the engine in this process; N > 0
    /// runs the leader here and N worker processes, each holding a 1/N
    /// slice of every block (see [`dist`]).
    pub workers: u32,
    /// The worker executable; `None` for the default
    /// ([`dist::find_node_exe`]).
    pub worker_exe: Option<PathBuf>,
    /// The engine's `offload_in_flight`; `None` for its default.
    pub offload_in_flight: Option<usize>,
    /// The engine's `g1_free_reserve` (write-back: G1 slots kept free ahead
    /// of need); `None` for its default.
    pub g1_free_reserve: Option<usize>,
    /// Fault injection for tests of failure reporting (host tiers in this
    /// process only); none in every real run.
    pub g3_faults: G3Faults,
    /// Host memory for G3 prefetch staging, in whole blocks, allocated
    /// beyond G2's capacity (0: no prefetch; ignored with workers or
    /// without G2 or G3).
    pub g3_staging_bytes: u64,
    /// Let the engine leave blocks to recompute whose load would be slower
    /// than recomputing them at `prefill_tokens_per_s` (its cost model).
    pub decline_slow_loads: bool,
    /// Whole-instance restarts over a kept G3 (tensor-parallel replay
    /// only; see [`restart`]); none by default.
    pub restarts: Restarts,
}

/// Hits and rates of one tier.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct TierHits {
    /// Tier name.
    pub tier: &'static str,
    /// Capacity in blocks.
    pub capacity_blocks: usize,
    /// Prefix hits served.
    pub hits: u64,
    /// Hits ÷ block references, percent.
    pub hit_rate_pct: f64,
}

/// Bytes and speed of one path.
#[derive(Debug, Clone, Serialize)]
pub struct PathReport {
    /// `G1->G2` etc.
    pub path: &'static str,
    /// Blocks moved.
    pub blocks: u64,
    /// Bytes moved (copy planner's count).
    pub bytes: u64,
    /// Bytes ÷ time over the phases in which this path alone moved bytes
    /// (0 when it never did), GB/s.
    pub gbps: f64,
}

/// One capacity point of the simulator sweep.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SweepPoint {
    /// Total capacity as a fraction of distinct blocks.
    pub fraction: f64,
    /// Total capacity in blocks (G1 + G2 + G3).
    pub capacity_blocks: usize,
    /// The engine's default policy (reuse score) in the tiered simulator.
    pub tiered_reuse_pct: f64,
    /// LRU victim tiers in the tiered simulator.
    pub tiered_lru_pct: f64,
    /// One LRU cache of the same total size.
    pub lru_pct: f64,
    /// Belady's optimum of the same total size.
    pub belady_pct: f64,
}

/// Everything a replay reports.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// Workload description.
    pub workload: String,
    /// Requests replayed.
    pub requests: usize,
    /// Prompt block references.
    pub block_references: u64,
    /// Distinct blocks.
    pub unique_blocks: usize,
    /// Tokens per trace block.
    pub block_tokens: u32,
    /// KV shape.
    pub model: KvModel,
    /// Shrink factor.
    pub scale: u32,
    /// Tokens actually stored per block.
    pub stored_tokens_per_block: usize,
    /// Bytes per stored block (from the layout).
    pub block_bytes: u64,
    /// What G1 is.
    pub g1_memory: String,
    /// What decides placement.
    pub placement: String,
    /// Per-tier hits.
    pub tiers: Vec<TierHits>,
    /// All hits ÷ references, percent.
    pub hit_rate_pct: f64,
    /// Prompt tokens of all requests.
    pub prompt_tokens: u64,
    /// Prefill tokens avoided by G1 (the engine's own prefix cache).
    pub tokens_avoided_g1: u64,
    /// Prefill tokens avoided by kvbm (G2 + G3 hits).
    pub tokens_avoided_kvbm: u64,
    /// Prefill rate assumed, tokens/s.
    pub prefill_tokens_per_s: f64,
    /// kvbm tokens avoided ÷ prefill rate, seconds over the whole trace.
    pub modelled_ttft_saving_s: f64,
    /// Onboard wall time summed over requests (the cost of that saving).
    pub onboard_total_s: f64,
    /// Per-path bytes and speed.
    pub paths: Vec<PathReport>,
    /// All onboard phases together (G2 and G3 → G1, mixed), GB/s.
    pub onboard_gbps: f64,
    /// All offload phases together (G1 → G2 and G2 → G3, mixed), GB/s.
    pub offload_gbps: f64,
    /// Offloads the engine's policy skipped (admission refused, target
    /// tier full, queue full, ...): decisions, not failures.
    pub offloads_skipped: u64,
    /// Blocks whose offload copy failed (G1->G2, G2->G3, G1->G3): not
    /// stored, not among `offloads_skipped`.
    pub offload_failures: u64,
    /// Blocks whose onboard copy failed (G2->G1, G3->G1).
    pub onboard_failures: u64,
    /// Requests whose onboard failed: their blocks were computed again and
    /// count as misses.
    pub failed_onboards: usize,
    /// Copy failures by path and OS error.
    pub copy_failures: Vec<FailureRow>,
    /// What failed, in one line; `None` when nothing did.
    pub failure_summary: Option<String>,
    /// Requests that onboarded from G2/G3.
    pub onboards: usize,
    /// Onboard latency median, milliseconds.
    pub onboard_p50_ms: f64,
    /// Onboard latency 99th percentile, milliseconds.
    pub onboard_p99_ms: f64,
    /// Onboarded blocks whose bytes were checked.
    pub verified_blocks: u64,
    /// G3 prefetch staging blocks (0: onboards read G3 straight into G1).
    pub g3_staging_blocks: usize,
    /// Whether the engine's cost model could decline slow loads.
    pub decline_slow_loads: bool,
    /// Matched blocks the cost model left to recompute.
    pub declined_blocks: u64,
    /// Onboard latency against recompute time, and the G3 onboard rate
    /// against the disk's raw read rate.
    pub onboard_cost: latency::OnboardCost,
    /// The tiered simulator with reuse-score G2/G3 at the same capacities.
    pub sim_reuse_hit_rate_pct: f64,
    /// The tiered simulator with LRU victim G2/G3 at the same capacities.
    pub sim_lru_tiers_hit_rate_pct: f64,
    /// One LRU cache of capacity G1 + G2 + G3.
    pub lru_hit_rate_pct: f64,
    /// Belady's optimum of capacity G1 + G2 + G3.
    pub belady_hit_rate_pct: f64,
    /// The simulator sweep, when asked for.
    pub sweep: Vec<SweepPoint>,
    /// Wall time of the data-plane replay, seconds.
    pub wall_s: f64,
    /// With restarts: what they cost against an uninterrupted run of the
    /// same configuration.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restarts: Option<RestartReport>,
}

/// Tokens of prefill a request's hit prefix avoids, per tier: each hit
/// block saves its tokens; when the whole prompt hits, the last token is
/// still computed (the engine needs its logits).
fn tokens_avoided(request: &Request, block_tokens: u32, tiers: &[Tier]) -> [u64; 3] {
    let mut out = [0u64; 3];
    let len = u64::from(request.input_length);
    let bt = u64::from(block_tokens);
    for (i, t) in tiers.iter().enumerate() {
        let start = i as u64 * bt;
        let end = ((i as u64 + 1) * bt).min(len);
        out[*t as usize] += end.saturating_sub(start);
    }
    let total: u64 = out.iter().sum();
    if total == len && len > 0 {
        // Take the recomputed token from the last hit's tier.
        if let Some(t) = tiers.last() {
            out[*t as usize] -= 1;
        }
    }
    out
}

fn phase_gbps((bytes, secs): (u64, f64)) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

/// What a replay's tiers are sized to, checked against the machine.
pub(crate) struct Plan {
    /// The workload's figures.
    pub(crate) facts: TraceFacts,
    /// Tokens stored per block.
    pub(crate) page: usize,
    /// G1, G2, G3 capacities in blocks.
    pub(crate) caps: [usize; 3],
    /// Bytes of one stored block.
    pub(crate) block_bytes: u64,
    /// Blocks of G3 prefetch staging, allocated after G2's pool in its
    /// memory (0: none).
    pub(crate) staging: usize,
    /// The engine's knobs.
    pub(crate) knobs: TierKnobs,
}

/// Checks `cfg`, sizes the tiers and prepares the disk directory (cleared
/// of the files of killed runs).
pub(crate) fn plan(cfg: &ReplayConfig) -> Result<Plan> {
    if cfg.fractions.iter().any(|f| !f.is_finite() || *f < 0.0) {
        return Err(BenchError::Config(
            "capacity fractions must be finite and non-negative".into(),
        ));
    }
    if !(cfg.prefill_tokens_per_s.is_finite() && cfg.prefill_tokens_per_s > 0.0) {
        return Err(BenchError::Config("--prefill-rate must be positive".into()));
    }
    let requests = &cfg.requests;
    if requests.is_empty() {
        return Err(BenchError::Config("the workload has no requests".into()));
    }
    if cfg.restarts.any() && cfg.workers == 0 {
        return Err(BenchError::Config(
            "--restarts restarts the worker processes over their kept G3: give --workers 1 or more"
                .into(),
        ));
    }
    let facts = TraceFacts::of(requests);
    let page = cfg.model.scaled_page(cfg.block_tokens, cfg.scale)?;
    check_disk_alignment(&cfg.model, page)?; // G1 must hold the longest request while it runs.
    let longest = requests.iter().map(|r| r.hash_ids.len()).max().unwrap_or(0);
    let caps = [
        capacity_for(cfg.fractions[0], facts.unique_blocks).max(longest + 1),
        capacity_for(cfg.fractions[1], facts.unique_blocks),
        capacity_for(cfg.fractions[2], facts.unique_blocks),
    ];
    let block_bytes = cfg.model.layout_config(1, page)?.block_bytes();
    let staging = if cfg.workers == 0 && caps[1] > 0 && caps[2] > 0 {
        usize::try_from(cfg.g3_staging_bytes / block_bytes).unwrap_or(usize::MAX)
    } else {
        0
    };
    let host_bytes = (caps[0] + caps[1] + staging) as u64 * block_bytes;
    if host_bytes > cfg.max_host_bytes {
        return Err(BenchError::Config(format!(
            "G1 + G2 would need {:.2} GiB of host memory (limit {:.2} GiB): raise --scale, lower the capacities, or pass --max-host-gib",
            host_bytes as f64 / (1u64 << 30) as f64,
            cfg.max_host_bytes as f64 / (1u64 << 30) as f64
        )));
    }
    // The engine counts a trace block's tokens; its bytes are those of
    // `page` stored tokens. Recomputing `scale` times faster keeps the
    // comparison per stored token, as the report makes it.
    let load_cost = cfg
        .decline_slow_loads
        .then(|| LoadCost::recompute_at(cfg.prefill_tokens_per_s * f64::from(cfg.scale)));
    let knobs = TierKnobs {
        block_tokens: cfg.block_tokens as usize,
        policy: cfg.policy,
        offload_mode: cfg.offload_mode,
        // The staging blocks after G2's pool, which the in-process replay
        // allocates (none with workers).
        g3_staging_bytes: staging as u64 * block_bytes,
        load_cost,
        g1_free_reserve: cfg.g1_free_reserve,
        offload_in_flight: cfg.offload_in_flight,
    };
    if caps[2] > 0 || cfg.workers > 0 {
        crate::disk_dir::prepare(&cfg.disk_dir)?;
        crate::disk_dir::remove_stale(&cfg.disk_dir)?;
    }
    crate::shutdown::check()?;
    Ok(Plan {
        facts,
        page,
        caps,
        block_bytes,
        staging,
        knobs,
    })
}

/// Runs the replay; `progress(done, total)` is called after each request
/// (with restarts over both passes, the uninterrupted reference first).
pub fn run_replay(
    cfg: &ReplayConfig,
    mut progress: impl FnMut(usize, usize),
) -> Result<ReplayReport> {
    let n = cfg.requests.len();
    let points = cfg.restarts.points(n)?;
    let plan = plan(cfg)?;
    // With restarts: the same configuration without them first, as the
    // reference (its G3 kept the same way, in a directory of its own).
    let reference = if cfg.restarts.any() {
        Some(data_plane(cfg, &plan, Some(Vec::new()), &mut |done| {
            progress(done, 2 * n)
        })?)
    } else {
        None
    };
    let before = if reference.is_some() { n } else { 0 };
    let kept = cfg.restarts.any().then_some(points);
    let mut pass = data_plane(cfg, &plan, kept, &mut |done| {
        progress(before + done, before + n)
    })?;
    refs::fill(&mut pass.report, cfg, plan.caps, plan.facts.unique_blocks);
    crate::shutdown::check()?;
    if let (Some(reference), Some(log)) = (reference, pass.log) {
        pass.report.restarts = Some(restart::report(
            cfg.restarts,
            &cfg.requests,
            log,
            &pass.per_request,
            pass.report.verified_blocks,
            pass.g3_unreadable,
            &reference.per_request,
            reference.report.verified_blocks,
            reference.report.wall_s,
        ));
    }
    Ok(pass.report)
}

/// One pass of the data plane over the trace.
struct Pass {
    /// Its report, the simulators' figures left at 0.
    report: ReplayReport,
    /// Blocks each request hit in G1, G2 and G3.
    per_request: Vec<[u32; 3]>,
    /// With a kept G3: its restarts and directories.
    log: Option<restart::Log>,
    /// G3 blocks whose read failed, over all its engines.
    g3_unreadable: u64,
}

/// What must outlive a pass's engine, dropped in this order after it: the
/// guard that removes the G3 file of a run stopped by force, the restarter
/// of a kept G3, and the leader and workers (the leader shuts the workers
/// down when dropped).
struct Instance {
    g3_guard: Option<crate::shutdown::Guard>,
    restarter: Option<restart::Restarter>,
    cluster: Option<dist::Cluster>,
}

/// A pass's started engine, before a driver wraps it.
struct Started {
    instance: Instance,
    engine: kvbm_pool::TierEngine,
    g1: engine::G1Memory,
    /// What G1 is, for the report.
    g1_memory: String,
    /// Whether the local G3 file is read and written with O_DIRECT.
    g3_direct: bool,
}

/// Starts a pass's tier engine: in this process, over worker processes,
/// or (with `kept`) over workers that restart over a kept G3 before each
/// request of `points`.
fn start_engine(cfg: &ReplayConfig, plan: &Plan, kept: Option<Vec<usize>>) -> Result<Started> {
    let Plan {
        page,
        caps,
        staging,
        knobs,
        ..
    } = *plan;
    // Layouts: G1 as an engine allocates it, G2 and G3 as kvbm does.
    let g1_layout = Layout::new(
        cfg.model.layout_config(caps[0].max(1), page)?,
        LayoutKind::LayerSeparate(BlockOrder::OuterFirst),
    )?;
    // G2's memory holds its pool and, after it, the staging slots.
    let g2_layout = match caps[1] {
        0 => None,
        n => Some(Layout::new(
            cfg.model.layout_config(n + staging, page)?,
            LayoutKind::FullyContiguous,
        )?),
    };
    let mut instance = Instance {
        g3_guard: None,
        restarter: None,
        cluster: None,
    };
    let (engine, g1, g1_memory, g3_direct) = if cfg.workers > 0 {
        if cfg.g3_faults.any() {
            return Err(BenchError::Config(
                "G3 fault injection runs with the engine in this process only (no --workers)"
                    .into(),
            ));
        }
        match kept {
            Some(points) => {
                let (r, engine, g1) = restart::Restarter::start(cfg, plan, points)?;
                instance.restarter = Some(r);
                (engine, g1, dist::g1_memory(cfg.workers), false)
            }
            None => {
                let (engine, g1, what, c) = dist::engine(cfg, knobs, page, caps)?;
                instance.cluster = Some(c);
                (engine, g1, what, false)
            }
        }
    } else {
        local::local_engine(cfg, knobs, g1_layout, g2_layout, caps, page)?
    };
    // A run stopped by force still removes its G3 file.
    if let Some((file, _)) = engine
        .layout(kvbm_pool::Tier::G3)
        .and_then(|l| l.regions().first())
        .and_then(|r| r.file_location())
    {
        instance.g3_guard = Some(crate::shutdown::guard_path(file.path()));
    }
    Ok(Started {
        instance,
        engine,
        g1,
        g1_memory,
        g3_direct,
    })
}

/// What the requests of one pass add up to.
#[derive(Default)]
struct Tally {
    /// Prefix hits in G1, G2 and G3.
    hits: [u64; 3],
    /// Prefill tokens avoided by each tier's hits.
    avoided: [u64; 3],
    /// Seconds of each onboard.
    onboard: Vec<f64>,
    /// Prompt block references.
    refs: u64,
    /// Prompt tokens.
    prompt_tokens: u64,
    /// Matched blocks the cost model left to recompute.
    declined: u64,
    /// Onboard latencies against recompute time.
    samples: Vec<latency::OnboardSample>,
    /// Blocks each request hit in G1, G2 and G3.
    per_request: Vec<[u32; 3]>,
}

impl Tally {
    /// Adds request `r`, whose replay came out as `out`.
    fn add(&mut self, cfg: &ReplayConfig, page: usize, r: &Request, out: &RequestOutcome) {
        let a = tokens_avoided(r, cfg.block_tokens, &out.prefix);
        let mut mine = [0u32; 3];
        for (sum, n) in self.avoided.iter_mut().zip(a) {
            *sum += n;
        }
        for &t in &out.prefix {
            self.hits[t as usize] += 1;
            mine[t as usize] += 1;
        }
        self.per_request.push(mine);
        if let Some(s) = out.onboard_secs {
            self.onboard.push(s);
        }
        self.declined += out.declined_blocks as u64;
        self.samples.extend(latency::OnboardSample::of(
            out,
            page,
            cfg.prefill_tokens_per_s,
        ));
        self.refs += r.hash_ids.len() as u64;
        self.prompt_tokens += u64::from(r.input_length);
    }

    /// `n` as a percentage of the block references.
    fn pct(&self, n: u64) -> f64 {
        if self.refs == 0 {
            0.0
        } else {
            100.0 * n as f64 / self.refs as f64
        }
    }
}

/// Replays the trace through the tiers once. `kept`: `None` for the
/// plain instance; `Some(points)` for the tensor-parallel one with a kept
/// G3, crashed and restarted before each request of `points`.
fn data_plane(
    cfg: &ReplayConfig,
    plan: &Plan,
    kept: Option<Vec<usize>>,
    progress: &mut dyn FnMut(usize),
) -> Result<Pass> {
    let Started {
        mut instance,
        engine,
        g1,
        g1_memory,
        g3_direct,
    } = start_engine(cfg, plan, kept)?;
    let mut driver = EngineDriver::new(engine, g1, cfg.block_tokens);
    // The disk's own rate, same run (before and after: the best counts);
    // its scratch file is reserved now, beside G3, and kept to the end.
    let mut raw = if plan.caps[2] > 0 && cfg.workers == 0 {
        latency::RawRead::start(&cfg.disk_dir, plan.caps[2] as u64 * plan.block_bytes)
    } else {
        latency::RawRead::default()
    };
    let mut tally = Tally {
        per_request: Vec::with_capacity(cfg.requests.len()),
        ..Tally::default()
    };
    let start = Instant::now();
    for (i, r) in cfg.requests.iter().enumerate() {
        // Between requests nothing is in flight: a signal stops here.
        crate::shutdown::check()?;
        if let Some(rs) = instance.restarter.as_mut().filter(|rs| rs.due(i)) {
            driver = rs.restart(driver, i)?;
        }
        let out = driver.request(i, r)?;
        if let Some(rs) = instance.restarter.as_mut() {
            rs.observe(r, &out);
            rs.keep_history(driver.engine(), r.timestamp_ms);
        }
        tally.add(cfg, plan.page, r, &out);
        progress(i + 1);
    }
    let wall_s = start.elapsed().as_secs_f64();
    raw.finish();
    let log = instance
        .restarter
        .as_mut()
        .map(|r| r.log(&driver))
        .transpose()?;
    let measured = Measured {
        g1_memory,
        g3_direct,
        wall_s,
        onboard_cost: latency::OnboardCost {
            raw_read_skipped: raw.skipped.take(),
            ..latency::summarise(&tally.samples, raw.gbps)
        },
    };
    let stats = failures::merged(&driver.all_stats());
    let report = pass_report(cfg, plan, &driver, &tally, &stats, measured);
    Ok(Pass {
        report,
        per_request: tally.per_request,
        log,
        g3_unreadable: stats.g3_unreadable,
    })
}

/// What a pass measured besides its tally, for its report.
struct Measured {
    /// What G1 is.
    g1_memory: String,
    /// Whether the local G3 file is read and written with O_DIRECT.
    g3_direct: bool,
    /// Wall time of the requests, seconds.
    wall_s: f64,
    /// Onboard latency against recompute time and the disk's raw rate.
    onboard_cost: latency::OnboardCost,
}

/// The report of one pass (the simulators' figures left at 0).
fn pass_report(
    cfg: &ReplayConfig,
    plan: &Plan,
    driver: &EngineDriver,
    tally: &Tally,
    stats: &kvbm_pool::metrics::TierStats,
    measured: Measured,
) -> ReplayReport {
    let skipped: u64 = stats.skipped.iter().sum();
    let failure_rows = failures::rows(stats);
    let (offload_failures, onboard_failures) =
        (stats.offload_copy_failures(), stats.onboard_copy_failures());
    let failure_summary = failures::summary(
        offload_failures,
        onboard_failures,
        driver.failed_onboards,
        &failure_rows,
    );
    let Tally {
        hits,
        avoided,
        ref onboard,
        ..
    } = *tally;
    let onboard_ms: Vec<f64> = onboard.iter().map(|s| s * 1e3).collect();
    ReplayReport {
        workload: cfg.workload.clone(),
        requests: cfg.requests.len(),
        block_references: tally.refs,
        unique_blocks: plan.facts.unique_blocks,
        block_tokens: cfg.block_tokens,
        model: cfg.model,
        scale: cfg.scale,
        stored_tokens_per_block: plan.page,
        block_bytes: plan.block_bytes,
        g1_memory: measured.g1_memory,
        placement: placement(cfg, driver, plan.caps, measured.g3_direct),
        tiers: tier_hits(tally, plan.caps),
        hit_rate_pct: tally.pct(hits.iter().sum()),
        prompt_tokens: tally.prompt_tokens,
        tokens_avoided_g1: avoided[0],
        tokens_avoided_kvbm: avoided[1] + avoided[2],
        prefill_tokens_per_s: cfg.prefill_tokens_per_s,
        modelled_ttft_saving_s: (avoided[1] + avoided[2]) as f64 / cfg.prefill_tokens_per_s,
        onboard_total_s: onboard.iter().sum(),
        paths: path_reports(driver),
        onboard_gbps: phase_gbps(driver.onboard_phase),
        offload_gbps: phase_gbps(driver.offload_phase),
        offloads_skipped: skipped,
        offload_failures,
        onboard_failures,
        failed_onboards: driver.failed_onboards,
        copy_failures: failure_rows,
        failure_summary,
        onboards: onboard.len(),
        onboard_p50_ms: percentile(&onboard_ms, 50.0),
        onboard_p99_ms: percentile(&onboard_ms, 99.0),
        verified_blocks: driver.verified_blocks,
        g3_staging_blocks: plan.staging,
        decline_slow_loads: cfg.decline_slow_loads,
        declined_blocks: tally.declined,
        onboard_cost: measured.onboard_cost,
        sim_reuse_hit_rate_pct: 0.0,
        sim_lru_tiers_hit_rate_pct: 0.0,
        lru_hit_rate_pct: 0.0,
        belady_hit_rate_pct: 0.0,
        sweep: Vec::new(),
        wall_s: measured.wall_s,
        restarts: None,
    }
}

/// What decides placement, and what G3 is, in one line.
fn placement(
    cfg: &ReplayConfig,
    driver: &EngineDriver,
    caps: [usize; 3],
    g3_direct: bool,
) -> String {
    format!(
        "kvbm-pool TierEngine, G2/G3 policy {:?}, {:?} from G1 (G1 free reserve {}); G3 {}",
        cfg.policy,
        driver.engine().offload_mode(),
        driver.engine().g1_free_reserve(),
        if cfg.workers > 0 {
            "files on the workers (O_DIRECT where the file system allows)"
        } else if caps[2] == 0 {
            "none (no G3 capacity)"
        } else if g3_direct {
            "O_DIRECT"
        } else {
            "buffered (the file system refused O_DIRECT)"
        }
    )
}

/// Each tier's capacity, hits and hit rate.
fn tier_hits(tally: &Tally, caps: [usize; 3]) -> Vec<TierHits> {
    let names = ["G1", "G2", "G3"];
    (0..3)
        .map(|t| TierHits {
            tier: names[t],
            capacity_blocks: caps[t],
            hits: tally.hits[t],
            hit_rate_pct: tally.pct(tally.hits[t]),
        })
        .collect()
}

/// Each path's blocks, bytes and speed over its single-path phases.
fn path_reports(driver: &EngineDriver) -> Vec<PathReport> {
    driver
        .paths
        .iter()
        .zip(PATHS)
        .map(|(t, path)| PathReport {
            path,
            blocks: t.blocks,
            bytes: t.bytes,
            gbps: if t.timed_secs > 0.0 {
                t.timed_bytes as f64 / t.timed_secs / 1e9
            } else {
                0.0
            },
        })
        .collect()
}

#[cfg(test)]
mod tests;
