//! `cargo xtask ci` and `cargo xtask bench`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// Debian packages the test suite needs on a fresh machine.
const APT_PACKAGES: &[&str] = &[];

/// Runs every CI step; the first failure stops the run.
pub fn run() -> Result<(), String> {
    install_prerequisites()?;
    step("fmt", cargo(&["fmt", "--all", "--check"]))?;
    // Every feature (the CUDA backend builds without a toolkit: libcuda is
    // loaded at run time), then the pread/pwrite-only disk path.
    step(
        "clippy (all features)",
        cargo(&[
            "clippy",
            "--workspace",
            "--all-targets",
            "--all-features",
            "--locked",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    step(
        "clippy (kvbm-transfer without default features)",
        cargo(&[
            "clippy",
            "-p",
            "kvbm-transfer",
            "--all-targets",
            "--no-default-features",
            "--locked",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    let passed = run_tests()?;
    println!("xtask ci: {passed} tests passed");
    let mut doc = cargo(&[
        "doc",
        "--workspace",
        "--all-features",
        "--no-deps",
        "--locked",
    ]);
    doc.env("RUSTDOCFLAGS", "-D warnings");
    step("doc", doc)?;
    println!("xtask ci: all steps passed");
    Ok(())
}

/// Runs `cargo bench` for the workspace with the given extra arguments.
pub fn bench(extra: &[String]) -> Result<(), String> {
    let mut cmd = cargo(&["bench", "--workspace"]);
    cmd.args(extra);
    step("bench", cmd)
}

fn cargo(args: &[&str]) -> Command {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let mut cmd = Command::new(cargo);
    cmd.args(args);
    cmd
}

fn step(name: &str, mut cmd: Command) -> Result<(), String> {
    println!("xtask ci: == {name}: {cmd:?}");
    let status = cmd
        .status()
        .map_err(|e| format!("{name}: could not start: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{name} failed ({status})"))
    }
}

/// Runs the whole test suite, echoing its output, and returns how many tests
/// passed. Zero tests is a failure: a suite that runs nothing proves nothing.
fn run_tests() -> Result<u64, String> {
    let mut cmd = cargo(&["test", "--workspace", "--all-features", "--locked"]);
    println!("xtask ci: == test: {cmd:?}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("test: could not start: {e}"))?;
    let mut passed = 0u64;
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line.map_err(|e| format!("test: reading output: {e}"))?;
            println!("{line}");
            passed += passed_count(&line);
        }
    }
    let status = child.wait().map_err(|e| format!("test: {e}"))?;
    if !status.success() {
        return Err(format!("tests failed ({status})"));
    }
    if passed == 0 {
        return Err("no test ran: the suite must run at least one test".to_string());
    }
    Ok(passed)
}

/// Extracts N from a libtest summary line `test result: ok. N passed; ...`.
fn passed_count(line: &str) -> u64 {
    line.strip_prefix("test result: ")
        .and_then(|rest| rest.split_once(". "))
        .and_then(|(_, counts)| counts.split_once(" passed"))
        .and_then(|(n, _)| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Installs the Debian packages in [`APT_PACKAGES`] that are missing, saying
/// which. Needs root (CI and the dev machines run as root).
fn install_prerequisites() -> Result<(), String> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|pkg| {
            !Command::new("dpkg")
                .args(["-s", pkg])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect();
    if missing.is_empty() {
        println!("xtask ci: prerequisites present: {APT_PACKAGES:?}");
        return Ok(());
    }
    println!("xtask ci: installing Debian packages {missing:?}");
    step("apt-get update", {
        let mut c = Command::new("apt-get");
        c.args(["update", "-q"]);
        c
    })?;
    let mut install = Command::new("apt-get");
    install
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive");
    step("apt-get install", install)
}

#[cfg(test)]
mod tests {
    use super::passed_count;

    #[test]
    fn reads_libtest_summary_lines() {
        assert_eq!(
            passed_count("test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured"),
            12
        );
        assert_eq!(passed_count("test result: ok. 0 passed; 0 failed"), 0);
        assert_eq!(passed_count("running 3 tests"), 0);
    }
}
