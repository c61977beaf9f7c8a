//! `kvbm-dist-node`: the worker process, one per GPU / tensor-parallel
//! rank. [`main`] is the whole body of this crate's `kvbm-dist-node`
//! binary (and of the test and bench executables that start themselves as
//! workers).
//!
//! ```text
//! kvbm-dist-node worker --endpoint E --instance I --rank R --world W
//!     --layout DESCRIPTOR_JSON [--g1-file PATH] [--g3-dir DIR]
//!     [--kept-identity TEXT] [--g2-keep-dir DIR] [--host-g1] [--threads N]
//!     [--leader-timeout-ms MS] [--secret-file PATH]
//! ```
//!
//! (With feature `fault-injection`, `--fault-delay-ms MS` delays every
//! transfer, for tests that kill a worker mid-transfer.)
//!
//! The instance secret comes from the environment variable
//! `KVBM_INSTANCE_SECRET` (removed at once) or from `--secret-file`, a file
//! of this user's with mode 0600 — never from the command line, which any
//! user of the host can read.
//!
//! G1 comes one of two ways:
//! - `--g1-file PATH`: host memory shared with the engine process through
//!   a file both map (created by the engine at the layout's size); the
//!   multi-process tests start workers this way.
//! - without it, the worker allocates G1 itself, standing in for the
//!   engine (benches): on GPU `rank` when built with `cuda`, the GPU exists
//!   and `--host-g1` is not given (G2 then in pinned memory, copies through
//!   the CUDA backend with `--threads` memcpy threads beside it), in host
//!   memory otherwise.
//!
//! Built with feature `probe` (a test hook: tests and benches), the worker
//! writes and checks test patterns in G1 for the leader either way, so a
//! leader can verify every rank's bytes.
//!
//! With `--kept-identity` (and `--g3-dir`) G3 outlives the process: a worker
//! started again on the same directory with the same identity finds every
//! block G3 held and reports them to its leader (see
//! [`crate::kept`]); without it G3 starts empty and its file goes with
//! the process. `--g2-keep-dir` (a directory in `/dev/shm`) does the same
//! for G2.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use kvbm_layout::{Layout, LayoutDescriptor};
use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::memory::SystemAllocator;

use crate::auth::InstanceSecret;
use crate::error::{DistError, Result};
use crate::worker::memory::SharedMapping;
#[cfg(feature = "probe")]
use crate::worker::probe::HostProbe;
use crate::worker::{self, WorkerConfig};

/// A worker process's arguments (`kvbm-dist-node worker ...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeArgs {
    /// The leader's endpoint.
    pub endpoint: String,
    /// The instance.
    pub instance: u64,
    /// This worker's rank.
    pub rank: u32,
    /// Ranks in all.
    pub world: u32,
    /// The G1 layout, as a descriptor's JSON.
    pub layout_json: String,
    /// A file the engine shares as G1; `None`: the worker allocates G1.
    pub g1_file: Option<PathBuf>,
    /// Directory for this worker's G3 file.
    pub g3_dir: Option<PathBuf>,
    /// Keeps G3 in `g3_dir` across restarts under this identity (what its
    /// bytes mean; [`WorkerConfig::kept_identity`]); `None`: G3 starts empty.
    pub kept_identity: Option<String>,
    /// Keeps G2 across restarts in this directory
    /// ([`WorkerConfig::g2_keep_dir`]), under `kept_identity`.
    pub g2_keep_dir: Option<PathBuf>,
    /// Keep a worker-allocated G1 in host memory even when a GPU is present.
    pub host_g1: bool,
    /// memcpy threads of a GPU worker's executor.
    pub threads: usize,
    /// Fault injection: wait this long before starting each transfer.
    #[cfg(feature = "fault-injection")]
    pub fault_delay: Duration,
    /// Exit when the leader has been silent this long.
    pub leader_timeout: Duration,
    /// A 0600 file holding the instance secret; `None`: the secret comes
    /// from the environment.
    pub secret_file: Option<PathBuf>,
}

