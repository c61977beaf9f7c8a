//! Tensor-parallel replay: the tier engine's leader in this process, one
//! worker process per rank (this executable started as `worker ...`,
//! running kvbm-dist's worker entry point, [`kvbm_dist::node`], as its
//! `kvbm-dist-node` binary does; see [`find_node_exe`]), each owning its
//! G1 (GPU `rank` when built with `cuda` and the GPU exists, a host
//! stand-in otherwise), G2 and G3.
//!
//! The engine runs over kvbm-dist's distributed mover, so every offload
//! and onboard is broadcast to all workers and counts only when all of
//! them acknowledged. Blocks are written and checked by the workers
//! themselves (a probe through the leader): every onboarded block is
//! checked on every rank, against a pattern of its hash and the rank.
//!
//! With a kept G3 ([`InstanceSpec::kept_identity`]) each worker keeps its G3
//! in its rank's directory under an identity of the model shape, so an
//! instance started again on the same [`RunDir`] finds what G3 held (the
//! restarts of [`super::restart`]).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_dist::auth::InstanceSecret;
use kvbm_dist::leader::{Leader, LeaderConfig, PRIVATE_ENDPOINT, PendingLeader};
use kvbm_dist::node::NodeArgs;
use kvbm_dist::proto::ProbeOp;
use kvbm_layout::{BlockOrder, Layout, LayoutKind};
use kvbm_pool::tier::TierEngine;
use kvbm_transfer::memory::DISK_ALIGNMENT;

use parking_lot::Mutex;

use super::super::error::{BenchError, Result};
use super::super::host_view::Mismatch;
use super::engine::G1Memory;
use super::{ReplayConfig, TierKnobs};
use crate::disk_dir::DIST_PREFIX;
use crate::model::{KvModel, check_disk_alignment};
use crate::shutdown::{self, Guard};

fn dist_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Tier(format!("kvbm-dist: {e}"))
}

/// The first argument of a worker process's command line
/// (`EXE worker --endpoint ...`, see [`kvbm_dist::node`]).
pub const WORKER_ARG: &str = "worker";

/// The executable the replay starts once per rank, as `EXE worker ...`:
/// `$KVBM_DIST_NODE` when set (kvbm-dist's `kvbm-dist-node`, built with its
/// feature `probe`: the replay checks every rank's bytes through probes),
/// else this executable. The `kvbm-bench` binary runs as the worker when
/// started so, built with the same features as the replay; another
/// program that runs a replay with workers must do the same (see
/// [`run_as_worker`]).
pub fn find_node_exe() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KVBM_DIST_NODE") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(BenchError::Config(format!(
                "KVBM_DIST_NODE={} is not a file",
                p.display()
            )))
        };
    }
    std::env::current_exe()
        .map_err(|e| BenchError::Config(format!("cannot find this executable: {e}")))
}

/// When this process was started as a replay's worker (its first argument
/// is [`WORKER_ARG`]), runs the worker ([`kvbm_dist::node::main`]) to the
/// end and returns its exit status; `None` otherwise.
///
/// Call it first thing in `main`, before any other thread starts: the
/// worker takes the instance secret out of the environment.
pub fn run_as_worker() -> Option<std::process::ExitCode> {
    if std::env::args_os().nth(1)? != WORKER_ARG {
        return None;
    }
    Some(kvbm_dist::node::main())
}

/// How to start the worker of each rank (again, after a loss).
struct Recipe {
    exe: PathBuf,
    args: Vec<NodeArgs>,
    secret: InstanceSecret,
}

/// The worker processes, one per rank; shut down and reaped when dropped.
///
/// Each runs in its own process group, so a Ctrl-C in the terminal reaches
/// only the replay, which then shuts its workers down in order (a worker
/// killed by the terminal's signal would leave its G3 file behind).
pub struct Workers {
    ranks: Vec<Option<(Child, Guard)>>,
    recipe: Recipe,
}

