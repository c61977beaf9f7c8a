//! Loading the committed fatbins, and launching the gather/scatter copy
//! kernel: over a run list in device-readable memory, or, for a plan of up
//! to [`INLINE_RUNS`] runs, over runs carried in the launch's parameters.
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

/// Name of the entry point whose runs travel in its parameters.
const INLINE_ENTRY: &std::ffi::CStr = c"kvbm_copy_inline";

/// Most runs a launch carries in its parameters (`INLINE_RUNS` in the
/// kernel source).
pub(crate) const INLINE_RUNS: usize = 64;

/// A plan of at most [`INLINE_RUNS`] runs, addresses resolved, passed by
/// value to the kernel: the launch carries it, so no descriptor upload
/// precedes the copy. Matches `InlineRuns` in the kernel source.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct InlineRuns {
    src: [u64; INLINE_RUNS],
    dst: [u64; INLINE_RUNS],
    len: [u64; INLINE_RUNS],
    n_runs: u32,
}

// The kernel source asserts the same size.
const _: () = assert!(std::mem::size_of::<InlineRuns>() == 3 * 8 * INLINE_RUNS + 8);

impl InlineRuns {
    /// The runs `(source address, destination address, bytes)`; `None`
    /// when there are more than [`INLINE_RUNS`].
    pub(crate) fn new(runs: impl ExactSizeIterator<Item = (u64, u64, u64)>) -> Option<Self> {
        if runs.len() > INLINE_RUNS {
            return None;
        }
        let mut plan = InlineRuns {
            src: [0; INLINE_RUNS],
            dst: [0; INLINE_RUNS],
            len: [0; INLINE_RUNS],
            n_runs: 0,
        };
        for (i, (src, dst, len)) in runs.enumerate() {
            plan.src[i] = src;
            plan.dst[i] = dst;
            plan.len[i] = len;
            plan.n_runs += 1;
        }
        Some(plan)
    }
}

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

/// The copy kernel: its module and entry points.
pub(crate) struct CopyKernel {
    func: CUfunction,
    inline: CUfunction,
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
        let inline = module.function(INLINE_ENTRY)?;
        Ok(CopyKernel {
            func,
            inline,
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
        // pointer, pointer, u32); the caller guarantees the pointed-to
        // memory, the stream and the context.
        unsafe { launch(self.func, stream, grid, &mut params) }
    }

    /// Enqueues one launch copying the runs of `plan` on `stream`, each
    /// warp a worker.
    ///
    /// # Safety
    /// Every run's byte ranges must be valid device-accessible memory until
    /// the launch completes. The stream must belong to the kernel's
    /// context, and that context be current.
    pub(crate) unsafe fn launch_inline(
        &self,
        stream: &Stream,
        grid: Grid,
        plan: &InlineRuns,
    ) -> CudaResult<()> {
        let mut plan = *plan;
        let mut params: [*mut c_void; 1] = [(&mut plan as *mut InlineRuns).cast()];
        // SAFETY: `params` matches the kernel's signature (one
        // `InlineRuns` by value, the same `repr(C)` layout); the caller
        // guarantees the memory the runs address, the stream and the
        // context.
        unsafe { launch(self.inline, stream, grid, &mut params) }
    }
}

/// Enqueues one launch of `func` over `grid` on `stream`.
///
/// # Safety
/// `params` must point to the kernel's arguments, in its signature's order
/// and types (the call copies them); the stream must belong to the
/// function's context, current on this thread.
unsafe fn launch(
    func: CUfunction,
    stream: &Stream,
    grid: Grid,
    params: &mut [*mut c_void],
) -> CudaResult<()> {
    // SAFETY: the caller's promise.
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            func,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_travels_inline_up_to_its_capacity_and_no_further() {
        let runs = |n: usize| {
            (0..n as u64)
                .collect::<Vec<_>>()
                .into_iter()
                .map(|i| (i, 100 + i, 16 * (i + 1)))
        };
        let full = InlineRuns::new(runs(INLINE_RUNS)).expect("fits");
        assert_eq!(full.n_runs as usize, INLINE_RUNS);
        assert_eq!(
            (full.src[63], full.dst[63], full.len[63]),
            (63, 163, 16 * 64)
        );
        let one = InlineRuns::new(runs(1)).expect("fits");
        assert_eq!((one.n_runs, one.len[0], one.len[1]), (1, 16, 0));
        assert!(InlineRuns::new(runs(INLINE_RUNS + 1)).is_none());
    }
}
