//! The copy planner: which contiguous byte ranges to copy so that each
//! destination block receives its source block.
//!
//! A plan is pure data (`CopyRun`s, a `#[repr(C)]` array a copy kernel or a
//! batched-copy call consumes directly); executing it is the transfer crate's
//! job. Fewer, longer runs are what makes copies fast (each API call costs
//! microseconds of CPU; each kernel work item wants big contiguous ranges), so
//! the planner coalesces chunks that are adjacent in both layouts.
//!
//! # Why the plan is minimal
//! Every chunk has the same length `L`, and destination chunks never overlap.
//! A chunk can only extend the run of the chunk that ends exactly where it
//! begins in the destination, which — among chunks sorted by destination
//! address — is its immediate predecessor. So the planner walks chunks in
//! destination address order (pairs sorted by destination block, the loop
//! nest ordered by the destination's strides) and merges each chunk into the
//! previous run when it continues it in both source and destination. One pass,
//! no search, and the result has the fewest runs any plan of these pairs can
//! have.
//!
//! # Cost
//! Whether consecutive chunks of one block continue each other is the same
//! for every block, so when a layer's K and V (or a whole block) are adjacent
//! in both layouts the planner takes them as one piece: the loop runs once
//! per piece, not once per chunk, and FullyContiguous → FullyContiguous costs
//! a few nanoseconds per block. The inner loop keeps the open run in
//! registers and has no branch on the layout kinds.
//!
//! One allocation for the runs, sized from an upper bound (pieces per block
//! × pairs), plus one for a sorted copy of the pairs only when they are not
//! already in increasing destination order. [`CopyPlanner`] keeps both
//! buffers across plans, so steady-state planning allocates nothing.

use crate::error::{LayoutError, Result};
use crate::layout::{BlockOrder, Layout, LayoutKind};

/// One contiguous copy: `len` bytes from `src_region + src_offset` to
/// `dst_region + dst_offset`.
///
/// `#[repr(C)]` with the fields in this order (40 bytes, 4 bytes of padding
/// after each region index), so a copy kernel can read `CopyPlan::runs()`
/// as a plain array.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CopyRun {
    /// Source region index.
    pub src_region: u32,
    /// Byte offset in the source region.
    pub src_offset: u64,
    /// Destination region index.
    pub dst_region: u32,
    /// Byte offset in the destination region.
    pub dst_offset: u64,
    /// Bytes to copy.
    pub len: u64,
}

/// The runs that copy a set of blocks from one layout to another, in
/// increasing destination address order, coalesced to the minimum.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyPlan {
    runs: Vec<CopyRun>,
    total_bytes: u64,
    num_chunks: usize,
    src_num_regions: usize,
    dst_num_regions: usize,
}

impl CopyPlan {
    /// The runs, in increasing `(dst_region, dst_offset)` order.
    pub fn runs(&self) -> &[CopyRun] {
        &self.runs
    }

    /// Takes the runs out of the plan.
    pub fn into_runs(self) -> Vec<CopyRun> {
        self.runs
    }

    /// Bytes the plan moves (the sum of the run lengths).
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Number of runs.
    pub fn len(&self) -> usize {
        self.runs.len()
    }

    /// Whether the plan copies nothing.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Number of `(block, layer, outer)` chunks the plan covers, i.e. the run
    /// count before coalescing.
    pub fn num_chunks(&self) -> usize {
        self.num_chunks
    }

    /// Number of regions of the source layout (every `src_region` is below).
    pub fn src_num_regions(&self) -> usize {
        self.src_num_regions
    }

    /// Number of regions of the destination layout (every `dst_region` is
    /// below).
    pub fn dst_num_regions(&self) -> usize {
        self.dst_num_regions
    }
}

/// Whose addresses a plan's runs follow in increasing order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RunOrder {
    /// The destination's: writes go forward (what disk files and host
    /// memory copies want).
    #[default]
    Destination,
    /// The source's: for a copy that reads its source with a few large
    /// DMA transfers (an onboard from a fully contiguous host layout into
    /// an engine's per-layer device layout), so consecutive source bytes
    /// come one after another in the plan.
    Source,
}

