//! Two instances, each a leader (this process) and two worker processes,
//! pulling each other's G2 blocks through NIXL over UCX on loopback TCP.
//! Only the leaders exchange metadata (encoded `PeerInfo` frames, passed
//! through this process); the workers meet only through NIXL's reads.
//! Every byte is checked on every rank, and a pull naming a block the peer
//! does not have is refused and reads nothing.
//!
//! This test binary doubles as the worker process (`node_harness`,
//! `harness = false`): the tests start it again with `worker ...`.

mod node_harness;

use std::process::{Child, Command, ExitCode};
use std::sync::mpsc;
use std::time::Duration;

use kvbm_dist::leader::{Leader, LeaderConfig, PendingLeader, decode_peer_info, encode_peer_info};
use kvbm_dist::proto::ProbeOp;
use kvbm_dist::worker::memory::create_shared_file;
use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_pool::Tier;
use kvbm_pool::tier::TierMover;
use kvbm_transfer::nixl::runtime_or_skip as nixl_or_skip;
use kvbm_transfer::{CancelToken, Completion, TransferOutcome};

const WORLD: u32 = 2;
const G1_BLOCKS: usize = 16;
const G2_BLOCKS: usize = 8;
/// G2 blocks `0..SERVED` hold the instance's own bytes; pulls land in
/// `SERVED..`.
const SERVED: usize = 4;
/// Generous: the box running the tests is loaded.
const WAIT: Duration = Duration::from_secs(90);

