//! Command-line arguments.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// kvbm's benchmarks: the tier-to-tier bandwidth matrix and the workload
/// replay through real tiers.
#[derive(Debug, Parser)]
#[command(name = "kvbm-bench", version, about)]
pub struct Cli {
    /// Which benchmark.
    #[command(subcommand)]
    pub command: Command,
    /// No progress bar and no log lines (results still print).
    #[arg(long, short, global = true)]
    pub quiet: bool,
    /// Print results as JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// Also write the JSON results to this file (whatever `--json` says).
    #[arg(long, global = true)]
    pub json_file: Option<PathBuf>,
    /// Where to write the SVG plot (default: next to the JSON/table output,
    /// `kvbm-bench-<command>.svg` in the current directory).
    #[arg(long, global = true)]
    pub svg: Option<PathBuf>,
    /// Do not write an SVG plot.
    #[arg(long, global = true)]
    pub no_svg: bool,
    /// Directory for disk-tier files (G3). They are opened with O_DIRECT;
    /// where the file system refuses it, kvbm warns and uses buffered I/O
    /// (the raw disk reference rows of `transfer` need O_DIRECT). Files
    /// left here by a killed run are removed at the next start.
    #[arg(long, global = true, default_value = "target/kvbm-bench")]
    pub dir: PathBuf,
    /// memcpy worker threads.
    #[arg(long, global = true, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: u16,
}

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Bandwidth matrix: tier pair × layout pair × tokens per block × blocks
    /// per batch, each row with its same-run reference.
    Transfer(TransferArgs),
    /// Replay a workload through real tiers, checking every onboarded block.
    Replay(ReplayArgs),
    /// The tier engine's G1 -> G2 offload, idle and beside a GEMM: offload
    /// batches in flight × batch size × tokens per block, every block
    /// checked in G2, each row against one large device -> pinned copy.
    Offload(OffloadArgs),
    /// The tensor-parallel replay for minutes, one worker process killed
    /// and restarted every interval; reports requests served, blocks
    /// verified, failures by cause, and memory and open files of every
    /// process at the start and the end (a benchmark, not a test).
    Soak(SoakArgs),
}

/// `transfer` options.
#[derive(Debug, Args)]
pub struct TransferArgs {
    /// KV shape: a preset (llama-3.1-8b, llama-3.1-70b, deepseek-mla, tiny)
    /// or LAYERSxOUTERxINNERxDTYPE_BYTES.
    #[arg(long, default_value = "llama-3.1-8b")]
    pub model: String,
    /// Tokens per block to sweep.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64")]
    pub tokens: Vec<usize>,
    /// Blocks per transfer to sweep.
    #[arg(long, value_delimiter = ',', default_value = "8,64")]
    pub batch: Vec<usize>,
    /// MiB moved per repetition.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub mib: u64,
    /// Repetitions per row (median and spread are reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub reps: u16,
    /// Only rows whose path contains this (e.g. `G3`, `host`).
    #[arg(long)]
    pub only: Option<String>,
}

