//! A few seconds of the soak run (the benchmark runs for minutes): a
//! worker killed and restarted, every onboarded block still right, the
//! run's files gone at the end.

use std::process::Command;

#[test]
fn a_short_soak_survives_a_killed_worker() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_kvbm-bench"))
        .args([
            "soak",
            "--conversations",
            "400",
            "--model",
            "tiny",
            "--scale",
            "32",
            "--minutes",
            "0.1",
            "--kill-every",
            "2",
            "--workers",
            "2",
            "--json",
            "--quiet",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON");
    assert_eq!(r["mismatches"], 0, "{r}");
    assert!(r["requests_served"].as_u64().unwrap() > 0, "{r}");
    let kills = r["kills"].as_array().unwrap();
    assert!(!kills.is_empty(), "{r}");
    for k in kills {
        assert!(k["rejoin_s"].is_number(), "a rank did not rejoin: {r}");
    }
    for when in ["start", "warm", "end"] {
        let roles: Vec<&str> = r[when]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["leader", "rank 0", "rank 1"], "{when}: {r}");
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "files left behind"
    );
}
