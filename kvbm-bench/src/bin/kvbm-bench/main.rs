//! `kvbm-bench`: the bandwidth matrix (`transfer`), the workload replay
//! through real tiers (`replay`), the tier engine's offload stream
//! (`offload`) and the soak run of the tensor-parallel replay (`soak`). See the `kvbm_bench` library for what each
//! measures; this binary parses arguments, shows progress and prints.
//!
//! Started as `kvbm-bench worker ...` (by a tensor-parallel replay, once
//! per rank) it is a kvbm-dist worker instead, as kvbm-dist's
//! `kvbm-dist-node` binary is: see `kvbm_bench::replay::dist`.

mod cli;
mod output;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvbm_bench::matrix::{MatrixConfig, matrix_cells, run_matrix};
use kvbm_bench::offload::{GpuPath, Load, OffloadConfig, Outcome, run_offload};
use kvbm_bench::replay::{G3Faults, ReplayConfig, ReplayReport, Restarts, run_replay};
use kvbm_bench::soak::{SoakConfig, run_soak};
use kvbm_bench::{BenchError, KvModel};
use kvbm_pool::tier::{OffloadMode, TierPolicy};
use kvbm_testkit::trace::{
    MOONCAKE_BLOCK_TOKENS, Request, SyntheticConfig, generate_synthetic, read_mooncake,
};

use crate::cli::{
    Cli, Command, G1Offload, GpuPathArg, LoadArg, OffloadArgs, Policy, ReplayArgs, SoakArgs,
    TierArgs, TransferArgs, WorkloadArgs,
};

