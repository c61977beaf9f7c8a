//! The model's stand-in on the GPU (feature `gemm`): a bf16 8192³ cuBLAS
//! GEMM loop on its own stream, to measure copies beside the work a model
//! keeps the SMs busy with, and what the copies cost it.
//!
//! It depends on cudarc alone (no kvbm-transfer types), so it builds
//! without kvbm-transfer's `cuda` feature; kvbm-bench's offload bench and
//! its `cuda_bench` use it. It runs in the device's
//! *primary* context, the one kvbm-transfer's `CudaDevice` retains, so the
//! copies and the GEMM share the GPU the way an engine and kvbm do.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::result as drv;
use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{CudaContext, sys::CUdeviceptr};

/// The matrices' side.
const N: usize = 8192;
/// Floating-point operations of one GEMM.
const FLOPS: f64 = 2.0 * (N as f64) * (N as f64) * (N as f64);

/// A bf16 8192³ GEMM (C = A·B, fp32 accumulation) through cuBLAS, with its
/// own A, B, C and stream in the device's primary context. Frees them on
/// drop.
pub struct Gemm {
    ctx: Arc<CudaContext>,
    handle: cudarc::cublas::sys::cublasHandle_t,
    stream: sys::CUstream,
    a: CUdeviceptr,
    b: CUdeviceptr,
    c: CUdeviceptr,
}

// SAFETY: the handle, stream and device pointers are plain handles of the
// primary context; every use binds that context first, and cuBLAS handles
// may be used from any thread as long as calls on one handle do not race
// (`run` and `run_until` take `&self` but are documented to be called from
// one thread at a time, and the benches do so).
unsafe impl Send for Gemm {}
// SAFETY: see `Send`.
unsafe impl Sync for Gemm {}

