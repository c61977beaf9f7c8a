//! Recognising an engine's KV tensors as a [`Layout`].
//!
//! Engines hand us their KV cache as framework tensors: a shape, strides in
//! elements and a dtype. Rather than trusting that a tensor is laid out the
//! way its backend usually lays it out, we derive the layout from the strides
//! themselves and refuse anything our layouts cannot address exactly:
//!
//! * the token and inner axes (`block_size`, `num_kv_heads`, `head_size`, in
//!   any stride order, so NHD and HND both work) must be packed densely,
//!   because a chunk is one contiguous byte range;
//! * the block, outer (K/V) and layer strides may be anything that keeps
//!   chunks apart, including padding between blocks (engines that round a
//!   block's page up);
//! * per-layer tensors (one region each) must all have the same shape and
//!   strides; a single all-layers tensor must keep the block index outermost.
//!
//! Each axis of the tensor is named by a [`KvAxis`]; [`KvTensorFormat`] holds
//! the axis lists of the engines we know, plus a custom one.

use crate::config::LayoutConfig;
use crate::error::{LayoutError, Result};
use crate::layout::{BlockOrder, Layout, LayoutKind, LayoutStrides};

/// What one axis of a KV tensor indexes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvAxis {
    /// The block (page) index.
    Block,
    /// The layer index (only in one-tensor-for-all-layers formats).
    Layer,
    /// K/V selector (extent 2) or a size-1 plane axis.
    Outer,
    /// Token within a block (`block_size`).
    Page,
    /// Anything per token: heads, head size, MLA latent dim. Several allowed.
    Inner,
}

/// The axis order of an engine's KV tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KvTensorFormat {
    /// vLLM flash-attention, one tensor per layer:
    /// `[2, num_blocks, block_size, num_kv_heads, head_size]`.
    FlashAttn,
    /// FlashInfer-style, one tensor per layer:
    /// `[num_blocks, 2, block_size, num_kv_heads, head_size]`.
    FlashInfer,
    /// MLA, one tensor per layer: `[num_blocks, block_size, head_dim]`.
    Mla,
    /// One tensor for all layers:
    /// `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`.
    CrossLayer,
    /// One MLA tensor for all layers: `[num_blocks, num_layers, block_size, head_dim]`.
    CrossLayerMla,
    /// Any other axis order.
    Custom(Vec<KvAxis>),
}

impl KvTensorFormat {
    /// The axes, outermost first.
    pub fn axes(&self) -> &[KvAxis] {
        use KvAxis::*;
        match self {
            KvTensorFormat::FlashAttn => &[Outer, Block, Page, Inner, Inner],
            KvTensorFormat::FlashInfer => &[Block, Outer, Page, Inner, Inner],
            KvTensorFormat::Mla => &[Block, Page, Inner],
            KvTensorFormat::CrossLayer => &[Block, Layer, Outer, Page, Inner, Inner],
            KvTensorFormat::CrossLayerMla => &[Block, Layer, Page, Inner],
            KvTensorFormat::Custom(axes) => axes,
        }
    }

    fn describe(&self) -> String {
        let names: Vec<&str> = self
            .axes()
            .iter()
            .map(|a| match a {
                KvAxis::Block => "num_blocks",
                KvAxis::Layer => "num_layers",
                KvAxis::Outer => "2",
                KvAxis::Page => "block_size",
                KvAxis::Inner => "inner",
            })
            .collect();
        format!("{self:?} [{}]", names.join(", "))
    }
}

/// Shape and strides (in elements) of one framework tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorView<'a> {
    /// Extent of each axis.
    pub shape: &'a [usize],
    /// Stride of each axis, in elements.
    pub strides: &'a [usize],
}

/// A layout recognised from engine tensors, and where each tensor goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecognisedLayout {
    /// The layout the tensors form.
    pub layout: Layout,
    /// `tensor_regions[i]` is the region index tensor `i` provides (tensor
    /// `i` is layer `i` for per-layer formats; the one tensor is region 0).
    pub tensor_regions: Vec<usize>,
}

fn unsupported(reason: String) -> LayoutError {
    LayoutError::UnsupportedTensor { reason }
}

