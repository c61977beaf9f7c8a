//! Pure planning for the copy paths: no driver calls, testable anywhere.
//!
//! A copy plan arrives as a list of [`CopyRun`]s over numbered source and
//! destination regions. The copy-engine path needs absolute (source,
//! destination, length) triples, merged where both sides are contiguous.
//! The staged path needs the plan cut into staging-slot-sized chunks: on
//! the device side a gather/scatter kernel moves each run between its place
//! in the device layout and a dense staging slot; on the host side the slot
//! moves as a few large DMA copies, because runs are ordered by their host
//! address and so land next to each other in the slot.

/// One contiguous piece of a copy plan: kvbm-layout's run, whose
/// `#[repr(C)]` layout (40 bytes) the copy kernel reads as is.
pub use kvbm_layout::CopyRun;

const _: () = assert!(std::mem::size_of::<CopyRun>() == 40);

/// An absolute copy: `len` bytes from address `src` to address `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
}

/// Resolves runs to absolute spans in plan order, merging a span into the
/// previous one when both its ends continue it.
pub(crate) fn absolute_spans(runs: &[CopyRun], src_bases: &[u64], dst_bases: &[u64]) -> Vec<Span> {
    let mut out: Vec<Span> = Vec::with_capacity(runs.len());
    for r in runs.iter().filter(|r| r.len > 0) {
        let s = Span {
            src: src_bases[r.src_region as usize] + r.src_offset,
            dst: dst_bases[r.dst_region as usize] + r.dst_offset,
            len: r.len,
        };
        match out.last_mut() {
            Some(p) if p.src + p.len == s.src && p.dst + p.len == s.dst => p.len += s.len,
            _ => out.push(s),
        }
    }
    out
}

/// Splits spans so that none crosses an address in `bounds` (sorted) on
/// either side. The driver refuses a DMA copy that spans two separate host
/// registrations, and pinned memory is registered in chunks.
pub(crate) fn split_at_bounds(spans: &[Span], bounds: &[u64]) -> Vec<Span> {
    let next_bound = |from: u64, to: u64| -> Option<u64> {
        let i = bounds.partition_point(|&b| b <= from);
        bounds.get(i).copied().filter(|&b| b < to)
    };
    let mut out = Vec::with_capacity(spans.len());
    for s in spans {
        let mut s = *s;
        loop {
            let cut = [
                next_bound(s.src, s.src + s.len).map(|b| b - s.src),
                next_bound(s.dst, s.dst + s.len).map(|b| b - s.dst),
            ]
            .into_iter()
            .flatten()
            .min();
            match cut {
                Some(c) if c > 0 && c < s.len => {
                    out.push(Span { len: c, ..s });
                    s = Span {
                        src: s.src + c,
                        dst: s.dst + c,
                        len: s.len - c,
                    };
                }
                _ => {
                    out.push(s);
                    break;
                }
            }
        }
    }
    out
}

/// Which side of a staged copy the host is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostSide {
    /// Host → staging by DMA, then staging → device by the kernel.
    Source,
    /// Device → staging by the kernel, then staging → host by DMA.
    Destination,
}

/// A DMA piece between the host and a staging slot (offset in the slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HostPiece {
    pub host: u64,
    pub slot_offset: u64,
    pub len: u64,
}

/// One staging slot's worth of a staged copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StagedChunk {
    /// Range of `StagedPlan::kernel_runs` for this chunk.
    pub kernel_runs: std::ops::Range<usize>,
    /// Range of `StagedPlan::pieces` for this chunk.
    pub pieces: std::ops::Range<usize>,
}

/// A copy cut into staging chunks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StagedPlan {
    /// Kernel runs; the staging side is region 0 at the slot's start.
    pub kernel_runs: Vec<CopyRun>,
    /// Host DMA pieces, merged where contiguous on both sides.
    pub pieces: Vec<HostPiece>,
    /// Chunks in the order they go through the ring.
    pub chunks: Vec<StagedChunk>,
}