/// Random bf16 values in [-1, 1) for A and B: the top halves of random
/// f32s (xorshift64*, fixed seed, so every run multiplies the same data).
fn random_bf16(count: usize) -> Vec<u16> {
    let mut x: u64 = 99 | 1;
    let mut raw = Vec::with_capacity(count * 4 + 8);
    while raw.len() < count * 4 {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        raw.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    raw.chunks_exact(4)
        .take(count)
        .map(|w| {
            let u = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            let f = (u as f32 / u32::MAX as f32) * 2.0 - 1.0;
            (f.to_bits() >> 16) as u16
        })
        .collect()
}

impl Gemm {
    /// Sets the GEMM up on device `ordinal`: retains its primary context,
    /// allocates and fills A, B and C, and creates a stream and a cuBLAS
    /// handle. `None` when cuBLAS (printed: GEMM interference not
    /// measured) or the device is missing, or a step fails.
    pub fn new(ordinal: usize) -> Option<Gemm> {
        // SAFETY: only tries to dlopen libcublas.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            println!("skipped: cuBLAS not found (GEMM interference not measured)");
            return None;
        }
        // SAFETY: only tries to dlopen libcuda (`CudaContext::new` panics
        // without it).
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        let ctx = CudaContext::new(ordinal).ok()?;
        ctx.bind_to_thread().ok()?;
        let mut gemm = Gemm {
            ctx,
            handle: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
            a: 0,
            b: 0,
            c: 0,
        };
        gemm.stream = drv::stream::create(drv::stream::StreamKind::NonBlocking).ok()?;
        gemm.handle = blas::create_handle().ok()?;
        // SAFETY: handle and stream are live, in the current context.
        unsafe { blas::set_stream(gemm.handle, gemm.stream as _) }.ok()?;
        let host = random_bf16(N * N);
        let bytes = N * N * 2;
        for p in [&mut gemm.a, &mut gemm.b, &mut gemm.c] {
            // SAFETY: the context is current; `bytes` is non-zero.
            *p = unsafe { drv::malloc_sync(bytes) }.ok()?;
            // SAFETY: the allocation holds `bytes` = N×N bf16, the host
            // slice as many.
            unsafe { drv::memcpy_htod_sync(*p, &host) }.ok()?;
        }
        Some(gemm)
    }

    fn enqueue(&self) -> Result<(), String> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: A, B and C hold N×N bf16 each and live as long as
        // `self`; handle and stream are live; alpha and beta outlive the
        // call (cuBLAS reads host scalars before returning).
        unsafe {
            blas::gemm_ex(
                self.handle,
                cublasOperation_t::CUBLAS_OP_N,
                cublasOperation_t::CUBLAS_OP_N,
                N as i32,
                N as i32,
                N as i32,
                (&alpha as *const f32).cast(),
                self.a as *const _,
                cudaDataType::CUDA_R_16BF,
                N as i32,
                self.b as *const _,
                cudaDataType::CUDA_R_16BF,
                N as i32,
                (&beta as *const f32).cast(),
                self.c as *mut _,
                cudaDataType::CUDA_R_16BF,
                N as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .map_err(|e| format!("cublasGemmEx: {e:?}"))
    }

    /// Runs `n` GEMMs back to back and returns TFLOP/s (host clock, from
    /// the first submission to the stream's drain). Panics if cuBLAS
    /// rejects the call (the shapes are fixed, so that is a broken
    /// installation, not bad input).
    pub fn run(&self, n: usize) -> f64 {
        // Binding can only fail on a destroyed context, which `self` keeps.
        let _ = self.ctx.bind_to_thread();
        let t = Instant::now();
        for _ in 0..n {
            self.enqueue().expect("gemm");
        }
        // SAFETY: the stream is live.
        let _ = unsafe { drv::stream::synchronize(self.stream) };
        FLOPS * n as f64 / t.elapsed().as_secs_f64() / 1e12
    }

    /// Runs GEMMs until `stop` is set, keeping `KVBM_GEMM_QUEUE` (default
    /// two) queued on the stream, and returns when each completed (host
    /// clock). `started` is set once the first GEMM is queued.
    pub fn run_until(&self, stop: &AtomicBool, started: &AtomicBool) -> Result<GemmLog, String> {
        let depth = std::env::var("KVBM_GEMM_QUEUE")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(2)
            .clamp(1, 64);
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
        let flags = CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
            | CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        let mut events = Vec::with_capacity(depth);
        for _ in 0..depth {
            let mut ev = std::ptr::null_mut();
            // SAFETY: a valid out-pointer; the context is current; the
            // flags are the driver's own values.
            unsafe { sys::cuEventCreate(&mut ev, flags) }
                .result()
                .map_err(|e| format!("cuEventCreate: {e:?}"))?;
            events.push(ev);
        }
        let mut done = Vec::new();
        let mut queued = std::collections::VecDeque::new();
        let mut next = 0usize;
        let mut result = Ok(());
        let start = Instant::now();
        while !stop.load(Ordering::Relaxed) || !queued.is_empty() {
            if !stop.load(Ordering::Relaxed) && queued.len() < depth {
                let ev = events[next % depth];
                next += 1;
                if let Err(e) = self.enqueue() {
                    result = Err(e);
                    stop.store(true, Ordering::Relaxed);
                    continue;
                }
                // SAFETY: event and stream are live; the event is not
                // queued elsewhere (`depth` events, at most `depth` queued).
                if let Err(e) = unsafe { drv::event::record(ev, self.stream) } {
                    result = Err(format!("cuEventRecord: {e:?}"));
                    stop.store(true, Ordering::Relaxed);
                    continue;
                }
                queued.push_back(ev);
                started.store(true, Ordering::Relaxed);
                if queued.len() < depth {
                    continue;
                }
            }
            if let Some(ev) = queued.pop_front() {
                // SAFETY: the event is live and was recorded.
                let _ = unsafe { drv::event::synchronize(ev) };
                done.push(Instant::now());
            }
        }
        for ev in events {
            // SAFETY: nothing is queued on the events any more.
            let _ = unsafe { drv::event::destroy(ev) };
        }
        result.map(|()| GemmLog { start, done })
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: the stream is drained before anything it uses is freed;
        // each handle and pointer was created by `new` (null / 0 when that
        // step never ran) and is released once.
        unsafe {
            if !self.stream.is_null() {
                let _ = drv::stream::synchronize(self.stream);
            }
            if !self.handle.is_null() {
                let _ = blas::destroy_handle(self.handle);
            }
            for p in [self.a, self.b, self.c] {
                if p != 0 {
                    let _ = drv::free_sync(p);
                }
            }
            if !self.stream.is_null() {
                let _ = drv::stream::destroy(self.stream);
            }
        }
    }
}

/// When the GEMMs of [`Gemm::run_until`] completed.
#[derive(Debug, Clone)]
pub struct GemmLog {
    /// When the loop started.
    pub start: Instant,
    /// Each GEMM's completion, in order.
    pub done: Vec<Instant>,
}

impl GemmLog {
    /// TFLOP/s over the GEMMs that completed inside `[from, to]`: those
    /// after the first one there, over the time from the first to the
    /// last (so a GEMM that started before `from` is not counted). `None`
    /// with fewer than two completions inside.
    pub fn tflops_between(&self, from: Instant, to: Instant) -> Option<f64> {
        let inside: Vec<Instant> = self
            .done
            .iter()
            .copied()
            .filter(|t| *t >= from && *t <= to)
            .collect();
        match (inside.first(), inside.last()) {
            (Some(a), Some(b)) if inside.len() > 1 => {
                let secs = (*b - *a).as_secs_f64();
                (secs > 0.0).then(|| FLOPS * (inside.len() - 1) as f64 / secs / 1e12)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn tflops_counts_only_gemms_completed_inside_the_window() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let log = GemmLog {
            start,
            done: (1..=10).map(|i| at(i * 10)).collect(),
        };
        // Completions at 30, 40, 50, 60: three GEMMs over 30 ms.
        let t = log.tflops_between(at(25), at(65)).unwrap();
        let want = FLOPS * 3.0 / 0.030 / 1e12;
        assert!((t - want).abs() < 1e-6 * want, "{t} vs {want}");
        assert_eq!(log.tflops_between(at(31), at(39)), None);
        assert_eq!(log.tflops_between(at(35), at(45)), None);
    }

    #[test]
    fn random_matrix_values_are_bf16_in_range() {
        let v = random_bf16(1000);
        assert_eq!(v.len(), 1000);
        for &h in &v {
            let f = f32::from_bits(u32::from(h) << 16);
            assert!((-1.0..1.0).contains(&f), "{f}");
        }
        assert!(v.iter().any(|&h| h != v[0]));
    }
}
