//! CURVE on TCP: what crosses the wire between a leader and its
//! `kvbm-dist-node` workers is encrypted (recorded by a relay between
//! them), a worker without the instance's secret cannot even reach the
//! leader, and a peer that does not speak CURVE gets nothing.
//!
//! Without CURVE in this build every test is skipped, and fails instead
//! under `KVBM_REQUIRE_CURVE=1`.

mod common;
mod node_harness;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use common::{
    Reaper, WAIT, WorkerSpec, exit_within, hello, leader_config, spec, stderr_of, stranger,
};
use kvbm_dist::DistError;
use kvbm_dist::auth::InstanceSecret;
use kvbm_dist::curve;
use kvbm_dist::leader::PendingLeader;
use kvbm_pool::Tier;
use kvbm_pool::tier::TierMover;
use kvbm_transfer::CancelToken;
use parking_lot::Mutex;

/// False (after saying so) when this build has no CURVE; panics instead
/// under `KVBM_REQUIRE_CURVE=1`.
fn curve_built() -> bool {
    if curve::available() {
        return true;
    }
    assert!(
        std::env::var("KVBM_REQUIRE_CURVE").as_deref() != Ok("1"),
        "KVBM_REQUIRE_CURVE=1, but this build's ZeroMQ has no CURVE"
    );
    eprintln!("skipped: this build's ZeroMQ has no CURVE");
    false
}

/// Where the leaders of these tests listen.
const TCP: &str = "tcp://127.0.0.1:*";

/// A TCP relay on 127.0.0.1 to `upstream` that keeps every byte it passes
/// towards the leader.
struct Recorder {
    port: u16,
    to_leader: Arc<Mutex<Vec<u8>>>,
}

impl Recorder {
    fn start(upstream: &str) -> Recorder {
        let upstream = upstream.trim_start_matches("tcp://").to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let to_leader = Arc::new(Mutex::new(Vec::new()));
        let record = to_leader.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(&upstream) else {
                    return;
                };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let record = record.clone();
                std::thread::spawn(move || pipe(client, server, Some(record)));
                std::thread::spawn(move || pipe(s2, c2, None));
            }
        });
        Recorder { port, to_leader }
    }

    fn endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    fn recorded(&self) -> Vec<u8> {
        self.to_leader.lock().clone()
    }
}

