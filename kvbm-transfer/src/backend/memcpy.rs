//! The memcpy backend: host ↔ host copies on the CPU.
//!
//! A plan is flattened into (source address, destination address, length)
//! segments and cut into pieces of roughly equal bytes, one per worker, so
//! a large plan uses every worker's share of memory bandwidth while a small
//! one stays on a single worker (splitting it would cost more in wake-ups
//! than it saves).

use std::sync::Arc;

use super::{BackendKind, Side, TransferBackend, TransferJob, accepted_kinds};
use crate::completion::{Completion, completion_pair};
use crate::error::{Result, TransferError};
use crate::memory::MemoryKind;
use crate::pool::WorkerPool;

/// Below this many bytes a job is not split across workers.
const MIN_PIECE_BYTES: u64 = 4 << 20;

/// Jobs at least this large bypass the cache on stores (non-temporal
/// stores): the destination will not be read by this CPU soon, and skipping
/// the read-for-ownership of every destination line saves a third of the
/// memory traffic. One large `memcpy` does the same internally; many 32 KiB
/// `memcpy` calls do not, because each one looks small.
const STREAMING_JOB_BYTES: u64 = 2 << 20;

/// Copies `len` bytes, with non-temporal stores when `streaming`.
///
/// # Safety
/// `src` must be valid for reading and `dst` for writing `len` bytes; the
/// ranges may overlap only when `streaming` is false.
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize, streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    if streaming {
        // SAFETY: forwarded from the caller; ranges do not overlap.
        unsafe { stream_copy(src, dst, len) };
        return;
    }
    let _ = streaming;
    // SAFETY: forwarded from the caller; `copy` tolerates overlap.
    unsafe { std::ptr::copy(src, dst, len) };
}

/// Copy with 16-byte non-temporal stores (SSE2, always present on x86_64).
/// The caller issues a store fence before publishing completion.
///
/// # Safety
/// As for [`copy_bytes`], with non-overlapping ranges.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{
        __m128i, _MM_HINT_NTA, _mm_loadu_si128, _mm_prefetch, _mm_stream_si128,
    };
    let head = dst.align_offset(16).min(len);
    // SAFETY: in bounds (`head <= len`), non-overlapping per the contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut n = len - head;
    // SAFETY: `head <= len`, so both stay within their ranges.
    let (mut s, mut d) = unsafe { (src.add(head), dst.add(head)) };
    while n >= 64 {
        // SAFETY: 64 bytes remain in both ranges; `d` is 16-byte aligned
        // (advanced from an aligned start in steps of 64), as the stream
        // stores require; loads are unaligned.
        unsafe {
            // Prefetching never faults, even past the end of the range; a
            // short chunk gets no help from the hardware prefetcher, which
            // has to relearn the stream at every chunk.
            _mm_prefetch::<_MM_HINT_NTA>(s.add(PREFETCH_AHEAD).cast::<i8>());
            let a = _mm_loadu_si128(s.cast::<__m128i>());
            let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
            let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
            let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
            _mm_stream_si128(d.cast::<__m128i>(), a);
            _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
            _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
            _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
            s = s.add(64);
            d = d.add(64);
        }
        n -= 64;
    }
    // SAFETY: the remaining `n < 64` bytes are in bounds.
    unsafe { std::ptr::copy_nonoverlapping(s, d, n) };
}

/// How far ahead of the loads the streaming copy prefetches.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 1024;

/// Orders non-temporal stores before the completion is published.
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions (SSE is baseline on x86_64).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

fn overlaps(segs: &[Segment]) -> bool {
    segs.iter()
        .any(|s| s.src < s.dst + s.len && s.dst < s.src + s.len)
}

/// CPU copies between system and pinned memory.
pub struct MemcpyBackend {
    pool: WorkerPool,
}

impl MemcpyBackend {
    /// A backend with `threads` copy workers (at least one).
    pub fn new(threads: usize) -> Result<Self> {
        let pool =
            WorkerPool::new("kvbm-memcpy", threads).map_err(|source| TransferError::Alloc {
                what: "memcpy worker threads".into(),
                source,
            })?;
        Ok(MemcpyBackend { pool })
    }
}

#[derive(Clone, Copy)]
struct Segment {
    src: u64,
    dst: u64,
    len: u64,
}

fn segments(job: &TransferJob) -> Result<Vec<Segment>> {
    job.validate_bounds()?;
    let src = job.address_table(Side::Source)?;
    let dst = job.address_table(Side::Destination)?;
    Ok(job
        .runs
        .iter()
        .map(|r| Segment {
            src: src[r.src_region as usize] + r.src_offset,
            dst: dst[r.dst_region as usize] + r.dst_offset,
            len: r.len,
        })
        .collect())
}