impl NodeArgs {
    /// A worker of `rank` in a world of `world` with G1 of `layout_json`,
    /// the defaults elsewhere (G1 allocated by the worker on its GPU if it
    /// has one, no G3 directory, 2 memcpy threads, no fault delay, a leader
    /// timeout that outlasts the default leader handshake: 40 s).
    pub fn new(
        endpoint: impl Into<String>,
        instance: u64,
        rank: u32,
        world: u32,
        layout_json: impl Into<String>,
    ) -> Self {
        NodeArgs {
            endpoint: endpoint.into(),
            instance,
            rank,
            world,
            layout_json: layout_json.into(),
            g1_file: None,
            g3_dir: None,
            kept_identity: None,
            g2_keep_dir: None,
            host_g1: false,
            threads: 2,
            #[cfg(feature = "fault-injection")]
            fault_delay: Duration::ZERO,
            leader_timeout: crate::leader::worker_leader_timeout(
                crate::leader::DEFAULT_HANDSHAKE_TIMEOUT,
            ),
            secret_file: None,
        }
    }

    /// Parses the command line after the program name (`worker --flag
    /// value ...`).
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<NodeArgs> {
        let bad = |m: String| DistError::InvalidConfig(m);
        let mut args = args.into_iter();
        match args.next().as_deref() {
            Some("worker") => {}
            other => {
                return Err(bad(format!(
                    "usage: kvbm-dist-node worker --flag value..., got {other:?}"
                )));
            }
        }
        let mut endpoint = None;
        let mut instance = None;
        let mut rank = None;
        let mut world = None;
        let mut layout = None;
        let mut out = NodeArgs::new("", 0, 0, 0, "");
        while let Some(k) = args.next() {
            let key = k
                .strip_prefix("--")
                .ok_or_else(|| bad(format!("expected a --flag, got {k:?}")))?;
            if key == "host-g1" {
                out.host_g1 = true;
                continue;
            }
            let v = args
                .next()
                .ok_or_else(|| bad(format!("--{key} needs a value")))?;
            let num =
                |v: &str| -> Result<u64> { v.parse().map_err(|e| bad(format!("--{key}: {e}"))) };
            let rank_num = |v: &str| -> Result<u32> {
                u32::try_from(num(v)?).map_err(|e| bad(format!("--{key}: {e}")))
            };
            match key {
                "endpoint" => endpoint = Some(v),
                "instance" => instance = Some(num(&v)?),
                "rank" => rank = Some(rank_num(&v)?),
                "world" => world = Some(rank_num(&v)?),
                "layout" => layout = Some(v),
                "g1-file" => out.g1_file = Some(PathBuf::from(v)),
                "g3-dir" => out.g3_dir = Some(PathBuf::from(v)),
                "g2-keep-dir" => out.g2_keep_dir = Some(PathBuf::from(v)),
                "kept-identity" => {
                    if v.trim().is_empty() {
                        return Err(bad("--kept-identity must not be empty".into()));
                    }
                    out.kept_identity = Some(v);
                }
                "secret-file" => out.secret_file = Some(PathBuf::from(v)),
                "threads" => {
                    out.threads = usize::try_from(num(&v)?)
                        .ok()
                        .filter(|&t| t > 0)
                        .ok_or_else(|| bad(format!("--threads {v}: must be at least 1")))?;
                }
                #[cfg(feature = "fault-injection")]
                "fault-delay-ms" => out.fault_delay = Duration::from_millis(num(&v)?),
                "leader-timeout-ms" => out.leader_timeout = Duration::from_millis(num(&v)?),
                _ => return Err(bad(format!("unknown flag --{key}"))),
            }
        }
        let need = |k: &str| bad(format!("--{k} is required"));
        out.endpoint = endpoint.ok_or_else(|| need("endpoint"))?;
        out.instance = instance.ok_or_else(|| need("instance"))?;
        out.rank = rank.ok_or_else(|| need("rank"))?;
        out.world = world.ok_or_else(|| need("world"))?;
        out.layout_json = layout.ok_or_else(|| need("layout"))?;
        if out.kept_identity.is_some() && out.g3_dir.is_none() && out.g2_keep_dir.is_none() {
            return Err(bad("--kept-identity needs --g3-dir or --g2-keep-dir".into()));
        }
        if out.g2_keep_dir.is_some() && out.kept_identity.is_none() {
            return Err(bad("--g2-keep-dir needs --kept-identity".into()));
        }
        Ok(out)
    }