/// `offload` options.
#[derive(Debug, Args)]
pub struct OffloadArgs {
    /// KV shape: a preset (llama-3.1-8b, llama-3.1-70b, deepseek-mla, tiny)
    /// or LAYERSxOUTERxINNERxDTYPE_BYTES.
    #[arg(long, default_value = "llama-3.1-8b")]
    pub model: String,
    /// Tokens per block to sweep (4 and 16: 8 and 32 KiB chunks for
    /// llama-3.1-8b).
    #[arg(long, value_delimiter = ',', default_value = "4,16")]
    pub tokens: Vec<usize>,
    /// `offload_in_flight` values to sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub in_flight: Vec<usize>,
    /// `offload_batch` values to sweep.
    #[arg(long, value_delimiter = ',', default_value = "64,256")]
    pub batch: Vec<usize>,
    /// The engine's `offload_batch_bytes` in MiB: small blocks' batches
    /// grow to this size (0: off; default: the engine's).
    #[arg(long, value_parser = mib)]
    pub batch_mib: Option<u64>,
    /// Loads to sweep: idle, busy (a bf16 GEMM loop on the GPU; needs a
    /// GPU and a build with `--features cuda,gemm`).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "idle,busy")]
    pub load: Vec<LoadArg>,
    /// At least this many MiB per rep (more when 8 batches of the largest
    /// batch size need more).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub mib: u64,
    /// Timed reps per row, after one warm-up (median and spread reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub reps: u16,
    /// MiB of each single-copy reference.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub reference_mib: u64,
    /// G1 in host memory, moved by memcpy (idle rows only), even with a GPU.
    #[arg(long)]
    pub host_g1: bool,
    /// Refuse to allocate more host memory than this, GiB.
    #[arg(long, default_value_t = 8.0, value_parser = gib)]
    pub max_host_gib: f64,
    /// The CUDA backend's copy path (auto: chosen per job).
    #[arg(long, value_enum, default_value_t = GpuPathArg::Auto)]
    pub gpu_path: GpuPathArg,
    /// Busy rows: also stream offloads (the engine's queue never drains)
    /// for this many ms beside the GEMM, against as long of the GEMM alone
    /// before and after (0: off).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub sustain_ms: u64,
    /// Diagnostics: print the staged copies' timelines of each row's last
    /// rep (GPU G1; use a small --mib).
    #[arg(long)]
    pub timeline: bool,
}

/// The CUDA backend's copy path for `offload`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GpuPathArg {
    /// Chosen per job from the plan and the declared load.
    Auto,
    /// The device staging ring.
    Staged,
    /// The copy engines (no SMs).
    CopyEngine,
    /// The copy kernel on pinned memory.
    Kernel,
}

/// Whether the model runs beside the offloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LoadArg {
    /// Nothing else on the GPU.
    Idle,
    /// A bf16 8192^3 GEMM loop on its own stream; the CUDA backend told
    /// the GPU is busy.
    Busy,
}

/// Options `replay` and `soak` share: the synthetic workload and the KV
/// shape.
#[derive(Debug, Args)]
pub struct WorkloadArgs {
    /// Seed of the synthetic workload.
    #[arg(long, default_value_t = 0x6b76_626d)]
    pub seed: u64,
    /// Conversations in the synthetic workload.
    #[arg(long, default_value_t = 400)]
    pub conversations: usize,
    /// KV shape: a preset (llama-3.1-8b, llama-3.1-70b, deepseek-mla, tiny)
    /// or LAYERSxOUTERxINNERxDTYPE_BYTES.
    #[arg(long, default_value = "llama-3.1-8b")]
    pub model: String,
}

/// Options `replay` and `soak` share: how large each tier is, and where
/// G1 lives.
#[derive(Debug, Clone, Copy, Args)]
pub struct TierArgs {
    /// Store each trace block with block_tokens / SCALE tokens, so the
    /// workload fits the machine.
    #[arg(long, default_value_t = 128)]
    pub scale: u32,
    /// G1 capacity as a fraction of the workload's distinct blocks.
    #[arg(long, default_value_t = 0.02)]
    pub g1: f64,
    /// G2 capacity, same unit.
    #[arg(long, default_value_t = 0.06)]
    pub g2: f64,
    /// G3 capacity, same unit.
    #[arg(long, default_value_t = 0.12)]
    pub g3: f64,
    /// Keep G1 (every worker's) in host memory even when built with
    /// `cuda` and a GPU is present (G1 is on the GPU then by default).
    #[arg(long)]
    pub host_g1: bool,
    /// Refuse to allocate more host memory than this, GiB.
    #[arg(long, default_value_t = 8.0, value_parser = gib)]
    pub max_host_gib: f64,
}