/// Exactly one axis of `kind` (its index), or none when `optional`.
fn find_axis(axes: &[KvAxis], kind: KvAxis, optional: bool) -> Result<Option<usize>> {
    let mut found = axes.iter().enumerate().filter(|&(_, &a)| a == kind);
    let first = found.next().map(|(i, _)| i);
    if found.next().is_some() {
        return Err(unsupported(format!(
            "format names the {kind:?} axis more than once"
        )));
    }
    if first.is_none() && !optional {
        return Err(unsupported(format!("format has no {kind:?} axis")));
    }
    Ok(first)
}

/// Recognises engine KV tensors as a layout.
///
/// For per-layer formats (no [`KvAxis::Layer`]) pass one tensor per layer, in
/// layer order; for all-layers formats pass exactly one. `dtype_bytes` is the
/// element size. Errors say which axis or stride broke which expectation.
pub fn recognise_kv_tensors(
    format: &KvTensorFormat,
    tensors: &[TensorView<'_>],
    dtype_bytes: usize,
) -> Result<RecognisedLayout> {
    let axes = format.axes();
    let expected = format.describe();
    let at = AxisPositions::locate(axes, &expected)?;
    let TensorView { shape, strides } = shared_view(axes, &at, tensors, &expected)?;
    check_chunk_packed(axes, shape, strides, &expected)?;

    let config = recognised_config(axes, &at, shape, tensors.len(), dtype_bytes, &expected)?;
    let layout_strides = LayoutStrides {
        block: byte_stride(shape, strides, Some(at.block), dtype_bytes)?,
        layer: byte_stride(shape, strides, at.layer, dtype_bytes)?,
        outer: byte_stride(shape, strides, at.outer, dtype_bytes)?,
    };
    let outer_dim = at.outer.map_or(1, |i| shape[i]);
    let num_blocks = shape[at.block];
    let kind = if at.layer.is_some() {
        LayoutKind::FullyContiguous
    } else if outer_dim > 1 && num_blocks > 1 && layout_strides.outer > layout_strides.block {
        LayoutKind::LayerSeparate(BlockOrder::OuterFirst)
    } else {
        LayoutKind::LayerSeparate(BlockOrder::BlockFirst)
    };
    let layout = Layout::with_strides(config, kind, layout_strides).map_err(|e| match e {
        LayoutError::InvalidStrides { reason } => unsupported(format!(
            "strides {strides:?} for shape {shape:?} ({expected}) cannot be addressed: {reason}"
        )),
        other => other,
    })?;
    let tensor_regions = if at.layer.is_some() {
        vec![0]
    } else {
        (0..tensors.len()).collect()
    };
    Ok(RecognisedLayout {
        layout,
        tensor_regions,
    })
}

/// Where the block, token, layer and outer axes sit in a format's axis list.
struct AxisPositions {
    /// The block axis.
    block: usize,
    /// The token-within-block axis.
    page: usize,
    /// The layer axis, in all-layers formats.
    layer: Option<usize>,
    /// The K/V axis, when the format has one.
    outer: Option<usize>,
}

impl AxisPositions {
    /// Finds each named axis, refusing a format that names one twice or
    /// lacks the block, token or inner axes.
    fn locate(axes: &[KvAxis], expected: &str) -> Result<Self> {
        let block = find_axis(axes, KvAxis::Block, false)?.unwrap_or_default();
        let page = find_axis(axes, KvAxis::Page, false)?.unwrap_or_default();
        let layer = find_axis(axes, KvAxis::Layer, true)?;
        let outer = find_axis(axes, KvAxis::Outer, true)?;
        if !axes.contains(&KvAxis::Inner) {
            return Err(unsupported(format!("format {expected} has no Inner axis")));
        }
        Ok(Self {
            block,
            page,
            layer,
            outer,
        })
    }
}

/// The shape and strides all `tensors` share: refuses an empty list, more
/// than one tensor for an all-layers format, a rank that does not match the
/// format, per-layer tensors that differ, and an empty axis.
fn shared_view<'a>(
    axes: &[KvAxis],
    at: &AxisPositions,
    tensors: &[TensorView<'a>],
    expected: &str,
) -> Result<TensorView<'a>> {
    let Some(first) = tensors.first() else {
        return Err(unsupported("no tensors given".into()));
    };
    if at.layer.is_some() && tensors.len() != 1 {
        return Err(unsupported(format!(
            "format {expected} holds all layers in one tensor, got {} tensors",
            tensors.len()
        )));
    }
    for (i, t) in tensors.iter().enumerate() {
        if t.shape.len() != axes.len() || t.strides.len() != axes.len() {
            return Err(unsupported(format!(
                "tensor {i}: expected rank {} for {expected}, got shape {:?} strides {:?}",
                axes.len(),
                t.shape,
                t.strides
            )));
        }
        if t.shape != first.shape || t.strides != first.strides {
            return Err(unsupported(format!(
                "per-layer tensors must share shape and strides: tensor 0 has {:?}/{:?}, \
                 tensor {i} has {:?}/{:?}",
                first.shape, first.strides, t.shape, t.strides
            )));
        }
    }
    let shape = first.shape;
    if let Some(i) = shape.iter().position(|&n| n == 0) {
        return Err(unsupported(format!(
            "axis {i} of shape {shape:?} is empty; expected {expected}"
        )));
    }
    Ok(*first)
}

