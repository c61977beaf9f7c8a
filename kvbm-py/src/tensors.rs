//! An engine's KV tensors as kvbm's G1.
//!
//! vLLM hands its worker one tensor per attention layer. Which axis is
//! which depends on the attention backend; this module names the axes of
//! the shapes vLLM's backends produce (the block axis is the one whose
//! extent is the engine's block count) and hands shape and strides to
//! kvbm-transfer's [`EngineKvCache`] (kvbm-layout's recognition: the
//! layout comes from the strides, and anything it cannot address exactly
//! is refused). The resulting [`PhysicalLayout`] points at the engine's
//! memory; nothing is copied.

use kvbm_layout::{KvAxis, KvTensorFormat};
use kvbm_transfer::memory::{EngineKvCache, EngineTensor, Owner};
use kvbm_transfer::{PhysicalLayout, TransferError};

use crate::error::{PyKvbmError, Result};

/// One engine tensor as Python describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawTensor {
    /// Address of element 0.
    pub addr: u64,
    /// Extent of each axis.
    pub shape: Vec<usize>,
    /// Stride of each axis, in elements.
    pub strides: Vec<usize>,
}

/// Names the axes of a vLLM per-layer KV tensor of `shape`, given the
/// engine's block count:
///
/// - flash-attn `[2, num_blocks, block_size, heads, head_size]`;
/// - FlashInfer `[num_blocks, 2, block_size, heads, head_size]`;
/// - `[num_blocks, kv_heads, block_size, 2 * head_size]`: what every
///   backend of vLLM 0.32 and later hands over, CPU attention included
///   (each head's K and V rows packed in its page; the physical order of
///   the axes is the engine's KV cache layout, read from the strides). A
///   block whose bytes are one run per layer is one chunk; a layout with
///   heads outside blocks is refused. `kv_heads` is this rank's share, 1
///   under tensor parallelism with as many ranks as KV heads;
/// - MLA `[num_blocks, block_size, latent]`.
///
/// Strides decide the order inside a block (NHD or HND both work); a shape
/// that is none of these is an error naming it.
pub fn vllm_format(shape: &[usize], num_blocks: usize) -> Result<KvTensorFormat> {
    use KvAxis::*;
    let unsupported = || {
        PyKvbmError::Invalid(format!(
            "unsupported KV tensor: shape {shape:?} with {num_blocks} blocks is none of \
             flash-attn [2, num_blocks, block_size, heads, head_size], FlashInfer \
             [num_blocks, 2, block_size, heads, head_size], vLLM 0.32+ \
             [num_blocks, heads, block_size, 2 * head_size] or MLA [num_blocks, block_size, \
             latent]"
        ))
    };
    let format = match shape {
        [2, nb, _, _, _] if *nb == num_blocks => KvTensorFormat::FlashAttn,
        [nb, 2, _, _, _] if *nb == num_blocks => KvTensorFormat::FlashInfer,
        // Heads and the packed K|V row are both per-token data of the
        // block's one chunk, not a K/V selector.
        [nb, _, _, _] if *nb == num_blocks => {
            KvTensorFormat::Custom(vec![Block, Inner, Page, Inner])
        }
        [nb, _, _] if *nb == num_blocks => KvTensorFormat::Mla,
        _ => return Err(unsupported()),
    };
    Ok(format)
}

/// Where the tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorMemory {
    /// Host memory.
    Host,
    /// Memory of the CUDA device with this ordinal.
    Device(u32),
}

