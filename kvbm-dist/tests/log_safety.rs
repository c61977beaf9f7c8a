//! What strangers can do to the leader's log: an identity with a newline
//! and terminal escapes is printed escaped (it cannot forge a line), and a
//! flood of frames produces a bounded number of lines. The leader's log is
//! captured by a subscriber writing to a buffer; the workers are
//! `kvbm-dist-node` processes.

mod common;
mod node_harness;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::{Reaper, WAIT, WorkerSpec, hello, layout, stranger};
use kvbm_dist::auth::InstanceSecret;
use kvbm_dist::leader::{LeaderConfig, PRIVATE_ENDPOINT, PendingLeader};
use kvbm_dist::proto::Message;

#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl Write for Buffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Buffer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

const FORGED: &[u8] = b"evil\n\x1b[32mINFO kvbm_dist::leader: all ranks verified OK\x1b[0m";
const PINGS: u64 = 10_000;

fn strangers_cannot_forge_log_lines_nor_flood_the_log() {
    let log = Buffer::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let instance = 0xb1;
    let bpb = layout().config().block_bytes();
    let mut config = LeaderConfig::new(PRIVATE_ENDPOINT, instance, 2, 8 * bpb, 0);
    config.handshake_timeout = WAIT;
    let pending = PendingLeader::bind(config).unwrap();
    let ep = pending.endpoint().to_owned();
    let secret = pending.secret().clone();
    let key = pending.curve_public().copied();
    let ctx = zmq::Context::new();

    let handshake = std::thread::spawn(move || pending.handshake());
    // A forged identity during the handshake: a hello without the secret.
    let forger = stranger(&ctx, &ep, FORGED, key.as_ref());
    forger
        .send(&hello(
            instance,
            0,
            2,
            FORGED,
            &InstanceSecret::from_bytes([1; 32]),
        ))
        .unwrap();
    assert!(forger.recv_timeout(20_000).unwrap().is_some());
    let _workers = Reaper(
        (0..2)
            .map(|rank| {
                WorkerSpec {
                    dir: dir.path(),
                    endpoint: &ep,
                    instance,
                    rank,
                    world: 2,
                    secret: Some(&secret),
                    leader_timeout_ms: 60_000,
                }
                .spawn()
            })
            .collect(),
    );
    let leader = handshake.join().unwrap().unwrap();

    // The same identity on the running leader, then a flood of pings.
    forger.send(&Message::Ping { seq: 1 }).unwrap();
    let flood = stranger(&ctx, &ep, b"flooder", key.as_ref());
    for seq in 0..PINGS {
        flood.send(&Message::Ping { seq }).unwrap();
    }
    assert!(
        leader.wait_for(WAIT, |s| s.refused.stranger >= PINGS + 2),
        "{:?}",
        leader.status()
    );
    // Every ping was answered with an error, none dropped the leader.
    let mut answered = 0;
    while flood.recv_timeout(2_000).unwrap().is_some() {
        answered += 1;
    }
    assert!(answered > 0);
    assert!(leader.status().is_whole());
    leader.shutdown();

    let text = log.text();
    assert!(!text.contains('\x1b'), "a raw escape reached the log");
    assert!(
        !text.lines().any(|l| l
            .trim_start()
            .starts_with("INFO kvbm_dist::leader: all ranks")),
        "a forged line:\n{text}"
    );
    assert!(
        text.contains(r"evil\n\x1b[32mINFO"),
        "the identity is printed escaped:\n{text}"
    );
    let flood_lines = text.lines().filter(|l| l.contains("flooder")).count();
    assert!(
        (1..=5).contains(&flood_lines),
        "{flood_lines} lines for {PINGS} pings:\n{text}"
    );
}

/// Every test, by name.
const TESTS: [(&str, fn()); 1] = [(
    "strangers_cannot_forge_log_lines_nor_flood_the_log",
    strangers_cannot_forge_log_lines_nor_flood_the_log,
)];

fn main() -> std::process::ExitCode {
    node_harness::main(&TESTS)
}
