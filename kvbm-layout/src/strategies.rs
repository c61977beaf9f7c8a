//! Proptest strategies for configs, layouts and copyable layout pairs
//! (feature `proptest`).
//!
//! Sizes are kept small (a few blocks, layers and bytes per chunk) so that a
//! test can materialise every region as a byte buffer and check every byte,
//! while still covering every kind, both outer dims, every element size,
//! alignment padding and explicit padded strides.

use proptest::prelude::*;

use crate::config::LayoutConfig;
use crate::layout::{BlockOrder, Layout, LayoutKind, LayoutStrides};

/// What makes two layouts copyable: everything but block count and padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockShape {
    /// Layers per block.
    pub num_layers: usize,
    /// 1 or 2.
    pub outer_dim: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Elements per token.
    pub inner_dim: usize,
    /// Bytes per element.
    pub dtype_bytes: usize,
}

/// Any of the three layout kinds.
pub fn layout_kind() -> impl Strategy<Value = LayoutKind> {
    prop_oneof![
        Just(LayoutKind::FullyContiguous),
        Just(LayoutKind::LayerSeparate(BlockOrder::BlockFirst)),
        Just(LayoutKind::LayerSeparate(BlockOrder::OuterFirst)),
    ]
}

/// A small block shape.
pub fn block_shape() -> impl Strategy<Value = BlockShape> {
    (
        1usize..=4,
        1usize..=2,
        1usize..=4,
        1usize..=6,
        prop::sample::select(vec![1usize, 2, 4, 8]),
    )
        .prop_map(
            |(num_layers, outer_dim, page_size, inner_dim, dtype_bytes)| BlockShape {
                num_layers,
                outer_dim,
                page_size,
                inner_dim,
                dtype_bytes,
            },
        )
}

/// A valid config of `shape` with 1..=`max_blocks` blocks and an alignment
/// from 1 to 256 bytes.
pub fn config_of(shape: BlockShape, max_blocks: usize) -> impl Strategy<Value = LayoutConfig> {
    (1usize..=max_blocks.max(1), 0u32..=8).prop_map(move |(blocks, align_log2)| {
        LayoutConfig::new(
            blocks,
            shape.num_layers,
            shape.outer_dim,
            shape.page_size,
            shape.inner_dim,
            shape.dtype_bytes,
        )
        .and_then(|c| c.with_alignment(1 << align_log2))
        .expect("strategy sizes are small and valid")
    })
}

/// A small valid config.
pub fn layout_config() -> impl Strategy<Value = LayoutConfig> {
    block_shape().prop_flat_map(|shape| config_of(shape, 8))
}

/// A layout of `config`: either the kind's default strides or explicit
/// strides with extra padding between blocks (and between K/V planes for
/// outer-first), as engines over-allocate.
pub fn layout_of(config: LayoutConfig) -> impl Strategy<Value = Layout> {
    (layout_kind(), prop::option::of((0u64..=96, 0u64..=96))).prop_map(move |(kind, pad)| {
        let base = Layout::new(config, kind).expect("strategy configs are valid");
        let Some((block_pad, plane_pad)) = pad else {
            return base;
        };
        let s = base.strides();
        let strides = match kind {
            LayoutKind::FullyContiguous | LayoutKind::LayerSeparate(BlockOrder::BlockFirst) => {
                LayoutStrides {
                    block: s.block + block_pad,
                    ..s
                }
            }
            LayoutKind::LayerSeparate(BlockOrder::OuterFirst) => {
                let block = s.block + block_pad;
                LayoutStrides {
                    block,
                    layer: 0,
                    outer: block * config.num_blocks() as u64 + plane_pad,
                }
            }
        };
        Layout::with_strides(config, kind, strides).expect("padding keeps chunks apart")
    })
}

/// A small valid layout of any kind.
pub fn layout() -> impl Strategy<Value = Layout> {
    layout_config().prop_flat_map(layout_of)
}

/// Two layouts with the same block shape (so blocks can be copied between
/// them), each with its own block count, alignment, kind and padding.
pub fn layout_pair() -> impl Strategy<Value = (Layout, Layout)> {
    block_shape().prop_flat_map(|shape| {
        (
            config_of(shape, 8).prop_flat_map(layout_of),
            config_of(shape, 8).prop_flat_map(layout_of),
        )
    })
}

/// Up to `max_pairs` `(src, dst)` block pairs for a copy between layouts of
/// `src_blocks` and `dst_blocks` blocks: distinct destinations, sources
/// possibly repeated, in random order.
pub fn block_pairs(
    src_blocks: usize,
    dst_blocks: usize,
    max_pairs: usize,
) -> impl Strategy<Value = Vec<(usize, usize)>> {
    let n = max_pairs.min(dst_blocks);
    (0..=n)
        .prop_flat_map(move |k| {
            (
                prop::sample::subsequence((0..dst_blocks).collect::<Vec<_>>(), k),
                prop::collection::vec(0..src_blocks.max(1), k),
            )
        })
        .prop_map(|(dst, src)| src.into_iter().zip(dst).collect::<Vec<_>>())
        .prop_shuffle()
}

/// A layout pair and block pairs between them.
pub fn copy_case() -> impl Strategy<Value = (Layout, Layout, Vec<(usize, usize)>)> {
    layout_pair().prop_flat_map(|(src, dst)| {
        let pairs = block_pairs(src.config().num_blocks(), dst.config().num_blocks(), 8);
        (Just(src), Just(dst), pairs)
    })
}
