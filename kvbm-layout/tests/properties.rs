//! Property tests: address math never overlaps, plans copy exactly the right
//! bytes with the fewest runs possible, descriptors round-trip.

use std::collections::{HashMap, HashSet};

use kvbm_layout::strategies::{block_shape, copy_case, layout};
use kvbm_layout::{
    BlockOrder, CopyPlan, CopyPlanner, Layout, LayoutConfig, LayoutDescriptor, LayoutError,
    LayoutKind, RunOrder, plan_copy, plan_copy_ordered,
};
use proptest::prelude::*;

/// Every region of `layout` as bytes, each byte distinct-ish per position.
fn filled(layout: &Layout, seed: u8) -> Vec<Vec<u8>> {
    (0..layout.num_regions())
        .map(|r| {
            let size = layout.region_size(r).unwrap() as usize;
            (0..size)
                .map(|i| (i as u8).wrapping_mul(31) ^ (r as u8).wrapping_mul(7) ^ seed)
                .collect()
        })
        .collect()
}

/// Executes a plan run by run.
fn execute(plan: &CopyPlan, src: &[Vec<u8>], dst: &mut [Vec<u8>]) {
    for run in plan.runs() {
        let (so, d0, n) = (
            run.src_offset as usize,
            run.dst_offset as usize,
            run.len as usize,
        );
        dst[run.dst_region as usize][d0..d0 + n]
            .copy_from_slice(&src[run.src_region as usize][so..so + n]);
    }
}

/// The reference: every chunk of every pair copied on its own.
fn reference(
    src_l: &Layout,
    dst_l: &Layout,
    pairs: &[(usize, usize)],
    src: &[Vec<u8>],
    dst: &mut [Vec<u8>],
) {
    let c = src_l.config();
    for &(s, d) in pairs {
        for layer in 0..c.num_layers() {
            for outer in 0..c.outer_dim() {
                let a = src_l.chunk(s, layer, outer).unwrap();
                let b = dst_l.chunk(d, layer, outer).unwrap();
                let (ao, bo, n) = (a.offset as usize, b.offset as usize, a.len as usize);
                dst[b.region][bo..bo + n].copy_from_slice(&src[a.region][ao..ao + n]);
            }
        }
    }
}

