//! Affine families of runs, as strided copies: pure planning for the copy
//! engines.
//!
//! A copy engine moves a pitched (2D) copy — `height` lines of `width`
//! bytes, each line `pitch` bytes after the last on either side — as one
//! descriptor, at the cost of one. KV plans are full of such families: one
//! block's runs are contiguous in a FullyContiguous host layout, and on a
//! LayerSeparate device layout its K and V of one layer sit a constant
//! `num_blocks × run` apart; when the layer tensors come from one allocation,
//! every layer's K and V do, so a whole block (64 runs) becomes one
//! descriptor. One flat descriptor per run is submission-bound at runs of
//! a few KiB (each costs the driver a fixed time, longer than the engine
//! needs to move the run); one per block takes a few calls, and what
//! remains is the engine's own cost per line, which still shows at the
//! smallest runs.
//!
//! [`strided_copies`] finds the families. A family never spans a boundary
//! in `src_bounds` / `dst_bounds` (host registration chunks, device
//! allocations): the driver refuses, or cannot be trusted with, a copy whose
//! address range covers two allocations, even when no byte in between is
//! touched.

use super::plan::{CopyRun, Span, split_at_bounds};

/// `height` lines of `width` bytes: line `i` moves from `src + i ×
/// src_pitch` to `dst + i × dst_pitch`. Pitches are at least `width` when
/// `height > 1` (lines never overlap) and equal `width` when `height == 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Strided {
    pub src: u64,
    pub dst: u64,
    pub width: u64,
    pub height: u64,
    pub src_pitch: u64,
    pub dst_pitch: u64,
}

impl Strided {
    fn single(s: &Span) -> Strided {
        Strided {
            src: s.src,
            dst: s.dst,
            width: s.len,
            height: 1,
            src_pitch: s.len,
            dst_pitch: s.len,
        }
    }

    /// Bytes moved.
    #[cfg(test)]
    pub fn bytes(&self) -> u64 {
        self.width * self.height
    }

    /// One past the last byte of line `height - 1` on the source side.
    #[cfg(test)]
    fn src_end(&self) -> u64 {
        self.src + (self.height - 1) * self.src_pitch + self.width
    }

    #[cfg(test)]
    fn dst_end(&self) -> u64 {
        self.dst + (self.height - 1) * self.dst_pitch + self.width
    }

    /// The lines as plain spans (for checks).
    #[cfg(test)]
    pub fn lines(&self) -> impl Iterator<Item = Span> + '_ {
        (0..self.height).map(|i| Span {
            src: self.src + i * self.src_pitch,
            dst: self.dst + i * self.dst_pitch,
            len: self.width,
        })
    }
}

/// Which side's address order groups best: the host side of a host ↔
/// device copy (its runs are contiguous per block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OrderBy {
    Source,
    Destination,
}

/// True when no bound lies strictly inside `(start, end)`.
fn no_bound_inside(bounds: &[u64], start: u64, end: u64) -> bool {
    let i = bounds.partition_point(|&b| b <= start);
    bounds.get(i).is_none_or(|&b| b >= end)
}

/// Greedily groups consecutive spans into affine families.
///
/// A span joins the open family when it has the family's width, continues
/// both sides at the family's pitches (fixed by its second line), each pitch
/// is at least the width and at most `max_pitch`, and the family's extent
/// then holds no bound on either side. Spans must not cross a bound
/// themselves (see [`split_at_bounds`]).
pub(crate) fn group_affine(
    spans: &[Span],
    src_bounds: &[u64],
    dst_bounds: &[u64],
    max_pitch: u64,
) -> Vec<Strided> {
    let mut out: Vec<Strided> = Vec::with_capacity(spans.len() / 2 + 1);
    for s in spans.iter().filter(|s| s.len > 0) {
        if let Some(g) = out.last_mut() {
            let fits = if g.height == 1 {
                s.len == g.width
                    && s.src >= g.src + g.width
                    && s.dst >= g.dst + g.width
                    && s.src - g.src <= max_pitch
                    && s.dst - g.dst <= max_pitch
            } else {
                s.len == g.width
                    && Some(s.src) == g.height.checked_mul(g.src_pitch).map(|o| g.src + o)
                    && Some(s.dst) == g.height.checked_mul(g.dst_pitch).map(|o| g.dst + o)
            };
            if fits
                && no_bound_inside(src_bounds, g.src, s.src + s.len)
                && no_bound_inside(dst_bounds, g.dst, s.dst + s.len)
            {
                if g.height == 1 {
                    g.src_pitch = s.src - g.src;
                    g.dst_pitch = s.dst - g.dst;
                }
                g.height += 1;
                continue;
            }
        }
        out.push(Strided::single(s));
    }
    out
}

