//! Unit tests of engine tensor recognition: each known shape, each error.

use super::*;

/// Row-major strides of a contiguous tensor.
fn contiguous(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i];
    }
    strides
}

/// Recognises `layers` identical tensors.
fn recognise(
    format: KvTensorFormat,
    shape: &[usize],
    strides: &[usize],
    tensors: usize,
) -> Result<RecognisedLayout> {
    let views = vec![TensorView { shape, strides }; tensors];
    recognise_kv_tensors(&format, &views, 2)
}

/// Checks every chunk's byte offset against the tensor's own element offset
/// of `(block, layer, outer, token 0, inner 0)`.
fn assert_matches_tensor(
    r: &RecognisedLayout,
    format: &KvTensorFormat,
    shape: &[usize],
    strides: &[usize],
) {
    let l = &r.layout;
    let c = *l.config();
    for b in 0..c.num_blocks() {
        for layer in 0..c.num_layers() {
            for o in 0..c.outer_dim() {
                let mut elem = 0;
                for (i, a) in format.axes().iter().enumerate() {
                    let idx = match a {
                        KvAxis::Block => b,
                        KvAxis::Layer => layer,
                        KvAxis::Outer => o,
                        _ => 0,
                    };
                    if shape[i] > 1 {
                        elem += idx * strides[i];
                    }
                }
                let chunk = l.chunk(b, layer, o).unwrap();
                let region = if format.axes().contains(&KvAxis::Layer) {
                    0
                } else {
                    layer
                };
                assert_eq!(chunk.region, region);
                assert_eq!(chunk.offset, (elem * 2) as u64, "b{b} l{layer} o{o}");
                assert!(chunk.offset + chunk.len <= l.region_size(region).unwrap());
            }
        }
    }
}

#[test]
fn vllm_flash_attention_per_layer() {
    let shape = [2, 10, 16, 8, 128];
    let strides = contiguous(&shape);
    let r = recognise(KvTensorFormat::FlashAttn, &shape, &strides, 4).unwrap();
    let want = LayoutConfig::new(10, 4, 2, 16, 1024, 2).unwrap();
    assert_eq!(*r.layout.config(), want);
    assert_eq!(
        r.layout.kind(),
        LayoutKind::LayerSeparate(BlockOrder::OuterFirst)
    );
    assert_eq!(r.layout, Layout::new(want, r.layout.kind()).unwrap());
    assert_eq!(r.tensor_regions, vec![0, 1, 2, 3]);
    assert_eq!(r.layout.region_size(3).unwrap(), 2 * 10 * 16 * 1024 * 2);
    assert_matches_tensor(&r, &KvTensorFormat::FlashAttn, &shape, &strides);
}

#[test]
fn flashinfer_per_layer() {
    let shape = [10, 2, 16, 8, 128];
    let strides = contiguous(&shape);
    let r = recognise(KvTensorFormat::FlashInfer, &shape, &strides, 3).unwrap();
    assert_eq!(
        r.layout.kind(),
        LayoutKind::LayerSeparate(BlockOrder::BlockFirst)
    );
    assert_eq!(r.layout.config().outer_dim(), 2);
    assert_matches_tensor(&r, &KvTensorFormat::FlashInfer, &shape, &strides);
}

#[test]
fn mla_per_layer() {
    let shape = [10, 64, 576];
    let strides = contiguous(&shape);
    let r = recognise(KvTensorFormat::Mla, &shape, &strides, 61).unwrap();
    let c = r.layout.config();
    assert_eq!(
        (c.outer_dim(), c.page_size(), c.inner_dim(), c.num_layers()),
        (1, 64, 576, 61)
    );
    assert_eq!(
        r.layout.kind(),
        LayoutKind::LayerSeparate(BlockOrder::BlockFirst)
    );
    assert_matches_tensor(&r, &KvTensorFormat::Mla, &shape, &strides);
}

