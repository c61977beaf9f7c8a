//! The `kvbm-bench` binary end to end: argument errors, trace errors, a
//! tiny replay, a tiny transfer matrix and a tiny host offload bench, all
//! as parsed JSON.

mod replay_support;

use std::path::Path;
use std::process::{Command, Output};

use replay_support::{TINY_REPLAY, stderr};

fn bench(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvbm-bench"))
        .args(args)
        .arg("--dir")
        .arg(dir)
        .arg("--quiet")
        .output()
        .expect("the kvbm-bench binary runs")
}

#[test]
fn bad_arguments_are_clap_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["transfer", "--reps", "0"][..],
        &["transfer", "--tokens", "abc"],
        &["replay", "--g1", "lots"],
        &["frobnicate"],
    ] {
        let o = bench(args, dir.path());
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{args:?}");
    }
}

#[test]
fn bad_values_give_a_clear_message_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let o = bench(&["replay", "--model", "gpt-5"], dir.path());
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("unknown model `gpt-5`") && e.contains("llama-3.1-8b"),
        "{e}"
    );

    let o = bench(&["replay", "--scale", "3"], dir.path());
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--scale 3"), "{}", stderr(&o));

    let o = bench(&["replay", "--model", "tiny", "--scale", "512"], dir.path());
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("O_DIRECT"), "{}", stderr(&o));

    let o = bench(&["replay", "--prefill-rate", "0"], dir.path());
    assert_eq!(o.status.code(), Some(1));
    assert!(!stderr(&o).contains("panicked"));
}

#[test]
fn malformed_trace_names_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 1, \"input_length\": oops}\n",
    )
    .unwrap();
    let o = bench(&["replay", "--trace", trace.to_str().unwrap()], dir.path());
    assert_eq!(o.status.code(), Some(1));
    let want = format!("{}:2:", trace.display());
    assert!(stderr(&o).contains(&want), "{}", stderr(&o));

    let o = bench(
        &["replay", "--trace", "/nonexistent/trace.jsonl"],
        dir.path(),
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("/nonexistent/trace.jsonl"));
}

