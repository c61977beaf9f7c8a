//! `cargo xtask ci` and `cargo xtask bench`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Debian packages the test suite needs on a fresh machine: libclang for
/// nixl-sys's bindgen (it runs even when NIXL itself is loaded at run time),
/// libsodium, which gives ZeroMQ its CURVE encryption, and libibverbs,
/// which every binary of the Mooncake Store wheel loads (G4's tests).
const APT_PACKAGES: &[&str] = &["libclang-dev", "libsodium-dev", "libibverbs1"];

/// The NIXL runtime the `nixl` feature's tests load: the pip wheel carries
/// `libnixl_capi.so`, its plugins (POSIX, UCX, ...) and UCX itself.
const NIXL_WHEEL: &str = "nixl-cu13==1.5.1";
/// Where the wheel is unpacked, under the target directory.
const NIXL_DIR: &str = "nixl-runtime";
/// The wheel's library directory, relative to [`NIXL_DIR`].
const NIXL_LIBS: &str = ".nixl_cu13.mesonpy.libs";

/// Runs every CI step; the first failure stops the run.
pub fn run() -> Result<(), String> {
    install_prerequisites()?;
    let nixl_libs = install_nixl_runtime()?;
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
    let tally = run_tests(&nixl_libs)?;
    println!("xtask ci: {}", tally.summary());
    python()?;
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

/// Builds kvbm-py's wheel and runs its pytest suite, saying how many
/// tests passed and how long it took.
pub fn python() -> Result<(), String> {
    let started = std::time::Instant::now();
    let passed = crate::python::run(&crate::workspace_root(), &target_dir())?;
    println!(
        "xtask ci: {passed} Python tests passed ({:.0} s with the wheel build)",
        started.elapsed().as_secs_f64()
    );
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

pub(crate) fn step(name: &str, mut cmd: Command) -> Result<(), String> {
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

/// Runs the whole test suite, echoing its output, and returns what passed
/// and what was skipped. Zero tests is a failure: a suite that runs nothing
/// proves nothing. The NIXL runtime is on the library path and required: a
/// NIXL test that would skip for lack of it fails instead; so is CURVE in
/// ZeroMQ. Where the published Mooncake traces are present (tests find
/// them in `shared/data/mooncake` under the checkout or a directory above
/// it), every trace a test reads is required: one gone missing or
/// unreadable fails instead of skipping; where the directory is absent
/// altogether the run says so loudly and those tests skip. Tests print their output (`--show-output`) so that a GPU
/// test that returned early on a machine without one is seen and counted
/// as skipped.
/// Whether `shared/data/mooncake` exists under the workspace root or a
/// directory above it; says so when it does not.
fn traces_present() -> bool {
    let root = crate::workspace_root();
    let found = root
        .ancestors()
        .any(|d| d.join("shared/data/mooncake").is_dir());
    if !found {
        println!(
            "xtask ci: NOTE: no shared/data/mooncake above {}: the tests that replay \
             Mooncake traces skip",
            root.display()
        );
    }
    found
}

fn run_tests(nixl_libs: &Path) -> Result<Tally, String> {
    let mut cmd = cargo(&["test", "--workspace", "--all-features", "--locked"]);
    cmd.args(["--", "--show-output"]);
    let mut lib_path = nixl_libs.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        lib_path.push(":");
        lib_path.push(old);
    }
    cmd.env("LD_LIBRARY_PATH", lib_path)
        .env("KVBM_REQUIRE_NIXL", "1")
        .env("KVBM_REQUIRE_CURVE", "1")
        .env(
            "KVBM_REQUIRE_TRACES",
            if traces_present() { "1" } else { "0" },
        )
        // UCX's InfiniBand module can crash at exit on machines without it.
        .env("UCX_MODULES", "^ib");
    println!("xtask ci: == test: {cmd:?}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("test: could not start: {e}"))?;
    let mut tally = Tally::default();
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line.map_err(|e| format!("test: reading output: {e}"))?;
            println!("{line}");
            tally.read(&line);
        }
    }
    let status = child.wait().map_err(|e| format!("test: {e}"))?;
    if !status.success() {
        return Err(format!("tests failed ({status})"));
    }
    if tally.passed() == 0 {
        return Err("no test ran: the suite must run at least one test".to_string());
    }
    Ok(tally)
}

/// The line a GPU test prints when it returns early without a device.
const GPU_SKIP_LINE: &str = "skipped: no CUDA device";

/// What a test run's output says: tests libtest counted as passed, and
/// those among them that only said they skipped.
#[derive(Debug, Default)]
struct Tally {
    /// Tests libtest reported as passed (the skipped ones included).
    reported: u64,
    /// Tests that printed [`GPU_SKIP_LINE`].
    skipped: u64,
    /// Whether the test whose output is being read already counted as
    /// skipped (each test counts once, however often it says so).
    skip_seen: bool,
}

impl Tally {
    /// Takes one line of `cargo test` output into account.
    fn read(&mut self, line: &str) {
        let line = line.trim_end();
        if line.trim() == GPU_SKIP_LINE {
            if !self.skip_seen {
                self.skipped += 1;
                self.skip_seen = true;
            }
            return;
        }
        // Where one test's output ends: libtest's header of a test's
        // captured output, a test's result line (harnesses that do not
        // capture), the start and the end of a test binary's run.
        let boundary = (line.starts_with("---- ") && line.ends_with(" ----"))
            || (line.starts_with("test ") && line.ends_with(" ... ok"))
            || line.starts_with("running ")
            || line.starts_with("test result: ");
        if boundary {
            self.skip_seen = false;
        }
        self.reported += passed_count(line);
    }

    /// Tests that passed without skipping.
    fn passed(&self) -> u64 {
        self.reported.saturating_sub(self.skipped)
    }

    /// The summary line, skips apart from passes as pytest reports them.
    fn summary(&self) -> String {
        format!("{} passed, {} skipped", self.passed(), self.skipped)
    }
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
pub(crate) fn install_prerequisites() -> Result<(), String> {
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

/// The target directory (`CARGO_TARGET_DIR`, or `target/` in the workspace).
pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let xtask = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
            xtask.parent().unwrap_or(&xtask).join("target")
        })
}

