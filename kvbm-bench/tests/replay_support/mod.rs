//! Shared fixtures of the replay tests: the tiny replay (40 synthetic
//! conversations, the `tiny` KV shape, small tiers), as `kvbm-bench`
//! arguments and as a library configuration.
#![allow(dead_code)]

use std::path::Path;
use std::process::Output;

use kvbm_bench::MODEL_PRESETS;
use kvbm_bench::replay::ReplayConfig;
use kvbm_pool::tier::TierPolicy;
use kvbm_testkit::trace::Request;

/// The `kvbm-bench` arguments of the tiny replay: 40 synthetic
/// conversations, the `tiny` shape at scale 64, G1/G2/G3 at 5/10/30 % of
/// the distinct blocks.
pub const TINY_REPLAY: [&str; 13] = [
    "replay",
    "--conversations",
    "40",
    "--model",
    "tiny",
    "--scale",
    "64",
    "--g1",
    "0.05",
    "--g2",
    "0.1",
    "--g3",
    "0.3",
];

/// What a run of the binary wrote on stderr.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A replay of `requests` in the `tiny` shape at scale 64, tiers sized
/// `fractions` of the distinct blocks (G1 in host memory, G3 in `dir`),
/// in this process with the reuse-score policy, no sweep, no faults and no
/// G3 staging.
pub fn tiny_replay_config(
    workload: &str,
    requests: Vec<Request>,
    block_tokens: u32,
    fractions: [f64; 3],
    dir: &Path,
) -> ReplayConfig {
    let model = *MODEL_PRESETS
        .iter()
        .find(|m| m.name == "tiny")
        .expect("the tiny preset");
    ReplayConfig {
        workload: workload.into(),
        requests,
        block_tokens,
        model,
        scale: 64,
        fractions,
        prefill_tokens_per_s: 10_000.0,
        memcpy_threads: 1,
        disk_dir: dir.to_path_buf(),
        max_host_bytes: 1 << 30,
        policy: TierPolicy::ReuseScore,
        offload_mode: Default::default(),
        host_g1: true,
        sweep: Vec::new(),
        workers: 0,
        worker_exe: None,
        offload_in_flight: None,
        g1_free_reserve: None,
        g3_faults: Default::default(),
        g3_staging_bytes: 0,
        decline_slow_loads: false,
        restarts: Default::default(),
    }
}