/// Loop nest of a layout, outermost index first (the destination's unless
/// the plan follows the source).
#[derive(Debug, Clone, Copy)]
enum DstOrder {
    BlockLayerOuter,
    BlockOuterLayer,
    LayerBlockOuter,
    LayerOuterBlock,
}

/// The order in which `dst` addresses increase: the region index first, then
/// the moving indices by decreasing stride (an index with one value can go
/// anywhere).
fn dst_order(dst: &Layout) -> DstOrder {
    let c = dst.config();
    let s = dst.strides();
    match dst.kind() {
        LayoutKind::FullyContiguous => {
            if c.num_layers() > 1 && c.outer_dim() > 1 && s.outer > s.layer {
                DstOrder::BlockOuterLayer
            } else {
                DstOrder::BlockLayerOuter
            }
        }
        LayoutKind::LayerSeparate(BlockOrder::BlockFirst) => DstOrder::LayerBlockOuter,
        LayoutKind::LayerSeparate(BlockOrder::OuterFirst) => DstOrder::LayerOuterBlock,
    }
}

/// A layout's address math with the kind folded into numbers:
/// region = `layer * region_per_layer`,
/// offset = `block * block + layer * layer + outer * outer`
/// (`layer` is 0 for per-layer layouts, `region_per_layer` is 0 for one
/// region), so the planner's inner loops have no branches on the kind.
#[derive(Debug, Clone, Copy)]
struct Affine {
    block: u64,
    layer: u64,
    outer: u64,
    region_per_layer: u32,
}

impl Affine {
    fn of(layout: &Layout) -> Affine {
        let s = layout.strides();
        Affine {
            block: s.block,
            layer: s.layer,
            outer: s.outer,
            region_per_layer: u32::from(matches!(layout.kind(), LayoutKind::LayerSeparate(_))),
        }
    }

    /// Region and offset of `(layer, outer)` relative to the block's start.
    /// For per-layer layouts `layer < num_regions <= u32::MAX`; for one
    /// region the truncated layer is multiplied by 0.
    #[inline(always)]
    fn within_block(&self, layer: usize, outer: usize) -> (u32, u64) {
        (
            layer as u32 * self.region_per_layer,
            layer as u64 * self.layer + outer as u64 * self.outer,
        )
    }
}

/// Adds one piece (one or more chunks adjacent in both layouts): extends
/// `current` when the piece continues it in both layouts, otherwise stores
/// `current` (unless it is the empty start) and starts a new run. `current` is a local of the caller, so the hot loop
/// keeps it in registers.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn push_piece(
    runs: &mut Vec<CopyRun>,
    current: &mut CopyRun,
    len: u64,
    src_region: u32,
    src_offset: u64,
    dst_region: u32,
    dst_offset: u64,
) {
    // The empty start run either continues trivially into a chunk at offset
    // 0 of region 0 on both sides (giving that very piece), or is replaced
    // without being stored.
    if current.dst_offset + current.len == dst_offset
        && current.src_offset + current.len == src_offset
        && current.dst_region == dst_region
        && current.src_region == src_region
    {
        current.len += len;
    } else {
        if current.len != 0 {
            runs.push(*current);
        }
        *current = CopyRun {
            src_region,
            src_offset,
            dst_region,
            dst_offset,
            len,
        };
    }
}

