//! `cargo xtask gpu [--out DIR]`: build the release binaries that run on
//! the GPU machine (which has no cargo) and copy them into one folder.
//!
//! Builds the `cuda` feature's test executables of kvbm-transfer,
//! kvbm-dist's test executables, kvbm-pool's `quickstart_gpu` example, and
//! kvbm-bench's `kvbm-bench` (which is also its replay's worker process)
//! and the backend benches `cuda_bench`, `transfer_bench` and `pin_bench`
//! (features `cuda,gemm`: the replay with G1 on the GPU, also across
//! worker processes, the offload bench and `cuda_bench` beside a GEMM) in
//! release mode, reads their paths from cargo's JSON messages, and copies
//! them to `DIR` (default `gpu-bin` in the workspace root, git-ignored),
//! stripped: with debug info the set is ~470 MB, stripped ~25 MB, and what
//! travels to the GPU machine is capped at 64 MiB. There, run the tests with
//! `KVBM_REQUIRE_GPU=1` so a missing GPU fails instead of skipping.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Builds and collects the binaries.
pub fn run(root: &Path, args: &[String]) -> Result<(), String> {
    let out = match args {
        [flag, dir] if flag == "--out" => PathBuf::from(dir),
        [] => root.join("gpu-bin"),
        _ => return Err("usage: cargo xtask gpu [--out DIR]".into()),
    };
    std::fs::create_dir_all(&out).map_err(|e| format!("create {}: {e}", out.display()))?;
    let mut copied = 0;
    // (package, features, what to build)
    let builds: [(&str, &str, &[&str]); 4] = [
        ("kvbm-transfer", "cuda", &["--tests"]),
        ("kvbm-dist", "cuda", &["--lib", "--tests"]),
        ("kvbm-pool", "cuda", &["--example", "quickstart_gpu"]),
        (
            "kvbm-bench",
            "cuda,gemm",
            &[
                "--bin",
                "kvbm-bench",
                "--bin",
                "cuda_bench",
                "--bin",
                "transfer_bench",
                "--bin",
                "pin_bench",
            ],
        ),
    ];
    for (package, features, what) in builds {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let output = Command::new(cargo)
            .current_dir(root)
            .args(["build", "--release", "-p", package, "--features", features])
            .args(what)
            .arg("--message-format=json")
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("could not run cargo: {e}"))?;
        if !output.status.success() {
            return Err(format!("cargo build -p {package} {what:?} failed"));
        }
        for exe in executables(&String::from_utf8_lossy(&output.stdout)) {
            let name = exe
                .file_name()
                .ok_or_else(|| format!("odd executable path {}", exe.display()))?;
            let dest = out.join(name);
            std::fs::copy(&exe, &dest).map_err(|e| format!("copy {}: {e}", exe.display()))?;
            strip(&dest);
            println!("xtask gpu: {}", dest.display());
            copied += 1;
        }
    }
    println!("xtask gpu: {copied} binaries in {}", out.display());
    Ok(())
}

/// Strips `path` in place with the system's `strip`; without one the
/// binary stays as it is, with a warning.
fn strip(path: &Path) {
    match Command::new("strip").arg(path).status() {
        Ok(s) if s.success() => {}
        Ok(s) => eprintln!("xtask gpu: strip {} exited with {s}", path.display()),
        Err(e) => eprintln!("xtask gpu: strip {}: {e} (left unstripped)", path.display()),
    }
}

/// Paths of `"executable":"…"` entries in cargo's JSON messages.
fn executables(json: &str) -> Vec<PathBuf> {
    const KEY: &str = "\"executable\":\"";
    json.lines()
        .filter_map(|line| {
            let start = line.find(KEY)? + KEY.len();
            let end = line[start..].find('"')? + start;
            Some(PathBuf::from(&line[start..end]))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_executables_in_cargo_json() {
        let json = "{\"reason\":\"compiler-artifact\",\"executable\":\"/t/release/deps/cuda_roundtrip-ab\",\"fresh\":true}\n\
                    {\"reason\":\"compiler-artifact\",\"executable\":null}\n\
                    {\"reason\":\"build-finished\",\"success\":true}";
        assert_eq!(
            executables(json),
            vec![PathBuf::from("/t/release/deps/cuda_roundtrip-ab")]
        );
    }
}