impl Workers {
    fn spawn(&self, rank: u32) -> Result<(Child, Guard)> {
        let args = &self.recipe.args[rank as usize];
        let mut cmd = Command::new(&self.recipe.exe);
        cmd.args(args.to_args()).process_group(0);
        // The secret travels in the child's environment, never its arguments.
        self.recipe.secret.pass_to(&mut cmd);
        let child = cmd.spawn().map_err(|e| {
            BenchError::Config(format!("cannot start {}: {e}", self.recipe.exe.display()))
        })?;
        let guard = shutdown::guard_pid(child.id());
        Ok((child, guard))
    }

    /// The process id of each rank's worker (`None` while a rank has none).
    pub fn pids(&self) -> Vec<Option<u32>> {
        self.ranks
            .iter()
            .map(|r| r.as_ref().map(|(c, _)| c.id()))
            .collect()
    }

    /// Kills rank `rank`'s worker (SIGKILL, as a crash would) and reaps it;
    /// returns its pid.
    pub fn kill(&mut self, rank: u32) -> Result<u32> {
        let (mut child, _guard) = self
            .ranks
            .get_mut(rank as usize)
            .and_then(Option::take)
            .ok_or_else(|| BenchError::Config(format!("rank {rank} has no worker to kill")))?;
        let pid = child.id();
        let _ = child.kill();
        child
            .wait()
            .map_err(|e| BenchError::Tier(format!("cannot reap worker {pid}: {e}")))?;
        Ok(pid)
    }

    /// Starts a new worker for rank `rank` (one that has none): it says
    /// `Hello` and the leader takes it back as that rank. Returns its pid.
    pub fn restart(&mut self, rank: u32) -> Result<u32> {
        if self.ranks.get(rank as usize).is_none_or(Option::is_some) {
            return Err(BenchError::Config(format!(
                "rank {rank} is not a rank without a worker"
            )));
        }
        let (child, guard) = self.spawn(rank)?;
        let pid = child.id();
        self.ranks[rank as usize] = Some((child, guard));
        Ok(pid)
    }