/// What a family may look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FamilyLimits {
    /// Largest pitch the driver accepts.
    pub max_pitch: u64,
    /// Families of fewer lines are handed back as single lines: a pitched
    /// descriptor costs the driver several times a flat one (a
    /// `cuMemcpy3DBatchAsync_v2` entry against a `cuMemcpyBatchAsync_v2`
    /// entry), so only tall families pay.
    pub min_height: u64,
}

/// Resolves `runs` to absolute spans, merges contiguous ones, splits them
/// at the bounds and groups them into affine families.
///
/// The plan's own order is tried first (kvbm-layout plans come in
/// destination order; a D2H plan into a FullyContiguous host layout is then
/// already block by block). When that leaves most spans alone and the plan
/// is not sorted by the `order` side's address, the spans are sorted by it
/// and grouped again; the result with fewer copies wins.
pub(crate) fn strided_copies(
    runs: &[CopyRun],
    src_bases: &[u64],
    dst_bases: &[u64],
    order: OrderBy,
    src_bounds: &[u64],
    dst_bounds: &[u64],
    limits: FamilyLimits,
) -> Vec<Strided> {
    let key = |s: &Span| match order {
        OrderBy::Source => s.src,
        OrderBy::Destination => s.dst,
    };
    let mut spans: Vec<Span> = runs
        .iter()
        .filter(|r| r.len > 0)
        .map(|r| Span {
            src: src_bases[r.src_region as usize] + r.src_offset,
            dst: dst_bases[r.dst_region as usize] + r.dst_offset,
            len: r.len,
        })
        .collect();
    let group = |spans: &[Span]| {
        let merged = merge_contiguous(spans);
        let mut bounds: Vec<u64> = src_bounds.iter().chain(dst_bounds).copied().collect();
        bounds.sort_unstable();
        bounds.dedup();
        let split = split_at_bounds(&merged, &bounds);
        group_affine(&split, src_bounds, dst_bounds, limits.max_pitch)
    };
    // Judged before short families are flattened: a plan of two-run
    // families (K and V of a layer in its own allocation) is grouped as
    // well as it can be, and needs no sort.
    let first = group(&spans);
    if first.len() * 2 <= spans.len() || spans.is_sorted_by_key(key) {
        return flatten_short(first, limits.min_height);
    }
    spans.sort_unstable_by_key(key);
    let sorted = group(&spans);
    let best = if sorted.len() < first.len() {
        sorted
    } else {
        first
    };
    flatten_short(best, limits.min_height)
}

/// Replaces families shorter than `min_height` by their lines.
fn flatten_short(families: Vec<Strided>, min_height: u64) -> Vec<Strided> {
    if families
        .iter()
        .all(|g| g.height == 1 || g.height >= min_height)
    {
        return families;
    }
    let mut out = Vec::with_capacity(families.len() * 2);
    for g in families {
        if g.height == 1 || g.height >= min_height {
            out.push(g);
            continue;
        }
        out.extend((0..g.height).map(|i| {
            Strided::single(&Span {
                src: g.src + i * g.src_pitch,
                dst: g.dst + i * g.dst_pitch,
                len: g.width,
            })
        }));
    }
    out
}