/// Cuts `segs` into at most `n` pieces of about equal bytes, splitting
/// segments where needed.
fn split(segs: Vec<Segment>, n: usize, total: u64) -> Vec<Vec<Segment>> {
    let pieces = (total / MIN_PIECE_BYTES).clamp(1, n as u64);
    if pieces == 1 {
        return vec![segs];
    }
    let target = total.div_ceil(pieces);
    let mut out = Vec::with_capacity(pieces as usize);
    let mut cur = Vec::new();
    let mut cur_bytes = 0;
    for mut s in segs {
        while s.len > 0 {
            let take = s.len.min(target - cur_bytes);
            cur.push(Segment { len: take, ..s });
            cur_bytes += take;
            s = Segment {
                src: s.src + take,
                dst: s.dst + take,
                len: s.len - take,
            };
            if cur_bytes == target {
                out.push(std::mem::take(&mut cur));
                cur_bytes = 0;
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

impl TransferBackend for MemcpyBackend {
    fn name(&self) -> &'static str {
        "memcpy"
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Memcpy
    }

    fn supports(&self, src: MemoryKind, dst: MemoryKind) -> bool {
        src.is_host() && dst.is_host()
    }

    fn submit(&self, job: TransferJob) -> Completion {
        let _span = tracing::trace_span!("memcpy", runs = job.runs.len()).entered();
        if let Err(e) = accepted_kinds(self, &job) {
            return Completion::ready(Err(e));
        }
        let segs = match segments(&job) {
            Ok(s) => s,
            Err(e) => return Completion::ready(Err(e)),
        };
        let total = job.total_bytes();
        if total == 0 {
            return Completion::ready(Ok(()));
        }
        let streaming = total >= STREAMING_JOB_BYTES && !overlaps(&segs);
        let job = Arc::new(job);
        let parts = split(segs, self.pool.threads(), total)
            .into_iter()
            .map(|piece| {
                let (completer, completion) = completion_pair();
                let job = job.clone();
                self.pool.spawn(move || {
                    for s in &piece {
                        if job.cancel.is_cancelled() {
                            store_fence();
                            completer.complete(Err(TransferError::Cancelled));
                            return;
                        }
                        // SAFETY: every run was checked to lie inside its
                        // source and destination regions (`validate_bounds`),
                        // both sides are host memory, and the regions (kept
                        // alive by `job`) guarantee the ranges are valid and
                        // not accessed by anyone else while the transfer
                        // runs. Streaming is chosen only when no segment
                        // overlaps itself.
                        unsafe {
                            copy_bytes(
                                s.src as *const u8,
                                s.dst as *mut u8,
                                s.len as usize,
                                streaming,
                            )
                        };
                    }
                    store_fence();
                    completer.complete(Ok(()));
                });
                completion
            });
        Completion::join_all(parts.collect::<Vec<_>>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn streaming_copy_equals_plain_copy(
            src_off in 0usize..64, dst_off in 0usize..64, len in 0usize..5000, seed in any::<u8>(),
        ) {
            let src: Vec<u8> = (0..len + 64).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
            let mut dst = vec![0xAAu8; len + 128];
            // SAFETY: both ranges lie inside their own vectors.
            unsafe { copy_bytes(src.as_ptr().add(src_off), dst.as_mut_ptr().add(dst_off), len, true) };
            store_fence();
            prop_assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..src_off + len]);
            prop_assert!(dst[..dst_off].iter().all(|&b| b == 0xAA));
            prop_assert!(dst[dst_off + len..].iter().all(|&b| b == 0xAA));
        }

        #[test]
        fn split_preserves_bytes_and_order(lens in proptest::collection::vec(1u64..(3 << 20), 1..40), n in 1usize..5) {
            let mut src = 0;
            let segs: Vec<_> = lens.iter().map(|&len| { let s = Segment { src, dst: src * 2, len }; src += len + 7; s }).collect();
            let total: u64 = lens.iter().sum();
            let pieces = split(segs.clone(), n, total);
            prop_assert!(pieces.len() <= n);
            // Re-joining the pieces gives the original byte stream.
            let flat: Vec<_> = pieces.iter().flatten().copied().collect();
            let mut i = 0;
            for s in &segs {
                let mut covered = 0;
                while covered < s.len {
                    let p = flat[i];
                    prop_assert_eq!(p.src, s.src + covered);
                    prop_assert_eq!(p.dst, s.dst + covered);
                    covered += p.len;
                    i += 1;
                }
                prop_assert_eq!(covered, s.len);
            }
            prop_assert_eq!(i, flat.len());
        }
    }
}
