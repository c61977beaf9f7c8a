//! The tensor-parallel replay with whole-instance restarts over a kept G3:
//! three crashes at random points (the seed is printed with any failure;
//! set `KVBM_RESTART_SEED` to run one again), every onboarded block still
//! right on both ranks, G3 serving right after each restart, and the G3
//! directories no larger than configured.
//!
//! What G3 serves after a restart depends on where it falls (a span whose
//! requests want nothing G3 kept gets nothing from it), so each restart is
//! held to what is certain: everything the crashed engine had in G3 is
//! found again, and the first request after it (G1 and G2 empty) hits
//! exactly the prefix the kept G3 holds; over the three, the kept G3
//! serves hits.

mod replay_support;

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use replay_support::stderr;
use serde_json::Value;

/// The seed of this run: `KVBM_RESTART_SEED`, else drawn from the clock.
fn seed() -> u64 {
    match std::env::var("KVBM_RESTART_SEED") {
        Ok(s) => s.parse().expect("KVBM_RESTART_SEED is a number"),
        Err(_) => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
    }
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[test]
fn three_random_restarts_keep_g3_and_every_block_right() {
    let seed = seed();
    let ctx = format!("seed {seed} (run again with KVBM_RESTART_SEED={seed})");
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_kvbm-bench"))
        .args([
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
            "2",
            "--restarts",
            "3",
            "--restart-seed",
            &seed.to_string(),
            "--json",
            "--no-svg",
            "--quiet",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    // A block that came back wrong on any rank stops the replay with an
    // error: success means zero mismatches, before and after the restarts.
    assert!(o.status.success(), "{ctx}: {}", stderr(&o));
    let r: Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON");
    assert!(r["failure_summary"].is_null(), "{ctx}: {r}");
    assert!(u(&r["verified_blocks"]) > 0, "{ctx}: nothing onboarded");
    let rs = &r["restarts"];
    let rows = rs["rows"].as_array().expect("the restart rows");
    assert_eq!(rows.len(), 3, "{ctx}: {rs}");

    // Both runs did the same until the first crash.
    let before = &rs["before_first_restart"];
    assert_eq!(
        before["hit_rate_pct"], before["reference_hit_rate_pct"],
        "{ctx}: {rs}"
    );

    // G3 is no larger than configured, after every restart and at the end.
    let end = &rs["g3_disk_end"];
    let files = u(&end["files"]);
    let limit = u(&rs["g3_data_file_bytes"]) + u(&rs["g3_record_bytes"]) + files * 4096;
    assert!(
        u(&rs["g3_data_file_bytes"]) >= u(&rs["g3_configured_bytes"]),
        "{ctx}: {rs}"
    );
    for disk in rows.iter().map(|row| &row["g3_disk"]).chain([end]) {
        assert_eq!(u(&disk["directories"]), 2, "{ctx}: one per rank: {rs}");
        assert_eq!(u(&disk["files"]), files, "{ctx}: files came and went: {rs}");
        assert!(u(&disk["allocated_bytes"]) <= limit, "{ctx}: G3 grew: {rs}");
    }

    let mut recovered_hits = 0;
    for row in rows {
        // Nothing torn: every crash fell between requests.
        assert_eq!(u(&row["g3_rejected"]), 0, "{ctx}: {row}");
        // Everything the crashed engine had in G3 came back.
        assert!(
            u(&row["g3_recovered"]) >= u(&row["g3_held_at_crash"]),
            "{ctx}: {row}"
        );
        // Right after the restart G1 and G2 are empty: the first request
        // hits, from G3, exactly the prefix the kept G3 holds.
        assert_eq!(
            row["first_request_g3_hits"], row["first_request_kept_prefix"],
            "{ctx}: {row}"
        );
        // Every recovered block served was wanted, onboarded and checked.
        assert!(
            u(&row["recovered_referenced"]) >= u(&row["recovered_hits"]),
            "{ctx}: {row}"
        );
        assert!(
            u(&row["verified_blocks"]) >= u(&row["recovered_hits"]),
            "{ctx}: {row}"
        );
        assert_eq!(row["g3_open_ms"].as_array().unwrap().len(), 2, "{ctx}");
        assert!(row["restart_s"].as_f64().unwrap() > 0.0, "{ctx}: {row}");
        recovered_hits += u(&row["recovered_hits"]);
    }
    assert!(
        recovered_hits > 0,
        "{ctx}: the kept G3 served nothing: {rs}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "{ctx}: files left behind"
    );
}