    /// The directory of rank `rank`'s G3 file.
    pub fn g3_dir(&self, rank: u32) -> Option<&Path> {
        self.recipe
            .args
            .get(rank as usize)
            .and_then(|a| a.g3_dir.as_deref())
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // A moment to exit on the leader's shutdown first, then killed.
        let deadline = Instant::now() + Duration::from_secs(1);
        for (c, _) in self.ranks.iter_mut().flatten() {
            while Instant::now() < deadline {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The run's directory of worker files (`dist-<pid>` under `--dir`),
/// removed with everything in it when dropped (after the workers).
pub struct RunDir {
    path: PathBuf,
    _guard: Guard,
}

impl RunDir {
    /// Creates the run's directory, `dist-<pid>` under `dir`.
    pub fn create(dir: &Path) -> Result<RunDir> {
        let path = dir.join(format!("{DIST_PREFIX}{}", std::process::id()));
        std::fs::create_dir_all(&path).map_err(|e| BenchError::Dir {
            dir: dir.to_path_buf(),
            problem: format!("cannot create {}: {e}", path.display()),
        })?;
        Ok(RunDir {
            _guard: shutdown::guard_path(&path),
            path,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %self.path.display(), error = %e, "cannot remove the workers' directory");
        }
    }
}

/// The leader and its workers. Dropped in this order: the leader (which
/// tells the workers to exit), the workers (reaped), their directory (once
/// no instance started on it is left).
pub struct Cluster {
    /// The leader.
    pub leader: Arc<Leader>,
    /// The worker processes (kept alive while this lives).
    pub workers: Arc<Mutex<Workers>>,
    /// Where the workers keep their G3 files.
    pub run_dir: Arc<RunDir>,
}

/// What starts the replay's instance, the first time and after a restart.
#[derive(Debug, Clone)]
pub struct InstanceSpec {
    /// The worker executable ([`find_node_exe`]).
    pub exe: PathBuf,
    /// Ranks.
    pub world: u32,
    /// Each rank's G1 layout (its slice of every block).
    pub rank_g1: Layout,
    /// G2 blocks per worker.
    pub g2_blocks: usize,
    /// G3 blocks per worker.
    pub g3_blocks: usize,
    /// Keep G1 in host memory even with a GPU.
    pub host_g1: bool,
    /// memcpy threads per worker.
    pub threads: usize,
    /// Keeps every worker's G3 across restarts under this identity (the
    /// rank is added per worker); `None`: G3 goes with its process.
    pub kept_identity: Option<String>,
    /// Keeps every worker's G2 across restarts too, in `rank<r>` under
    /// this directory (in `/dev/shm`), under `kept_identity`.
    pub g2_keep_dir: Option<PathBuf>,
    /// The tier engine's knobs.
    pub knobs: TierKnobs,
}

impl InstanceSpec {
    /// Bytes of the G3 data the leader configures over all workers.
    pub fn g3_bytes(&self) -> u64 {
        self.g3_blocks as u64 * self.rank_g1.config().block_bytes() * u64::from(self.world)
    }

    /// Bytes of one rank's G3 data file as its worker lays it out
    /// (disk-aligned regions, rounded up to the alignment).
    pub fn rank_g3_file_bytes(&self) -> Result<u64> {
        if self.g3_blocks == 0 {
            return Ok(0);
        }
        let config = self
            .rank_g1
            .config()
            .with_num_blocks(self.g3_blocks)?
            .with_alignment(DISK_ALIGNMENT)?;
        let bytes = Layout::new(config, LayoutKind::FullyContiguous)?.total_bytes();
        Ok(bytes.div_ceil(DISK_ALIGNMENT) * DISK_ALIGNMENT)
    }
}

/// Starts the instance `spec` describes on `run_dir`: its workers, the
/// leader that configures them, and a fresh tier engine over the leader's
/// mover (nothing registered in it yet).
pub fn launch(
    spec: &InstanceSpec,
    run_dir: Arc<RunDir>,
) -> Result<(TierEngine, G1Memory, Cluster)> {
    let c = start(spec, run_dir)?;
    let engine = spec.knobs.build(c.leader.mover())?;
    let g1 = G1Memory::Distributed(Arc::clone(&c.leader));
    Ok((engine, g1, c))
}

/// Starts the workers of `spec` (one worker process per rank, G3 in
/// `run_dir/rank<r>`) and the leader that configures them.
fn start(spec: &InstanceSpec, run_dir: Arc<RunDir>) -> Result<Cluster> {
    let (world, layout) = (spec.world, &spec.rank_g1);
    let (g2_blocks, g3_blocks) = (spec.g2_blocks, spec.g3_blocks);
    let bpb = layout.config().block_bytes() * u64::from(world);
    // On this host: an IPC socket in a directory only this user can enter.
    let config = LeaderConfig::new(
        PRIVATE_ENDPOINT,
        u64::from(std::process::id()),
        world,
        g2_blocks as u64 * bpb,
        g3_blocks as u64 * bpb,
    );
    // Workers wait for the leader longer than it waits for them: a rank
    // that is late is then the one its error names.
    let leader_timeout = config.worker_leader_timeout();
    let pending = PendingLeader::bind(config).map_err(dist_err)?;
    let args = (0..world)
        .map(|rank| {
            let mut args = NodeArgs::new(
                pending.endpoint(),
                u64::from(std::process::id()),
                rank,
                world,
                layout.descriptor().to_json(),
            );
            args.g3_dir = Some(run_dir.path().join(format!("rank{rank}")));
            args.kept_identity = spec
                .kept_identity
                .as_ref()
                .map(|id| format!("{}\ntp_rank: {rank} of {world}", id.trim_end()));
            args.g2_keep_dir = spec
                .g2_keep_dir
                .as_ref()
                .map(|d| d.join(format!("rank{rank}")));
            args.host_g1 = spec.host_g1;
            args.threads = spec.threads;
            args.leader_timeout = leader_timeout;
            args
        })
        .collect();
    let mut workers = Workers {
        ranks: Vec::new(),
        recipe: Recipe {
            exe: spec.exe.clone(),
            args,
            secret: pending.secret().clone(),
        },
    };
    for rank in 0..world {
        let started = workers.spawn(rank)?;
        workers.ranks.push(Some(started));
    }
    let leader = pending.handshake().map_err(dist_err)?;
    Ok(Cluster {
        leader: Arc::new(leader),
        workers: Arc::new(Mutex::new(workers)),
        run_dir,
    })
}

/// The identity a tensor-parallel replay keeps its workers' G3 under:
/// what a G3 block's bytes mean — the model's KV shape and each rank's
/// slice of it, the tokens stored per block, the trace's block size and
/// hashes, the tensor parallelism (each worker adds its rank).
pub fn kept_identity(model: &KvModel, page: usize, block_tokens: u32, world: u32) -> String {
    format!(
        "engine: kvbm-bench replay\nmodel: {} ({} layers x {} planes x {} values x {} bytes)\nrank_slice: {} values\nstored_tokens_per_block: {page}\ntrace_block_tokens: {block_tokens}\nhashes: trace hash_ids\ntp_world: {world}",
        model.name,
        model.num_layers,
        model.outer_dim,
        model.inner_dim,
        model.dtype_bytes,
        model.inner_dim / world.max(1) as usize,
    )
}

/// The instance of `cfg`'s tensor-parallel replay: `cfg.workers` worker
/// processes, each holding a 1/N slice of every block (G1 per worker: GPU
/// `rank` when built with `cuda` and present, else a host stand-in), G2
/// and G3 of `caps`; with `keep_g3`, G3 kept under [`kept_identity`].
pub(crate) fn spec(
    cfg: &ReplayConfig,
    knobs: TierKnobs,
    page: usize,
    caps: [usize; 3],
    keep_g3: bool,
) -> Result<InstanceSpec> {
    let n = cfg.workers as usize;
    if n == 0 || !cfg.model.inner_dim.is_multiple_of(n) {
        return Err(BenchError::Config(format!(
            "{} KV values per token do not split over {n} ranks",
            cfg.model.inner_dim
        )));
    }
    let rank_model = KvModel {
        inner_dim: cfg.model.inner_dim / n,
        ..cfg.model
    };
    check_disk_alignment(&rank_model, page)?;
    let rank_g1 = Layout::new(
        rank_model.layout_config(caps[0].max(1), page)?,
        LayoutKind::LayerSeparate(BlockOrder::OuterFirst),
    )?;
    let exe = match &cfg.worker_exe {
        Some(p) => p.clone(),
        None => find_node_exe()?,
    };
    Ok(InstanceSpec {
        exe,
        world: cfg.workers,
        rank_g1,
        g2_blocks: caps[1],
        g3_blocks: caps[2],
        host_g1: cfg.host_g1,
        threads: cfg.memcpy_threads,
        kept_identity: keep_g3
            .then(|| kept_identity(&cfg.model, page, cfg.block_tokens, cfg.workers)),
        g2_keep_dir: None,
        knobs,
    })
}

/// What G1 is in a tensor-parallel replay over `workers` ranks, for the
/// report.
pub(crate) fn g1_memory(workers: u32) -> String {
    format!(
        "{workers} worker processes, 1/{workers} of every block each (G1 per worker: GPU `rank` when built with cuda and present, else a host stand-in; each worker logs which)"
    )
}

/// The tier engine over `cfg.workers` worker processes (see [`spec`]; G3
/// not kept), with the leader and workers that serve it, and what G1 is,
/// for the report.
pub(crate) fn engine(
    cfg: &ReplayConfig,
    knobs: TierKnobs,
    page: usize,
    caps: [usize; 3],
) -> Result<(TierEngine, G1Memory, String, Cluster)> {
    let spec = spec(cfg, knobs, page, caps, false)?;
    let run_dir = Arc::new(RunDir::create(&cfg.disk_dir)?);
    let (engine, g1, c) = launch(&spec, run_dir)?;
    Ok((engine, g1, g1_memory(cfg.workers), c))
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