/// Unpacks the NIXL runtime wheel under the target directory unless it is
/// already there, and returns its library directory (absolute).
fn install_nixl_runtime() -> Result<PathBuf, String> {
    let dir = target_dir().join(NIXL_DIR);
    let libs = dir.join(NIXL_LIBS);
    if libs.join("libnixl_capi.so").is_file() {
        println!("xtask ci: NIXL runtime present: {}", libs.display());
        return Ok(libs);
    }
    println!("xtask ci: installing {NIXL_WHEEL} into {}", dir.display());
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let mut pip = Command::new(python);
    pip.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--upgrade",
        "--target",
    ])
    .arg(&dir)
    .arg(NIXL_WHEEL)
    .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    .env("PIP_ROOT_USER_ACTION", "ignore");
    step("pip install nixl runtime", pip)?;
    if !libs.join("libnixl_capi.so").is_file() {
        return Err(format!(
            "{NIXL_WHEEL} installed, but {} has no libnixl_capi.so",
            libs.display()
        ));
    }
    Ok(libs)
}

#[cfg(test)]
mod tests {
    use super::{Tally, passed_count};

    #[test]
    fn reads_libtest_summary_lines() {
        assert_eq!(
            passed_count("test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured"),
            12
        );
        assert_eq!(passed_count("test result: ok. 0 passed; 0 failed"), 0);
        assert_eq!(passed_count("running 3 tests"), 0);
    }

    #[test]
    fn gpu_tests_that_returned_early_count_as_skipped() {
        // `cargo test -- --show-output`: two GPU tests of one binary
        // skipped (one said so twice), a third test passed, then a
        // harness that prints as it goes.
        let output = "\
running 3 tests
test gpu_copy ... ok
test gpu_pin ... ok
test host_copy ... ok

successes:

---- gpu_copy stdout ----
skipped: no CUDA device
skipped: no CUDA device

---- gpu_pin stdout ----
skipped: no CUDA device


successes:
    gpu_copy
    gpu_pin
    host_copy

test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out

running 2 tests
skipped: no CUDA device
test own_harness_gpu ... ok
test own_harness_host ... ok

test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out
";
        let mut t = Tally::default();
        for line in output.lines() {
            t.read(line);
        }
        assert_eq!((t.passed(), t.skipped), (2, 3));
        assert_eq!(t.summary(), "2 passed, 3 skipped");
    }
}
