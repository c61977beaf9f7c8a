//! Handshake errors, with in-process workers (threads) and raw sockets.

use std::thread::JoinHandle;
use std::time::Duration;

use kvbm_layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::memory::SystemAllocator;

use super::*;
use crate::auth::{InstanceSecret, hello_mac};
use crate::proto::{self, Hello, Message};
use crate::transport::DealerSocket;
use crate::worker::{self, WorkerConfig};
use kvbm_pool::tier::TierMover;

pub(crate) const INSTANCE: u64 = 7;

fn g1(blocks: usize) -> PhysicalLayout {
    let c = LayoutConfig::new(blocks, 2, 2, 4, 32, 2).unwrap();
    let l = Layout::new(c, LayoutKind::FullyContiguous).unwrap();
    PhysicalLayout::allocate_system(l, &SystemAllocator::new()).unwrap()
}

pub(crate) fn endpoint(dir: &tempfile::TempDir) -> String {
    format!("ipc://{}", dir.path().join("leader").display())
}

pub(crate) fn secret() -> InstanceSecret {
    InstanceSecret::from_bytes([3; 32])
}

pub(crate) fn config(endpoint: String, world: u32) -> LeaderConfig {
    let mut c = LeaderConfig::new(endpoint, INSTANCE, world, 1 << 20, 0);
    c.handshake_timeout = Duration::from_secs(20);
    c.secret = Some(secret());
    c
}

fn worker(endpoint: &str, rank: u32, world: u32, blocks: usize) -> JoinHandle<Result<()>> {
    let mut c = WorkerConfig::new(endpoint, INSTANCE, rank, world, g1(blocks), secret());
    c.leader_timeout = Duration::from_secs(20);
    std::thread::spawn(move || worker::run(c))
}

#[test]
fn a_handshake_configures_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let pending = PendingLeader::bind(config(endpoint(&dir), 2)).unwrap();
    let ws: Vec<_> = (0..2)
        .map(|r| worker(pending.endpoint(), r, 2, 8))
        .collect();
    let leader = pending.handshake().unwrap();
    let s = leader.status();
    assert!(s.is_whole());
    // Two ranks: every copy is broadcast, even with both in this process.
    assert!(!leader.mover().is_local());
    // 1 MiB over 2 workers of 1 KiB blocks: 512 blocks each.
    let bpb = g1(8).layout().config().block_bytes();
    assert_eq!(s.g2_blocks as u64, (1 << 20) / (2 * bpb));
    assert_eq!(s.g3_blocks, 0);
    assert_eq!(leader.mover().capacity(kvbm_pool::Tier::G3), None);
    leader.shutdown();
    for w in ws {
        w.join().unwrap().unwrap();
    }
}

#[test]
fn a_shape_mismatch_names_the_rank() {
    let dir = tempfile::tempdir().unwrap();
    let pending = PendingLeader::bind(config(endpoint(&dir), 2)).unwrap();
    let w0 = worker(pending.endpoint(), 0, 2, 8);
    let w1 = worker(pending.endpoint(), 1, 2, 9);
    let e = pending.handshake().unwrap_err();
    assert!(
        matches!(&e, DistError::ShapeMismatch { rank: 1, reason } if reason.contains("device blocks")),
        "{e}"
    );
    // Both workers were told to exit.
    w0.join().unwrap().unwrap();
    w1.join().unwrap().unwrap();
}

#[test]
fn a_missing_rank_times_out_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(endpoint(&dir), 3);
    c.handshake_timeout = Duration::from_millis(1500);
    let pending = PendingLeader::bind(c).unwrap();
    let w0 = worker(pending.endpoint(), 0, 3, 8);
    let w2 = worker(pending.endpoint(), 2, 3, 8);
    let e = pending.handshake().unwrap_err();
    assert!(
        matches!(&e, DistError::Timeout { phase: "hello", missing, .. } if *missing == [1]),
        "{e}"
    );
    w0.join().unwrap().unwrap();
    w2.join().unwrap().unwrap();
}