/// Builds kvbm's G1 over `tensors` (one per layer, in layer order) in
/// `format`, through kvbm-transfer's [`EngineKvCache`]: the layout is
/// recognised from shapes and strides, each tensor is a region, nothing is
/// copied.
///
/// # Safety
/// Every tensor's bytes (its address through its span) must stay valid
/// memory of `memory` for as long as the layout (or a clone) lives —
/// `owner`, kept alive with host regions, should be what keeps the tensors
/// alive; for device tensors the caller keeps it alive as long — and the
/// engine must not touch a block while kvbm copies it.
pub unsafe fn engine_layout(
    format: &KvTensorFormat,
    tensors: &[RawTensor],
    dtype_bytes: usize,
    memory: TensorMemory,
    owner: Owner,
) -> Result<PhysicalLayout> {
    if tensors.iter().any(|t| t.addr == 0) {
        return Err(PyKvbmError::Invalid("a tensor at address 0".into()));
    }
    let tensors: Vec<EngineTensor> = tensors
        .iter()
        .map(|t| EngineTensor {
            addr: t.addr,
            shape: t.shape.clone(),
            strides: t.strides.clone(),
        })
        .collect();
    let cache = match memory {
        // SAFETY: forwarded from the caller; `owner` keeps the tensors.
        TensorMemory::Host => unsafe {
            EngineKvCache::host(format, dtype_bytes, &tensors, Some(owner))
        },
        TensorMemory::Device(ordinal) => {
            // SAFETY: forwarded from the caller.
            unsafe { device_cache(ordinal, format, dtype_bytes, &tensors) }
        }
    }
    .map_err(|e| match e {
        // Recognition failures are the engine's tensors, not ours.
        TransferError::Plan(l) => PyKvbmError::Layout(l),
        TransferError::LayoutMismatch(m) => {
            PyKvbmError::Invalid(format!("unsupported KV tensor: {m}"))
        }
        other => PyKvbmError::Transfer(other),
    })?;
    Ok(cache.into_physical())
}

/// # Safety
/// As [`engine_layout`], for device tensors.
#[cfg(feature = "cuda")]
unsafe fn device_cache(
    ordinal: u32,
    format: &KvTensorFormat,
    dtype_bytes: usize,
    tensors: &[EngineTensor],
) -> std::result::Result<EngineKvCache, TransferError> {
    use kvbm_transfer::cuda::{CudaDevice, to_transfer_error};
    let device = CudaDevice::open(ordinal as usize).map_err(to_transfer_error)?;
    // SAFETY: forwarded from the caller; the cache asks the driver that
    // every span is device memory of `device`.
    unsafe { EngineKvCache::device(&device, format, dtype_bytes, tensors) }
}