/// How many chunks of a block the planner takes as one piece: `(outers,
/// layers)` per piece.
///
/// Whether two consecutive chunks of one block continue each other is the
/// same for every block (offsets are the block's base plus a part that does
/// not depend on the block), and it only depends on two facts: are the K and
/// V chunks of a layer adjacent in both layouts, and does a layer end where
/// the next one starts in both. When they are, the planner pushes a layer's
/// or the whole block's chunks as one piece instead of one by one: the runs
/// are the same, the work per block drops from `layers * outer` steps to
/// `layers` or 1.
fn piece_shape(
    order: DstOrder,
    s: Affine,
    d: Affine,
    chunk: u64,
    layers: usize,
    outers: usize,
) -> (usize, usize) {
    let outer_joins = outers == 1 || (s.outer == chunk && d.outer == chunk);
    let layer_bytes = chunk * outers as u64;
    let layer_joins = layers == 1
        || (s.region_per_layer == 0
            && d.region_per_layer == 0
            && s.layer == layer_bytes
            && d.layer == layer_bytes);
    match order {
        DstOrder::BlockLayerOuter if outer_joins && layer_joins => (outers, layers),
        DstOrder::BlockLayerOuter | DstOrder::LayerBlockOuter if outer_joins => (outers, 1),
        _ => (1, 1),
    }
}

/// Plans copying block `s` of `src` into block `d` of `dst` for every
/// `(s, d)` in `pairs`.
///
/// Errors: the layouts' block shapes differ, a block index is out of range,
/// or a destination block appears twice. A source block may appear several
/// times (fan-out). The pairs may come in any order. Allocates the run list
/// once (from an upper bound), plus a sorted copy of the pairs when they are
/// not in increasing destination order; [`CopyPlanner`] reuses both.
pub fn plan_copy(src: &Layout, dst: &Layout, pairs: &[(usize, usize)]) -> Result<CopyPlan> {
    plan_copy_ordered(src, dst, pairs, RunOrder::Destination)
}

/// [`plan_copy`] with the runs in the address order of the side `order`
/// names (the same runs, possibly listed differently).
pub fn plan_copy_ordered(
    src: &Layout,
    dst: &Layout,
    pairs: &[(usize, usize)],
    order: RunOrder,
) -> Result<CopyPlan> {
    let mut plan = CopyPlan::default();
    CopyPlanner::new().plan_into_ordered(src, dst, pairs, order, &mut plan)?;
    Ok(plan)
}

/// A reusable planner: plans into a caller's [`CopyPlan`] and keeps its own
/// scratch, so that once the buffers have grown, planning allocates nothing.
#[derive(Debug, Clone, Default)]
pub struct CopyPlanner {
    sorted: Vec<(usize, usize)>,
    by_src: Vec<(usize, usize)>,
}

impl CopyPlanner {
    /// A planner with empty buffers.
    pub fn new() -> CopyPlanner {
        CopyPlanner::default()
    }

    /// Plans like [`plan_copy`], replacing `plan`'s contents and reusing its
    /// run buffer. On error `plan` is left empty.
    pub fn plan_into(
        &mut self,
        src: &Layout,
        dst: &Layout,
        pairs: &[(usize, usize)],
        plan: &mut CopyPlan,
    ) -> Result<()> {
        self.plan_into_ordered(src, dst, pairs, RunOrder::Destination, plan)
    }

    /// Plans like [`plan_copy_ordered`] into `plan` (see
    /// [`CopyPlanner::plan_into`]).
    pub fn plan_into_ordered(
        &mut self,
        src: &Layout,
        dst: &Layout,
        pairs: &[(usize, usize)],
        order: RunOrder,
        plan: &mut CopyPlan,
    ) -> Result<()> {
        plan.runs.clear();
        plan.total_bytes = 0;
        plan.num_chunks = 0;
        plan.src_num_regions = src.num_regions();
        plan.dst_num_regions = dst.num_regions();
        let CopyPlanner { sorted, by_src } = self;
        let pairs = checked_in_dst_order(sorted, src, dst, pairs)?;
        match order {
            RunOrder::Destination => fill(src, dst, pairs, dst_order(dst), plan),
            RunOrder::Source => {
                let pairs = if pairs.windows(2).all(|w| w[0].0 <= w[1].0) {
                    pairs
                } else {
                    by_src.clear();
                    by_src.extend_from_slice(pairs);
                    by_src.sort_unstable();
                    by_src
                };
                fill(src, dst, pairs, dst_order(src), plan);
            }
        }
        Ok(())
    }
}