#[test]
fn a_duplicate_rank_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pending = PendingLeader::bind(config(endpoint(&dir), 2)).unwrap();
    let a = worker(pending.endpoint(), 0, 2, 8);
    let b = worker(pending.endpoint(), 0, 2, 8);
    let e = pending.handshake().unwrap_err();
    assert!(matches!(e, DistError::DuplicateRank { rank: 0, .. }), "{e}");
    // One was told to exit; the other was refused and gives up on its own
    // (it never heard from the leader) — or also got the shutdown.
    let _ = a.join();
    let _ = b.join();
}

/// A rank-0 hello of a one-rank world from `identity`, with the MAC of
/// `secret`.
fn hello(identity: &[u8], secret: &InstanceSecret) -> Message {
    let l = g1(8);
    Message::Hello(Hello {
        instance: INSTANCE,
        rank: 0,
        world_size: 1,
        device_blocks: 8,
        bytes_per_block: l.layout().config().block_bytes(),
        layout: l.layout().descriptor(),
        auth: hello_mac(secret, INSTANCE, 0, 1, identity),
    })
}

fn hello_frame(version: u16) -> Vec<u8> {
    proto::codec::encode_with_version(&hello(b"hostile", &secret()), version).unwrap()
}

#[test]
fn a_wrong_version_is_answered_counted_and_survived() {
    let dir = tempfile::tempdir().unwrap();
    let pending = PendingLeader::bind(config(endpoint(&dir), 1)).unwrap();
    let ctx = zmq::Context::new();
    let peer = DealerSocket::connect(&ctx, pending.endpoint(), b"old-worker", None).unwrap();
    peer.send_raw(
        proto::codec::encode_with_version(
            &hello(b"old-worker", &secret()),
            proto::PROTOCOL_VERSION + 1,
        )
        .unwrap(),
    )
    .unwrap();
    let ep = pending.endpoint().to_owned();
    let handle = std::thread::spawn(move || pending.handshake());
    // The peer got an error reply naming the version.
    let reply = peer.recv_timeout(10_000).unwrap().expect("an error reply");
    assert!(
        matches!(reply.message, Ok(Message::Error(ref r)) if r.message.contains("version")),
        "{reply:?}"
    );
    // The handshake goes on and completes with the real rank 0.
    let w = worker(&ep, 0, 1, 8);
    let leader = handle.join().unwrap().unwrap();
    assert_eq!(leader.status().refused.wrong_version, 1);
    leader.shutdown();
    w.join().unwrap().unwrap();
}

#[test]
fn strangers_hellos_are_refused_during_the_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let pending = PendingLeader::bind(config(endpoint(&dir), 1)).unwrap();
    let ctx = zmq::Context::new();
    let peer = DealerSocket::connect(&ctx, pending.endpoint(), b"stranger", None).unwrap();
    // No secret, a wrong secret, a MAC made for another identity, another
    // instance.
    peer.send(&hello(b"stranger", &InstanceSecret::from_bytes([0; 32])))
        .unwrap();
    peer.send(&hello(b"stranger", &InstanceSecret::from_bytes([9; 32])))
        .unwrap();
    peer.send(&hello(b"someone-else", &secret())).unwrap();
    let mut foreign = hello(b"stranger", &secret());
    if let Message::Hello(h) = &mut foreign {
        h.instance = INSTANCE + 1;
    }
    peer.send(&foreign).unwrap();
    let ep = pending.endpoint().to_owned();
    let handle = std::thread::spawn(move || pending.handshake());
    for _ in 0..4 {
        let reply = peer.recv_timeout(10_000).unwrap().expect("an error reply");
        assert!(matches!(reply.message, Ok(Message::Error(_))), "{reply:?}");
    }
    let w = worker(&ep, 0, 1, 8);
    let leader = handle.join().unwrap().unwrap();
    let refused = leader.status().refused;
    assert_eq!((refused.stranger, refused.wrong_instance), (3, 1));
    leader.shutdown();
    w.join().unwrap().unwrap();
}

