//! An inference engine's own KV tensors as a [`PhysicalLayout`].
//!
//! An engine hands kvbm its KV cache as framework tensors: a data address,
//! a shape and strides (in elements). [`EngineKvCache`] recognises their
//! layout through kvbm-layout's [`recognise_kv_tensors`] (which derives the
//! layout from the strides and refuses anything it cannot address exactly)
//! and binds it to the tensors' memory without copying or owning it. What
//! cannot be recognised is an error at registration, never wrong bytes
//! later.

use kvbm_layout::{KvTensorFormat, TensorView, recognise_kv_tensors};

use super::{MemoryKind, MemoryRegion, Owner};
use crate::error::{Result, TransferError};
use crate::physical::PhysicalLayout;

/// One framework tensor of an engine's KV cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineTensor {
    /// Address of the element at index zero (a host address, or a device
    /// pointer for device tensors).
    pub addr: u64,
    /// Extent of each axis, outermost first.
    pub shape: Vec<usize>,
    /// Stride of each axis, in elements.
    pub strides: Vec<usize>,
}

impl EngineTensor {
    /// Bytes from the tensor's first element to the end of its last:
    /// the memory it spans, padding between blocks included.
    pub fn span_bytes(&self, dtype_bytes: usize) -> Result<u64> {
        if self.shape.len() != self.strides.len() {
            return Err(TransferError::LayoutMismatch(format!(
                "a tensor of {} axes has {} strides",
                self.shape.len(),
                self.strides.len()
            )));
        }
        if self.shape.contains(&0) {
            return Err(TransferError::LayoutMismatch(format!(
                "tensor of shape {:?} is empty",
                self.shape
            )));
        }
        let last = self
            .shape
            .iter()
            .zip(&self.strides)
            .try_fold(0u64, |acc, (&n, &s)| {
                (n as u64 - 1)
                    .checked_mul(s as u64)
                    .and_then(|v| acc.checked_add(v))
            });
        last.and_then(|l| l.checked_add(1))
            .and_then(|elems| elems.checked_mul(dtype_bytes as u64))
            .ok_or_else(|| {
                TransferError::LayoutMismatch(format!(
                    "tensor of shape {:?} and strides {:?} overflows",
                    self.shape, self.strides
                ))
            })
    }
}

/// An engine's KV cache, recognised and wrapped in place.
#[derive(Debug, Clone)]
pub struct EngineKvCache {
    physical: PhysicalLayout,
    format: KvTensorFormat,
}

impl EngineKvCache {
    /// Wraps host tensors (an engine running on the CPU, or host memory an
    /// engine shares).
    ///
    /// `tensors` follow `format`: one tensor per layer for per-layer
    /// formats, in layer order, or one tensor for all-layers formats.
    /// `dtype_bytes` is the element size. `owner`, when given, is kept
    /// alive as long as any region of the cache (a handle on the engine's
    /// tensors, for instance).
    ///
    /// # Safety
    /// Every tensor's memory (`addr` through its span) must stay valid,
    /// readable and writable host memory for as long as the returned cache
    /// or anything built from it (an engine's tier, an executor's
    /// registration) exists, and the engine must not touch the bytes of a
    /// block while kvbm moves it.
    pub unsafe fn host(
        format: &KvTensorFormat,
        dtype_bytes: usize,
        tensors: &[EngineTensor],
        owner: Option<Owner>,
    ) -> Result<Self> {
        // SAFETY: forwarded from the caller; host memory.
        unsafe {
            Self::wrap(format, dtype_bytes, tensors, |addr, len| {
                Ok(MemoryRegion::from_raw(
                    addr,
                    len,
                    MemoryKind::System,
                    owner.clone(),
                ))
            })
        }
    }

    /// Wraps device tensors on `device`, checking with the driver that each
    /// tensor's span is device memory.
    ///
    /// # Safety
    /// As [`host`](Self::host), for device memory of `device`.
    #[cfg(feature = "cuda")]
    pub unsafe fn device(
        device: &crate::cuda::CudaDevice,
        format: &KvTensorFormat,
        dtype_bytes: usize,
        tensors: &[EngineTensor],
    ) -> Result<Self> {
        use crate::cuda::backend::to_transfer_error;
        use crate::cuda::memory::ExternalDeviceMemory;
        use std::sync::Arc;
        // SAFETY: forwarded from the caller; `wrap` asks the driver that
        // both ends of each span are device memory.
        unsafe {
            Self::wrap(format, dtype_bytes, tensors, |addr, len| {
                let len = usize::try_from(len).map_err(|_| {
                    TransferError::LayoutMismatch(format!("a tensor of {len} bytes"))
                })?;
                let memory =
                    ExternalDeviceMemory::wrap(device, addr, len).map_err(to_transfer_error)?;
                Ok(Arc::new(memory).region())
            })
        }
    }