    /// The command line that [`NodeArgs::parse`] reads back as `self`.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "worker".to_string(),
            "--endpoint".into(),
            self.endpoint.clone(),
            "--instance".into(),
            self.instance.to_string(),
            "--rank".into(),
            self.rank.to_string(),
            "--world".into(),
            self.world.to_string(),
            "--layout".into(),
            self.layout_json.clone(),
            "--threads".into(),
            self.threads.to_string(),
            "--leader-timeout-ms".into(),
            self.leader_timeout.as_millis().to_string(),
        ];
        if let Some(f) = &self.g1_file {
            v.push("--g1-file".into());
            v.push(f.display().to_string());
        }
        if let Some(d) = &self.g3_dir {
            v.push("--g3-dir".into());
            v.push(d.display().to_string());
        }
        if let Some(identity) = &self.kept_identity {
            v.push("--kept-identity".into());
            v.push(identity.clone());
        }
        if let Some(d) = &self.g2_keep_dir {
            v.push("--g2-keep-dir".into());
            v.push(d.display().to_string());
        }
        #[cfg(feature = "fault-injection")]
        if !self.fault_delay.is_zero() {
            v.push("--fault-delay-ms".into());
            v.push(self.fault_delay.as_millis().to_string());
        }
        if let Some(f) = &self.secret_file {
            v.push("--secret-file".into());
            v.push(f.display().to_string());
        }
        if self.host_g1 {
            v.push("--host-g1".into());
        }
        v
    }
}