#[test]
fn one_tensor_for_all_layers() {
    let shape = [10, 4, 2, 16, 8, 128];
    let strides = contiguous(&shape);
    let r = recognise(KvTensorFormat::CrossLayer, &shape, &strides, 1).unwrap();
    let want = LayoutConfig::new(10, 4, 2, 16, 1024, 2).unwrap();
    assert_eq!(
        r.layout,
        Layout::new(want, LayoutKind::FullyContiguous).unwrap()
    );
    assert_eq!(r.tensor_regions, vec![0]);
    assert_matches_tensor(&r, &KvTensorFormat::CrossLayer, &shape, &strides);

    let shape = [10, 4, 16, 576];
    let strides = contiguous(&shape);
    let r = recognise(KvTensorFormat::CrossLayerMla, &shape, &strides, 1).unwrap();
    assert_eq!(r.layout.config().outer_dim(), 1);
    assert_matches_tensor(&r, &KvTensorFormat::CrossLayerMla, &shape, &strides);
}

#[test]
fn hnd_token_and_head_order_is_accepted() {
    // Logical [2, blocks, tokens, heads, head] stored as [2, blocks, heads, tokens, head].
    let shape = [2, 10, 16, 8, 128];
    let strides = [10 * 8 * 16 * 128, 8 * 16 * 128, 128, 16 * 128, 1];
    let r = recognise(KvTensorFormat::FlashAttn, &shape, &strides, 2).unwrap();
    assert_eq!(r.layout.config().chunk_bytes(), 16 * 1024 * 2);
    assert_matches_tensor(&r, &KvTensorFormat::FlashAttn, &shape, &strides);
}

#[test]
fn padding_between_blocks_is_kept() {
    let shape = [10, 2, 16, 8, 128];
    let mut strides = contiguous(&shape);
    strides[0] += 256; // the engine rounds each block's page up
    let r = recognise(KvTensorFormat::FlashInfer, &shape, &strides, 2).unwrap();
    assert_eq!(r.layout.strides().block, (strides[0] * 2) as u64);
    assert_eq!(
        r.layout.region_size(0).unwrap(),
        (10 * strides[0] * 2) as u64
    );
    assert_matches_tensor(&r, &KvTensorFormat::FlashInfer, &shape, &strides);

    // Padding between the K and V planes of a flash-attention tensor.
    let shape = [2, 10, 16, 8, 128];
    let mut strides = contiguous(&shape);
    strides[0] += 4096;
    let r = recognise(KvTensorFormat::FlashAttn, &shape, &strides, 2).unwrap();
    assert_matches_tensor(&r, &KvTensorFormat::FlashAttn, &shape, &strides);
}

#[test]
fn single_block_and_odd_unit_strides() {
    // Axes of extent 1 may carry any stride (frameworks do that).
    let shape = [2, 1, 16, 1, 128];
    let strides = [16 * 128, 999_999, 128, 7, 1];
    let r = recognise(KvTensorFormat::FlashAttn, &shape, &strides, 2).unwrap();
    assert_eq!(r.layout.config().num_blocks(), 1);
    assert_matches_tensor(&r, &KvTensorFormat::FlashAttn, &shape, &strides);
}

fn reason(r: Result<RecognisedLayout>) -> String {
    match r {
        Err(LayoutError::UnsupportedTensor { reason }) => reason,
        other => panic!("expected UnsupportedTensor, got {other:?}"),
    }
}

#[test]
fn wrong_rank_says_what_was_expected() {
    let shape = [10, 16, 8, 128];
    let msg = reason(recognise(
        KvTensorFormat::FlashAttn,
        &shape,
        &contiguous(&shape),
        1,
    ));
    assert!(msg.contains("expected rank 5"), "{msg}");
    assert!(msg.contains("num_blocks, block_size"), "{msg}");
}

#[test]
fn padded_head_is_rejected_with_the_expected_strides() {
    let shape = [2, 10, 16, 8, 128];
    let strides = [10 * 16 * 8 * 136, 16 * 8 * 136, 8 * 136, 136, 1];
    let msg = reason(recognise(KvTensorFormat::FlashAttn, &shape, &strides, 1));
    assert!(msg.contains("expected strides [1024, 128, 1]"), "{msg}");
}

#[test]
fn outer_extent_must_be_one_or_two() {
    let shape = [3, 10, 16, 8, 128];
    let msg = reason(recognise(
        KvTensorFormat::FlashAttn,
        &shape,
        &contiguous(&shape),
        1,
    ));
    assert!(msg.contains("extent 1 or 2, got 3"), "{msg}");
}