/// # Safety
/// Nothing is touched: without feature `cuda`, device tensors are refused.
#[cfg(not(feature = "cuda"))]
unsafe fn device_cache(
    ordinal: u32,
    _format: &KvTensorFormat,
    _dtype_bytes: usize,
    _tensors: &[EngineTensor],
) -> std::result::Result<EngineKvCache, TransferError> {
    Err(TransferError::InvalidRequest(format!(
        "KV tensors on CUDA device {ordinal}: this build of kvbm-py has no CUDA support \
         (feature `cuda`)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn names_the_backends_shapes() {
        assert_eq!(
            vllm_format(&[2, 10, 16, 8, 64], 10).unwrap(),
            KvTensorFormat::FlashAttn
        );
        assert_eq!(
            vllm_format(&[10, 2, 16, 8, 64], 10).unwrap(),
            KvTensorFormat::FlashInfer
        );
        assert_eq!(
            vllm_format(&[10, 16, 576], 10).unwrap(),
            KvTensorFormat::Mla
        );
        assert!(matches!(
            vllm_format(&[10, 2, 32, 128], 10).unwrap(),
            KvTensorFormat::Custom(_)
        ));
        let e = vllm_format(&[3, 10, 16, 8, 64], 10).unwrap_err();
        assert!(e.to_string().contains("unsupported KV tensor"), "{e}");
    }

    /// Two layers of vLLM CPU attention tensors `[nb, heads, 32, 128]`
    /// (bf16) as one layout: one chunk per block and layer.
    fn cpu_attention_layout(nb: usize, heads: usize) -> (usize, usize, usize, u64) {
        let per_block = heads * 32 * 128;
        let mut mem = vec![0u16; 2 * nb * per_block];
        let base = mem.as_mut_ptr() as u64;
        let tensors: Vec<RawTensor> = (0..2)
            .map(|l| RawTensor {
                addr: base + (l * nb * per_block * 2) as u64,
                shape: vec![nb, heads, 32, 128],
                strides: vec![per_block, 32 * 128, 128, 1],
            })
            .collect();
        let format = vllm_format(&tensors[0].shape, nb).unwrap();
        let owner: Owner = Arc::new(());
        // SAFETY: `mem` outlives the layout (dropped at the end of the test).
        let l = unsafe { engine_layout(&format, &tensors, 2, TensorMemory::Host, owner) }.unwrap();
        let c = *l.layout().config();
        let out = (
            c.num_blocks(),
            c.num_layers(),
            c.outer_dim(),
            c.block_bytes(),
        );
        drop(l);
        drop(mem);
        out
    }

    #[test]
    fn cpu_attention_tensors_become_a_layout() {
        // As vLLM's CPU backend hands them over: 2 KV heads (one rank),
        // 1 (each of 2 tensor-parallel ranks) or 4.
        for heads in [1, 2, 4] {
            assert_eq!(
                cpu_attention_layout(4, heads),
                (4, 2, 1, (2 * heads * 32 * 128 * 2) as u64),
                "{heads} heads"
            );
        }
    }

    /// One layer `[nb, heads, 16, 256]` (logical, K|V packed in the last
    /// axis) with the strides of `order` (a permutation of the four axes,
    /// outermost first), as vLLM's KV cache layouts view their memory.
    fn packed_layer(nb: usize, heads: usize, order: [usize; 4]) -> Result<(usize, u64)> {
        let shape = [nb, heads, 16, 256];
        let mut strides = [0usize; 4];
        let mut step = 1;
        for &axis in order.iter().rev() {
            strides[axis] = step;
            step *= shape[axis];
        }
        let mut mem = vec![0u16; step];
        let t = RawTensor {
            addr: mem.as_mut_ptr() as u64,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
        };
        let format = vllm_format(&t.shape, nb)?;
        // SAFETY: `mem` outlives the layout (dropped below).
        let l = unsafe { engine_layout(&format, &[t], 2, TensorMemory::Host, Arc::new(())) }?;
        let c = *l.layout().config();
        let out = (c.outer_dim(), c.block_bytes());
        drop(l);
        drop(mem);
        Ok(out)
    }

    #[test]
    fn vllm_packed_layouts_are_one_chunk_or_refused() {
        let block = (8 * 16 * 256 * 2) as u64;
        // Blocks outermost, heads before or after tokens (HND / NHD): each
        // block's bytes are one run.
        assert_eq!(packed_layer(4, 8, [0, 1, 2, 3]).unwrap(), (1, block));
        assert_eq!(packed_layer(4, 8, [0, 2, 1, 3]).unwrap(), (1, block));
        // Heads outside blocks: a block is scattered over every head's
        // slab, which one chunk cannot address; refused, never misread.
        let r = packed_layer(4, 8, [1, 0, 2, 3]);
        assert!(matches!(r, Err(PyKvbmError::Layout(_))), "{r:?}");
    }

    #[test]
    fn a_gappy_inner_axis_is_refused() {
        let mut mem = vec![0u16; 4 * 2 * 32 * 256];
        let t = RawTensor {
            addr: mem.as_mut_ptr() as u64,
            shape: vec![4, 2, 32, 128],
            // Every token row padded to 256 elements: not one chunk.
            strides: vec![2 * 32 * 256, 32 * 256, 256, 1],
        };
        let format = vllm_format(&t.shape, 4).unwrap();
        // SAFETY: refused before any region is built; `mem` outlives it.
        let r = unsafe { engine_layout(&format, &[t], 2, TensorMemory::Host, Arc::new(())) };
        assert!(matches!(r, Err(PyKvbmError::Layout(_))), "{r:?}");
        drop(mem);
    }
}