    /// # Safety
    /// `region(addr, len)` must only be given spans of the caller's tensors,
    /// which the caller vouches for.
    unsafe fn wrap(
        format: &KvTensorFormat,
        dtype_bytes: usize,
        tensors: &[EngineTensor],
        region: impl Fn(u64, u64) -> Result<MemoryRegion>,
    ) -> Result<Self> {
        let views: Vec<TensorView<'_>> = tensors
            .iter()
            .map(|t| TensorView {
                shape: &t.shape,
                strides: &t.strides,
            })
            .collect();
        let recognised = recognise_kv_tensors(format, &views, dtype_bytes)?;
        let layout = recognised.layout;
        let mut regions: Vec<Option<MemoryRegion>> = vec![None; layout.num_regions()];
        for (tensor, &r) in tensors.iter().zip(&recognised.tensor_regions) {
            let span = tensor.span_bytes(dtype_bytes)?;
            let need = layout.region_size(r)?;
            if span < need {
                return Err(TransferError::LayoutMismatch(format!(
                    "tensor at {:#x} spans {span} bytes, its layout region needs {need}",
                    tensor.addr
                )));
            }
            regions[r] = Some(region(tensor.addr, span)?);
        }
        let regions = regions
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                r.ok_or_else(|| {
                    TransferError::LayoutMismatch(format!("no tensor provides layout region {i}"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(EngineKvCache {
            physical: PhysicalLayout::new(layout, regions)?,
            format: format.clone(),
        })
    }

    /// The recognised layout over the tensors' memory.
    pub fn physical(&self) -> &PhysicalLayout {
        &self.physical
    }

    /// The tensor format it was recognised as.
    pub fn format(&self) -> &KvTensorFormat {
        &self.format
    }

    /// The physical layout, for a tier.
    pub fn into_physical(self) -> PhysicalLayout {
        self.physical
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flash_attn(addr: u64, blocks: usize) -> EngineTensor {
        // [2, blocks, 16 tokens, 2 heads, 8 dims], dense.
        EngineTensor {
            addr,
            shape: vec![2, blocks, 16, 2, 8],
            strides: vec![blocks * 256, 256, 16, 8, 1],
        }
    }

    #[test]
    fn host_flash_attn_tensors_become_a_layer_separate_layout() {
        let blocks = 4;
        let mut memory = vec![vec![0u16; 2 * blocks * 256]; 3];
        let tensors: Vec<_> = memory
            .iter_mut()
            .map(|m| flash_attn(m.as_mut_ptr() as u64, blocks))
            .collect();
        // SAFETY: `memory` outlives `cache`, which is dropped at the end of
        // the test; nothing else touches it.
        let cache = unsafe { EngineKvCache::host(&KvTensorFormat::FlashAttn, 2, &tensors, None) }
            .expect("recognised");
        let cfg = *cache.physical().layout().config();
        assert_eq!(
            (cfg.num_blocks(), cfg.num_layers(), cfg.page_size()),
            (blocks, 3, 16)
        );
        assert_eq!(cfg.inner_dim(), 16);
        assert_eq!(cache.physical().regions().len(), 3);
        assert_eq!(
            cache.physical().regions()[1].addr(),
            Some(memory[1].as_ptr() as u64)
        );
    }

    #[test]
    fn mismatched_strides_and_shapes_are_errors() {
        let mut memory = vec![0u16; 2 * 4 * 256];
        let mut t = flash_attn(memory.as_mut_ptr() as u64, 4);
        t.strides.pop();
        assert!(t.span_bytes(2).is_err());
        // SAFETY: `memory` outlives the call; it fails before wrapping.
        let err = unsafe { EngineKvCache::host(&KvTensorFormat::FlashAttn, 2, &[t], None) };
        assert!(err.is_err());
        // A token axis that is not dense cannot be a layout.
        let mut t = flash_attn(memory.as_mut_ptr() as u64, 4);
        t.strides[2] = 17;
        // SAFETY: as above.
        let err = unsafe { EngineKvCache::host(&KvTensorFormat::FlashAttn, 2, &[t], None) };
        assert!(err.is_err());
    }

    #[test]
    fn span_counts_padding_and_the_last_element() {
        let t = EngineTensor {
            addr: 0,
            shape: vec![3, 4],
            strides: vec![10, 1],
        };
        // Last element at 2·10 + 3 = 23: 24 elements.
        assert_eq!(t.span_bytes(2).unwrap(), 48);
    }
}
