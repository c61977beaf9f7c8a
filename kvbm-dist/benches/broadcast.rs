//! The cost of the leader/worker split: one logical copy broadcast to two
//! worker processes and acknowledged by both, against the same per-rank
//! copy run by an executor inside one process (the reference).
//!
//! Shape: a tensor-parallel rank of an 8B-class model — 32 layers, K and
//! V, 16 tokens × 4 KV heads × 128 × bf16 per chunk (16 KiB chunks, 1 MiB
//! blocks per rank). G1 is a layer-separate host stand-in shared through
//! /dev/shm, G2 host memory, both moved by memcpy threads. The bench
//! binary doubles as the worker process (see `main`). The broadcast runs
//! twice: over IPC (the default on one host) and over TCP on 127.0.0.1,
//! where frames are encrypted with CURVE in a build that has it.
#![allow(missing_docs)] // criterion_group! generates undocumented functions.

use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use kvbm_dist::leader::{Leader, LeaderConfig, PendingLeader};
use kvbm_dist::worker::default_executor;
use kvbm_dist::worker::memory::{SharedMapping, create_shared_file};
use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_pool::Tier;
use kvbm_pool::tier::TierMover;
use kvbm_transfer::memory::SystemAllocator;
use kvbm_transfer::{CancelToken, PhysicalLayout};

const BLOCKS: usize = 64;
const WORLD: u32 = 2;

fn g1_layout() -> Layout {
    let c = LayoutConfig::new(BLOCKS, 32, 2, 16, 4 * 128, 2).unwrap();
    Layout::new(c, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap()
}

struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A leader on `endpoint` and its two worker processes, their G1 files
/// in `dir` (named after `tag`).
fn cluster(dir: &Path, endpoint: String, tag: &str) -> (Leader, Workers) {
    let layout = g1_layout();
    let bpb = layout.config().block_bytes();
    let config = LeaderConfig::new(
        endpoint,
        1,
        WORLD,
        BLOCKS as u64 * bpb * u64::from(WORLD),
        0,
    );
    let pending = PendingLeader::bind(config).unwrap();
    let mut workers = Workers(Vec::new());
    for rank in 0..WORLD {
        let file = dir.join(format!("g1-{tag}-{rank}"));
        create_shared_file(&file, &layout).unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.arg("worker")
            .args(["--endpoint", pending.endpoint()])
            .args(["--instance", "1"])
            .args(["--rank", &rank.to_string()])
            .args(["--world", &WORLD.to_string()])
            .args(["--layout", &layout.descriptor().to_json()])
            .args(["--g1-file", file.to_str().unwrap()]);
        pending.secret().pass_to(&mut cmd);
        workers.0.push(cmd.spawn().unwrap());
    }
    (pending.handshake().unwrap(), workers)
}

fn bench(c: &mut Criterion) {
    let shm = Path::new("/dev/shm");
    let dir = tempfile::tempdir_in(if shm.is_dir() { shm } else { Path::new("/tmp") }).unwrap();
    let ipc = format!("ipc://{}", dir.path().join("leader").display());
    let (leader, _workers) = cluster(dir.path(), ipc, "ipc");
    let mover = leader.mover();
    let (tcp_leader, _tcp_workers) = cluster(dir.path(), "tcp://127.0.0.1:*".into(), "tcp");
    let tcp_mover = tcp_leader.mover();
    let tcp_name = if kvbm_dist::curve::available() {
        "broadcast_two_ranks_tcp_curve"
    } else {
        "broadcast_two_ranks_tcp"
    };

    // The reference: one rank's copy inside one process.
    let layout = g1_layout();
    let file = dir.path().join("g1-local");
    create_shared_file(&file, &layout).unwrap();
    let g1 = Arc::new(SharedMapping::open(&file, layout.total_bytes()).unwrap())
        .physical_layout(layout.clone())
        .unwrap();
    let exec = default_executor(&g1).unwrap();
    let g2 = PhysicalLayout::allocate_system(
        Layout::new(*layout.config(), LayoutKind::FullyContiguous).unwrap(),
        &SystemAllocator::new(),
    )
    .unwrap();
    let rank_block = layout.config().block_bytes();

    let mut group = c.benchmark_group("g1_to_g2");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    for n in [1usize, 8, 64] {
        let pairs: Vec<(usize, usize)> = (0..n).map(|b| (b, b)).collect();
        group.throughput(Throughput::Bytes(n as u64 * rank_block));
        group.bench_with_input(BenchmarkId::new("local_one_rank", n), &pairs, |b, p| {
            b.iter(|| exec.transfer(&g1, &g2, p).wait().unwrap())
        });
        // Per-rank bytes, so the two lines compare like for like: the
        // distributed copy moves this on each of the two workers at once.
        group.bench_with_input(
            BenchmarkId::new("broadcast_two_ranks", n),
            &pairs,
            |b, p| {
                b.iter(|| {
                    mover
                        .copy(Tier::G1, Tier::G2, p.clone(), CancelToken::new())
                        .wait()
                        .unwrap()
                })
            },
        );
        group.bench_with_input(BenchmarkId::new(tcp_name, n), &pairs, |b, p| {
            b.iter(|| {
                tcp_mover
                    .copy(Tier::G1, Tier::G2, p.clone(), CancelToken::new())
                    .wait()
                    .unwrap()
            })
        });
    }
    group.finish();
    leader.shutdown();
    tcp_leader.shutdown();
}

criterion_group!(benches, bench);

/// `worker ...`: this bench binary doubles as the worker process (the
/// entry point of `kvbm-dist-node`, so it runs wherever it is copied);
/// otherwise the benches.
fn main() -> std::process::ExitCode {
    if std::env::args().nth(1).as_deref() == Some("worker") {
        return kvbm_dist::node::main();
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
    std::process::ExitCode::SUCCESS
}
