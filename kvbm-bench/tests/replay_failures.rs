//! A replay whose copies fail says so and exits non-zero: G3 writes fail
//! with `ENOSPC` mid-run (fault injection under the disk backend), and the
//! binary prints the failures by path and errno apart from the policy's
//! skips, on stderr even with `--quiet`, and exits 3 — or 0 with
//! `--allow-failures`. G3 read errors make onboards fail; their blocks are
//! computed again and never counted as hits. A G3 that does not fit its
//! file system is refused at start-up, naming the file system.

mod replay_support;

use std::path::Path;
use std::process::{Command, Output};

use kvbm_bench::replay::{G3Faults, ReplayConfig, ReplayReport, run_replay};
use kvbm_testkit::small_fs::SmallFs;
use kvbm_testkit::trace::{SyntheticConfig, generate_synthetic};
use replay_support::{TINY_REPLAY, stderr, tiny_replay_config};

/// The tiny replay of `bench_cli`, with `extra` arguments.
fn tiny_replay(extra: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvbm-bench"))
        .args(TINY_REPLAY)
        .args(["--no-svg", "--quiet"])
        .args(extra)
        .arg("--dir")
        .arg(dir)
        .output()
        .expect("the kvbm-bench binary runs")
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).expect("stdout is JSON")
}

#[test]
fn failed_offloads_fail_the_replay_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let clean = tiny_replay(&["--json"], dir.path());
    assert!(clean.status.success(), "{}", stderr(&clean));
    let clean = json(&clean);
    assert_eq!(clean["offload_failures"], 0);
    assert_eq!(clean["copy_failures"], serde_json::json!([]));
    assert!(clean["failure_summary"].is_null());

    let faults = ["--g3-enospc-after-writes", "20"];
    let o = tiny_replay(&[&faults[..], &["--json"]].concat(), dir.path());
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("FAILED") && e.contains("ENOSPC"), "{e}");
    assert!(e.contains("--allow-failures"), "{e}");
    let r = json(&o);
    let failed = r["offload_failures"].as_u64().unwrap();
    assert!(failed > 0, "{r}");
    let rows = r["copy_failures"].as_array().unwrap();
    assert!(rows.iter().all(|f| f["errno"] == "ENOSPC"), "{rows:?}");
    let sum: u64 = rows.iter().map(|f| f["blocks"].as_u64().unwrap()).sum();
    assert_eq!(sum, failed);
    assert!(rows.iter().any(|f| f["path"] == "G2->G3"), "{rows:?}");
    // Failures are reported apart from the policy's skips, and what never
    // reached G3 is never a G3 hit.
    assert!(r["offloads_skipped"].is_u64());
    assert!(r["tiers"][2]["hits"].as_u64() < clean["tiers"][2]["hits"].as_u64());

    // The table says it too.
    let o = tiny_replay(&faults, dir.path());
    assert_eq!(o.status.code(), Some(3));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("COPY FAILURES"), "{out}");
    assert!(
        out.contains("offloads skipped by the engine's policy"),
        "{out}"
    );

    let o = tiny_replay(&[&faults[..], &["--allow-failures"]].concat(), dir.path());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("warning") && e.contains("ENOSPC"), "{e}");
    // Nothing left behind either way.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn copy_failure_warnings_are_rate_limited() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_kvbm-bench"))
        .args(TINY_REPLAY)
        .args(["--no-svg", "--json", "--g3-enospc-after-writes", "20"])
        .arg("--dir")
        .arg(dir.path())
        .env("RUST_LOG", "warn")
        .output()
        .expect("the kvbm-bench binary runs");
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let failed = json(&o)["offload_failures"].as_u64().unwrap();
    assert!(failed > 50, "too few failures to flood: {failed}");
    let e = stderr(&o);
    let warnings = e
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("failed"))
        .count();
    // One line per kind of failure, and another only every few seconds.
    assert!(
        (1..=6).contains(&warnings),
        "{warnings} warnings for {failed} failed blocks:\n{e}"
    );
}

fn library_replay(dir: &Path, faults: G3Faults) -> ReplayReport {
    let synth = SyntheticConfig {
        conversations: 40,
        ..SyntheticConfig::default()
    };
    let cfg = ReplayConfig {
        g3_faults: faults,
        ..tiny_replay_config(
            "failures",
            generate_synthetic(&synth),
            synth.block_tokens,
            [0.05, 0.1, 0.3],
            dir,
        )
    };
    run_replay(&cfg, |_, _| {}).expect("the replay runs to the end")
}

#[test]
fn failed_onboards_are_computed_again_and_are_not_hits() {
    let dir = tempfile::tempdir().unwrap();
    let clean = library_replay(dir.path(), G3Faults::default());
    assert!(clean.failure_summary.is_none());
    assert!(clean.tiers[2].hits > 0, "no G3 hits to fail");
    let r = library_replay(
        dir.path(),
        G3Faults {
            eio_after_reads: Some(3),
            ..G3Faults::default()
        },
    );
    assert!(r.failed_onboards > 0);
    assert!(r.onboard_failures > 0);
    assert_eq!(r.offload_failures, 0);
    assert!(
        r.copy_failures
            .iter()
            .all(|f| f.path == "G3->G1" && f.errno == "EIO"),
        "{:?}",
        r.copy_failures
    );
    assert!(r.failure_summary.as_deref().unwrap().contains("EIO"));
    // Every request was served; the failed prefixes were misses.
    assert_eq!(r.requests, clean.requests);
    assert!(r.tiers[2].hits < clean.tiers[2].hits);
    assert!(r.verified_blocks < clean.verified_blocks);
}

#[test]
fn a_g3_larger_than_its_file_system_is_refused_at_start() {
    let fs = match SmallFs::ext2(2 << 20) {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("skipping: {why}");
            return;
        }
    };
    let o = tiny_replay(&[], fs.path());
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("cannot reserve"), "{e}");
    assert!(e.contains("ext2/ext3/ext4"), "{e}");
    assert!(e.contains(fs.path().to_str().unwrap()), "{e}");
    assert_eq!(
        std::fs::read_dir(fs.path())
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name() != "lost+found")
            .count(),
        0,
        "a G3 file was left behind"
    );
}

#[test]
fn a_disk_without_room_for_the_raw_read_reference_still_reports() {
    // Room for the tiny replay's G3 (under 5 MiB), not for the 64 MiB
    // scratch file of the raw read reference.
    let fs = match SmallFs::ext2(16 << 20) {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("skipping: {why}");
            return;
        }
    };
    let o = tiny_replay(&["--json"], fs.path());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let r = json(&o);
    assert!(r["verified_blocks"].as_u64().unwrap() > 0, "{r}");
    let c = &r["onboard_cost"];
    assert_eq!(c["raw_read_gbps"], 0.0, "{c}");
    let why = c["raw_read_skipped"]
        .as_str()
        .expect("the reason it was skipped");
    assert!(why.contains("no room for its scratch file"), "{why}");
    // The table says it too.
    let o = tiny_replay(&[], fs.path());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("raw O_DIRECT read reference skipped: no room"),
        "{out}"
    );
}