/// `replay` options.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// A Mooncake JSONL trace (default: the embedded synthetic multi-turn
    /// workload).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Replay only the first N requests.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// The synthetic workload and the KV shape.
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// The tiers' sizes and where G1 lives.
    #[command(flatten)]
    pub tiers: TierArgs,
    /// G2/G3 admission and eviction of the tier engine.
    #[arg(long, value_enum, default_value_t = Policy::ReuseScore)]
    pub policy: Policy,
    /// Prefill rate for the modelled TTFT saving, tokens per second.
    #[arg(long, default_value_t = 10_000.0)]
    pub prefill_rate: f64,
    /// Tensor parallelism: run the leader here and this many worker
    /// processes (GPU `rank` each when built with `cuda`), every block
    /// sliced across them and checked on every one after each onboard.
    /// The workers are this binary started again as `worker ...` (or the
    /// binary at $KVBM_DIST_NODE: kvbm-dist's `kvbm-dist-node`, built with
    /// its feature `probe`). 0 runs everything in this process.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub workers: u32,
    /// Also sweep total capacity (fractions of distinct blocks, in the
    /// G1:G2:G3 proportions) through the simulators and plot hit rate
    /// against capacity.
    #[arg(long)]
    pub sweep: bool,
    /// When G1's blocks are copied to G2: as G1 evicts them, so that G2
    /// holds only what G1 lost (the engine's default), or as they are
    /// registered, so that G2 also holds what G1 holds, as vLLM's connector
    /// offloads (G2 then keeps G1's blocks through a crash).
    #[arg(long, value_enum, default_value_t = G1Offload::OnEviction)]
    pub g1_offload: G1Offload,
    /// Offload batches the engine keeps in flight (default: the engine's).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub offload_in_flight: Option<u64>,
    /// G1 slots the engine keeps free ahead of need, saving G1's victims
    /// in the background, at most half of G1 (default: the engine's
    /// automatic size, 256 but at most a sixty-fourth of G1; 0: every
    /// allocation that evicts waits for the save).
    #[arg(long)]
    pub g1_free_reserve: Option<usize>,
    /// Exit 0 even when copies failed during the replay (a disk that
    /// filled up, I/O errors). Without it such a run exits 3 after its
    /// report; either way the failures are printed on stderr, by path and
    /// OS error.
    #[arg(long)]
    pub allow_failures: bool,
    /// Fault injection for tests: G3 writes fail with ENOSPC once this
    /// many have succeeded (in-process engine, host tiers).
    #[arg(long, hide = true)]
    pub g3_enospc_after_writes: Option<u64>,
    /// Fault injection for tests: G3 reads fail with EIO once this many
    /// have succeeded (in-process engine, host tiers).
    #[arg(long, hide = true)]
    pub g3_eio_after_reads: Option<u64>,
    /// MiB of host memory for G3 prefetch staging, allocated beyond G2's
    /// capacity: G3 reads start at match time into these blocks (0: read
    /// G3 straight into G1 at onboard).
    #[arg(long, default_value_t = kvbm_pool::tier::DEFAULT_G3_STAGING_BYTES >> 20, value_parser = mib)]
    pub g3_staging_mib: u64,
    /// Let the engine leave matched blocks to recompute when loading them
    /// would be slower than prefill at --prefill-rate (its cost model, off
    /// by default; hit rates then depend on the machine's speed).
    #[arg(long)]
    pub decline_slow_loads: bool,
    /// Crash and restart the whole instance this many times during the
    /// replay (needs --workers): every worker SIGKILLed, the leader and the
    /// engine dropped without a flush, then all started again on the same
    /// G3 directories, kept under an identity of the model shape. The
    /// points are spread evenly over the trace unless --restart-seed is
    /// given. The same configuration runs first without restarts, in the
    /// same invocation: the report sets the hit rate after each restart
    /// against that run's over the same requests.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub restarts: u32,
    /// Restart at points drawn at random from this seed instead (with
    /// --restarts), no two closer than half the even spacing.
    #[arg(long, requires = "restarts")]
    pub restart_seed: Option<u64>,
    /// Keep G2 across the restarts too (with --restarts): each worker's G2
    /// lives in /dev/shm, as a kept G2 does in an engine, and comes back
    /// with G3.
    #[arg(long, requires = "restarts")]
    pub restart_keep_g2: bool,
}

/// When the replayed engine copies G1's blocks to G2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum G1Offload {
    /// When G1 evicts them (write-back: G2 is a victim cache).
    OnEviction,
    /// When they are registered (write-through).
    OnRegistration,
}