#[test]
fn per_layer_tensors_must_agree() {
    let a = [2, 10, 16, 8, 128];
    let b = [2, 11, 16, 8, 128];
    let (sa, sb) = (contiguous(&a), contiguous(&b));
    let views = [
        TensorView {
            shape: &a,
            strides: &sa,
        },
        TensorView {
            shape: &b,
            strides: &sb,
        },
    ];
    let msg = reason(recognise_kv_tensors(&KvTensorFormat::FlashAttn, &views, 2));
    assert!(msg.contains("tensor 1"), "{msg}");
}

#[test]
fn tensor_count_errors() {
    let shape = [10, 4, 2, 16, 8, 128];
    let msg = reason(recognise(
        KvTensorFormat::CrossLayer,
        &shape,
        &contiguous(&shape),
        2,
    ));
    assert!(msg.contains("one tensor"), "{msg}");
    let msg = reason(recognise_kv_tensors(&KvTensorFormat::Mla, &[], 2));
    assert!(msg.contains("no tensors"), "{msg}");
}

#[test]
fn empty_axis_is_an_error() {
    let shape = [2, 0, 16, 8, 128];
    let msg = reason(recognise(
        KvTensorFormat::FlashAttn,
        &shape,
        &contiguous(&shape),
        1,
    ));
    assert!(msg.contains("empty"), "{msg}");
}

#[test]
fn layer_outermost_all_layers_tensor_is_rejected() {
    // [layers, blocks, ...] memory order labelled as the block-outermost format.
    let shape = [10, 4, 2, 16, 8, 128];
    let chunk = 16 * 8 * 128;
    let strides = [2 * chunk, 10 * 2 * chunk, chunk, 8 * 128, 128, 1];
    let msg = reason(recognise(KvTensorFormat::CrossLayer, &shape, &strides, 1));
    assert!(msg.contains("block index outermost"), "{msg}");
}

#[test]
fn overlapping_blocks_are_rejected() {
    let shape = [10, 2, 16, 8, 128];
    let mut strides = contiguous(&shape);
    strides[0] = 16 * 1024; // one chunk per block, but each block holds two
    let msg = reason(recognise(KvTensorFormat::FlashInfer, &shape, &strides, 1));
    assert!(msg.contains("cannot be addressed"), "{msg}");
}

#[test]
fn malformed_custom_formats() {
    use KvAxis::*;
    let shape = [10, 10, 16, 128];
    let strides = contiguous(&shape);
    let twice = KvTensorFormat::Custom(vec![Block, Block, Page, Inner]);
    assert!(reason(recognise(twice, &shape, &strides, 1)).contains("more than once"));
    let no_page = KvTensorFormat::Custom(vec![Block, Outer, Inner, Inner]);
    assert!(reason(recognise(no_page, &shape, &strides, 1)).contains("no Page"));
    let no_inner = KvTensorFormat::Custom(vec![Block, Layer, Outer, Page]);
    assert!(reason(recognise(no_inner, &shape, &strides, 1)).contains("no Inner"));
    let dtype = recognise_kv_tensors(
        &KvTensorFormat::Custom(vec![Block, Layer, Page, Inner]),
        &[TensorView {
            shape: &shape,
            strides: &strides,
        }],
        3,
    );
    assert_eq!(dtype.unwrap_err(), LayoutError::InvalidDtypeBytes(3));
}

#[test]
fn flash_attention_view_over_block_first_memory() {
    // vLLM can allocate `[num_blocks, 2, ...]` and hand out the
    // `[2, num_blocks, ...]` view (a permute): the strides, not the shape,
    // decide the order.
    let shape = [2, 10, 16, 8, 128];
    let chunk = 16 * 8 * 128;
    let strides = [chunk, 2 * chunk, 8 * 128, 128, 1];
    let r = recognise(KvTensorFormat::FlashAttn, &shape, &strides, 3).unwrap();
    assert_eq!(
        r.layout.kind(),
        LayoutKind::LayerSeparate(BlockOrder::BlockFirst)
    );
    assert_eq!(
        r.layout,
        Layout::new(*r.layout.config(), r.layout.kind()).unwrap()
    );
    assert_matches_tensor(&r, &KvTensorFormat::FlashAttn, &shape, &strides);
}
