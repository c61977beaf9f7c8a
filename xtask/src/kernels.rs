//! `cargo xtask kernels`: rebuild the committed CUDA fatbins.
//!
//! nvcc comes from `$NVCC`, the PATH, or `/usr/local/cuda/bin`. On a CPU
//! machine, a venv with
//! `pip install nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88
//! nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96` provides one at
//! `site-packages/nvidia/cu13/bin/nvcc` (pin all four: a newer nvvm emits PTX
//! the GPU machine's 13.0 driver cannot JIT).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Kernel sources and their fatbins, relative to the workspace root.
const KERNELS: &[(&str, &str)] = &[
    (
        "kvbm-transfer/kernels/copy_runs.cu",
        "kvbm-transfer/kernels/copy_runs.fatbin",
    ),
    (
        "kvbm-transfer/kernels/block_sums.cu",
        "kvbm-transfer/kernels/block_sums.fatbin",
    ),
];

/// Targets: native code for A100 and H100/H200, plus PTX for newer GPUs.
const GENCODE: &[&str] = &[
    "-gencode",
    "arch=compute_80,code=sm_80",
    "-gencode",
    "arch=compute_90,code=sm_90",
    "-gencode",
    "arch=compute_90,code=compute_90",
];

/// Builds every fatbin.
pub fn run(root: &Path) -> Result<(), String> {
    let nvcc = find_nvcc().ok_or(
        "nvcc not found: set NVCC, or pip install nvidia-cuda-nvcc==13.0.88 \
         nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 \
         and point NVCC at site-packages/nvidia/cu13/bin/nvcc",
    )?;
    for (src, out) in KERNELS {
        let mut cmd = Command::new(&nvcc);
        cmd.arg("-fatbin")
            .arg("-O3")
            .args(GENCODE)
            .arg("-o")
            .arg(root.join(out))
            .arg(root.join(src));
        println!("xtask kernels: {cmd:?}");
        let status = cmd
            .status()
            .map_err(|e| format!("could not run {}: {e}", nvcc.display()))?;
        if !status.success() {
            return Err(format!("nvcc failed on {src} ({status})"));
        }
    }
    Ok(())
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("nvcc"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| {
        let p = PathBuf::from("/usr/local/cuda/bin/nvcc");
        p.is_file().then_some(p)
    })
}
