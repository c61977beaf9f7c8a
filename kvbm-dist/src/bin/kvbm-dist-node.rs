//! `kvbm-dist-node`: a kvbm-dist worker process.
//!
//! ```text
//! kvbm-dist-node worker --endpoint E --instance I --rank R --world W
//!     --layout DESCRIPTOR_JSON --g1-file PATH [--g3-dir DIR]
//!     [--fault-delay-ms MS] [--leader-timeout-ms MS] [--secret-file PATH]
//! ```
//!
//! The instance secret comes from the environment variable
//! `KVBM_INSTANCE_SECRET` (removed at once) or from `--secret-file`, a file
//! of this user's with mode 0600 — never from the command line, which any
//! user of the host can read.
//!
//! G1 is host memory shared with the engine process through `--g1-file`
//! (created by the engine at the layout's size); the multi-process tests
//! start workers this way.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use kvbm_dist::auth::InstanceSecret;
use kvbm_dist::worker::memory::{HostProbe, SharedMapping};
use kvbm_dist::worker::{self, WorkerConfig};
use kvbm_layout::LayoutDescriptor;

fn main() -> ExitCode {
    // SAFETY: the first thing in `main`, before any thread is started.
    let from_env = unsafe { InstanceSecret::take_from_env() };
    match run(from_env) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvbm-dist-node: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(from_env: kvbm_dist::Result<InstanceSecret>) -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("worker") => {}
        other => {
            return Err(format!(
                "usage: kvbm-dist-node worker --flag value..., got {other:?}"
            ));
        }
    }
    let mut flags: HashMap<String, String> = HashMap::new();
    while let Some(k) = args.next() {
        let key = k
            .strip_prefix("--")
            .ok_or_else(|| format!("expected a --flag, got {k:?}"))?;
        let v = args
            .next()
            .ok_or_else(|| format!("--{key} needs a value"))?;
        flags.insert(key.to_owned(), v);
    }
    let get = |k: &str| flags.get(k).ok_or_else(|| format!("--{k} is required"));
    let num =
        |k: &str| -> Result<u64, String> { get(k)?.parse().map_err(|e| format!("--{k}: {e}")) };
    let opt_num = |k: &str, default: u64| -> Result<u64, String> {
        flags.get(k).map_or(Ok(default), |v| {
            v.parse().map_err(|e| format!("--{k}: {e}"))
        })
    };
    let layout = LayoutDescriptor::from_json(get("layout")?)
        .and_then(|d| d.to_layout())
        .map_err(|e| format!("--layout: {e}"))?;
    let mapping = SharedMapping::open(&PathBuf::from(get("g1-file")?), layout.total_bytes())
        .map_err(|e| e.to_string())?;
    let g1 = Arc::new(mapping)
        .physical_layout(layout)
        .map_err(|e| e.to_string())?;
    let rank = u32::try_from(num("rank")?).map_err(|e| format!("--rank: {e}"))?;
    let world = u32::try_from(num("world")?).map_err(|e| format!("--world: {e}"))?;
    let secret = match flags.get("secret-file") {
        Some(path) => InstanceSecret::read_file(&PathBuf::from(path)),
        None => from_env,
    }
    .map_err(|e| e.to_string())?;
    let mut config = WorkerConfig::new(
        get("endpoint")?.clone(),
        num("instance")?,
        rank,
        world,
        g1,
        secret,
    );
    config.g3_dir = flags.get("g3-dir").map(PathBuf::from);
    config.fault_delay = Duration::from_millis(opt_num("fault-delay-ms", 0)?);
    config.leader_timeout = Duration::from_millis(opt_num("leader-timeout-ms", 30_000)?);
    config.probe = Some(Box::new(HostProbe));
    worker::run(config).map_err(|e| e.to_string())
}
