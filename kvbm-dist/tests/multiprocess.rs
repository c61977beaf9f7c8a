//! A leader (this process) and two worker processes on loopback: bytes
//! through G1 → G2 → G3 and back, verified on every worker; a worker
//! killed mid-transfer; the worker rejoining; a reset reaching a worker
//! that rejoins after it.
//!
//! This test binary doubles as the worker binary, `kvbm-dist-node`:
//! started with `worker ...` it runs the same entry point
//! ([`kvbm_dist::node::main`]), and the tests start it that way, so the
//! test binary runs wherever it is copied (`cargo xtask gpu`) with no path
//! to another executable built in. That needs its own `main`, so the tests
//! run under a small runner (`node_harness`, `harness = false`).

mod node_harness;

use std::path::PathBuf;
use std::process::{Child, Command, ExitCode};
use std::sync::mpsc;
use std::time::Duration;

use std::sync::Arc;

use kvbm_block::SequenceHash;
use kvbm_dist::auth::InstanceSecret;
use kvbm_dist::leader::{
    DistMover, Leader, LeaderConfig, PendingLeader, RankState, evict_distributed_tiers,
};
use kvbm_dist::proto::ProbeOp;
use kvbm_dist::worker::memory::{SharedMapping, create_shared_file};
use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_pool::Tier;
use kvbm_pool::tier::{G1Lookup, OffloadMode, OnboardTarget, TierEngine, TierMover, TierPolicy};
use kvbm_testkit::blocks::{self, chain};
use kvbm_transfer::{CancelToken, TransferOutcome};

const WORLD: u32 = 2;
const INSTANCE: u64 = 0x5eed;
const G1_BLOCKS: usize = 16;
const G2_BLOCKS: u64 = 8;
const G3_BLOCKS: u64 = 12;
/// Generous: the box running the tests is loaded.
const WAIT: Duration = Duration::from_secs(60);