/// Merges each span into the previous one when both its ends continue it.
fn merge_contiguous(spans: &[Span]) -> Vec<Span> {
    let mut out: Vec<Span> = Vec::with_capacity(spans.len());
    for &s in spans {
        match out.last_mut() {
            Some(p) if p.src + p.len == s.src && p.dst + p.len == s.dst => p.len += s.len,
            _ => out.push(s),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Byte-level replay: copying every line of every family into `mem`
    /// must equal copying every run.
    fn check_equivalent(runs: &[CopyRun], src_bases: &[u64], dst_bases: &[u64], got: &[Strided]) {
        let total: u64 = runs.iter().map(|r| r.len).sum();
        assert_eq!(got.iter().map(Strided::bytes).sum::<u64>(), total);
        let mut want: Vec<(u64, u64)> = Vec::new(); // (dst byte, src byte)
        for r in runs {
            let s = src_bases[r.src_region as usize] + r.src_offset;
            let d = dst_bases[r.dst_region as usize] + r.dst_offset;
            want.extend((0..r.len).map(|i| (d + i, s + i)));
        }
        let mut have: Vec<(u64, u64)> = Vec::new();
        for g in got {
            assert!(g.height >= 1 && g.width > 0);
            if g.height > 1 {
                assert!(g.src_pitch >= g.width && g.dst_pitch >= g.width);
            }
            for l in g.lines() {
                have.extend((0..l.len).map(|i| (l.dst + i, l.src + i)));
            }
        }
        want.sort_unstable();
        have.sort_unstable();
        assert_eq!(have, want);
    }

    /// Runs of a LayerSeparate (outer-first) device layout whose layers sit
    /// `layer_gap` bytes apart, against a FullyContiguous host layout, for
    /// the given (host block, device block) pairs.
    fn kv_plan(
        pairs: &[(u64, u64)],
        layers: u64,
        blocks: u64,
        run: u64,
        to_host: bool,
    ) -> Vec<CopyRun> {
        let mut runs = Vec::new();
        for &(hb, db) in pairs {
            for l in 0..layers {
                for o in 0..2 {
                    let host = ((hb * layers + l) * 2 + o) * run;
                    let dev = (o * blocks + db) * run;
                    runs.push(if to_host {
                        CopyRun {
                            src_region: l as u32,
                            src_offset: dev,
                            dst_region: 0,
                            dst_offset: host,
                            len: run,
                        }
                    } else {
                        CopyRun {
                            src_region: 0,
                            src_offset: host,
                            dst_region: l as u32,
                            dst_offset: dev,
                            len: run,
                        }
                    });
                }
            }
        }
        runs
    }

    const DEV: u64 = 1 << 40;
    const ANY: FamilyLimits = FamilyLimits {
        max_pitch: u64::MAX,
        min_height: 2,
    };
    const HOST: u64 = 1 << 20;

    #[test]
    fn one_allocation_gives_one_family_per_block() {
        let (layers, blocks, run) = (32u64, 64u64, 8192u64);
        let layer_bytes = 2 * blocks * run;
        let dev_bases: Vec<u64> = (0..layers).map(|l| DEV + l * layer_bytes).collect();
        let dev_bounds = [DEV, DEV + layers * layer_bytes];
        let host_bounds = [HOST, HOST + blocks * layers * 2 * run];
        let pairs = [(3, 17), (0, 5), (9, 60)];
        for to_host in [false, true] {
            let runs = kv_plan(&pairs, layers, blocks, run, to_host);
            let (sb, db, sbd, dbd, order) = if to_host {
                (
                    &dev_bases[..],
                    &[HOST][..],
                    &dev_bounds,
                    &host_bounds,
                    OrderBy::Destination,
                )
            } else {
                (
                    &[HOST][..],
                    &dev_bases[..],
                    &host_bounds,
                    &dev_bounds,
                    OrderBy::Source,
                )
            };
            let got = strided_copies(&runs, sb, db, order, sbd, dbd, ANY);
            assert_eq!(got.len(), 3, "{got:?}");
            assert!(got.iter().all(|g| g.height == 64 && g.width == run));
            check_equivalent(&runs, sb, db, &got);
        }
    }

    #[test]
    fn separate_allocations_give_one_family_per_layer() {
        let (layers, blocks, run) = (4u64, 16u64, 4096u64);
        let layer_bytes = 2 * blocks * run;
        // Layers back to back in address space, but each its own allocation.
        let dev_bases: Vec<u64> = (0..layers).map(|l| DEV + l * layer_bytes).collect();
        let dev_bounds: Vec<u64> = (0..=layers).map(|l| DEV + l * layer_bytes).collect();
        let runs = kv_plan(&[(1, 2), (2, 7)], layers, blocks, run, false);
        let got = strided_copies(
            &runs,
            &[HOST],
            &dev_bases,
            OrderBy::Source,
            &[],
            &dev_bounds,
            ANY,
        );
        assert_eq!(got.len(), 2 * layers as usize);
        assert!(got.iter().all(|g| g.height == 2));
        check_equivalent(&runs, &[HOST], &dev_bases, &got);
        // Families under the minimum height come back as single lines.
        let flat = strided_copies(
            &runs,
            &[HOST],
            &dev_bases,
            OrderBy::Source,
            &[],
            &dev_bounds,
            FamilyLimits {
                max_pitch: u64::MAX,
                min_height: 3,
            },
        );
        assert_eq!(flat.len(), runs.len());
        assert!(flat.iter().all(|g| g.height == 1));
        check_equivalent(&runs, &[HOST], &dev_bases, &flat);
    }

    #[test]
    fn plans_in_device_order_are_regrouped_by_host_address() {
        // kvbm-layout orders an onboard by destination: layer by layer.
        let (layers, blocks, run) = (8u64, 32u64, 4096u64);
        let layer_bytes = 2 * blocks * run;
        let dev_bases: Vec<u64> = (0..layers).map(|l| DEV + l * layer_bytes).collect();
        let mut runs = kv_plan(&[(0, 9), (1, 3), (2, 30)], layers, blocks, run, false);
        runs.sort_by_key(|r| (r.dst_region, r.dst_offset));
        let got = strided_copies(
            &runs,
            &[HOST],
            &dev_bases,
            OrderBy::Source,
            &[],
            &[DEV, DEV + layers * layer_bytes],
            ANY,
        );
        assert_eq!(got.len(), 3);
        check_equivalent(&runs, &[HOST], &dev_bases, &got);
    }

    #[test]
    fn pitch_limit_and_bounds_break_families() {
        let spans: Vec<Span> = (0..4)
            .map(|i| Span {
                src: i * 100,
                dst: 10_000 + i * 1000,
                len: 100,
            })
            .collect();
        assert_eq!(group_affine(&spans, &[], &[], u64::MAX).len(), 1);
        assert_eq!(group_affine(&spans, &[], &[], 999).len(), 4);
        // A destination bound between lines 1 and 2 splits the family.
        let got = group_affine(&spans, &[], &[11_500], u64::MAX);
        assert_eq!(got.iter().map(|g| g.height).collect::<Vec<_>>(), [2, 2]);
        // Overlapping or backwards steps never group.
        let back = [spans[1], spans[0]];
        assert_eq!(group_affine(&back, &[], &[], u64::MAX).len(), 2);
    }

    fn arb_case() -> impl Strategy<Value = (Vec<CopyRun>, Vec<u64>, Vec<u64>)> {
        // Runs of a few lengths at offsets on a coarse grid (so affine steps
        // happen often), regions 0..3 on each side, non-overlapping
        // destinations; bounds anywhere.
        (1usize..48)
            .prop_flat_map(|n| {
                (
                    proptest::collection::vec((0u32..3, 0u64..64, 0u32..3, 1u64..4), n),
                    proptest::collection::vec(0u64..(4 << 16), 0..4),
                    proptest::collection::vec(0u64..(4 << 16), 0..4),
                    Just((0..n as u64).collect::<Vec<_>>()).prop_shuffle(),
                )
            })
            .prop_map(|(raw, mut sb, mut db, perm)| {
                let runs = raw
                    .iter()
                    .zip(&perm)
                    .map(|(&(sr, so, dr, len), &p)| CopyRun {
                        src_region: sr,
                        src_offset: so * 256,
                        dst_region: dr,
                        // Slot p of region dr: destinations never overlap.
                        dst_offset: p * 1024,
                        len: len * 128,
                    })
                    .collect();
                sb.sort_unstable();
                db.sort_unstable();
                (runs, sb, db)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn families_move_exactly_the_plans_bytes(
            (runs, sbounds, dbounds) in arb_case(),
            by_src in any::<bool>(),
            max_pitch in prop_oneof![Just(u64::MAX), 128u64..4096],
            min_height in 1u64..5,
        ) {
            let src_bases = [0u64, 1 << 16, 2 << 16];
            let dst_bases = [0u64, 1 << 16, 2 << 16];
            let order = if by_src { OrderBy::Source } else { OrderBy::Destination };
            let limits = FamilyLimits { max_pitch, min_height };
            let got = strided_copies(&runs, &src_bases, &dst_bases, order, &sbounds, &dbounds, limits);
            check_equivalent(&runs, &src_bases, &dst_bases, &got);
            for g in &got {
                prop_assert!(no_bound_inside(&sbounds, g.src, g.src_end()));
                prop_assert!(no_bound_inside(&dbounds, g.dst, g.dst_end()));
                if g.height > 1 {
                    prop_assert!(g.src_pitch <= max_pitch && g.dst_pitch <= max_pitch);
                    prop_assert!(g.height >= min_height);
                }
            }
        }
    }
}