/// Copies `from` to `to` until either end closes, keeping the bytes in
/// `record` when given.
fn pipe(mut from: TcpStream, mut to: TcpStream, record: Option<Arc<Mutex<Vec<u8>>>>) {
    let mut buf = [0u8; 16 << 10];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
        if let Some(r) = &record {
            r.lock().extend_from_slice(&buf[..n]);
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn frames_on_tcp_are_encrypted_end_to_end() {
    if !curve_built() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let instance = 0xc1;
    let pending = PendingLeader::bind(leader_config(TCP, instance, 2)).unwrap();
    assert!(pending.curve_public().is_some(), "TCP speaks CURVE");
    let relay = Recorder::start(pending.endpoint());
    let ep = relay.endpoint();
    let secret = pending.secret().clone();
    let _workers = Reaper(
        (0..2)
            .map(|r| spec(dir.path(), &ep, instance, r, &secret).spawn())
            .collect(),
    );
    let leader = pending
        .handshake()
        .expect("both ranks join through the relay");
    let (tx, rx) = mpsc::channel();
    leader
        .mover()
        .copy(Tier::G1, Tier::G2, vec![(0, 0), (1, 1)], CancelToken::new())
        .on_complete(move |o| {
            let _ = tx.send(o);
        });
    assert_eq!(rx.recv_timeout(WAIT).unwrap().unwrap().blocks, 2);
    leader.shutdown();

    let bytes = relay.recorded();
    assert!(bytes.len() > 1000, "{} bytes passed", bytes.len());
    // The ZMTP greeting names the mechanism in clear; everything after it
    // is sealed. Under ZeroMQ's NULL mechanism the workers' identities
    // (`<instance>/<rank>/...`) and the `Identity` property would show.
    for rank in 0..2 {
        let id = format!("{instance:x}/{rank}/");
        assert!(!contains(&bytes, id.as_bytes()), "identity {id} in clear");
    }
    assert!(!contains(&bytes, b"Identity"), "metadata in clear");
    assert!(!contains(&bytes, b"Socket-Type"), "metadata in clear");
    assert!(contains(&bytes, b"CURVE"), "greetings name CURVE");
}

fn a_worker_without_the_secret_cannot_reach_the_leader() {
    if !curve_built() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let instance = 0xc2;
    let mut config = leader_config(TCP, instance, 2);
    config.handshake_timeout = Duration::from_secs(8);
    let pending = PendingLeader::bind(config).unwrap();
    let ep = pending.endpoint().to_owned();
    let secret = pending.secret().clone();
    let wrong = InstanceSecret::from_bytes([9; 32]);
    let mut workers = Reaper(vec![
        spec(dir.path(), &ep, instance, 0, &secret).spawn(),
        WorkerSpec {
            leader_timeout_ms: 3_000,
            ..spec(dir.path(), &ep, instance, 1, &wrong)
        }
        .spawn(),
    ]);
    // Its CURVE handshake expects another leader key: the leader never
    // sees its hello, so rank 1 is missing rather than refused.
    let e = pending.handshake().unwrap_err();
    assert!(
        matches!(&e, DistError::Timeout { phase: "hello", missing, .. } if *missing == [1]),
        "{e}"
    );
    let (status, _) = exit_within(&mut workers.0[1], WAIT).expect("rank 1 exits");
    assert!(!status.success());
    let err = stderr_of(&mut workers.0[1]);
    assert!(err.contains("instance secret"), "{err}");
}

fn a_peer_without_curve_gets_nothing() {
    if !curve_built() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let instance = 0xc3;
    let pending = PendingLeader::bind(leader_config(TCP, instance, 2)).unwrap();
    let ep = pending.endpoint().to_owned();
    let secret = pending.secret().clone();
    let key = *pending.curve_public().unwrap();
    let ctx = zmq::Context::new();
    // Plain ZeroMQ, even with a hello the secret signs: no reply, and the
    // leader does not even count it.
    let plain = stranger(&ctx, &ep, b"plain", None);
    plain
        .send(&hello(
            instance,
            0,
            2,
            b"plain",
            &InstanceSecret::from_bytes([3; 32]),
        ))
        .unwrap();
    assert!(plain.recv_timeout(1_500).unwrap().is_none());
    // One that knows the public key gets as far as the MAC check: refused.
    let keyed = stranger(&ctx, &ep, b"keyed", Some(&key));
    keyed
        .send(&hello(
            instance,
            0,
            2,
            b"keyed",
            &InstanceSecret::from_bytes([3; 32]),
        ))
        .unwrap();
    let handle = std::thread::spawn(move || pending.handshake());
    assert!(
        keyed.recv_timeout(20_000).unwrap().is_some(),
        "an error reply"
    );
    let _workers = Reaper(
        (0..2)
            .map(|r| spec(dir.path(), &ep, instance, r, &secret).spawn())
            .collect(),
    );
    let leader = handle.join().unwrap().expect("the handshake completes");
    let st = leader.status();
    assert!(st.is_whole(), "{st:?}");
    assert_eq!(st.refused.stranger, 1, "only the keyed stranger: {st:?}");
    leader.shutdown();
}

const TESTS: [(&str, fn()); 3] = [
    (
        "frames_on_tcp_are_encrypted_end_to_end",
        frames_on_tcp_are_encrypted_end_to_end,
    ),
    (
        "a_worker_without_the_secret_cannot_reach_the_leader",
        a_worker_without_the_secret_cannot_reach_the_leader,
    ),
    (
        "a_peer_without_curve_gets_nothing",
        a_peer_without_curve_gets_nothing,
    ),
];

fn main() -> std::process::ExitCode {
    node_harness::main(&TESTS)
}