/// 2 layers × K/V × 16 tokens × 128 bf16 values: 4 KiB chunks, so G3's
/// blocks are disk-aligned.
fn g1_layout() -> Layout {
    let c = LayoutConfig::new(G1_BLOCKS, 2, 2, 16, 128, 2).unwrap();
    Layout::new(c, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap()
}

struct Node {
    dir: tempfile::TempDir,
    layout: Layout,
    endpoint: String,
    secret: InstanceSecret,
    workers: Vec<Option<Child>>,
    /// The identity G3 is kept across restarts under (`None`: not kept).
    kept: Option<&'static str>,
}

impl Node {
    fn g1_file(&self, rank: u32) -> PathBuf {
        self.dir.path().join(format!("g1-rank{rank}"))
    }

    fn spawn(&mut self, rank: u32, fault_delay_ms: u64) {
        let g3 = self.dir.path().join(format!("g3-rank{rank}"));
        std::fs::create_dir_all(&g3).unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        self.secret.pass_to(&mut cmd);
        let child = cmd
            .arg("worker")
            .args(["--endpoint", &self.endpoint])
            .args(["--instance", &INSTANCE.to_string()])
            .args(["--rank", &rank.to_string()])
            .args(["--world", &WORLD.to_string()])
            .args(["--layout", &self.layout.descriptor().to_json()])
            .args(["--g1-file", self.g1_file(rank).to_str().unwrap()])
            .args(["--g3-dir", g3.to_str().unwrap()])
            .args(["--fault-delay-ms", &fault_delay_ms.to_string()])
            .args(["--leader-timeout-ms", "60000"])
            .args(
                self.kept
                    .map(|identity| ["--kept-identity", identity])
                    .into_iter()
                    .flatten(),
            )
            .spawn()
            .expect("start kvbm-dist-node");
        self.workers[rank as usize] = Some(child);
    }

    fn kill(&mut self, rank: u32) {
        if let Some(mut c) = self.workers[rank as usize].take() {
            c.kill().unwrap(); // SIGKILL
            c.wait().unwrap();
        }
    }

    fn g1(&self, rank: u32) -> SharedMapping {
        SharedMapping::open(&self.g1_file(rank), self.layout.total_bytes()).unwrap()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for rank in 0..WORLD {
            self.kill(rank);
        }
    }
}

/// Starts the leader and both workers (`delays[rank]` of fault delay).
fn start(delays: [u64; 2]) -> (Node, Leader) {
    start_in(tempfile::tempdir().unwrap(), delays, None)
}

/// [`start`] in `dir`, G3 kept under `kept` where given.
fn start_in(
    dir: tempfile::TempDir,
    delays: [u64; 2],
    kept: Option<&'static str>,
) -> (Node, Leader) {
    let endpoint = format!("ipc://{}", dir.path().join("leader").display());
    let layout = g1_layout();
    let bpb = layout.config().block_bytes();
    let mut config = LeaderConfig::new(
        endpoint,
        INSTANCE,
        WORLD,
        G2_BLOCKS * bpb * u64::from(WORLD),
        G3_BLOCKS * bpb * u64::from(WORLD),
    );
    config.heartbeat_interval = Duration::from_millis(100);
    config.heartbeat_timeout = Duration::from_secs(5);
    let pending = PendingLeader::bind(config).unwrap();
    let mut node = Node {
        endpoint: pending.endpoint().to_owned(),
        secret: pending.secret().clone(),
        dir,
        layout,
        workers: vec![None, None],
        kept,
    };
    for rank in 0..WORLD {
        create_shared_file(&node.g1_file(rank), &node.layout).unwrap();
        node.spawn(rank, delays[rank as usize]);
    }
    let leader = pending.handshake().unwrap();
    (node, leader)
}

/// The bytes of chunk `i` of the block holding `seq` on `rank`.
fn pattern(seq: u64, rank: u32, i: usize, len: usize) -> Vec<u8> {
    blocks::pattern(seq ^ (u64::from(rank) << 48 | (i as u64) << 32), len)
}

fn chunks(layout: &Layout, block: usize) -> Vec<(usize, usize)> {
    let c = layout.config();
    let mut v = Vec::new();
    for layer in 0..c.num_layers() {
        for outer in 0..c.outer_dim() {
            let ch = layout.chunk(block, layer, outer).unwrap();
            let at = ch.region as u64 * layout.uniform_region_size() + ch.offset;
            v.push((at as usize, ch.len as usize));
        }
    }
    v
}

fn fill(node: &Node, block: usize, seq: u64) {
    for rank in 0..WORLD {
        let mut m = node.g1(rank);
        for (i, (at, len)) in chunks(&node.layout, block).into_iter().enumerate() {
            m.bytes_mut()[at..at + len].copy_from_slice(&pattern(seq, rank, i, len));
        }
    }
}

fn zero_g1(node: &Node) {
    for rank in 0..WORLD {
        node.g1(rank).bytes_mut().fill(0);
    }
}

/// True when G1 `block` holds `seq`'s bytes on every rank (`None`: zeros).
fn holds(node: &Node, block: usize, seq: Option<u64>) -> bool {
    (0..WORLD).all(|rank| {
        let m = node.g1(rank);
        chunks(&node.layout, block)
            .into_iter()
            .enumerate()
            .all(|(i, (at, len))| match seq {
                Some(s) => m.bytes()[at..at + len] == pattern(s, rank, i, len)[..],
                None => m.bytes()[at..at + len].iter().all(|&b| b == 0),
            })
    })
}

fn copy(mover: &DistMover, src: Tier, dst: Tier, pairs: Vec<(usize, usize)>) -> TransferOutcome {
    let (tx, rx) = mpsc::channel();
    mover
        .copy(src, dst, pairs, CancelToken::new())
        .on_complete(move |o| {
            let _ = tx.send(o);
        });
    rx.recv_timeout(WAIT).expect("a copy hung")
}

fn bytes_round_trip_through_every_tier_on_every_worker() {
    let (node, leader) = start([0, 0]);
    let mover = leader.mover();
    assert_eq!(mover.capacity(Tier::G2), Some(G2_BLOCKS as usize));
    assert_eq!(mover.capacity(Tier::G3), Some(G3_BLOCKS as usize));
    let block_bytes = node.layout.config().block_bytes() * u64::from(WORLD);
    assert_eq!(mover.block_bytes(Tier::G2), block_bytes);
    for b in 0..8 {
        fill(&node, b, 100 + b as u64);
    }
    // G1 → G2, then G2 → G3 in reverse order.
    let r = copy(&mover, Tier::G1, Tier::G2, (0..8).map(|b| (b, b)).collect()).unwrap();
    assert_eq!((r.blocks, r.bytes), (8, 8 * block_bytes));
    copy(
        &mover,
        Tier::G2,
        Tier::G3,
        (0..8).map(|b| (b, 11 - b)).collect(),
    )
    .unwrap();
    zero_g1(&node);
    // Back: four blocks from G3 into G1 8..12, four from G2 into G1 4..8.
    copy(
        &mover,
        Tier::G3,
        Tier::G1,
        (0..4).map(|b| (11 - b, b + 8)).collect(),
    )
    .unwrap();
    copy(&mover, Tier::G2, Tier::G1, (4..8).map(|b| (b, b)).collect()).unwrap();
    for b in 0..4 {
        assert!(
            holds(&node, b + 8, Some(100 + b as u64)),
            "G1 block {}",
            b + 8
        );
        assert!(holds(&node, b, None), "G1 block {b} untouched");
    }
    for b in 4..8 {
        assert!(holds(&node, b, Some(100 + b as u64)), "G1 block {b}");
    }
    // The workers' own probes agree (and see each rank's own bytes).
    let probe = |op, blocks: Vec<(u32, u64)>| leader.probe(op, blocks).unwrap();
    probe(ProbeOp::Fill, vec![(0, 42), (1, 43)]);
    copy(&mover, Tier::G1, Tier::G3, vec![(0, 0), (1, 1)]).unwrap();
    zero_g1(&node);
    copy(&mover, Tier::G3, Tier::G1, vec![(0, 2), (1, 3)]).unwrap();
    assert_eq!(
        probe(ProbeOp::Check, vec![(2, 42), (3, 43)]),
        vec![Vec::<u32>::new(); 2]
    );
    assert_eq!(
        probe(ProbeOp::Check, vec![(2, 43), (0, 42)]),
        vec![vec![2, 0]; 2]
    );
    // A request outside the tiers is refused before anything is sent.
    let e = copy(&mover, Tier::G2, Tier::G1, vec![(G2_BLOCKS as usize, 0)]).unwrap_err();
    assert!(
        e.completed.is_empty() && e.to_string().contains("outside G2"),
        "{e}"
    );
    assert!(leader.status().is_whole());
    leader.shutdown();
}

fn a_worker_killed_mid_transfer_fails_it_and_can_rejoin() {
    // Rank 1 waits 2 s before each transfer: the kill lands mid-transfer.
    let (mut node, leader) = start([0, 2000]);
    let mover = leader.mover();
    for b in 0..4 {
        fill(&node, b, 200 + b as u64);
    }
    let (tx, rx) = mpsc::channel();
    mover
        .copy(
            Tier::G1,
            Tier::G2,
            (0..4).map(|b| (b, b)).collect(),
            CancelToken::new(),
        )
        .on_complete(move |o| {
            let _ = tx.send(o);
        });
    std::thread::sleep(Duration::from_millis(300));
    node.kill(1);
    let failure = rx
        .recv_timeout(WAIT)
        .expect("the transfer hung")
        .unwrap_err();
    assert!(failure.to_string().contains("rank 1"), "{failure}");
    assert!(failure.completed.is_empty(), "nothing may be registered");
    assert_eq!(failure.failed.len(), 4);
    let status = leader.status();
    assert!(
        matches!(status.ranks[1], RankState::Lost { .. }),
        "{status:?}"
    );
    assert_eq!(status.losses.len(), 1);
    assert_eq!(status.losses[0].rank, 1);
    // Degraded: copies fail at once, naming the rank.
    let e = copy(&mover, Tier::G1, Tier::G2, vec![(0, 0)]).unwrap_err();
    assert!(e.to_string().contains("rank 1"), "{e}");

    // Rank 1 comes back (without the delay) and the instance is whole.
    node.spawn(1, 0);
    assert!(leader.wait_whole(WAIT), "{:?}", leader.status());
    // G2/G3 bytes died with the old process: reading them fails.
    assert_eq!(
        leader.status().lost_blocks,
        (G2_BLOCKS as usize, G3_BLOCKS as usize)
    );
    let e = copy(&mover, Tier::G2, Tier::G1, vec![(0, 0)]).unwrap_err();
    assert!(
        e.completed.is_empty() && e.to_string().contains("lost"),
        "{e}"
    );
    // Written again, they are served again, on both workers.
    copy(&mover, Tier::G1, Tier::G2, (0..4).map(|b| (b, b)).collect()).unwrap();
    assert_eq!(leader.status().lost_blocks.0, G2_BLOCKS as usize - 4);
    zero_g1(&node);
    copy(
        &mover,
        Tier::G2,
        Tier::G1,
        (0..4).map(|b| (b, b + 4)).collect(),
    )
    .unwrap();
    for b in 0..4 {
        assert!(
            holds(&node, b + 4, Some(200 + b as u64)),
            "G1 block {}",
            b + 4
        );
    }
    leader.shutdown();
    // The workers exit on shutdown.
    for rank in 0..WORLD {
        if let Some(mut c) = node.workers[rank as usize].take() {
            let status = wait_exit(&mut c);
            assert!(status.success(), "rank {rank} exited with {status:?}");
        }
    }
}

/// A reset empties the kept G3 of every worker, of one lost at the time
/// too: it hears of the reset when it rejoins. Each rank's records, opened
/// again once the instance stopped, name no block.
fn a_reset_reaches_a_worker_that_rejoins_after_it() {
    const IDENTITY: &str = "model: tiny";
    let (mut node, leader) = start_in(tempfile::tempdir().unwrap(), [0, 0], Some(IDENTITY));
    let mover = leader.mover();
    for b in 0..2 {
        fill(&node, b, 300 + b as u64);
    }
    copy(&mover, Tier::G1, Tier::G2, vec![(0, 0), (1, 1)]).unwrap();
    let labels = chain(7, 2).into_iter().map(|h| (h, None)).collect();
    let (tx, rx) = mpsc::channel();
    mover
        .copy_labelled(
            Tier::G2,
            Tier::G3,
            vec![(0, 3), (1, 5)],
            labels,
            CancelToken::new(),
        )
        .on_complete(move |o| {
            let _ = tx.send(o);
        });
    rx.recv_timeout(WAIT).expect("a copy hung").unwrap();
    node.kill(1);
    assert!(
        leader.wait_for(WAIT, |s| matches!(s.ranks[1], RankState::Lost { .. })),
        "{:?}",
        leader.status()
    );
    mover.stop_keeping();
    node.spawn(1, 0);
    assert!(leader.wait_whole(WAIT), "{:?}", leader.status());
    leader.shutdown();
    for rank in 0..WORLD {
        if let Some(mut c) = node.workers[rank as usize].take() {
            assert!(wait_exit(&mut c).success(), "rank {rank}");
        }
    }
    let shape = *node.layout.config();
    let g3 = Layout::new(
        shape
            .with_num_blocks(G3_BLOCKS as usize)
            .unwrap()
            .with_alignment(kvbm_transfer::memory::DISK_ALIGNMENT)
            .unwrap(),
        LayoutKind::FullyContiguous,
    )
    .unwrap();
    for rank in 0..WORLD {
        let dir = node.dir.path().join(format!("g3-rank{rank}"));
        let medium = kvbm_dist::kept::Medium::Disk(kvbm_transfer::memory::IoMode::Auto);
        let (_, _, found) =
            kvbm_dist::kept::KeptStore::open_free(&dir, IDENTITY, g3.clone(), &medium).unwrap();
        assert_eq!(
            found.started_fresh, None,
            "rank {rank}'s records were reopened"
        );
        assert!(
            found.blocks.is_empty(),
            "rank {rank} still names {:?}",
            found.blocks
        );
    }
}

fn signal(node: &Node, rank: u32, sig: &str) {
    let pid = node.workers[rank as usize].as_ref().unwrap().id();
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

fn a_stalled_worker_is_lost_by_heartbeat_and_told_to_exit() {
    let (mut node, leader) = start([0, 0]);
    signal(&node, 1, "-STOP");
    assert!(
        leader.wait_for(WAIT, |s| matches!(s.ranks[1], RankState::Lost { .. })),
        "{:?}",
        leader.status()
    );
    let status = leader.status();
    assert!(status.losses[0].reason.contains("silent"), "{status:?}");
    // Resumed, it finds the leader's shutdown and exits.
    signal(&node, 1, "-CONT");
    let mut old = node.workers[1].take().unwrap();
    assert!(wait_exit(&mut old).success());
    node.spawn(1, 0);
    assert!(leader.wait_whole(WAIT), "{:?}", leader.status());
    let mover = leader.mover();
    fill(&node, 0, 7);
    copy(&mover, Tier::G1, Tier::G2, vec![(0, 3)]).unwrap();
    copy(&mover, Tier::G2, Tier::G1, vec![(3, 9)]).unwrap();
    assert!(holds(&node, 9, Some(7)));
}

fn a_cancelled_transfer_reports_cancelled_and_lands_nothing_it_did_not_finish() {
    let (node, leader) = start([1500, 1500]);
    let mover = leader.mover();
    fill(&node, 0, 1);
    let cancel = CancelToken::new();
    let (tx, rx) = mpsc::channel();
    mover
        .copy(Tier::G1, Tier::G2, vec![(0, 0), (1, 1)], cancel.clone())
        .on_complete(move |o| {
            let _ = tx.send(o);
        });
    cancel.cancel();
    let f = rx.recv_timeout(WAIT).expect("hung").unwrap_err();
    assert!(
        matches!(f.error, kvbm_transfer::TransferError::Cancelled),
        "{f}"
    );
    assert!(f.completed.is_empty(), "{f}");
    // The instance is still whole: cancelling is not a fault.
    assert!(leader.status().is_whole());
}

/// The engine computes `hashes` in fresh G1 blocks (bytes written on every
/// rank) and registers them, which queues their offload.
fn compute(node: &Node, engine: &TierEngine, hashes: &[SequenceHash]) {
    let blocks = engine.allocate_g1(hashes.len()).unwrap();
    let mut prev = None;
    let mut complete = Vec::new();
    for (b, &h) in blocks.into_iter().zip(hashes) {
        fill(node, b.block_id() as usize, h.0);
        complete.push(b.complete(h, prev).unwrap());
        prev = Some(h);
    }
    drop(engine.register_g1(complete).unwrap());
}

/// Matches and onboards `hashes` from G2/G3 and checks every loaded block
/// on every rank; returns (G2, G3) blocks matched.
fn onboard_and_verify(
    node: &Node,
    engine: &TierEngine,
    id: &str,
    hashes: &[SequenceHash],
) -> (usize, usize) {
    let tokens = hashes.len() * 16 + 1;
    let m = engine
        .match_request(id, hashes, tokens, G1Lookup::Pool)
        .unwrap();
    let loaded = engine
        .onboard(id, OnboardTarget::Pool)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(loaded.count, m.g2_blocks + m.g3_blocks);
    for i in 0..loaded.blocks.len() {
        let b = loaded.blocks.get(i).unwrap();
        assert!(
            holds(node, b.block_id() as usize, Some(b.sequence_hash().0)),
            "G1 block {} does not hold {:?} on every rank",
            b.block_id(),
            b.sequence_hash()
        );
    }
    drop(loaded);
    engine.release(id);
    (m.g2_blocks, m.g3_blocks)
}

fn the_tier_engine_runs_over_the_workers() {
    let (mut node, leader) = start([0, 0]);
    let engine = TierEngine::builder_with_mover(leader.mover(), 16)
        .offload_mode(OffloadMode::WriteThrough)
        .g2_policy(TierPolicy::WriteThrough)
        .g3_policy(TierPolicy::WriteThrough)
        .build()
        .unwrap();
    let engine = Arc::new(engine);
    let weak = Arc::downgrade(&engine);
    leader.on_worker_lost(move |_| {
        if let Some(e) = weak.upgrade() {
            evict_distributed_tiers(&e);
        }
    });
    // Two chains of 6: G2 (8 blocks) keeps the newest, its victims go to G3.
    let a = chain(1, 6);
    let b = chain(2, 6);
    compute(&node, &engine, &a);
    engine.flush();
    compute(&node, &engine, &b);
    engine.flush();
    engine.g1().evict(G1_BLOCKS);
    zero_g1(&node);
    let (g2, g3) = onboard_and_verify(&node, &engine, "a", &a);
    assert_eq!(g2 + g3, 6, "the whole chain is in G2 or G3");
    assert!(g3 > 0, "some of it came back from disk");

    // A worker dies: its G2/G3 bytes are gone and nothing is served from them.
    engine.g1().evict(G1_BLOCKS);
    node.kill(1);
    assert!(
        leader.wait_for(WAIT, |s| !s.is_whole()),
        "{:?}",
        leader.status()
    );
    let m = engine
        .match_request("after", &b, 6 * 16 + 1, G1Lookup::Pool)
        .unwrap();
    assert_eq!((m.g1_blocks, m.g2_blocks, m.g3_blocks), (0, 0, 0));
    engine.release("after");
    // It rejoins; new blocks flow again.
    node.spawn(1, 0);
    assert!(leader.wait_whole(WAIT), "{:?}", leader.status());
    let c = chain(3, 4);
    compute(&node, &engine, &c);
    engine.flush();
    engine.g1().evict(G1_BLOCKS);
    zero_g1(&node);
    assert_eq!(onboard_and_verify(&node, &engine, "c", &c), (4, 0));
    drop(engine);
    leader.shutdown();
}

fn wait_exit(c: &mut Child) -> std::process::ExitStatus {
    for _ in 0..600 {
        if let Some(s) = c.try_wait().unwrap() {
            return s;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    c.kill().unwrap();
    panic!("a worker did not exit on shutdown");
}

/// Every test, by name.
const TESTS: [(&str, fn()); 6] = [
    (
        "bytes_round_trip_through_every_tier_on_every_worker",
        bytes_round_trip_through_every_tier_on_every_worker,
    ),
    (
        "a_worker_killed_mid_transfer_fails_it_and_can_rejoin",
        a_worker_killed_mid_transfer_fails_it_and_can_rejoin,
    ),
    (
        "a_stalled_worker_is_lost_by_heartbeat_and_told_to_exit",
        a_stalled_worker_is_lost_by_heartbeat_and_told_to_exit,
    ),
    (
        "a_cancelled_transfer_reports_cancelled_and_lands_nothing_it_did_not_finish",
        a_cancelled_transfer_reports_cancelled_and_lands_nothing_it_did_not_finish,
    ),
    (
        "the_tier_engine_runs_over_the_workers",
        the_tier_engine_runs_over_the_workers,
    ),
    (
        "a_reset_reaches_a_worker_that_rejoins_after_it",
        a_reset_reaches_a_worker_that_rejoins_after_it,
    ),
];

fn main() -> ExitCode {
    node_harness::main(&TESTS)
}
