//! Project automation, run as `cargo xtask <command>`.
//!
//! - `ci`: everything CI checks, in the order a developer wants to see failures:
//!   install what the tests need, format, lint, test (Rust, then kvbm-py's
//!   wheel and pytest suite against vLLM's CPU engine), docs.
//! - `py`: only kvbm-py's wheel and pytest suite.
//! - `bench`: run the criterion benches (extra arguments go to `cargo bench`).
//! - `kernels`: rebuild the committed CUDA fatbins with nvcc.
//! - `gpu`: build the release binaries for the GPU machine into `gpu-bin/`.
//! - `wheel`: build kvbm-py's wheel for users (manylinux_2_28, release).

mod ci;
mod gpu;
mod kernels;
mod python;
mod wheel;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci::run(),
        Some("bench") => ci::bench(&args[1..]),
        Some("py") => ci::python(),
        Some("kernels") => kernels::run(&workspace_root()),
        Some("gpu") => gpu::run(&workspace_root(), &args[1..]),
        Some("wheel") => wheel::run(&workspace_root(), &ci::target_dir()).map(|_| ()),
        Some(other) => Err(format!("unknown command `{other}`\n\n{USAGE}")),
        None => Err(USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("xtask: {msg}");
            ExitCode::FAILURE
        }
    }
}

const USAGE: &str = "usage: cargo xtask <command>

commands:
  ci       install test prerequisites, then fmt --check, clippy -D warnings, tests, docs
  py       build kvbm-py's wheel and run its pytest suite (vLLM CPU engine)
  bench    run the criterion benches (arguments after `bench` go to cargo bench)
  kernels  rebuild the CUDA fatbins (needs nvcc: $NVCC, PATH or /usr/local/cuda)
  gpu      build release GPU test/bench binaries into gpu-bin/ (--out DIR)
  wheel    build kvbm-py's wheel for users into target/wheels/ (manylinux_2_28)";

/// The workspace root (xtask lives one level below it).
pub(crate) fn workspace_root() -> std::path::PathBuf {
    let manifest = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or(manifest)
}