#[test]
fn garbage_during_the_handshake_is_answered_and_survived() {
    let dir = tempfile::tempdir().unwrap();
    let pending = PendingLeader::bind(config(endpoint(&dir), 1)).unwrap();
    let ctx = zmq::Context::new();
    let hostile = DealerSocket::connect(&ctx, pending.endpoint(), b"hostile", None).unwrap();
    let mut truncated = hello_frame(proto::PROTOCOL_VERSION);
    truncated.truncate(truncated.len() - 3);
    for frame in [vec![], b"XXXX garbage".to_vec(), truncated] {
        hostile.send_raw(frame).unwrap();
    }
    let ep = pending.endpoint().to_owned();
    let handle = std::thread::spawn(move || pending.handshake());
    for _ in 0..3 {
        let reply = hostile
            .recv_timeout(10_000)
            .unwrap()
            .expect("an error reply");
        assert!(matches!(reply.message, Ok(Message::Error(_))), "{reply:?}");
    }
    let w = worker(&ep, 0, 1, 8);
    let leader = handle.join().unwrap().unwrap();
    assert!(leader.status().is_whole());
    leader.shutdown();
    w.join().unwrap().unwrap();
}

#[test]
fn a_running_leader_answers_hostile_peers_and_stays_whole() {
    let dir = tempfile::tempdir().unwrap();
    let pending = PendingLeader::bind(config(endpoint(&dir), 1)).unwrap();
    let w = worker(pending.endpoint(), 0, 1, 8);
    let ep = pending.endpoint().to_owned();
    let leader = pending.handshake().unwrap();
    let ctx = zmq::Context::new();
    let hostile = DealerSocket::connect(&ctx, &ep, b"intruder", None).unwrap();
    // Garbage, a forged ack from a stranger, a foreign instance's hello.
    hostile.send_raw(vec![0xff; 40]).unwrap();
    hostile
        .send(&Message::Ack(proto::Ack {
            transfer_id: 1,
            rank: 0,
            completed: vec![(0, 0)],
            failure: None,
        }))
        .unwrap();
    let mut foreign = proto::decode(&hello_frame(proto::PROTOCOL_VERSION)).unwrap();
    if let Message::Hello(h) = &mut foreign {
        h.instance = INSTANCE + 1;
    }
    hostile.send(&foreign).unwrap();
    for _ in 0..3 {
        let reply = hostile
            .recv_timeout(10_000)
            .unwrap()
            .expect("an error reply");
        assert!(matches!(reply.message, Ok(Message::Error(_))), "{reply:?}");
    }
    assert!(leader.status().is_whole());
    // A copy still works.
    let out = leader
        .mover()
        .copy(
            kvbm_pool::Tier::G1,
            kvbm_pool::Tier::G2,
            vec![(1, 2)],
            kvbm_transfer::CancelToken::new(),
        )
        .wait();
    assert_eq!(out.unwrap().blocks, 1);
    leader.shutdown();
    w.join().unwrap().unwrap();
}