/// The `kvbm-dist-node` binary: parses the process's arguments, runs the
/// worker until the leader shuts it down, and reports an error on stderr.
///
/// Call it first thing in the process's `main`: it takes the secret out of
/// the environment before any other thread can read or change it.
pub fn main() -> ExitCode {
    // SAFETY: called first in the process's `main` (this function's
    // contract), before any thread is started.
    let from_env = unsafe { InstanceSecret::take_from_env() };
    let outcome = NodeArgs::parse(std::env::args().skip(1)).and_then(|a| {
        let secret = match &a.secret_file {
            Some(path) => InstanceSecret::read_file(path),
            None => from_env,
        }?;
        run(&a, secret)
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvbm-dist-node: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs one worker with `args` and the instance's `secret` until the
/// leader shuts it down (`Ok`) or goes silent.
pub fn run(args: &NodeArgs, secret: InstanceSecret) -> Result<()> {
    let layout = LayoutDescriptor::from_json(&args.layout_json)
        .and_then(|d| d.to_layout())
        .map_err(|e| DistError::InvalidConfig(format!("--layout: {e}")))?;
    if let Some(dir) = &args.g3_dir {
        std::fs::create_dir_all(dir).map_err(|source| DistError::Io {
            what: "create the G3 directory",
            source,
        })?;
    }
    let mut config = match &args.g1_file {
        Some(path) => {
            let mapping = SharedMapping::open(path, layout.total_bytes())?;
            let g1 = Arc::new(mapping).physical_layout(layout)?;
            worker_config(args, g1, secret)
        }
        None => own_g1(args, layout, secret)?,
    };
    #[cfg(feature = "probe")]
    if args.g1_file.is_some() {
        config.probe = Some(Box::new(HostProbe));
    }
    config.g3_dir = args.g3_dir.clone();
    config.kept_identity = args.kept_identity.clone();
    config.g2_keep_dir = args.g2_keep_dir.clone();
    #[cfg(feature = "fault-injection")]
    {
        config.fault_delay = args.fault_delay;
    }
    config.leader_timeout = args.leader_timeout;
    worker::run(config)
}

fn worker_config(args: &NodeArgs, g1: PhysicalLayout, secret: InstanceSecret) -> WorkerConfig {
    WorkerConfig::new(
        args.endpoint.clone(),
        args.instance,
        args.rank,
        args.world,
        g1,
        secret,
    )
}

/// A worker whose G1 it allocates itself: GPU `rank` when there is one
/// (and `--host-g1` was not given), host memory otherwise.
fn own_g1(args: &NodeArgs, layout: Layout, secret: InstanceSecret) -> Result<WorkerConfig> {
    #[cfg(feature = "cuda")]
    if !args.host_g1
        && let Some(dev) = worker::device::device_at(args.rank as usize)
    {
        use worker::device::DeviceG1;
        eprintln!(
            "kvbm-dist-node rank {}: G1 on GPU {} ({})",
            args.rank,
            args.rank,
            dev.name()
        );
        let g1 = DeviceG1::allocate(&dev, layout)?;
        let mut config = worker_config(args, g1.physical().clone(), secret);
        config.executor = Some(executor(args, g1.physical())?);
        #[cfg(feature = "probe")]
        {
            config.probe = Some(Box::new(g1.probe()));
        }
        return Ok(config);
    }
    let why = if args.host_g1 {
        "asked for"
    } else if cfg!(feature = "cuda") {
        "no CUDA device for this rank"
    } else {
        "built without CUDA"
    };
    eprintln!(
        "kvbm-dist-node rank {}: G1 host-memory stand-in ({why})",
        args.rank
    );
    let g1 = PhysicalLayout::allocate_system(layout, &SystemAllocator::new())?;
    let executor = executor(args, &g1)?;
    let mut config = worker_config(args, g1, secret);
    config.executor = Some(executor);
    #[cfg(feature = "probe")]
    {
        config.probe = Some(Box::new(HostProbe));
    }
    Ok(config)
}

/// The executor for `g1` (see [`worker::executor_spec`]) with `--threads`
/// memcpy threads.
fn executor(args: &NodeArgs, g1: &PhysicalLayout) -> Result<kvbm_transfer::Executor> {
    Ok(worker::executor_spec(g1)?
        .memcpy_threads(args.threads)
        .disk(true)
        .build()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn arguments_round_trip() {
        let mut a = NodeArgs::new("tcp://127.0.0.1:5555", 7, 1, 2, "{}");
        assert_eq!(NodeArgs::parse(a.to_args()).unwrap(), a);
        a.g1_file = Some("/tmp/g1".into());
        a.g3_dir = Some("/tmp/g3".into());
        a.host_g1 = true;
        a.threads = 4;
        #[cfg(feature = "fault-injection")]
        {
            a.fault_delay = Duration::from_millis(5);
        }
        a.leader_timeout = Duration::from_secs(120);
        a.secret_file = Some("/run/kvbm/secret".into());
        assert_eq!(NodeArgs::parse(a.to_args()).unwrap(), a);
    }

    #[test]
    fn kept_identity_is_parsed_and_needs_a_g3_directory() {
        let mut a = NodeArgs::new("tcp://127.0.0.1:5555", 7, 1, 2, "{}");
        // An identity of several lines, as callers write them.
        a.kept_identity = Some("model: tiny\ntp: rank 1 of 2".into());
        let e = NodeArgs::parse(a.to_args()).unwrap_err().to_string();
        assert!(e.contains("--kept-identity needs --g3-dir"), "{e}");
        a.g2_keep_dir = Some("/dev/shm/kvbm-test".into());
        let parsed = NodeArgs::parse(a.to_args()).unwrap();
        assert_eq!(parsed.g2_keep_dir, a.g2_keep_dir);
        a.kept_identity = None;
        let e = NodeArgs::parse(a.to_args()).unwrap_err().to_string();
        assert!(e.contains("--g2-keep-dir needs --kept-identity"), "{e}");
        a.g2_keep_dir = None;
        a.kept_identity = Some("model: tiny\ntp: rank 1 of 2".into());
        a.g3_dir = Some("/tmp/g3".into());
        let args = a.to_args();
        let at = args.iter().position(|v| v == "--kept-identity").unwrap();
        assert_eq!(args[at + 1], "model: tiny\ntp: rank 1 of 2");
        let parsed = NodeArgs::parse(args).unwrap();
        assert_eq!(
            parsed.kept_identity.as_deref(),
            Some("model: tiny\ntp: rank 1 of 2")
        );
        assert_eq!(parsed, a);
    }

    #[test]
    fn bad_arguments_are_errors_naming_the_flag() {
        for (args, want) in [
            (&["serve"][..], "usage"),
            (&["worker", "--rank"], "--rank needs a value"),
            (&["worker", "--rank", "x"], "--rank"),
            (&["worker", "--frobnicate", "1"], "--frobnicate"),
            (&["worker", "--threads", "0"], "--threads"),
            (&["worker", "--rank", "0"], "--endpoint is required"),
            (
                &["worker", "--kept-identity", " "],
                "--kept-identity must not be empty",
            ),
        ] {
            let e = NodeArgs::parse(strings(args)).unwrap_err().to_string();
            assert!(e.contains(want), "{args:?}: {e}");
        }
    }
}