/// Validates the pairs and returns them in increasing destination order
/// (the caller's slice when it already is, else sorted in `scratch`).
fn checked_in_dst_order<'p>(
    scratch: &'p mut Vec<(usize, usize)>,
    src: &Layout,
    dst: &Layout,
    pairs: &'p [(usize, usize)],
) -> Result<&'p [(usize, usize)]> {
    let sc = src.config();
    let dc = dst.config();
    sc.same_block_shape(dc)?;
    let mut sorted_by_dst = true;
    let mut prev_dst: Option<usize> = None;
    for &(s, d) in pairs {
        if s >= sc.num_blocks() {
            return Err(LayoutError::BlockOutOfRange {
                index: s,
                count: sc.num_blocks(),
            });
        }
        if d >= dc.num_blocks() {
            return Err(LayoutError::BlockOutOfRange {
                index: d,
                count: dc.num_blocks(),
            });
        }
        if let Some(p) = prev_dst
            && p >= d
        {
            sorted_by_dst = false;
        }
        prev_dst = Some(d);
    }
    if sorted_by_dst {
        return Ok(pairs);
    }
    scratch.clear();
    scratch.extend_from_slice(pairs);
    scratch.sort_unstable_by_key(|&(_, d)| d);
    if let Some(w) = scratch.windows(2).find(|w| w[0].1 == w[1].1) {
        return Err(LayoutError::DuplicateDestination(w[0].1));
    }
    Ok(scratch)
}

/// What every piece of one plan shares: both layouts' address math, the
/// layer and outer extents, how many of each one piece joins, and its bytes.
#[derive(Clone, Copy)]
struct PieceGrid {
    /// The source layout's address math.
    s: Affine,
    /// The destination layout's address math.
    d: Affine,
    /// Layers per block.
    layers: usize,
    /// Outer (K/V) planes per layer.
    outers: usize,
    /// Layers one piece joins.
    layer_step: usize,
    /// Outer planes one piece joins.
    outer_step: usize,
    /// Bytes in one piece.
    piece: u64,
}

/// Pushes every piece of `pairs` onto `runs` through `cur` (the run still
/// growing), in the loop nest `order` names.
fn walk_pieces(
    order: DstOrder,
    grid: PieceGrid,
    pairs: &[(usize, usize)],
    runs: &mut Vec<CopyRun>,
    cur: &mut CopyRun,
) {
    let PieceGrid {
        s,
        d,
        layers,
        outers,
        layer_step,
        outer_step,
        piece,
    } = grid;
    match order {
        DstOrder::BlockLayerOuter => {
            for &(sb, db) in pairs {
                let (s0, d0) = (sb as u64 * s.block, db as u64 * d.block);
                for l in (0..layers).step_by(layer_step) {
                    for o in (0..outers).step_by(outer_step) {
                        let (sr, so) = s.within_block(l, o);
                        let (dr, dof) = d.within_block(l, o);
                        push_piece(runs, cur, piece, sr, s0 + so, dr, d0 + dof);
                    }
                }
            }
        }
        DstOrder::BlockOuterLayer => {
            for &(sb, db) in pairs {
                let (s0, d0) = (sb as u64 * s.block, db as u64 * d.block);
                for o in 0..outers {
                    for l in 0..layers {
                        let (sr, so) = s.within_block(l, o);
                        let (dr, dof) = d.within_block(l, o);
                        push_piece(runs, cur, piece, sr, s0 + so, dr, d0 + dof);
                    }
                }
            }
        }
        DstOrder::LayerBlockOuter => {
            for l in 0..layers {
                for &(sb, db) in pairs {
                    let (s0, d0) = (sb as u64 * s.block, db as u64 * d.block);
                    for o in (0..outers).step_by(outer_step) {
                        let (sr, so) = s.within_block(l, o);
                        let (dr, dof) = d.within_block(l, o);
                        push_piece(runs, cur, piece, sr, s0 + so, dr, d0 + dof);
                    }
                }
            }
        }
        DstOrder::LayerOuterBlock => {
            for l in 0..layers {
                for o in 0..outers {
                    let (sr, so) = s.within_block(l, o);
                    let (dr, dof) = d.within_block(l, o);
                    for &(sb, db) in pairs {
                        let (s0, d0) = (sb as u64 * s.block, db as u64 * d.block);
                        push_piece(runs, cur, piece, sr, s0 + so, dr, d0 + dof);
                    }
                }
            }
        }
    }
}

