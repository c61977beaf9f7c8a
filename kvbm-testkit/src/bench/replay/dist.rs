//! Tensor-parallel replay: the tier engine's leader in this process, one
//! worker process per rank (this same binary, hidden `worker`
//! subcommand), each owning its G1 (GPU `rank` when built with `cuda` and
//! the GPU exists, a host stand-in otherwise), G2 and G3.
//!
//! The engine runs over kvbm-dist's distributed mover, so every offload
//! and onboard is broadcast to all workers and counts only when all of
//! them acknowledged. Blocks are written and checked by the workers
//! themselves (a probe through the leader): every onboarded block is
//! checked on every rank, against a pattern of its hash and the rank.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;

use kvbm_dist::auth::InstanceSecret;
use kvbm_dist::leader::{Leader, LeaderConfig, PRIVATE_ENDPOINT, PendingLeader};
use kvbm_dist::proto::ProbeOp;
use kvbm_dist::worker::probe::{BlockProbe, rank_seed};
use kvbm_dist::worker::{self, WorkerConfig};
use kvbm_layout::{Layout, LayoutDescriptor};
use kvbm_transfer::PhysicalLayout;

use super::super::error::{BenchError, Result};
use super::super::host_view::{HostTier, Mismatch};
use super::engine::G1Memory;

fn dist_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Tier(format!("kvbm-dist: {e}"))
}

/// What a worker process is started with.
#[derive(Debug, Clone)]
pub struct WorkerArgs {
    /// The leader's endpoint.
    pub endpoint: String,
    /// The instance.
    pub instance: u64,
    /// This worker's rank.
    pub rank: u32,
    /// Ranks in all.
    pub world: u32,
    /// The G1 layout, as a descriptor's JSON.
    pub layout_json: String,
    /// Directory for this worker's G3 file.
    pub g3_dir: PathBuf,
    /// Keep G1 in host memory even when a GPU is present.
    pub host_g1: bool,
    /// memcpy threads.
    pub threads: usize,
}

impl WorkerArgs {
    /// The command-line arguments of the hidden `worker` subcommand.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "worker".to_string(),
            "--endpoint".into(),
            self.endpoint.clone(),
            "--instance".into(),
            self.instance.to_string(),
            "--rank".into(),
            self.rank.to_string(),
            "--world".into(),
            self.world.to_string(),
            "--layout".into(),
            self.layout_json.clone(),
            "--g3-dir".into(),
            self.g3_dir.display().to_string(),
            "--threads".into(),
            self.threads.to_string(),
        ];
        if self.host_g1 {
            v.push("--host-g1".into());
        }
        v
    }
}

/// Writes and checks patterns in this worker's G1.
struct G1Probe(G1Memory);

impl BlockProbe for G1Probe {
    fn fill(
        &self,
        _g1: &PhysicalLayout,
        block: usize,
        seed: u64,
        rank: u32,
    ) -> std::result::Result<(), String> {
        // SAFETY: the leader probes a block only while no transfer touches
        // it (the driver fills before registering, checks after the
        // onboard completed).
        unsafe { self.0.fill(block, rank_seed(seed, rank)) }.map_err(|e| e.to_string())
    }

    fn check(
        &self,
        _g1: &PhysicalLayout,
        block: usize,
        seed: u64,
        rank: u32,
    ) -> std::result::Result<bool, String> {
        // SAFETY: as for `fill`.
        unsafe { self.0.check(block, rank_seed(seed, rank)) }
            .map(|m| m.is_none())
            .map_err(|e| e.to_string())
    }
}

/// Runs one worker until the leader shuts it down. The instance secret
/// comes from the environment the leader's process started it with (and
/// is removed from it).
pub fn run_worker(args: &WorkerArgs) -> Result<()> {
    // SAFETY: a worker process calls this from `main` before it starts any
    // thread (the executor's threads start below).
    let secret = unsafe { InstanceSecret::take_from_env() }.map_err(dist_err)?;
    let layout = LayoutDescriptor::from_json(&args.layout_json)
        .and_then(|d| d.to_layout())
        .map_err(|e| BenchError::Config(format!("--layout: {e}")))?;
    std::fs::create_dir_all(&args.g3_dir)
        .map_err(|e| BenchError::Config(format!("{}: {e}", args.g3_dir.display())))?;
    let (g1, executor, g2_allocator, what) = worker_memory(args, layout)?;
    let physical = g1
        .physical()
        .ok_or_else(|| BenchError::Config("a worker's G1 must be in its own process".into()))?
        .clone();
    let mut config = WorkerConfig::new(
        args.endpoint.clone(),
        args.instance,
        args.rank,
        args.world,
        physical,
        secret,
    );
    config.g3_dir = Some(args.g3_dir.clone());
    config.executor = Some(executor);
    config.g2_allocator = g2_allocator;
    config.probe = Some(Box::new(G1Probe(g1)));
    config.leader_timeout = std::time::Duration::from_secs(120);
    eprintln!("kvbm-bench worker rank {}: G1 {what}", args.rank);
    worker::run(config).map_err(dist_err)
}