#[test]
fn an_endless_trace_line_is_refused_with_its_number() {
    let dir = tempfile::tempdir().unwrap();
    let o = bench(&["replay", "--trace", "/dev/zero"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("/dev/zero:1: line longer than"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn tiny_replay_runs_end_to_end_and_verifies_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let o = bench(
        &[&TINY_REPLAY[..], &["--sweep", "--json"]].concat(),
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON");
    assert!(
        r["verified_blocks"].as_u64().unwrap() > 0,
        "nothing onboarded"
    );
    let tiers = r["tiers"].as_array().unwrap();
    assert!(tiers[1]["hits"].as_u64().unwrap() > 0, "no G2 hits");
    assert!(tiers[2]["hits"].as_u64().unwrap() > 0, "no G3 hits");
    let hit = r["hit_rate_pct"].as_f64().unwrap();
    let belady = r["belady_hit_rate_pct"].as_f64().unwrap();
    assert!(hit <= belady + 1e-9, "{hit} beats Belady {belady}");
    let paths = r["paths"].as_array().unwrap();
    let bytes = |name: &str| {
        paths.iter().find(|p| p["path"] == name).unwrap()["bytes"]
            .as_u64()
            .unwrap()
    };
    let block = r["block_bytes"].as_u64().unwrap();
    let blocks = |name: &str| {
        paths.iter().find(|p| p["path"] == name).unwrap()["blocks"]
            .as_u64()
            .unwrap()
    };
    for p in ["G1->G2", "G2->G3", "G2->G1", "G3->G1"] {
        assert!(bytes(p) > 0, "{p} moved nothing");
        assert_eq!(bytes(p), blocks(p) * block, "{p}: bytes are whole blocks");
    }
    assert_eq!(r["sweep"].as_array().unwrap().len(), 7);
    let svg = std::fs::read_to_string(dir.path().join("replay.svg")).unwrap();
    assert!(svg.contains("<polyline"));
}

#[test]
fn tiny_transfer_matrix_is_json_with_references() {
    let dir = tempfile::tempdir().unwrap();
    let o = bench(
        &[
            "transfer", "--model", "tiny", "--tokens", "8,16", "--batch", "4", "--mib", "1",
            "--reps", "1", "--json",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON");
    let all = r["rows"].as_array().unwrap();
    // With feature `nixl` the backend comparison rows follow the matrix
    // ("G2->G3 io_uring", "G2->G3 nixl-posix", ...): 5 per cell, each
    // checked or skipped for lack of the runtime.
    let (rows, extra): (Vec<_>, Vec<_>) = all
        .iter()
        .partition(|row| !row["path"].as_str().unwrap().contains(' '));
    assert_eq!(extra.len(), if cfg!(feature = "nixl") { 5 * 2 } else { 0 });
    for row in extra {
        let status = row["status"].as_str().unwrap();
        assert!(
            status.starts_with("skipped") || row["verified"] == true,
            "{row}"
        );
    }
    assert_eq!(rows.len(), 10 * 2);
    let mut measured = 0;
    for row in rows {
        if row["status"].as_str().unwrap().starts_with("skipped") {
            assert_eq!(row["blocks"], 0);
            continue;
        }
        measured += 1;
        assert_eq!(row["verified"], true, "{row}");
        assert!(row["gbps"]["median"].as_f64().unwrap() > 0.0);
        assert!(row["reference_gbps"]["median"].as_f64().unwrap() > 0.0);
        assert!(row["ratio"].as_f64().unwrap() > 0.0);
        let blocks = row["blocks"].as_u64().unwrap();
        assert_eq!(
            row["bytes"].as_u64().unwrap(),
            blocks * row["block_bytes"].as_u64().unwrap()
        );
    }
    assert_eq!(measured, 16, "every CPU path measured");
    assert!(dir.path().join("transfer.svg").exists());
}

#[test]
fn tp_replay_over_two_worker_processes_decides_and_verifies_like_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let run = |workers: &str| {
        let o = bench(
            &[
                "replay",
                "--conversations",
                "40",
                "--model",
                "tiny",
                // Half a block per rank must stay disk-aligned.
                "--scale",
                "32",
                "--g1",
                "0.05",
                "--g2",
                "0.1",
                "--g3",
                "0.3",
                "--workers",
                workers,
                "--no-svg",
                "--json",
            ],
            dir.path(),
        );
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).expect("stdout is JSON")
    };
    let local = run("0");
    let tp = run("2");
    assert!(
        tp["g1_memory"]
            .as_str()
            .unwrap()
            .contains("2 worker processes")
    );
    // The same engine decisions over the distributed mover...
    assert_eq!(tp["tiers"], local["tiers"]);
    // ...and every onboarded block checked (on both ranks, by the workers).
    let verified = tp["verified_blocks"].as_u64().unwrap();
    assert!(verified > 0, "nothing onboarded");
    assert_eq!(verified, local["verified_blocks"].as_u64().unwrap());
    // Failures travel through the leader's engine like any copy's outcome:
    // none here, and the report says so in the same fields.
    for r in [&local, &tp] {
        assert_eq!(r["copy_failures"], serde_json::json!([]));
        assert_eq!(r["failed_onboards"], 0);
        assert!(r["failure_summary"].is_null());
    }
}

#[test]
fn tiny_host_offload_copies_and_checks_every_block() {
    let dir = tempfile::tempdir().unwrap();
    #[rustfmt::skip]
    let o = bench(
        &[
            "offload", "--host-g1", "--model", "tiny", "--tokens", "4,16",
            "--in-flight", "1,2", "--batch", "8,32", "--mib", "4", "--reps", "2",
            "--reference-mib", "4", "--json",
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON");
    assert_eq!(r["benchmark"], "offload");
    let report = &r["report"];
    assert!(report["reference_d2h"]["gbps"]["median"].as_f64().unwrap() > 0.0);
    let rows = report["rows"].as_array().unwrap();
    // Host G1 runs idle rows only: 2 shapes × 2 batch sizes × 2 in-flight counts.
    assert_eq!(rows.len(), 8);
    for row in rows {
        assert_eq!(row["status"], "ok", "{row}");
        assert_eq!(row["load"], "idle");
        let blocks = row["blocks"].as_u64().unwrap();
        // 4 MiB of 16 KiB blocks (4 tokens) = 256 > 8 batches of 32.
        assert!(blocks >= 256, "{row}");
        // Warm-up and two timed reps, each copying and checking every block.
        assert_eq!(row["copied_blocks"].as_u64(), Some(3 * blocks), "{row}");
        assert_eq!(row["verified_blocks"].as_u64(), Some(3 * blocks), "{row}");
        assert_eq!(row["skipped_blocks"].as_u64(), Some(0), "{row}");
        assert_eq!(
            row["bytes_per_rep"].as_u64(),
            Some(blocks * row["block_bytes"].as_u64().unwrap())
        );
        assert!(row["gbps"]["median"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["ratio_to_d2h"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["gemm_alone_tflops"].is_null());
    }
}

#[test]
fn offload_without_a_device_or_host_g1_skips() {
    let dir = tempfile::tempdir().unwrap();
    let o = bench(&["offload", "--model", "tiny", "--mib", "1"], dir.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    // On a machine with a GPU (built with cuda) this runs the real rows.
    if !cfg!(feature = "cuda") {
        assert_eq!(out.trim(), "skipped: no CUDA device");
    }
}

#[test]
fn an_output_path_that_cannot_be_written_fails_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let missing = dir.path().join("missing").join("out.json");
    for (flag, path) in [
        ("--json-file", "/proc/nope.json"),
        ("--json-file", missing.to_str().unwrap()),
        ("--svg", "/proc/nope.svg"),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_kvbm-bench"))
            .args(TINY_REPLAY)
            .args([flag, path, "--quiet", "--dir"])
            .arg(&run_dir)
            .output()
            .expect("the kvbm-bench binary runs");
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains(&format!("{flag} {path}: cannot write")), "{e}");
        // Refused before the run: it did not even create its directory.
        assert!(!run_dir.exists(), "{flag} {path}: the run started");
    }
    // A file that can be written is left alone until the run writes it.
    let out = dir.path().join("out.json");
    let o = bench(
        &[
            &TINY_REPLAY[..],
            &["--no-svg", "--json-file", out.to_str().unwrap()],
        ]
        .concat(),
        &run_dir,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert!(r["verified_blocks"].as_u64().unwrap() > 0);
}
