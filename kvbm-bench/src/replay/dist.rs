//! Tensor-parallel replay: the tier engine's leader in this process, one
//! worker process per rank (`kvbm-dist-node worker`, see
//! [`kvbm_dist::node`]), each owning its G1 (GPU `rank` when built with
//! `cuda` and the GPU exists, a host stand-in otherwise), G2 and G3.
//!
//! The engine runs over kvbm-dist's distributed mover, so every offload
//! and onboard is broadcast to all workers and counts only when all of
//! them acknowledged. Blocks are written and checked by the workers
//! themselves (a probe through the leader): every onboarded block is
//! checked on every rank, against a pattern of its hash and the rank.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;

use kvbm_dist::leader::{Leader, LeaderConfig, PRIVATE_ENDPOINT, PendingLeader};
use kvbm_dist::node::NodeArgs;
use kvbm_dist::proto::ProbeOp;
use kvbm_layout::Layout;

use super::super::error::{BenchError, Result};
use super::super::host_view::Mismatch;

fn dist_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Tier(format!("kvbm-dist: {e}"))
}

/// Where the worker binary, `kvbm-dist-node`, is: `$KVBM_DIST_NODE` when
/// set, else next to this executable (where cargo builds both binaries of
/// this package), else next to the directory above it (a test or example
/// executable in `deps/` or `examples/`).
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
    let exe = std::env::current_exe()
        .map_err(|e| BenchError::Config(format!("cannot find this executable: {e}")))?;
    let name = format!("kvbm-dist-node{}", std::env::consts::EXE_SUFFIX);
    exe.ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join(&name))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            BenchError::Config(format!(
                "--workers needs the worker binary `kvbm-dist-node` next to {} (or its path in KVBM_DIST_NODE); build it with `cargo build --release -p kvbm-bench --bin kvbm-dist-node` (add the same --features as this build)",
                exe.display()
            ))
        })
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

/// Starts `world` workers (`exe` is `kvbm-dist-node`) with G1 `layout` and the leader that
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
        let mut args = NodeArgs::new(
            pending.endpoint(),
            u64::from(std::process::id()),
            rank,
            world,
            layout.descriptor().to_json(),
        );
        args.g3_dir = Some(run_dir.join(format!("rank{rank}")));
        args.host_g1 = host_g1;
        args.threads = threads;
        args.leader_timeout = std::time::Duration::from_secs(120);
        let mut cmd = Command::new(exe);
        cmd.args(args.to_args());
        // The secret travels in the child's environment, never its arguments.
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