/// The fewest runs any plan can have: chunks minus the chunk pairs that are
/// adjacent in both layouts (each chunk can continue at most one other).
fn minimum_runs(src_l: &Layout, dst_l: &Layout, pairs: &[(usize, usize)]) -> usize {
    let c = src_l.config();
    let mut by_dst = HashMap::new();
    for &(s, d) in pairs {
        for layer in 0..c.num_layers() {
            for outer in 0..c.outer_dim() {
                let a = src_l.chunk(s, layer, outer).unwrap();
                let b = dst_l.chunk(d, layer, outer).unwrap();
                by_dst.insert((b.region, b.offset), (a.region, a.offset));
            }
        }
    }
    let len = c.chunk_bytes();
    let joins = by_dst
        .iter()
        .filter(|&(&(dr, doff), &(sr, soff))| {
            by_dst.get(&(dr, doff + len)) == Some(&(sr, soff + len))
        })
        .count();
    by_dst.len() - joins
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn chunks_never_overlap_and_stay_inside(layout in layout()) {
        let c = *layout.config();
        let mut seen = HashSet::new();
        let mut chunks = Vec::new();
        for b in 0..c.num_blocks() {
            for l in 0..c.num_layers() {
                for o in 0..c.outer_dim() {
                    let ch = layout.chunk(b, l, o).unwrap();
                    prop_assert_eq!(ch.len, c.chunk_bytes());
                    prop_assert!(ch.offset + ch.len <= layout.region_size(ch.region).unwrap());
                    prop_assert!(seen.insert((b, l, o)));
                    chunks.push(ch);
                }
            }
        }
        chunks.sort_by_key(|ch| (ch.region, ch.offset));
        for w in chunks.windows(2) {
            if w[0].region == w[1].region {
                prop_assert!(w[0].offset + w[0].len <= w[1].offset, "{:?} overlaps {:?}", w[0], w[1]);
            }
        }
        // Region count follows the kind.
        let want = match layout.kind() {
            LayoutKind::FullyContiguous => 1,
            LayoutKind::LayerSeparate(_) => c.num_layers(),
        };
        prop_assert_eq!(layout.num_regions(), want);
        prop_assert!(layout.chunk(c.num_blocks(), 0, 0).is_err());
    }

    #[test]
    fn plan_copies_the_same_bytes_as_chunk_by_chunk((src_l, dst_l, pairs) in copy_case()) {
        let plan = plan_copy(&src_l, &dst_l, &pairs).unwrap();
        let src = filled(&src_l, 0x5a);
        let mut got = filled(&dst_l, 0xc3);
        let mut want = got.clone();
        execute(&plan, &src, &mut got);
        reference(&src_l, &dst_l, &pairs, &src, &mut want);
        prop_assert_eq!(got, want);

        let chunks = pairs.len() * src_l.config().chunks_per_block();
        prop_assert_eq!(plan.num_chunks(), chunks);
        prop_assert!(plan.len() <= chunks);
        prop_assert_eq!(plan.total_bytes(), pairs.len() as u64 * src_l.config().block_bytes());
        prop_assert_eq!(plan.runs().iter().map(|r| r.len).sum::<u64>(), plan.total_bytes());
        // Runs are in destination order and never overlap there.
        for w in plan.runs().windows(2) {
            prop_assert!((w[0].dst_region, w[0].dst_offset + w[0].len) <= (w[1].dst_region, w[1].dst_offset));
        }
    }

    #[test]
    fn a_source_ordered_plan_copies_the_same_bytes((src_l, dst_l, pairs) in copy_case()) {
        let plan = plan_copy_ordered(&src_l, &dst_l, &pairs, RunOrder::Source).unwrap();
        let src = filled(&src_l, 0x5a);
        let mut got = filled(&dst_l, 0xc3);
        let mut want = got.clone();
        execute(&plan, &src, &mut got);
        reference(&src_l, &dst_l, &pairs, &src, &mut want);
        prop_assert_eq!(got, want);
        prop_assert_eq!(plan.total_bytes(), pairs.len() as u64 * src_l.config().block_bytes());
        prop_assert_eq!(plan.runs().iter().map(|r| r.len).sum::<u64>(), plan.total_bytes());
        // Without fan-out, source bytes come in increasing order.
        let sources: HashSet<usize> = pairs.iter().map(|&(s, _)| s).collect();
        if sources.len() == pairs.len() {
            for w in plan.runs().windows(2) {
                prop_assert!((w[0].src_region, w[0].src_offset + w[0].len) <= (w[1].src_region, w[1].src_offset) || src_l.num_regions() > 1);
            }
        }
    }

    #[test]
    fn plan_has_the_fewest_runs_possible((src_l, dst_l, pairs) in copy_case()) {
        let plan = plan_copy(&src_l, &dst_l, &pairs).unwrap();
        prop_assert_eq!(plan.len(), minimum_runs(&src_l, &dst_l, &pairs));
    }

    #[test]
    fn plan_does_not_depend_on_pair_order((src_l, dst_l, mut pairs) in copy_case()) {
        let a = plan_copy(&src_l, &dst_l, &pairs).unwrap();
        pairs.sort_unstable_by_key(|&(_, d)| std::cmp::Reverse(d));
        let b = plan_copy(&src_l, &dst_l, &pairs).unwrap();
        prop_assert_eq!(a, b);
    }

    #[test]
    fn consecutive_unpadded_fc_blocks_are_one_run(
        shape in block_shape(),
        (src_blocks, dst_blocks) in (1usize..=8, 1usize..=8),
        start in 0usize..8,
        count in 1usize..=8,
    ) {
        let fc = |blocks| {
            let c = LayoutConfig::new(blocks, shape.num_layers, shape.outer_dim, shape.page_size,
                shape.inner_dim, shape.dtype_bytes).unwrap();
            Layout::new(c, LayoutKind::FullyContiguous).unwrap()
        };
        let (src_l, dst_l) = (fc(src_blocks), fc(dst_blocks));
        let n = count.min(src_blocks).min(dst_blocks);
        let s0 = start % (src_blocks - n + 1);
        let d0 = start % (dst_blocks - n + 1);
        let pairs: Vec<_> = (0..n).map(|i| (s0 + i, d0 + i)).collect();
        prop_assert_eq!(plan_copy(&src_l, &dst_l, &pairs).unwrap().len(), 1);
        // Block-first per-layer source: one run per layer (K and V adjacent,
        // and consecutive blocks adjacent in every layer region).
        let bf = Layout::new(*src_l.config(), LayoutKind::LayerSeparate(BlockOrder::BlockFirst)).unwrap();
        prop_assert_eq!(plan_copy(&bf, &dst_l, &pairs[..1]).unwrap().len(), shape.num_layers);
    }

    #[test]
    fn duplicate_destinations_are_rejected((src_l, dst_l, mut pairs) in copy_case()) {
        let d = pairs.first().map_or(0, |&(_, d)| d);
        pairs.push((0, d));
        if pairs.len() == 1 {
            pairs.push((0, d));
        }
        prop_assert_eq!(plan_copy(&src_l, &dst_l, &pairs), Err(LayoutError::DuplicateDestination(d)));
    }

    #[test]
    fn a_reused_planner_plans_like_a_fresh_one(cases in prop::collection::vec(copy_case(), 1..4)) {
        let mut planner = CopyPlanner::new();
        let mut plan = CopyPlan::default();
        for (src_l, dst_l, pairs) in &cases {
            planner.plan_into(src_l, dst_l, pairs, &mut plan).unwrap();
            prop_assert_eq!(&plan, &plan_copy(src_l, dst_l, pairs).unwrap());
        }
    }

    #[test]
    fn descriptors_round_trip(layout in layout()) {
        let d = layout.descriptor();
        let json = d.to_json();
        let back = LayoutDescriptor::from_json(&json).unwrap();
        prop_assert_eq!(&back, &d);
        prop_assert_eq!(Layout::from_descriptor(&back).unwrap(), layout);
    }

    #[test]
    fn garbage_descriptors_are_errors(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        prop_assert!(LayoutDescriptor::from_json_slice(&bytes).is_err());
    }

    #[test]
    fn mutated_descriptors_never_panic(layout in layout(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut json = layout.descriptor().to_json().into_bytes();
        let i = at.index(json.len());
        json[i] = byte;
        // Either rejected, or a layout that passed every validation.
        if let Ok(d) = LayoutDescriptor::from_json_slice(&json)
            && let Ok(l) = d.to_layout()
        {
            let c = *l.config();
            let last = l.chunk(c.num_blocks() - 1, c.num_layers() - 1, c.outer_dim() - 1).unwrap();
            prop_assert!(last.offset + last.len <= l.region_size(last.region).unwrap());
        }
    }
}
