//! `cargo xtask wheel`: the kvbm-py wheel users install.
//!
//! A release build, tagged `manylinux_2_28` (glibc 2.28 and newer: RHEL 8,
//! Ubuntu 20.04 and later), cross-compiled with zig so the host's newer
//! glibc does not leak in, with ZeroMQ's CURVE linked statically from the
//! host's libsodium (the build fails without it). maturin and zig come
//! from PyPI into a virtual environment under the target directory. The
//! wheel lands in `target/wheels/`, is installed into a scratch directory
//! and imported before the command succeeds.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The build tools, pinned.
const TOOLS: &[&str] = &["maturin==1.16.0", "ziglang==0.17.1"];
/// The oldest glibc the wheel runs on, as a manylinux tag.
const COMPATIBILITY: &str = "manylinux_2_28";

/// Builds, installs and imports the wheel; returns its path.
pub fn run(workspace: &Path, target: &Path) -> Result<PathBuf, String> {
    crate::ci::install_prerequisites()?;
    let venv = target.join("kvbm-wheel-venv");
    let bin = venv.join("bin");
    let python = bin.join("python");
    if !python.is_file() {
        crate::ci::step("python venv", {
            let mut c = Command::new("python3");
            c.args(["-m", "venv"]).arg(&venv);
            c
        })?;
    }
    crate::ci::step("pip install maturin and zig", {
        let mut c = Command::new(&python);
        c.args(["-m", "pip", "install", "--quiet"])
            .args(TOOLS)
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
            .env("PIP_ROOT_USER_ACTION", "ignore");
        c
    })?;
    let out = target.join("wheels");
    let _ = std::fs::remove_dir_all(&out);
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bin.clone()];
    paths.extend(std::env::split_paths(&path));
    crate::ci::step("maturin build (zig, manylinux_2_28)", {
        let mut c = Command::new(bin.join("maturin"));
        c.args([
            "build",
            "--release",
            "--zig",
            "--compatibility",
            COMPATIBILITY,
        ])
        .arg("--manifest-path")
        .arg(workspace.join("kvbm-py").join("Cargo.toml"))
        .arg("--interpreter")
        .arg(&python)
        .arg("--out")
        .arg(&out)
        // Its own target directory: the cross build's artefacts differ
        // from the host build's.
        .arg("--target-dir")
        .arg(target.join("zig"))
        .env(
            "PATH",
            std::env::join_paths(paths).map_err(|e| format!("PATH: {e}"))?,
        )
        .env("KVBM_ZMQ_CURVE", "require");
        c
    })?;
    let wheel = std::fs::read_dir(&out)
        .map_err(|e| format!("{}: {e}", out.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("maturin left no wheel in {}", out.display()))?;
    let scratch = target.join("kvbm-wheel-check");
    let _ = std::fs::remove_dir_all(&scratch);
    crate::ci::step("pip install the wheel (scratch)", {
        let mut c = Command::new(&python);
        c.args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
            .arg(&scratch)
            .arg(&wheel)
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1");
        c
    })?;
    crate::ci::step("import kvbm_py", {
        let mut c = Command::new(&python);
        c.args([
            "-c",
            "import kvbm_py, kvbm_py.config; print('kvbm_py', kvbm_py.__version__)",
        ])
        .env("PYTHONPATH", &scratch)
        .current_dir(target);
        c
    })?;
    println!("xtask wheel: {}", wheel.display());
    Ok(wheel)
}
