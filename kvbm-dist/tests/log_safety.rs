//! What strangers can do to the leader's log: an identity with a newline
//! and terminal escapes is printed escaped (it cannot forge a line), so is
//! a layout whose JSON quotes such text (over IPC, and over TCP with
//! CURVE), and a flood of frames produces a bounded number of lines. The
//! leader's log is captured by a subscriber writing to a buffer; the
//! workers are `kvbm-dist-node` processes.

mod common;
mod node_harness;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::{Reaper, WAIT, WorkerSpec, hello, layout, stranger};
use kvbm_dist::auth::InstanceSecret;
use kvbm_dist::curve;
use kvbm_dist::leader::{LeaderConfig, PRIVATE_ENDPOINT, PendingLeader};
use kvbm_dist::proto::{self, HEADER_BYTES, Message};

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

/// The log of this process, captured from the first call on.
fn log() -> Buffer {
    static LOG: OnceLock<Buffer> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Buffer::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).unwrap();
        log
    })
    .clone()
}

/// No raw control character, and no line that starts like a record of
/// the leader's own.
fn assert_unforged(text: &str) {
    assert!(
        !text.chars().any(|c| c.is_control() && c != '\n'),
        "a raw control character reached the log:\n{text:?}"
    );
    assert!(
        !text.lines().any(|l| l
            .trim_start()
            .starts_with("INFO kvbm_dist::leader: all ranks")),
        "a forged line:\n{text}"
    );
}

fn strangers_cannot_forge_log_lines_nor_flood_the_log() {
    let log = log();

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
    assert_unforged(&text);
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

/// A rank-0 hello of `instance` in a world of one whose layout names an
/// unknown kind: [`FORGED`] (the decoder's error quotes it).
fn hello_with_forged_layout(instance: u64) -> Vec<u8> {
    let secret = InstanceSecret::from_bytes([1; 32]);
    let Message::Hello(h) = hello(instance, 0, 1, b"x", &secret) else {
        unreachable!("hello() makes a hello")
    };
    let json = h.layout.to_json();
    let frame = proto::encode(&Message::Hello(h)).unwrap();
    let kind = match json.split_once("\"kind\":") {
        Some((_, rest)) => rest.split_once(",\"strides\"").unwrap().0.to_owned(),
        None => panic!("no kind in {json}"),
    };
    let forged = json.replace(
        &kind,
        &serde_json::to_string(&String::from_utf8_lossy(FORGED)).unwrap(),
    );
    // Header and the five numbers, then the descriptor's length and JSON,
    // then the MAC.
    let fields = HEADER_BYTES + 8 + 4 + 4 + 8 + 8;
    let mut out = frame[..fields].to_vec();
    out.extend_from_slice(&(forged.len() as u32).to_le_bytes());
    out.extend_from_slice(forged.as_bytes());
    out.extend_from_slice(&frame[frame.len() - 32..]);
    let body = (out.len() - HEADER_BYTES) as u32;
    out[8..12].copy_from_slice(&body.to_le_bytes());
    out
}

/// A leader on `endpoint` refuses a hello whose layout quotes [`FORGED`]:
/// its log and its handshake error hold it escaped.
fn refuse_forged_layout(endpoint: &str, instance: u64) {
    let log = log();
    let mut config = LeaderConfig::new(
        endpoint,
        instance,
        1,
        8 * layout().config().block_bytes(),
        0,
    );
    config.handshake_timeout = Duration::from_secs(3);
    let pending = PendingLeader::bind(config).unwrap();
    let ep = pending.endpoint().to_owned();
    let key = pending.curve_public().copied();
    let ctx = zmq::Context::new();
    let handshake = std::thread::spawn(move || pending.handshake());
    let forger = stranger(&ctx, &ep, b"layout-forger", key.as_ref());
    forger.send_raw(hello_with_forged_layout(instance)).unwrap();
    // The refusal is logged before it is answered.
    assert!(
        forger.recv_timeout(20_000).unwrap().is_some(),
        "{endpoint}: no answer"
    );
    let e = handshake.join().unwrap().unwrap_err().to_string();
    assert!(!e.chars().any(char::is_control), "{endpoint}: {e:?}");
    assert!(e.contains(r"evil\n\u{1b}[32mINFO"), "{endpoint}: {e}");
    let text = log.text();
    assert!(
        text.contains("layout-forger"),
        "{endpoint}: not logged:\n{text}"
    );
    assert_unforged(&text);
}

fn forged_layouts_cannot_forge_log_lines() {
    refuse_forged_layout(PRIVATE_ENDPOINT, 0xb2);
    if curve::available() {
        refuse_forged_layout("tcp://127.0.0.1:*", 0xb3);
    } else {
        assert!(
            std::env::var("KVBM_REQUIRE_CURVE").as_deref() != Ok("1"),
            "KVBM_REQUIRE_CURVE=1, but this build's ZeroMQ has no CURVE"
        );
        eprintln!("skipped over TCP: this build's ZeroMQ has no CURVE");
    }
}

/// Every test, by name.
const TESTS: [(&str, fn()); 2] = [
    (
        "strangers_cannot_forge_log_lines_nor_flood_the_log",
        strangers_cannot_forge_log_lines_nor_flood_the_log,
    ),
    (
        "forged_layouts_cannot_forge_log_lines",
        forged_layouts_cannot_forge_log_lines,
    ),
];

fn main() -> std::process::ExitCode {
    node_harness::main(&TESTS)
}