/// Cuts `runs` into chunks of at most `slot_bytes` staging bytes.
///
/// Runs are ordered by host address so consecutive host bytes share a slot
/// and merge into large DMA pieces; a run larger than the room left in a
/// slot is split across slots.
pub(crate) fn plan_staged(
    runs: &[CopyRun],
    src_bases: &[u64],
    dst_bases: &[u64],
    host: HostSide,
    slot_bytes: u64,
) -> StagedPlan {
    let host_addr = |r: &CopyRun| match host {
        HostSide::Source => src_bases[r.src_region as usize] + r.src_offset,
        HostSide::Destination => dst_bases[r.dst_region as usize] + r.dst_offset,
    };
    let mut order: Vec<&CopyRun> = runs.iter().filter(|r| r.len > 0).collect();
    // Plans from kvbm-layout come in destination order, so offloads are
    // usually sorted already; onboards need the sort to merge host bytes.
    if !order.is_sorted_by_key(|r| host_addr(r)) {
        order.sort_unstable_by_key(|r| host_addr(r));
    }

    let mut plan = StagedPlan::default();
    let mut used = 0u64; // bytes used in the current slot
    let mut chunk_runs = 0usize;
    let mut chunk_pieces = 0usize;
    for r in order {
        let mut done = 0u64;
        while done < r.len {
            if used == slot_bytes {
                plan.chunks.push(StagedChunk {
                    kernel_runs: chunk_runs..plan.kernel_runs.len(),
                    pieces: chunk_pieces..plan.pieces.len(),
                });
                chunk_runs = plan.kernel_runs.len();
                chunk_pieces = plan.pieces.len();
                used = 0;
            }
            let len = (r.len - done).min(slot_bytes - used);
            let kernel_run = match host {
                HostSide::Source => CopyRun {
                    src_region: 0,
                    src_offset: used,
                    dst_region: r.dst_region,
                    dst_offset: r.dst_offset + done,
                    len,
                },
                HostSide::Destination => CopyRun {
                    src_region: r.src_region,
                    src_offset: r.src_offset + done,
                    dst_region: 0,
                    dst_offset: used,
                    len,
                },
            };
            plan.kernel_runs.push(kernel_run);
            let piece = HostPiece {
                host: host_addr(r) + done,
                slot_offset: used,
                len,
            };
            let in_chunk = plan.pieces.len() > chunk_pieces;
            match plan.pieces.last_mut() {
                Some(p)
                    if in_chunk
                        && p.host + p.len == piece.host
                        && p.slot_offset + p.len == piece.slot_offset =>
                {
                    p.len += len
                }
                _ => plan.pieces.push(piece),
            }
            used += len;
            done += len;
        }
    }
    if plan.kernel_runs.len() > chunk_runs {
        plan.chunks.push(StagedChunk {
            kernel_runs: chunk_runs..plan.kernel_runs.len(),
            pieces: chunk_pieces..plan.pieces.len(),
        });
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_runs() -> impl Strategy<Value = Vec<CopyRun>> {
        // Non-overlapping runs: run i owns [i*1024, i*1024+len) on both sides,
        // with the destination order shuffled by a permutation.
        (1usize..40)
            .prop_flat_map(|n| {
                (
                    proptest::collection::vec(1u64..1024, n),
                    Just((0..n).collect::<Vec<_>>()).prop_shuffle(),
                    proptest::collection::vec(0u32..3, n),
                )
            })
            .prop_map(|(lens, perm, regions)| {
                lens.iter()
                    .enumerate()
                    .map(|(i, &len)| CopyRun {
                        src_region: regions[i],
                        src_offset: i as u64 * 1024,
                        dst_region: 0,
                        dst_offset: perm[i] as u64 * 1024,
                        len,
                    })
                    .collect()
            })
    }

    /// Replays a staged plan on byte arrays through a simulated ring of slots
    /// and checks the result equals a direct copy.
    fn replay(runs: &[CopyRun], host: HostSide, slot: u64) {
        let src_bases = [0u64, 64 << 10, 128 << 10];
        let dst_bases = [192 << 10];
        let mem_len = 256 << 10;
        let mut rng = 0x1234_5678u64;
        let src: Vec<u8> = (0..mem_len)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng as u8
            })
            .collect();
        let mut want = src.clone();
        for r in runs {
            let s = (src_bases[r.src_region as usize] + r.src_offset) as usize;
            let d = (dst_bases[r.dst_region as usize] + r.dst_offset) as usize;
            want.copy_within(s..s + r.len as usize, d);
        }
        let plan = plan_staged(runs, &src_bases, &dst_bases, host, slot);
        let mut got = src.clone();
        let mut staging = vec![0u8; slot as usize];
        for c in &plan.chunks {
            let krs = &plan.kernel_runs[c.kernel_runs.clone()];
            let pcs = &plan.pieces[c.pieces.clone()];
            let total: u64 = krs.iter().map(|r| r.len).sum();
            assert!(total <= slot);
            assert_eq!(total, pcs.iter().map(|p| p.len).sum::<u64>());
            match host {
                HostSide::Source => {
                    for p in pcs {
                        let h = p.host as usize;
                        staging[p.slot_offset as usize..][..p.len as usize]
                            .copy_from_slice(&got[h..h + p.len as usize]);
                    }
                    for r in krs {
                        let d = (dst_bases[r.dst_region as usize] + r.dst_offset) as usize;
                        got[d..d + r.len as usize]
                            .copy_from_slice(&staging[r.src_offset as usize..][..r.len as usize]);
                    }
                }
                HostSide::Destination => {
                    for r in krs {
                        let s = (src_bases[r.src_region as usize] + r.src_offset) as usize;
                        staging[r.dst_offset as usize..][..r.len as usize]
                            .copy_from_slice(&got[s..s + r.len as usize]);
                    }
                    for p in pcs {
                        let h = p.host as usize;
                        got[h..h + p.len as usize]
                            .copy_from_slice(&staging[p.slot_offset as usize..][..p.len as usize]);
                    }
                }
            }
        }
        assert!(got == want, "staged replay differs from a direct copy");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn staged_plan_replays_to_direct_copy(runs in arb_runs(), slot in 1u64..5_000, to_host in any::<bool>()) {
            let host = if to_host { HostSide::Destination } else { HostSide::Source };
            replay(&runs, host, slot);
        }

        #[test]
        fn absolute_spans_cover_every_byte_once(runs in arb_runs()) {
            let src_bases = [0u64, 64 << 10, 128 << 10];
            let dst_bases = [192 << 10];
            let spans = absolute_spans(&runs, &src_bases, &dst_bases);
            let total: u64 = runs.iter().map(|r| r.len).sum();
            prop_assert_eq!(spans.iter().map(|s| s.len).sum::<u64>(), total);
            // Every run's first byte is inside exactly one span at the same
            // relative position on both sides.
            for r in &runs {
                let s = src_bases[r.src_region as usize] + r.src_offset;
                let d = dst_bases[r.dst_region as usize] + r.dst_offset;
                let hits = spans.iter().filter(|p| s >= p.src && s < p.src + p.len && p.dst + (s - p.src) == d).count();
                prop_assert_eq!(hits, 1);
            }
        }
    }

    #[test]
    fn spans_split_at_registration_bounds_on_either_side() {
        let spans = [
            Span {
                src: 0,
                dst: 1000,
                len: 100,
            },
            Span {
                src: 500,
                dst: 5000,
                len: 10,
            },
        ];
        // Bound 50 cuts the first span on the source side, 1070 on the
        // destination side; 505 cuts the second span.
        let got = split_at_bounds(&spans, &[50, 505, 1070]);
        assert_eq!(
            got,
            vec![
                Span {
                    src: 0,
                    dst: 1000,
                    len: 50
                },
                Span {
                    src: 50,
                    dst: 1050,
                    len: 20
                },
                Span {
                    src: 70,
                    dst: 1070,
                    len: 30
                },
                Span {
                    src: 500,
                    dst: 5000,
                    len: 5
                },
                Span {
                    src: 505,
                    dst: 5005,
                    len: 5
                },
            ]
        );
        // A bound at a span's start or end cuts nothing.
        assert_eq!(
            split_at_bounds(&spans[..1], &[0, 100, 1000, 1100]),
            spans[..1].to_vec()
        );
    }

    #[test]
    fn contiguous_host_bytes_merge_into_one_piece() {
        // Four 1 KiB runs from scattered device places into one contiguous
        // host range: one DMA piece per slot.
        let runs: Vec<CopyRun> = (0..4u64)
            .map(|i| CopyRun {
                src_region: 0,
                src_offset: (3 - i) * 10_000,
                dst_region: 0,
                dst_offset: i * 1024,
                len: 1024,
            })
            .collect();
        let plan = plan_staged(&runs, &[0], &[1 << 20], HostSide::Destination, 4096);
        assert_eq!(plan.chunks.len(), 1);
        assert_eq!(plan.pieces.len(), 1);
        assert_eq!(plan.pieces[0].len, 4096);
        assert_eq!(plan.kernel_runs.len(), 4);
    }

    #[test]
    fn pieces_do_not_merge_across_slots() {
        let runs = [CopyRun {
            src_region: 0,
            src_offset: 0,
            dst_region: 0,
            dst_offset: 0,
            len: 10_000,
        }];
        let plan = plan_staged(&runs, &[0], &[1 << 20], HostSide::Source, 4096);
        assert_eq!(plan.chunks.len(), 3);
        assert_eq!(plan.pieces.len(), 3);
        assert_eq!(
            plan.pieces.iter().map(|p| p.len).collect::<Vec<_>>(),
            [4096, 4096, 1808]
        );
    }
}