/// Checks that the token and inner axes are packed densely, in some stride
/// order, so each (block, layer, K/V) chunk is one contiguous byte range.
fn check_chunk_packed(
    axes: &[KvAxis],
    shape: &[usize],
    strides: &[usize],
    expected: &str,
) -> Result<()> {
    let mut chunk_axes: Vec<(usize, usize)> = axes
        .iter()
        .enumerate()
        .filter(|&(i, &a)| matches!(a, KvAxis::Page | KvAxis::Inner) && shape[i] > 1)
        .map(|(i, _)| (strides[i], shape[i]))
        .collect();
    chunk_axes.sort_unstable();
    let mut dense = 1usize;
    for &(stride, extent) in &chunk_axes {
        if stride != dense {
            let row_major: Vec<String> = dense_row_major(axes, shape);
            return Err(unsupported(format!(
                "the block_size and inner axes must be packed densely so each (block, layer, \
                 K/V) chunk is contiguous: expected strides [{}] on those axes (or any \
                 permutation of that packing, e.g. HND), got strides {strides:?} for shape \
                 {shape:?} ({expected})",
                row_major.join(", ")
            )));
        }
        dense = dense
            .checked_mul(extent)
            .ok_or(LayoutError::SizeOverflow { what: "chunk size" })?;
    }
    Ok(())
}

/// The layout config a tensor of `shape` describes; per-layer formats take
/// their layer count from `num_tensors`.
fn recognised_config(
    axes: &[KvAxis],
    at: &AxisPositions,
    shape: &[usize],
    num_tensors: usize,
    dtype_bytes: usize,
    expected: &str,
) -> Result<LayoutConfig> {
    let page_size = shape[at.page];
    let inner_dim: usize = axes
        .iter()
        .enumerate()
        .filter(|&(_, &a)| a == KvAxis::Inner)
        .map(|(i, _)| shape[i])
        .try_fold(1usize, |acc, n| acc.checked_mul(n))
        .ok_or(LayoutError::SizeOverflow { what: "inner dim" })?;

    let num_blocks = shape[at.block];
    let outer_dim = at.outer.map_or(1, |i| shape[i]);
    let num_layers = at.layer.map_or(num_tensors, |i| shape[i]);
    LayoutConfig::new(
        num_blocks,
        num_layers,
        outer_dim,
        page_size,
        inner_dim,
        dtype_bytes,
    )
    .map_err(|e| match e {
        LayoutError::InvalidOuterDim(n) => unsupported(format!(
            "the outer (K/V) axis must have extent 1 or 2, got {n} ({expected})"
        )),
        other => other,
    })
}

/// Byte stride of `axis`; an absent axis or one with a single value never
/// moves, so its stride means nothing and is recorded as 0.
fn byte_stride(
    shape: &[usize],
    strides: &[usize],
    axis: Option<usize>,
    dtype_bytes: usize,
) -> Result<u64> {
    match axis {
        Some(i) if shape[i] > 1 => (strides[i] as u64)
            .checked_mul(dtype_bytes as u64)
            .ok_or(LayoutError::SizeOverflow { what: "stride" }),
        _ => Ok(0),
    }
}

/// The row-major dense strides of the token and inner axes, for messages.
fn dense_row_major(axes: &[KvAxis], shape: &[usize]) -> Vec<String> {
    let mut out = Vec::new();
    let mut acc = 1usize;
    for (i, a) in axes.iter().enumerate().rev() {
        if matches!(a, KvAxis::Page | KvAxis::Inner) {
            out.push(acc.to_string());
            acc = acc.saturating_mul(shape[i]);
        }
    }
    out.reverse();
    out
}

#[cfg(test)]
#[path = "tensor_tests.rs"]
mod tests;