fn main() -> ExitCode {
    // First: a worker takes the instance secret out of the environment
    // before any thread starts.
    if let Some(code) = kvbm_bench::replay::dist::run_as_worker() {
        return code;
    }
    let cli = Cli::parse();
    let level = if cli.quiet { "error" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let result = output::check_paths(&cli)
        .and_then(|()| kvbm_bench::shutdown::install())
        .map_err(Failed::from)
        .and_then(|()| match &cli.command {
            Command::Transfer(args) => transfer(&cli, args).map_err(Failed::from),
            Command::Replay(args) => replay(&cli, args),
            Command::Offload(args) => offload(&cli, args).map_err(Failed::from),
            Command::Soak(args) => soak(&cli, args).map_err(Failed::from),
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failed::CopiesFailed) => ExitCode::from(COPIES_FAILED),
        Err(Failed::Error(e)) => {
            eprintln!("kvbm-bench: {e}");
            match e {
                BenchError::Interrupted { code, .. } => ExitCode::from(code),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

/// The exit status of a replay that ran to the end but whose copies failed
/// (without `--allow-failures`).
const COPIES_FAILED: u8 = 3;

/// Why a command did not succeed.
enum Failed {
    /// It could not run or finish.
    Error(BenchError),
    /// It finished and reported, but copies failed on the way (already
    /// said on stderr).
    CopiesFailed,
}

impl From<BenchError> for Failed {
    fn from(e: BenchError) -> Self {
        Failed::Error(e)
    }
}

fn progress_bar(cli: &Cli, len: u64, what: &str) -> ProgressBar {
    if cli.quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} {elapsed_precise} eta {eta}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_string());
    bar
}

fn transfer(cli: &Cli, args: &TransferArgs) -> Result<(), BenchError> {
    kvbm_bench::disk_dir::prepare(&cli.dir)?;
    kvbm_bench::disk_dir::remove_stale(&cli.dir)?;
    let config = MatrixConfig {
        model: KvModel::parse(&args.model)?,
        tokens_per_block: args.tokens.clone(),
        blocks_per_batch: args.batch.clone(),
        bytes_per_rep: mib_bytes(args.mib),
        reps: args.reps.into(),
        memcpy_threads: cli.threads.into(),
        disk_dir: cli.dir.clone(),
        only: args.only.clone(),
    };
    let cells = matrix_cells()
        .iter()
        .filter(|(p, _, _)| args.only.as_deref().is_none_or(|o| p.name().contains(o)))
        .count();
    let bar = progress_bar(
        cli,
        (cells * args.tokens.len() * args.batch.len()) as u64,
        "transfer",
    );
    let rows = run_matrix(&config, |_| bar.inc(1))?;
    bar.finish_and_clear();
    output::matrix(cli, &config, &rows)
}

/// A loaded workload: what it is, its requests and tokens per block.
struct Loaded {
    workload: String,
    requests: Vec<Request>,
    block_tokens: u32,
}

/// The workload: a Mooncake trace, or the synthetic one.
fn workload(trace: Option<&std::path::Path>, args: &WorkloadArgs) -> Result<Loaded, BenchError> {
    Ok(match trace {
        Some(path) => Loaded {
            workload: format!("Mooncake trace {}", path.display()),
            requests: read_mooncake(path)?,
            block_tokens: MOONCAKE_BLOCK_TOKENS,
        },
        None => {
            let synth = SyntheticConfig {
                seed: args.seed,
                conversations: args.conversations,
                ..SyntheticConfig::default()
            };
            Loaded {
                workload: format!(
                    "embedded synthetic multi-turn chat (seed {:#x}, {} conversations)",
                    synth.seed, synth.conversations
                ),
                requests: generate_synthetic(&synth),
                block_tokens: synth.block_tokens,
            }
        }
    })
}

/// The replay of `loaded` through tiers sized `fractions` of its distinct
/// blocks, as `replay` and `soak` both set it up; the rest at the defaults
/// `soak` runs with (reuse-score policy, no sweep, no faults, in-process,
/// and no G3 staging or cost model, since workers read G3 themselves).
fn replay_config(
    cli: &Cli,
    loaded: Loaded,
    args: &WorkloadArgs,
    tiers: &TierArgs,
) -> Result<ReplayConfig, BenchError> {
    let TierArgs {
        scale,
        g1,
        g2,
        g3,
        host_g1,
        max_host_gib,
    } = *tiers;
    let fractions = [g1, g2, g3];
    Ok(ReplayConfig {
        workload: loaded.workload,
        requests: loaded.requests,
        block_tokens: loaded.block_tokens,
        model: KvModel::parse(&args.model)?,
        scale,
        fractions,
        host_g1,
        policy: TierPolicy::ReuseScore,
        offload_mode: OffloadMode::default(),
        prefill_tokens_per_s: 10_000.0,
        memcpy_threads: cli.threads.into(),
        disk_dir: cli.dir.clone(),
        max_host_bytes: host_bytes(max_host_gib)?,
        sweep: Vec::new(),
        workers: 0,
        worker_exe: None,
        offload_in_flight: None,
        g1_free_reserve: None,
        g3_faults: G3Faults::default(),
        g3_staging_bytes: 0,
        decline_slow_loads: false,
        restarts: Restarts::default(),
    })
}

/// A size flag's MiB in bytes (its parser kept it at most
/// [`cli::MAX_MIB`], so this cannot overflow; it saturates regardless).
fn mib_bytes(mib: u64) -> u64 {
    mib.saturating_mul(1 << 20)
}

/// `--max-host-gib` in bytes (the parser kept it positive and below
/// 2^64 bytes).
fn host_bytes(gib: f64) -> Result<u64, BenchError> {
    if gib.is_finite() && gib > 0.0 && gib <= cli::MAX_GIB {
        Ok((gib * (1u64 << 30) as f64) as u64)
    } else {
        Err(BenchError::Config(format!(
            "--max-host-gib {gib}: must be positive and at most {} GiB",
            cli::MAX_GIB
        )))
    }
}

fn soak(cli: &Cli, args: &SoakArgs) -> Result<(), BenchError> {
    let duration = std::time::Duration::try_from_secs_f64(args.minutes * 60.0)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            BenchError::Config(format!(
                "--minutes {}: must be positive and at most {}",
                args.minutes,
                cli::MAX_MINUTES
            ))
        })?;
    let loaded = workload(args.trace.as_deref(), &args.workload)?;
    let config = SoakConfig {
        replay: ReplayConfig {
            workers: args.workers,
            ..replay_config(cli, loaded, &args.workload, &args.tiers)?
        },
        duration,
        kill_every: (args.kill_every > 0).then(|| std::time::Duration::from_secs(args.kill_every)),
        rejoin_timeout: std::time::Duration::from_secs(args.rejoin_timeout.max(1)),
    };
    let secs = config.duration.as_secs();
    let bar = progress_bar(cli, secs, "soak (seconds)");
    let report = run_soak(&config, |_, elapsed| bar.set_position(elapsed.as_secs()));
    bar.finish_and_clear();
    let report = report?;
    output::soak(cli, &report)?;
    let unjoined = report.kills.iter().filter(|k| k.rejoin_s.is_none()).count();
    match (report.mismatches, unjoined) {
        (0, 0) => Ok(()),
        (m, u) => Err(BenchError::Tier(format!(
            "soak failed: {m} mismatched blocks, {u} restarted ranks that did not rejoin"
        ))),
    }
}

/// Runs and prints the replay, then says what failed (if anything did).
fn replay(cli: &Cli, args: &ReplayArgs) -> Result<(), Failed> {
    let report = replay_report(cli, args)?;
    // Last, on stderr, whatever `--quiet` and `--json` say: a degraded run
    // must not pass for a good one.
    match &report.failure_summary {
        None => Ok(()),
        Some(summary) if args.allow_failures => {
            eprintln!("kvbm-bench: warning: {summary} (allowed by --allow-failures)");
            Ok(())
        }
        Some(summary) => {
            eprintln!(
                "kvbm-bench: FAILED: {summary}. Exit status {COPIES_FAILED}; pass --allow-failures to accept such a run"
            );
            Err(Failed::CopiesFailed)
        }
    }
}

fn replay_report(cli: &Cli, args: &ReplayArgs) -> Result<ReplayReport, BenchError> {
    let mut loaded = workload(args.trace.as_deref(), &args.workload)?;
    if let Some(n) = args.max_requests {
        if n == 0 {
            return Err(BenchError::Config(
                "--max-requests 0 leaves no request to replay".into(),
            ));
        }
        loaded.requests.truncate(n);
    }
    if args.restart_seed.is_some() && args.restarts == 0 {
        return Err(BenchError::Config(
            "--restart-seed places restarts: give their number with --restarts".into(),
        ));
    }
    let base = replay_config(cli, loaded, &args.workload, &args.tiers)?;
    let config = ReplayConfig {
        policy: match args.policy {
            Policy::ReuseScore => TierPolicy::ReuseScore,
            Policy::WriteThrough => TierPolicy::WriteThrough,
        },
        offload_mode: match args.g1_offload {
            G1Offload::OnEviction => OffloadMode::WriteBack,
            G1Offload::OnRegistration => OffloadMode::WriteThrough,
        },
        prefill_tokens_per_s: args.prefill_rate,
        sweep: if args.sweep {
            vec![0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0]
        } else {
            Vec::new()
        },
        workers: args.workers,
        offload_in_flight: args.offload_in_flight.map(|n| n as usize),
        g1_free_reserve: args.g1_free_reserve,
        g3_faults: G3Faults {
            enospc_after_writes: args.g3_enospc_after_writes,
            eio_after_reads: args.g3_eio_after_reads,
        },
        g3_staging_bytes: mib_bytes(args.g3_staging_mib),
        decline_slow_loads: args.decline_slow_loads,
        restarts: Restarts {
            count: args.restarts,
            seed: args.restart_seed,
            keep_g2: args.restart_keep_g2,
        },
        ..base
    };
    let bar = progress_bar(cli, config.requests.len() as u64, "replay");
    let report = run_replay(&config, |done, _| bar.set_position(done as u64));
    bar.finish_and_clear();
    let report = report?;
    output::replay(cli, &report)?;
    Ok(report)
}

fn offload(cli: &Cli, args: &OffloadArgs) -> Result<(), BenchError> {
    let config = OffloadConfig {
        model: KvModel::parse(&args.model)?,
        tokens_per_block: args.tokens.clone(),
        in_flight: args.in_flight.clone(),
        batches: args.batch.clone(),
        batch_bytes: args.batch_mib.map(mib_bytes),
        loads: args
            .load
            .iter()
            .map(|l| match l {
                LoadArg::Idle => Load::Idle,
                LoadArg::Busy => Load::Busy,
            })
            .collect(),
        min_bytes_per_rep: mib_bytes(args.mib),
        reps: args.reps.into(),
        reference_bytes: mib_bytes(args.reference_mib),
        memcpy_threads: cli.threads.into(),
        max_host_bytes: host_bytes(args.max_host_gib)?,
        host_g1: args.host_g1,
        gpu_path: match args.gpu_path {
            GpuPathArg::Auto => GpuPath::Auto,
            GpuPathArg::Staged => GpuPath::Staged,
            GpuPathArg::CopyEngine => GpuPath::CopyEngine,
            GpuPathArg::Kernel => GpuPath::Kernel,
        },
        sustain: (args.sustain_ms > 0).then(|| std::time::Duration::from_millis(args.sustain_ms)),
        timeline: args.timeline,
    };
    let rows = config.tokens_per_block.len()
        * config.in_flight.len()
        * config.batches.len()
        * config.loads.len();
    let bar = progress_bar(cli, rows as u64, "offload");
    let outcome = run_offload(&config, |_| bar.inc(1))?;
    bar.finish_and_clear();
    match outcome {
        Outcome::NoDevice => {
            println!("skipped: no CUDA device");
            Ok(())
        }
        Outcome::Ran(report) => {
            output::offload(cli, &report)?;
            match report.failures() {
                0 => Ok(()),
                n => Err(BenchError::Tier(format!(
                    "{n} offload rows failed (see their status)"
                ))),
            }
        }
    }
}
