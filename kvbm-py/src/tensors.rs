//! An engine's KV tensors as kvbm's G1.
//!
//! vLLM hands its worker one tensor per attention layer. Which axis is
//! which depends on the attention backend; this module names the axes of
//! the shapes vLLM's backends produce (the block axis is the one whose
//! extent is the engine's block count) and hands shape and strides to
//! kvbm-layout's recognition, which derives the layout from the strides
//! and refuses anything it cannot address exactly. The resulting
//! [`PhysicalLayout`] points at the engine's memory; nothing is copied.

use kvbm_layout::{KvAxis, KvTensorFormat, TensorView, recognise_kv_tensors};
use kvbm_transfer::memory::Owner;
use kvbm_transfer::{MemoryKind, MemoryRegion, PhysicalLayout};

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
/// - CPU attention `[num_blocks, 2, block_size, inner]`;
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
             [num_blocks, 2, block_size, heads, head_size], CPU attention \
             [num_blocks, 2, block_size, inner] or MLA [num_blocks, block_size, latent]"
        ))
    };
    let format = match shape {
        [2, nb, _, _, _] if *nb == num_blocks => KvTensorFormat::FlashAttn,
        [nb, 2, _, _, _] if *nb == num_blocks => KvTensorFormat::FlashInfer,
        [nb, 2, _, _] if *nb == num_blocks => {
            KvTensorFormat::Custom(vec![Block, Outer, Page, Inner])
        }
        [nb, _, _] if *nb == num_blocks => KvTensorFormat::Mla,
        _ => return Err(unsupported()),
    };
    Ok(format)
}

/// The furthest byte a strided tensor reaches, plus one.
fn extent_bytes(t: &RawTensor, dtype_bytes: usize) -> Result<u64> {
    let mut last = 0u64;
    for (&n, &s) in t.shape.iter().zip(&t.strides) {
        let step = (n.saturating_sub(1) as u64)
            .checked_mul(s as u64)
            .ok_or_else(|| PyKvbmError::Invalid("tensor extent overflows".into()))?;
        last = last
            .checked_add(step)
            .ok_or_else(|| PyKvbmError::Invalid("tensor extent overflows".into()))?;
    }
    (last + 1)
        .checked_mul(dtype_bytes as u64)
        .ok_or_else(|| PyKvbmError::Invalid("tensor extent overflows".into()))
}

/// Where the tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorMemory {
    /// Host memory.
    Host,
    /// Memory of the CUDA device with this ordinal.
    Device(u32),
}

/// Builds the physical layout over `tensors` (one per layer, in layer
/// order) in `format`, each tensor a region.
///
/// # Safety
/// Every tensor's bytes, `[addr, addr + extent)`, must be valid memory of
/// `memory` for as long as the layout (or a clone) lives — `owner` is kept
/// alive with it and should be what keeps the tensors alive — and the
/// engine must not touch a block while kvbm copies it.
pub unsafe fn engine_layout(
    format: &KvTensorFormat,
    tensors: &[RawTensor],
    dtype_bytes: usize,
    memory: TensorMemory,
    owner: Owner,
) -> Result<PhysicalLayout> {
    let views: Vec<TensorView<'_>> = tensors
        .iter()
        .map(|t| TensorView {
            shape: &t.shape,
            strides: &t.strides,
        })
        .collect();
    let recognised = recognise_kv_tensors(format, &views, dtype_bytes)?;
    let layout = recognised.layout;
    let size = layout.uniform_region_size();
    let kind = match memory {
        TensorMemory::Host => MemoryKind::System,
        TensorMemory::Device(d) => MemoryKind::Device(d),
    };
    let mut regions: Vec<Option<MemoryRegion>> = vec![None; layout.num_regions()];
    for (t, &r) in tensors.iter().zip(&recognised.tensor_regions) {
        let reach = extent_bytes(t, dtype_bytes)?;
        if size > reach {
            return Err(PyKvbmError::Invalid(format!(
                "the layout needs {size} bytes per tensor, tensor of shape {:?} strides {:?} \
                 reaches {reach}",
                t.shape, t.strides
            )));
        }
        if t.addr == 0 {
            return Err(PyKvbmError::Invalid("a tensor at address 0".into()));
        }
        // SAFETY: the caller guarantees the tensor's bytes — which include
        // `[addr, addr + size)`, checked just above — stay valid memory of
        // `kind` while `owner` (kept by the region) lives.
        let region = unsafe { MemoryRegion::from_raw(t.addr, size, kind, Some(owner.clone())) };
        regions[r] = Some(region);
    }
    let regions: Vec<MemoryRegion> = regions
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.ok_or_else(|| PyKvbmError::Invalid(format!("no tensor for region {i}"))))
        .collect::<Result<_>>()?;
    Ok(PhysicalLayout::new(layout, regions)?)
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

    #[test]
    fn cpu_attention_tensors_become_a_layout() {
        // Two layers of [blocks, 2, 32, 128] bf16, as vLLM's CPU backend
        // hands them over.
        let (nb, per_block) = (4usize, 2 * 32 * 128);
        let mut mem = vec![0u16; 2 * nb * per_block];
        let base = mem.as_mut_ptr() as u64;
        let tensors: Vec<RawTensor> = (0..2)
            .map(|l| RawTensor {
                addr: base + (l * nb * per_block * 2) as u64,
                shape: vec![nb, 2, 32, 128],
                strides: vec![per_block, 32 * 128, 128, 1],
            })
            .collect();
        let format = vllm_format(&tensors[0].shape, nb).unwrap();
        let owner: Owner = Arc::new(());
        // SAFETY: `mem` outlives the layout (dropped at the end of the test).
        let l = unsafe { engine_layout(&format, &tensors, 2, TensorMemory::Host, owner) }.unwrap();
        let c = *l.layout().config();
        assert_eq!((c.num_blocks(), c.num_layers(), c.outer_dim()), (nb, 2, 2));
        assert_eq!(c.block_bytes(), 2 * 2 * 32 * 128 * 2);
        drop(l);
        drop(mem);
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