/// 2 layers × K/V × 16 tokens × 64 bf16 values: 2 KiB chunks.
fn g1_layout() -> Layout {
    let c = LayoutConfig::new(G1_BLOCKS, 2, 2, 16, 64, 2).unwrap();
    Layout::new(c, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap()
}

/// One instance: its leader and worker processes.
struct Instance {
    _dir: tempfile::TempDir,
    workers: Vec<Child>,
    leader: Leader,
}

impl Drop for Instance {
    fn drop(&mut self) {
        for c in &mut self.workers {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn start(instance: u64) -> Instance {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("ipc://{}", dir.path().join("leader").display());
    let layout = g1_layout();
    let bpb = layout.config().block_bytes();
    let mut config = LeaderConfig::new(
        endpoint,
        instance,
        WORLD,
        G2_BLOCKS as u64 * bpb * u64::from(WORLD),
        0,
    );
    config.heartbeat_interval = Duration::from_millis(100);
    config.heartbeat_timeout = Duration::from_secs(10);
    let pending = PendingLeader::bind(config).unwrap();
    let mut workers = Vec::new();
    for rank in 0..WORLD {
        let g1 = dir.path().join(format!("g1-rank{rank}"));
        create_shared_file(&g1, &layout).unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        pending.secret().pass_to(&mut cmd);
        let child = cmd
            .arg("worker")
            .args(["--endpoint", pending.endpoint()])
            .args(["--instance", &instance.to_string()])
            .args(["--rank", &rank.to_string()])
            .args(["--world", &WORLD.to_string()])
            .args(["--layout", &layout.descriptor().to_json()])
            .args(["--g1-file", g1.to_str().unwrap()])
            .args(["--leader-timeout-ms", "60000"])
            .env("UCX_TLS", "tcp")
            .env("UCX_NET_DEVICES", "lo")
            .env("UCX_MODULES", "^ib")
            .spawn()
            .expect("start kvbm-dist-node");
        workers.push(child);
    }
    let leader = pending.handshake().unwrap();
    Instance {
        _dir: dir,
        workers,
        leader,
    }
}

fn wait(c: Completion<TransferOutcome>) -> TransferOutcome {
    let (tx, rx) = mpsc::channel();
    c.on_complete(move |o| {
        let _ = tx.send(o);
    });
    rx.recv_timeout(WAIT).expect("a transfer hung")
}

fn copy(i: &Instance, src: Tier, dst: Tier, pairs: Vec<(usize, usize)>) {
    let c = i.leader.mover().copy(src, dst, pairs, CancelToken::new());
    wait(c).unwrap();
}

/// The seed of the pattern instance `id` writes into its block `b`.
fn seed(id: u64, b: usize) -> u64 {
    id << 16 | b as u64
}

/// Checks, on every rank, that G2 blocks `(g2 block, seed)` hold their
/// patterns, by copying them up to G1 blocks `8..` and probing there.
fn check_g2(i: &Instance, blocks: &[(usize, u64)]) {
    let up: Vec<(usize, usize)> = blocks
        .iter()
        .enumerate()
        .map(|(k, &(b, _))| (b, 8 + k))
        .collect();
    copy(i, Tier::G2, Tier::G1, up);
    let probe = blocks
        .iter()
        .enumerate()
        .map(|(k, &(_, s))| (8 + k as u32, s))
        .collect();
    let mismatched = i.leader.probe(ProbeOp::Check, probe).unwrap();
    assert_eq!(mismatched.len(), WORLD as usize);
    for (rank, m) in mismatched.iter().enumerate() {
        assert!(m.is_empty(), "rank {rank}: G1 blocks {m:?} differ");
    }
}

fn two_instances_pull_each_others_g2_blocks_through_the_leaders() {
    if !nixl_or_skip("two_instances_pull_each_others_g2_blocks_through_the_leaders") {
        return;
    }
    let (ida, idb) = (0xa, 0xb);
    let a = start(ida);
    let b = start(idb);
    // Each instance writes its own patterns to G1 and offloads them to G2.
    for (i, id) in [(&a, ida), (&b, idb)] {
        let fill = (0..SERVED).map(|k| (k as u32, seed(id, k))).collect();
        i.leader.probe(ProbeOp::Fill, fill).unwrap();
        copy(i, Tier::G1, Tier::G2, (0..SERVED).map(|k| (k, k)).collect());
    }
    // Only the leaders exchange metadata, as encoded frames.
    let frame_a = encode_peer_info(&a.leader.export_peer().unwrap()).unwrap();
    let frame_b = encode_peer_info(&b.leader.export_peer().unwrap()).unwrap();
    let info_a = decode_peer_info(&frame_a).unwrap();
    let info_b = decode_peer_info(&frame_b).unwrap();
    assert_eq!((info_a.instance, info_a.ranks.len()), (ida, WORLD as usize));
    a.leader.connect_peer(&info_b).unwrap();
    b.leader.connect_peer(&info_a).unwrap();
    // Connecting again with the same description is harmless.
    a.leader.connect_peer(&info_b).unwrap();
    // An instance cannot be its own peer.
    assert!(a.leader.connect_peer(&info_a).is_err());

    // Both directions at once; remote blocks in a scrambled order.
    let pairs: Vec<(usize, usize)> = (0..SERVED)
        .map(|k| ((k * 3 + 1) % SERVED, SERVED + k))
        .collect();
    let pull_a = a.leader.remote_pull(idb, pairs.clone());
    let pull_b = b.leader.remote_pull(ida, pairs.clone());
    let (ra, rb) = (wait(pull_a).unwrap(), wait(pull_b).unwrap());
    let block_bytes = g1_layout().config().block_bytes() * u64::from(WORLD);
    for r in [ra, rb] {
        assert_eq!(r.blocks, SERVED);
        assert_eq!(r.bytes, SERVED as u64 * block_bytes);
    }
    for (i, me, peer) in [(&a, ida, idb), (&b, idb, ida)] {
        let mut expect: Vec<(usize, u64)> =
            pairs.iter().map(|&(r, l)| (l, seed(peer, r))).collect();
        // The served blocks are untouched by the peer's reads.
        expect.extend((0..SERVED).map(|k| (k, seed(me, k))));
        check_g2(i, &expect);
    }

    // A pull naming a block the peer does not have is refused on the
    // workers before any read: not even its valid pair lands.
    let refused = wait(a.leader.remote_pull(idb, vec![(0, 0), (G2_BLOCKS, 1)]));
    let failure = refused.expect_err("an out-of-range remote block was pulled");
    assert!(failure.completed.is_empty());
    assert_eq!(failure.failed.len(), 2);
    let text = failure.to_string();
    assert!(text.contains("rank") && text.contains("remote"), "{text}");
    println!("refused: {text}");
    // An unknown peer instance is refused too.
    assert!(wait(a.leader.remote_pull(0xc, vec![(0, 0)])).is_err());
    check_g2(&a, &[(0, seed(ida, 0)), (1, seed(ida, 1))]);
    println!("pulled {SERVED} blocks each way on {WORLD} ranks; refusals read nothing");
}

fn main() -> ExitCode {
    node_harness::main(&[(
        "two_instances_pull_each_others_g2_blocks_through_the_leaders",
        two_instances_pull_each_others_g2_blocks_through_the_leaders,
    )])
}
