//! The copy-rate / GEMM-loss measurement around the GEMM beside the
//! copies (the bf16 8192³ cuBLAS loop itself is kvbm-testkit's
//! [`Gemm`], shared with `kvbm-bench offload`).

use super::*;

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
