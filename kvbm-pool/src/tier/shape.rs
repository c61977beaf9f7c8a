//! The KV shape of a model: what one block of its cache holds, given once
//! for every tier.

use kvbm_layout::LayoutConfig;

use super::TierError;

/// An element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// An 8-bit type (fp8 e4m3/e5m2, int8).
    Fp8,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::Fp8 => 1,
        }
    }

    /// The type of `bytes`-byte elements, for shapes read from a layout
    /// (2-byte elements read as bf16: only the size matters to kvbm).
    fn of_bytes(bytes: usize) -> Option<Self> {
        match bytes {
            4 => Some(Dtype::F32),
            2 => Some(Dtype::Bf16),
            1 => Some(Dtype::Fp8),
            _ => None,
        }
    }
}

/// What one block of a model's KV cache holds: layers, K and V planes (or
/// one latent plane), tokens per block, elements per token, element type.
/// Every tier's layout follows from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    layers: usize,
    planes: usize,
    block_tokens: usize,
    per_token: usize,
    dtype: Dtype,
}

/// Tokens per block unless set: what vLLM uses on GPUs.
const DEFAULT_BLOCK_TOKENS: usize = 16;

impl KvShape {
    /// Multi-head (or grouped-query) attention: K and V of `kv_heads` ×
    /// `head_dim` per token and layer; bf16 and 16 tokens per block unless
    /// [`dtype`](Self::dtype) and [`block_tokens`](Self::block_tokens) say
    /// otherwise.
    pub fn mha(layers: usize, kv_heads: usize, head_dim: usize) -> Self {
        KvShape {
            layers,
            planes: 2,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            per_token: kv_heads.saturating_mul(head_dim),
            dtype: Dtype::Bf16,
        }
    }

    /// Multi-head latent attention: one plane of `latent_dim` per token and
    /// layer; bf16 and 16 tokens per block unless set.
    pub fn mla(layers: usize, latent_dim: usize) -> Self {
        KvShape {
            layers,
            planes: 1,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            per_token: latent_dim,
            dtype: Dtype::Bf16,
        }
    }

    /// Sets the element type.
    pub fn dtype(mut self, dtype: Dtype) -> Self {
        self.dtype = dtype;
        self
    }

    /// The shape of `config`'s blocks.
    pub fn of_layout(config: &LayoutConfig) -> Result<Self, TierError> {
        let dtype = Dtype::of_bytes(config.dtype_bytes()).ok_or_else(|| {
            TierError::InvalidConfig(format!(
                "{}-byte elements have no KV dtype",
                config.dtype_bytes()
            ))
        })?;
        Ok(KvShape {
            layers: config.num_layers(),
            planes: config.outer_dim(),
            block_tokens: config.page_size(),
            per_token: config.inner_dim(),
            dtype,
        })
    }

    /// Sets the tokens per block.
    pub fn block_tokens(mut self, tokens: usize) -> Self {
        self.block_tokens = tokens;
        self
    }

    /// Tokens per block.
    pub fn tokens_per_block(&self) -> usize {
        self.block_tokens
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// 2 for K and V, 1 for a latent plane.
    pub fn planes(&self) -> usize {
        self.planes
    }

    /// Elements per token in one plane of one layer.
    pub fn elements_per_token(&self) -> usize {
        self.per_token
    }

    /// The element type.
    pub fn element_type(&self) -> Dtype {
        self.dtype
    }

    /// Bytes of one block (all layers and planes).
    pub fn block_bytes(&self) -> u64 {
        [self.layers, self.planes, self.block_tokens, self.per_token]
            .iter()
            .fold(self.dtype.bytes() as u64, |acc, &n| {
                acc.saturating_mul(n as u64)
            })
    }

    /// A layout configuration of `blocks` blocks of this shape.
    pub fn layout_config(&self, blocks: usize) -> Result<LayoutConfig, TierError> {
        LayoutConfig::new(
            blocks,
            self.layers,
            self.planes,
            self.block_tokens,
            self.per_token,
            self.dtype.bytes(),
        )
        .map_err(|e| TierError::InvalidConfig(format!("KV shape {self}: {e}")))
    }

    /// Whether `config`'s blocks have this shape; the error names the first
    /// dimension that differs.
    pub fn check(&self, what: &str, config: &LayoutConfig) -> Result<(), TierError> {
        let dims = [
            ("layers", self.layers, config.num_layers()),
            ("K/V planes", self.planes, config.outer_dim()),
            ("tokens per block", self.block_tokens, config.page_size()),
            ("elements per token", self.per_token, config.inner_dim()),
            (
                "bytes per element",
                self.dtype.bytes(),
                config.dtype_bytes(),
            ),
        ];
        for (dim, expected, found) in dims {
            if expected != found {
                return Err(TierError::ShapeMismatch {
                    what: what.to_string(),
                    dimension: dim,
                    expected,
                    found,
                });
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for KvShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} layers × {} × {} tokens × {} {:?}",
            self.layers,
            if self.planes == 2 { "K/V" } else { "latent" },
            self.block_tokens,
            self.per_token,
            self.dtype
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_bytes_count_every_layer_plane_token_and_byte() {
        // Llama-3.1-8B: 32 layers, 8 KV heads × 128, bf16, 16 tokens.
        let shape = KvShape::mha(32, 8, 128);
        assert_eq!(shape.block_bytes(), 32 * 2 * 16 * 1024 * 2);
        assert_eq!(
            shape.layout_config(4).unwrap().block_bytes(),
            shape.block_bytes()
        );
        let mla = KvShape::mla(61, 576).block_tokens(64);
        assert_eq!(mla.block_bytes(), 61 * 64 * 576 * 2);
    }

    #[test]
    fn a_layout_of_another_shape_names_the_dimension() {
        let shape = KvShape::mha(2, 1, 128);
        let other = KvShape::mha(2, 1, 128).block_tokens(32);
        let err = shape
            .check("G1", &other.layout_config(8).unwrap())
            .unwrap_err();
        assert!(err.to_string().contains("tokens per block"), "{err}");
        assert!(shape.check("G1", &shape.layout_config(8).unwrap()).is_ok());
        assert_eq!(
            KvShape::of_layout(&shape.layout_config(3).unwrap()).unwrap(),
            shape
        );
    }

    #[test]
    fn zero_dimensions_are_errors_not_panics() {
        assert!(KvShape::mha(0, 8, 128).layout_config(1).is_err());
        assert!(
            KvShape::mha(2, 8, 128)
                .block_tokens(0)
                .layout_config(1)
                .is_err()
        );
    }
}