/// Fills `plan` for validated pairs, walking the blocks in `pairs` order
/// and within them the loop nest `order` (the destination's or the
/// source's, as the pairs are sorted).
fn fill(
    src: &Layout,
    dst: &Layout,
    pairs: &[(usize, usize)],
    order: DstOrder,
    plan: &mut CopyPlan,
) {
    let sc = src.config();
    // No overflow below: pairs have distinct in-range destinations, so
    // `pairs.len() <= dst blocks`, and every offset stays below its region's
    // size, which fits u64 (checked when the layouts were built).
    let layers = sc.num_layers();
    let outers = sc.outer_dim();
    let chunk = sc.chunk_bytes();
    let (s, d) = (Affine::of(src), Affine::of(dst));
    let (outer_step, layer_step) = piece_shape(order, s, d, chunk, layers, outers);
    let piece = chunk * (outer_step * layer_step) as u64;
    // Every piece is at most one run, so this bounds the plan's length.
    let bound = pairs.len() * (layers / layer_step) * (outers / outer_step);
    let runs = &mut plan.runs;
    runs.reserve(bound);
    let mut cur = CopyRun::default();
    let grid = PieceGrid {
        s,
        d,
        layers,
        outers,
        layer_step,
        outer_step,
        piece,
    };
    walk_pieces(order, grid, pairs, runs, &mut cur);
    if cur.len != 0 {
        runs.push(cur);
    }
    debug_assert!(
        runs.len() <= bound,
        "run bound {bound} < {} runs",
        runs.len()
    );
    plan.total_bytes = pairs.len() as u64 * sc.block_bytes();
    plan.num_chunks = pairs.len() * layers * outers;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LayoutConfig;

    const FC: LayoutKind = LayoutKind::FullyContiguous;
    const BF: LayoutKind = LayoutKind::LayerSeparate(BlockOrder::BlockFirst);
    const OF: LayoutKind = LayoutKind::LayerSeparate(BlockOrder::OuterFirst);

    fn layout(kind: LayoutKind) -> Layout {
        Layout::new(LayoutConfig::new(8, 4, 2, 16, 64, 2).unwrap(), kind).unwrap()
    }

    #[test]
    fn consecutive_fc_to_fc_is_one_run() {
        let (s, d) = (layout(FC), layout(FC));
        let pairs: Vec<_> = (0..5).map(|i| (i + 2, i + 1)).collect();
        let plan = plan_copy(&s, &d, &pairs).unwrap();
        let bb = s.config().block_bytes();
        assert_eq!(
            plan.runs(),
            &[CopyRun {
                src_region: 0,
                src_offset: 2 * bb,
                dst_region: 0,
                dst_offset: bb,
                len: 5 * bb
            }]
        );
        assert_eq!(plan.total_bytes(), 5 * bb);
        assert_eq!(plan.num_chunks(), 5 * 8);
    }

    #[test]
    fn block_first_to_fc_is_one_run_per_block_and_layer() {
        let plan = plan_copy(&layout(BF), &layout(FC), &[(3, 0), (1, 5)]).unwrap();
        assert_eq!(plan.len(), 2 * 4);
        assert!(plan.runs().iter().all(|r| r.len == 2 * 2048));
    }

    #[test]
    fn outer_first_to_fc_is_one_run_per_chunk() {
        let plan = plan_copy(&layout(OF), &layout(FC), &[(3, 0), (1, 5)]).unwrap();
        assert_eq!(plan.len(), 2 * 4 * 2);
    }

    #[test]
    fn layer_separate_consecutive_is_one_run_per_region() {
        let pairs: Vec<_> = (0..8).map(|i| (i, i)).collect();
        assert_eq!(
            plan_copy(&layout(BF), &layout(BF), &pairs).unwrap().len(),
            4
        );
        // Outer-first, all blocks: the K plane runs straight into the V plane.
        assert_eq!(
            plan_copy(&layout(OF), &layout(OF), &pairs).unwrap().len(),
            4
        );
        // Outer-first, all but the last block: K and V of each layer apart.
        assert_eq!(
            plan_copy(&layout(OF), &layout(OF), &pairs[..7])
                .unwrap()
                .len(),
            8
        );
    }

    #[test]
    fn unsorted_pairs_give_the_same_plan_as_sorted_ones() {
        let sorted = plan_copy(&layout(FC), &layout(FC), &[(0, 1), (1, 2), (5, 3)]).unwrap();
        let shuffled = plan_copy(&layout(FC), &layout(FC), &[(5, 3), (0, 1), (1, 2)]).unwrap();
        assert_eq!(sorted, shuffled);
        assert_eq!(sorted.len(), 2);
    }

    #[test]
    fn errors() {
        let (s, d) = (layout(FC), layout(BF));
        assert_eq!(
            plan_copy(&s, &d, &[(8, 0)]),
            Err(LayoutError::BlockOutOfRange { index: 8, count: 8 })
        );
        assert_eq!(
            plan_copy(&s, &d, &[(0, 9)]),
            Err(LayoutError::BlockOutOfRange { index: 9, count: 8 })
        );
        assert_eq!(
            plan_copy(&s, &d, &[(0, 2), (1, 2)]),
            Err(LayoutError::DuplicateDestination(2))
        );
        assert_eq!(
            plan_copy(&s, &d, &[(0, 4), (1, 2), (3, 4)]),
            Err(LayoutError::DuplicateDestination(4))
        );
        let other = Layout::new(LayoutConfig::new(8, 4, 1, 16, 64, 2).unwrap(), FC).unwrap();
        assert!(matches!(
            plan_copy(&s, &other, &[(0, 0)]),
            Err(LayoutError::ShapeMismatch {
                field: "outer_dim",
                ..
            })
        ));
    }

    #[test]
    fn fan_out_and_empty_plans() {
        let plan = plan_copy(&layout(FC), &layout(FC), &[(1, 0), (1, 1)]).unwrap();
        assert_eq!(plan.len(), 2);
        let empty = plan_copy(&layout(FC), &layout(OF), &[]).unwrap();
        assert!(empty.is_empty());
        assert_eq!(empty.total_bytes(), 0);
        assert_eq!(empty.dst_num_regions(), 4);
    }

    #[test]
    fn planner_reuses_its_buffers() {
        let (bf, fc) = (layout(BF), layout(FC));
        let mut planner = CopyPlanner::new();
        let mut plan = CopyPlan::default();
        planner
            .plan_into(&bf, &fc, &[(5, 2), (1, 0), (2, 7)], &mut plan)
            .unwrap();
        assert_eq!(
            plan,
            plan_copy(&bf, &fc, &[(5, 2), (1, 0), (2, 7)]).unwrap()
        );
        let buffer = plan.runs().as_ptr();
        planner
            .plan_into(&bf, &fc, &[(0, 3), (4, 1), (6, 4)], &mut plan)
            .unwrap();
        assert_eq!(
            plan,
            plan_copy(&bf, &fc, &[(0, 3), (4, 1), (6, 4)]).unwrap()
        );
        assert_eq!(plan.runs().as_ptr(), buffer, "same-size replan reallocated");
        // An error leaves the plan empty, not stale.
        assert!(
            planner
                .plan_into(&bf, &fc, &[(0, 1), (2, 1)], &mut plan)
                .is_err()
        );
        assert!(plan.is_empty());
        assert_eq!(plan.total_bytes(), 0);
    }

    #[test]
    fn copy_run_is_plain_c_data() {
        assert_eq!(std::mem::size_of::<CopyRun>(), 40);
        assert_eq!(std::mem::align_of::<CopyRun>(), 8);
    }
}
