//! The GEMM beside the copies: a bf16 8192³ cuBLAS loop on its own
//! stream, and the copy-rate / GEMM-loss measurement around it.

use super::*;

/// bf16 8192³ GEMM loop through cuBLAS on its own stream.
pub(crate) struct Gemm {
    handle: cudarc::cublas::sys::cublasHandle_t,
    stream: cudarc::driver::sys::CUstream,
    a: DeviceBuffer,
    b: DeviceBuffer,
    c: DeviceBuffer,
}

const N: usize = 8192;

impl Gemm {
    pub(crate) fn new(dev: &CudaDevice) -> Option<Gemm> {
        // SAFETY: only tries to dlopen libcublas.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            println!("skipped: cuBLAS not found (GEMM interference not measured)");
            return None;
        }
        dev.bind().ok()?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; context current.
        unsafe {
            cudarc::driver::sys::cuStreamCreate(&mut stream, 1);
        }
        let handle = cudarc::cublas::result::create_handle().ok()?;
        // SAFETY: handle and stream are live.
        unsafe { cudarc::cublas::result::set_stream(handle, stream as _) }.ok()?;
        let bytes = N * N * 2;
        // Random bf16 in [-1, 1): the top half of random f32s.
        let mut host = Vec::with_capacity(bytes);
        let raw = random_bytes(N * N * 4, 99);
        for w in raw.chunks_exact(4) {
            let x = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            let f = (x as f32 / u32::MAX as f32) * 2.0 - 1.0;
            host.extend_from_slice(&((f.to_bits() >> 16) as u16).to_le_bytes());
        }
        let mk = || {
            let b = DeviceBuffer::new(dev, bytes).ok()?;
            b.write(0, &host).ok()?;
            Some(b)
        };
        Some(Gemm {
            handle,
            stream,
            a: mk()?,
            b: mk()?,
            c: mk()?,
        })
    }

    /// Runs `n` GEMMs and returns TFLOP/s.
    pub(crate) fn run(&self, n: usize) -> f64 {
        use cudarc::cublas::sys::*;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let t = Instant::now();
        for _ in 0..n {
            // SAFETY: the buffers hold N×N bf16 each; handle and stream live.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    self.handle,
                    cublasOperation_t::CUBLAS_OP_N,
                    cublasOperation_t::CUBLAS_OP_N,
                    N as i32,
                    N as i32,
                    N as i32,
                    (&alpha as *const f32).cast(),
                    self.a.ptr() as *const _,
                    cudaDataType::CUDA_R_16BF,
                    N as i32,
                    self.b.ptr() as *const _,
                    cudaDataType::CUDA_R_16BF,
                    N as i32,
                    (&beta as *const f32).cast(),
                    self.c.ptr() as *mut _,
                    cudaDataType::CUDA_R_16BF,
                    N as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
                )
            }
            .expect("gemm");
        }
        // SAFETY: the stream is live.
        unsafe { cudarc::driver::sys::cuStreamSynchronize(self.stream) };
        2.0 * (N as f64).powi(3) * n as f64 / t.elapsed().as_secs_f64() / 1e12
    }
}

/// A copy that completed beside the GEMM: (thread, lane, submitted,
/// completed, bytes).
type Done = (usize, usize, Instant, Instant, u64);

/// Runs `case` copies on a thread while `n` GEMMs run, keeping `in_flight`
/// copies submitted (1: each copy starts after the previous completed);
/// returns (GEMM TFLOP/s, copy GB/s inside the GEMM window, copy GB/s
/// from completion to completion).
///
/// The first rate is the earlier one: the bytes of the copies submitted and
/// completed inside the window over the span from the first submission to
/// the last completion. With several copies in flight it errs low (the
/// first counted copy waits behind uncounted ones, which the span then
/// includes), so those rows use the second: per submitting thread and per
/// lane its copies went to (the copier deals a thread's copies round-robin
/// over `lanes` lanes, so copy `k` went to lane `k mod lanes`), the bytes of
/// the copies completed inside the window after the lane's first completion
/// there, over the time between that completion and its last, summed over
/// lanes and threads. Per lane, because copies on two lanes run side by
/// side and finish in pairs: counted over the pairs, the second copy of
/// the first pair would be counted without its time (with 4 copies of 512
/// MiB in flight on two lanes that read 1.17–1.19 × the link's rate). With
/// one copy in flight the two agree up to the gap between a completion and
/// the next submission.
pub(crate) fn interfere(
    copier: &CudaCopier,
    gemm: &Gemm,
    cases: &[(&Case, CopyOptions)],
    n: usize,
    in_flight: usize,
    lanes: usize,
) -> (f64, f64, f64) {
    let stop = AtomicBool::new(false);
    let log: Mutex<Vec<Done>> = Mutex::new(Vec::new());
    let (tflops, t0, t1) = std::thread::scope(|s| {
        for (thread, &(case, o)) in cases.iter().enumerate() {
            let (stop, log) = (&stop, &log);
            s.spawn(move || {
                let mut queue = VecDeque::new();
                let mut submitted = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    while queue.len() < in_flight {
                        let a = Instant::now();
                        let lane = submitted % lanes.max(1);
                        submitted += 1;
                        match copier.copy(&case.runs, &case.src, &case.dst, o) {
                            Ok(c) => queue.push_back((lane, a, c)),
                            Err(e) => {
                                println!("FAILED copy beside GEMM: {e}");
                                return;
                            }
                        }
                    }
                    if let Some((lane, a, c)) = queue.pop_front() {
                        if let Err(e) = c.wait() {
                            println!("FAILED copy beside GEMM: {e}");
                        }
                        log.lock()
                            .unwrap()
                            .push((thread, lane, a, Instant::now(), case.bytes));
                    }
                }
                for (_, _, c) in queue {
                    let _ = c.wait();
                }
            });
        }
        std::thread::sleep(Duration::from_millis(30));
        let t0 = Instant::now();
        let tflops = gemm.run(n);
        let t1 = Instant::now();
        stop.store(true, Ordering::Relaxed);
        (tflops, t0, t1)
    });
    let log = log.into_inner().unwrap();
    let inside: Vec<_> = log
        .iter()
        .filter(|(_, _, a, b, _)| *a >= t0 && *b <= t1)
        .collect();
    let bytes: u64 = inside.iter().map(|x| x.4).sum();
    let span = inside
        .iter()
        .map(|x| x.2)
        .min()
        .zip(inside.iter().map(|x| x.3).max())
        .map_or(1e-9, |(a, b)| (b - a).as_secs_f64());
    let lanes = lanes.max(1);
    let steady: f64 = (0..cases.len() * lanes)
        .map(|key| {
            let (thread, lane) = (key / lanes, key % lanes);
            let mut ends: Vec<(Instant, u64)> = log
                .iter()
                .filter(|x| x.0 == thread && x.1 == lane && x.3 >= t0 && x.3 <= t1)
                .map(|x| (x.3, x.4))
                .collect();
            ends.sort_by_key(|x| x.0);
            match (ends.first(), ends.last()) {
                (Some(first), Some(last)) if ends.len() > 1 => {
                    let moved: u64 = ends[1..].iter().map(|x| x.1).sum();
                    moved as f64 / (last.0 - first.0).as_secs_f64() / 1e9
                }
                _ => 0.0,
            }
        })
        .sum();
    (tflops, bytes as f64 / span / 1e9, steady)
}