/// The tier engine's G2/G3 policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Policy {
    /// Learned reuse probability per unit of age (the engine's default).
    ReuseScore,
    /// Admit everything, evict the least recently used.
    WriteThrough,
}

/// `soak` options.
#[derive(Debug, Args)]
pub struct SoakArgs {
    /// A Mooncake JSONL trace (default: the embedded synthetic multi-turn
    /// workload); replayed from its start again when it runs out.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Minutes to run.
    #[arg(long, default_value_t = 10.0, value_parser = minutes)]
    pub minutes: f64,
    /// Worker processes (tensor-parallel ranks).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub workers: u32,
    /// Kill one worker (SIGKILL, round robin) and restart it every this
    /// many seconds (0: never).
    #[arg(long, default_value_t = 60)]
    pub kill_every: u64,
    /// Seconds a restarted rank may take to rejoin before the soak fails.
    #[arg(long, default_value_t = 60)]
    pub rejoin_timeout: u64,
    /// The synthetic workload and the KV shape.
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// The tiers' sizes (the defaults keep G2 and G3 under pressure) and
    /// where G1 lives.
    #[command(flatten)]
    pub tiers: TierArgs,
}

/// The largest size in MiB whose bytes fit in 64 bits.
pub const MAX_MIB: u64 = u64::MAX >> 20;
/// The largest size in GiB whose bytes fit in 64 bits.
pub const MAX_GIB: f64 = (u64::MAX >> 30) as f64;
/// The longest soak, in minutes (a hundred years).
pub const MAX_MINUTES: f64 = 100.0 * 365.0 * 24.0 * 60.0;

/// A size in MiB whose bytes fit in 64 bits (clap names the flag and the
/// value in front of the message).
fn mib(text: &str) -> Result<u64, String> {
    let v: u64 = text
        .parse()
        .map_err(|e| format!("not a whole number of MiB: {e}"))?;
    if v > MAX_MIB {
        return Err(format!(
            "{v} MiB does not fit in 64-bit byte counts; the limit is {MAX_MIB} MiB"
        ));
    }
    Ok(v)
}

/// A positive size in GiB whose bytes fit in 64 bits.
fn gib(text: &str) -> Result<f64, String> {
    let v: f64 = text
        .parse()
        .map_err(|e| format!("not a number of GiB: {e}"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("{v} GiB: the size must be positive"));
    }
    if v > MAX_GIB {
        return Err(format!(
            "{v} GiB does not fit in 64-bit byte counts; the limit is {MAX_GIB} GiB"
        ));
    }
    Ok(v)
}

/// A positive duration in minutes, at most [`MAX_MINUTES`].
fn minutes(text: &str) -> Result<f64, String> {
    let v: f64 = text
        .parse()
        .map_err(|e| format!("not a number of minutes: {e}"))?;
    if !(v.is_finite() && v > 0.0 && v <= MAX_MINUTES) {
        return Err(format!(
            "{v} minutes: the duration must be positive and at most {MAX_MINUTES}"
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn error(args: &[&str]) -> String {
        Cli::try_parse_from([&["kvbm-bench"], args].concat())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn size_flags_refuse_sizes_whose_bytes_overflow() {
        let max = MAX_MIB.to_string();
        let over = (MAX_MIB + 1).to_string();
        for (sub, flag) in [("replay", "--g3-staging-mib"), ("offload", "--batch-mib")] {
            assert!(Cli::try_parse_from(["kvbm-bench", sub, flag, &max]).is_ok());
            let e = error(&[sub, flag, &over]);
            assert!(
                e.contains(flag) && e.contains(&over) && e.contains(&format!("limit is {max} MiB")),
                "{e}"
            );
        }
        for sub in ["replay", "offload", "soak"] {
            for bad in ["1e30", "inf", "0", "-1"] {
                let e = error(&[sub, &format!("--max-host-gib={bad}")]);
                assert!(e.contains("--max-host-gib") && e.contains(bad), "{e}");
            }
        }
        let e = error(&["soak", "--minutes", "1e300"]);
        assert!(e.contains("--minutes") && e.contains("at most"), "{e}");
    }
}