type WorkerMemory = (
    G1Memory,
    kvbm_transfer::Executor,
    Option<worker::G2Allocator>,
    String,
);

#[cfg(feature = "cuda")]
fn worker_memory(args: &WorkerArgs, layout: Layout) -> Result<WorkerMemory> {
    use super::gpu;
    if !args.host_g1
        && let Some(dev) = gpu::device_at(args.rank as usize)
    {
        let what = format!("on GPU {} ({})", args.rank, dev.name());
        let g1 = G1Memory::Device(gpu::DeviceTier::allocate(&dev, layout)?);
        let exec = gpu::executor(&dev, args.threads)?;
        let alloc_dev = dev.clone();
        let g2: worker::G2Allocator = Box::new(move |l: Layout| {
            gpu::pinned_layout(&alloc_dev, l)
                .map_err(|e| kvbm_dist::DistError::InvalidConfig(format!("pinned G2: {e}")))
        });
        return Ok((g1, exec, Some(g2), what));
    }
    host_memory(args, layout)
}

#[cfg(not(feature = "cuda"))]
fn worker_memory(args: &WorkerArgs, layout: Layout) -> Result<WorkerMemory> {
    host_memory(args, layout)
}

fn host_memory(args: &WorkerArgs, layout: Layout) -> Result<WorkerMemory> {
    let what = if args.host_g1 {
        "host-memory stand-in (asked for)"
    } else if cfg!(feature = "cuda") {
        "host-memory stand-in: no CUDA device for this rank"
    } else {
        "host-memory stand-in: built without CUDA"
    };
    let g1 = HostTier::allocate(layout)?;
    let exec = worker::default_executor(g1.physical()).map_err(dist_err)?;
    let _ = args.threads;
    Ok((G1Memory::Host(g1), exec, None, what.to_string()))
}

/// The worker processes; killed when dropped.
pub struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            // Given a moment to exit on the leader's shutdown first.
            for _ in 0..50 {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The leader and its workers.
pub struct Cluster {
    /// The leader.
    pub leader: Arc<Leader>,
    /// The worker processes (kept alive while this lives).
    pub workers: Workers,
}

/// Starts `world` workers of `exe` with G1 `layout` and the leader that
/// configures them with `g2_blocks` and `g3_blocks` per worker.
#[allow(clippy::too_many_arguments)]
pub fn start(
    exe: &Path,
    world: u32,
    layout: &Layout,
    g2_blocks: usize,
    g3_blocks: usize,
    dir: &Path,
    host_g1: bool,
    threads: usize,
) -> Result<Cluster> {
    let run_dir = dir.join(format!("dist-{}", std::process::id()));
    std::fs::create_dir_all(&run_dir)
        .map_err(|e| BenchError::Config(format!("{}: {e}", run_dir.display())))?;
    let bpb = layout.config().block_bytes() * u64::from(world);
    // On this host: an IPC socket in a directory only this user can enter.
    let config = LeaderConfig::new(
        PRIVATE_ENDPOINT,
        u64::from(std::process::id()),
        world,
        g2_blocks as u64 * bpb,
        g3_blocks as u64 * bpb,
    );
    let pending = PendingLeader::bind(config).map_err(dist_err)?;
    let mut children = Vec::new();
    for rank in 0..world {
        let args = WorkerArgs {
            endpoint: pending.endpoint().to_owned(),
            instance: u64::from(std::process::id()),
            rank,
            world,
            layout_json: layout.descriptor().to_json(),
            g3_dir: run_dir.join(format!("rank{rank}")),
            host_g1,
            threads,
        };
        let mut cmd = Command::new(exe);
        cmd.args(args.to_args());
        pending.secret().pass_to(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| BenchError::Config(format!("cannot start {}: {e}", exe.display())))?;
        children.push(child);
    }
    let workers = Workers(children);
    let leader = pending.handshake().map_err(dist_err)?;
    Ok(Cluster {
        leader: Arc::new(leader),
        workers,
    })
}

/// Fills block `block` with `hash`'s pattern on every worker.
pub(crate) fn fill(leader: &Leader, block: usize, hash: u64) -> Result<()> {
    leader
        .probe(ProbeOp::Fill, vec![(block as u32, hash)])
        .map_err(dist_err)?;
    Ok(())
}

/// Checks block `block` against `hash`'s pattern on every worker.
pub(crate) fn check(leader: &Leader, block: usize, hash: u64) -> Result<Option<Mismatch>> {
    let per_rank = leader
        .probe(ProbeOp::Check, vec![(block as u32, hash)])
        .map_err(dist_err)?;
    // The probe reports which blocks differ, not where inside them.
    Ok(per_rank.iter().any(|m| !m.is_empty()).then_some(Mismatch {
        layer: 0,
        outer: 0,
        offset: 0,
    }))
}