fn wait_outcome(
    c: kvbm_transfer::Completion<kvbm_transfer::TransferOutcome>,
) -> kvbm_transfer::TransferOutcome {
    let (tx, rx) = std::sync::mpsc::channel();
    c.on_complete(move |o| {
        let _ = tx.send(o);
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("a pull hung")
}

#[test]
fn remote_pulls_and_peer_connects_are_refused_before_any_worker_reads() {
    let dir = tempfile::tempdir().unwrap();
    let pending = PendingLeader::bind(config(endpoint(&dir), 2)).unwrap();
    let ws: Vec<_> = (0..2)
        .map(|r| worker(pending.endpoint(), r, 2, 8))
        .collect();
    let leader = pending.handshake().unwrap();
    let g2 = leader.status().g2_blocks;
    // A peer of another world size: refused by the leader.
    let one_rank = proto::PeerInfo {
        instance: INSTANCE + 1,
        ranks: vec![proto::PeerRank {
            nixl_metadata: vec![1, 2, 3],
            layout: g1(8).layout().descriptor(),
        }],
    };
    assert!(matches!(
        leader.connect_peer(&one_rank),
        Err(DistError::InvalidConfig(_))
    ));
    // A peer whose ranks' descriptions are garbage: refused by a worker,
    // named in the error.
    let garbage = proto::PeerInfo {
        ranks: vec![one_rank.ranks[0].clone(); 2],
        ..one_rank
    };
    assert!(matches!(
        leader.connect_peer(&garbage),
        Err(DistError::Worker { .. })
    ));
    // A local block out of range: refused by the leader.
    let f = wait_outcome(leader.remote_pull(INSTANCE + 1, vec![(0, g2)])).unwrap_err();
    assert_eq!(f.failed, vec![(0, g2)]);
    // A peer nobody connected: refused by every worker, nothing landed.
    let f = wait_outcome(leader.remote_pull(INSTANCE + 1, vec![(0, 0), (1, 1)])).unwrap_err();
    assert!(f.completed.is_empty());
    assert_eq!(f.failed.len(), 2);
    assert!(f.to_string().contains("rank"), "{f}");
    // The frame leaders exchange round-trips; another frame is refused.
    let frame = encode_peer_info(&garbage).unwrap();
    assert_eq!(decode_peer_info(&frame).unwrap(), garbage);
    let ping = proto::encode(&Message::Ping { seq: 1 }).unwrap();
    assert!(decode_peer_info(&ping).is_err());
    #[cfg(not(feature = "nixl"))]
    assert!(matches!(
        leader.export_peer(),
        Err(DistError::Worker { .. })
    ));
    leader.shutdown();
    for w in ws {
        w.join().unwrap().unwrap();
    }
}

/// A one-rank instance in this process, the worker started before the
/// leader binds (as vLLM does) or after; copies G1 block 1 -> G2 block 2
/// -> G1 block 3 and checks the bytes.
fn lent_executor_moves_the_bytes(worker_first: bool) {
    let dir = tempfile::tempdir().unwrap();
    let start_worker = || {
        let mut c = WorkerConfig::new(endpoint(&dir), INSTANCE, 0, 1, g1(8), secret());
        c.leader_timeout = Duration::from_secs(20);
        c.probe = Some(Box::new(worker::probe::HostProbe));
        std::thread::spawn(move || worker::run(c))
    };
    let early = worker_first.then(start_worker);
    let pending = PendingLeader::bind(config(endpoint(&dir), 1)).unwrap();
    let w = early.unwrap_or_else(start_worker);
    let leader = pending.handshake().unwrap();
    let mover = leader.mover();
    assert!(mover.is_local(), "the only worker lends its executor");
    leader.probe(proto::ProbeOp::Fill, vec![(1, 42)]).unwrap();
    for (src, dst, pair) in [
        (kvbm_pool::Tier::G1, kvbm_pool::Tier::G2, (1, 2)),
        (kvbm_pool::Tier::G2, kvbm_pool::Tier::G1, (2, 3)),
    ] {
        let out = mover
            .copy(src, dst, vec![pair], kvbm_transfer::CancelToken::new())
            .wait();
        assert_eq!(out.unwrap().blocks, 1);
    }
    let check = |seed| {
        leader
            .probe(proto::ProbeOp::Check, vec![(3, seed)])
            .unwrap()
    };
    assert_eq!(check(42), vec![Vec::<u32>::new()]);
    assert_eq!(check(43), vec![vec![3]], "the check tells patterns apart");
    leader.shutdown();
    w.join().unwrap().unwrap();
    // The loan ended with the worker's loop.
    assert!(!mover.is_local());
}

#[test]
fn the_only_worker_lends_its_executor_to_a_leader_started_first() {
    lent_executor_moves_the_bytes(false);
}

#[test]
fn the_only_worker_lends_its_executor_to_a_leader_started_later() {
    lent_executor_moves_the_bytes(true);
}
