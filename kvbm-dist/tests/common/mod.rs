//! What the multi-process hardening tests share: a small layout, worker
//! processes (the test binary itself started as `worker ...`, which runs
//! `kvbm-dist-node`'s entry point: see `node_harness`) and hand-made
//! frames.
#![allow(dead_code)] // Each test binary uses its own part.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvbm_dist::auth::{InstanceSecret, hello_mac};
use kvbm_dist::curve::LeaderPublicKey;
use kvbm_dist::leader::LeaderConfig;
use kvbm_dist::proto::{self, Hello, Message};
use kvbm_dist::transport::DealerSocket;
use kvbm_dist::worker::memory::create_shared_file;
use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};

/// Generous: the box running the tests is loaded.
pub const WAIT: Duration = Duration::from_secs(60);

/// 8 blocks, 2 layers × K/V × 16 tokens × 128 bf16: 4 KiB chunks, so G3's
/// blocks are disk-aligned.
pub fn layout() -> Layout {
    let c = LayoutConfig::new(8, 2, 2, 16, 128, 2).unwrap();
    Layout::new(c, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap()
}

/// A worker process of `instance`, rank `rank` of `world`, whose G1 file
/// and G3 directory live in `dir`.
pub struct WorkerSpec<'a> {
    pub dir: &'a Path,
    pub endpoint: &'a str,
    pub instance: u64,
    pub rank: u32,
    pub world: u32,
    pub secret: Option<&'a InstanceSecret>,
    pub leader_timeout_ms: u64,
}

impl WorkerSpec<'_> {
    pub fn g3_dir(&self) -> PathBuf {
        self.dir.join(format!("g3-rank{}", self.rank))
    }

    /// Starts it, its stderr piped.
    pub fn spawn(&self) -> Child {
        let layout = layout();
        let g1 = self.dir.join(format!("g1-rank{}", self.rank));
        create_shared_file(&g1, &layout).unwrap();
        std::fs::create_dir_all(self.g3_dir()).unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.arg("worker")
            .args(["--endpoint", self.endpoint])
            .args(["--instance", &self.instance.to_string()])
            .args(["--rank", &self.rank.to_string()])
            .args(["--world", &self.world.to_string()])
            .args(["--layout", &layout.descriptor().to_json()])
            .args(["--g1-file", g1.to_str().unwrap()])
            .args(["--g3-dir", self.g3_dir().to_str().unwrap()])
            .args(["--leader-timeout-ms", &self.leader_timeout_ms.to_string()])
            .stderr(Stdio::piped());
        if let Some(s) = self.secret {
            s.pass_to(&mut cmd);
        }
        cmd.spawn().expect("start kvbm-dist-node")
    }
}

/// Waits up to `limit` for `c` to exit; `None` if it did not (then it is
/// killed).
pub fn exit_within(c: &mut Child, limit: Duration) -> Option<(ExitStatus, Duration)> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(s) = c.try_wait().unwrap() {
            return Some((s, start.elapsed()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
    None
}

/// Everything `c` wrote to its (piped) stderr.
pub fn stderr_of(c: &mut Child) -> String {
    use std::io::Read;
    let mut s = String::new();
    if let Some(mut e) = c.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

/// True when `dir` holds no file.
pub fn is_empty(dir: &Path) -> bool {
    std::fs::read_dir(dir).map_or(true, |mut d| d.next().is_none())
}

/// A rank `rank` hello of instance `instance` in a world of `world`, sent
/// from `identity`, with the MAC `secret` gives for `mac_identity`.
pub fn hello(
    instance: u64,
    rank: u32,
    world: u32,
    mac_identity: &[u8],
    secret: &InstanceSecret,
) -> Message {
    let l = layout();
    Message::Hello(Hello {
        instance,
        rank,
        world_size: world,
        device_blocks: l.config().num_blocks() as u64,
        bytes_per_block: l.config().block_bytes(),
        layout: l.descriptor(),
        auth: hello_mac(secret, instance, rank, world, mac_identity),
    })
}

/// `message` encoded with protocol version `version` in its header.
pub fn with_version(message: &Message, version: u16) -> Vec<u8> {
    let mut frame = proto::encode(message).unwrap();
    frame[4..6].copy_from_slice(&version.to_le_bytes());
    frame
}

/// A stranger's socket on `endpoint` with `identity`, knowing the leader's
/// CURVE public key `leader` when it has one (a public key is no secret:
/// the `Hello` MAC is what keeps a stranger out).
pub fn stranger(
    ctx: &zmq::Context,
    endpoint: &str,
    identity: &[u8],
    leader: Option<&LeaderPublicKey>,
) -> DealerSocket {
    DealerSocket::connect(ctx, endpoint, identity, leader).unwrap()
}

/// Kills every child when dropped.
pub struct Reaper(pub Vec<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A leader of `world` ranks on `endpoint`, with G2 and G3 of four blocks
/// per rank, a heartbeat every 100 ms and a generous handshake.
pub fn leader_config(endpoint: &str, instance: u64, world: u32) -> LeaderConfig {
    let bpb = layout().config().block_bytes();
    let mut c = LeaderConfig::new(
        endpoint,
        instance,
        world,
        4 * bpb * u64::from(world),
        4 * bpb * u64::from(world),
    );
    c.handshake_timeout = WAIT;
    c.heartbeat_interval = Duration::from_millis(100);
    c
}

/// Rank `rank` of a two-rank instance, holding `secret`, with a
/// one-minute leader timeout.
pub fn spec<'a>(
    dir: &'a std::path::Path,
    endpoint: &'a str,
    instance: u64,
    rank: u32,
    secret: &'a InstanceSecret,
) -> WorkerSpec<'a> {
    WorkerSpec {
        dir,
        endpoint,
        instance,
        rank,
        world: 2,
        secret: Some(secret),
        leader_timeout_ms: 60_000,
    }
}
