//! Loading the committed fatbins, and launching the gather/scatter copy
//! kernel.
//!
//! The CUDA C source is `kernels/copy_runs.cu`; `cargo xtask kernels` rebuilds
//! `kernels/copy_runs.fatbin` (sm_80, sm_90 and compute_90 PTX), which is
//! committed and embedded here, so building kvbm never needs nvcc.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUdeviceptr, CUfunction, CUmodule};

use super::error::{CudaResult, check};
use super::handles::Stream;

/// The fatbin built from `kernels/copy_runs.cu`.
static FATBIN: &[u8] = include_bytes!("../../kernels/copy_runs.fatbin");

/// Name of the kernel entry point in the fatbin.
const ENTRY: &std::ffi::CStr = c"kvbm_copy_runs";

/// A loaded fatbin, unloaded on drop; kernels hold it alive.
pub(crate) struct Module {
    raw: CUmodule,
    ctx: Arc<CudaContext>,
}

// SAFETY: a module handle is a plain driver handle, valid from any thread
// on which its context is current; the driver serialises use.
unsafe impl Send for Module {}
// SAFETY: as above; nothing is mutated through a shared reference.
unsafe impl Sync for Module {}

impl Module {
    /// Loads `fatbin` into `ctx`.
    pub(crate) fn load(ctx: &Arc<CudaContext>, fatbin: &[u8]) -> CudaResult<Self> {
        ctx.bind_to_thread()
            .map_err(|e| super::error::CudaError::driver("cuCtxSetCurrent", e.0))?;
        // A fatbin is embedded with byte alignment; the driver wants it
        // 8-byte aligned, so hand it an aligned copy.
        let mut aligned = vec![0u64; fatbin.len().div_ceil(8)];
        // SAFETY: `aligned` holds at least fatbin.len() bytes; the regions
        // do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                fatbin.as_ptr(),
                aligned.as_mut_ptr().cast::<u8>(),
                fatbin.len(),
            );
        }
        let mut raw: CUmodule = std::ptr::null_mut();
        // SAFETY: `aligned` is a complete fatbin image that outlives the
        // call; the context is current.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut raw, aligned.as_ptr().cast::<c_void>())
        })?;
        Ok(Module {
            raw,
            ctx: Arc::clone(ctx),
        })
    }

    /// The kernel entry point `name`.
    pub(crate) fn function(&self, name: &std::ffi::CStr) -> CudaResult<CUfunction> {
        let mut func: CUfunction = std::ptr::null_mut();
        // SAFETY: the module is loaded; `name` is NUL-terminated.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut func, self.raw, name.as_ptr())
        })?;
        Ok(func)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: loaded by `load` and unloaded once, here; every launch
            // holds its kernel (and so this module) alive until it completes.
            unsafe { sys::cuModuleUnload(self.raw) };
        }
    }
}

/// The copy kernel: its module and entry point.
pub(crate) struct CopyKernel {
    func: CUfunction,
    _module: Module,
}

// SAFETY: a function handle is a plain driver handle valid while its
// module (owned here) is loaded; the driver serialises launches.
unsafe impl Send for CopyKernel {}
// SAFETY: as above; launching takes no mutable state on our side.
unsafe impl Sync for CopyKernel {}

/// Launch geometry of one copy-kernel launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grid {
    /// Number of CTAs.
    pub ctas: u32,
    /// Threads per CTA (a multiple of 32, at most 1024).
    pub threads: u32,
}

impl CopyKernel {
    /// Loads the embedded fatbin into `ctx`.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> CudaResult<Self> {
        let module = Module::load(ctx, FATBIN)?;
        let func = module.function(ENTRY)?;
        Ok(CopyKernel {
            func,
            _module: module,
        })
    }

    /// Enqueues one launch copying `n_runs` runs on `stream`.
    ///
    /// # Safety
    /// `runs` must point to `n_runs` `CopyRun`s in device-readable memory,
    /// `src_bases`/`dst_bases` to the base address tables every run's region
    /// index is in bounds of, and every addressed byte range must be valid
    /// device-accessible memory until the launch completes. The stream must
    /// belong to the kernel's context, and that context be current.
    pub(crate) unsafe fn launch(
        &self,
        stream: &Stream,
        grid: Grid,
        runs: CUdeviceptr,
        n_runs: u32,
        src_bases: CUdeviceptr,
        dst_bases: CUdeviceptr,
    ) -> CudaResult<()> {
        let mut runs = runs;
        let mut n_runs = n_runs;
        let mut src_bases = src_bases;
        let mut dst_bases = dst_bases;
        // Each warp copies its own run (the kernel can also give each CTA
        // one; warps keep more loads in flight for small runs).
        let mut per_warp = 1u32;
        let mut params: [*mut c_void; 5] = [
            (&mut runs as *mut CUdeviceptr).cast(),
            (&mut n_runs as *mut u32).cast(),
            (&mut src_bases as *mut CUdeviceptr).cast(),
            (&mut dst_bases as *mut CUdeviceptr).cast(),
            (&mut per_warp as *mut u32).cast(),
        ];
        // SAFETY: `params` matches the kernel's signature (pointer, u32,
        // pointer, pointer, u32) and lives across the call, which copies it; the
        // caller guarantees the pointed-to memory.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.func,
                grid.ctas.max(1),
                1,
                1,
                grid.threads,
                1,
                1,
                0,
                stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}
