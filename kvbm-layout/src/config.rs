//! The shape of one KV block, validated once.
//!
//! A [`LayoutConfig`] is the only way to name a block shape, and it can only
//! be built through a validating constructor (serde included), so every other
//! module may trust its numbers: dimensions are non-zero, `outer_dim` is 1 or
//! 2, the element size is real, the alignment is a power of two, and the
//! whole cache's size fits `u64` and `usize`. That lets the address math and
//! the copy planner use plain arithmetic on their hot paths.

use serde::{Deserialize, Serialize};

use crate::error::{LayoutError, Result};

/// Shape of the KV cache's blocks: how many blocks, and what one block holds.
///
/// One block holds, for each of `num_layers` layers and each of `outer_dim`
/// planes (K and V, or one for MLA), a *chunk* of `page_size` tokens ×
/// `inner_dim` elements × `dtype_bytes` bytes, stored contiguously.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawLayoutConfig", into = "RawLayoutConfig")]
pub struct LayoutConfig {
    num_blocks: usize,
    num_layers: usize,
    outer_dim: usize,
    page_size: usize,
    inner_dim: usize,
    dtype_bytes: usize,
    alignment: u64,
}

/// The unvalidated wire form of [`LayoutConfig`]; deserialising goes through
/// [`LayoutConfig::new`] and [`LayoutConfig::with_alignment`].
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLayoutConfig {
    num_blocks: usize,
    num_layers: usize,
    outer_dim: usize,
    page_size: usize,
    inner_dim: usize,
    dtype_bytes: usize,
    alignment: u64,
}

impl TryFrom<RawLayoutConfig> for LayoutConfig {
    type Error = LayoutError;

    fn try_from(raw: RawLayoutConfig) -> Result<Self> {
        LayoutConfig::new(
            raw.num_blocks,
            raw.num_layers,
            raw.outer_dim,
            raw.page_size,
            raw.inner_dim,
            raw.dtype_bytes,
        )?
        .with_alignment(raw.alignment)
    }
}

impl From<LayoutConfig> for RawLayoutConfig {
    fn from(c: LayoutConfig) -> Self {
        RawLayoutConfig {
            num_blocks: c.num_blocks,
            num_layers: c.num_layers,
            outer_dim: c.outer_dim,
            page_size: c.page_size,
            inner_dim: c.inner_dim,
            dtype_bytes: c.dtype_bytes,
            alignment: c.alignment,
        }
    }
}

/// Rounds `value` up to a multiple of `alignment` (a power of two), or `None`
/// on overflow.
pub(crate) fn align_up(value: u64, alignment: u64) -> Option<u64> {
    let mask = alignment - 1;
    value.checked_add(mask).map(|v| v & !mask)
}

fn to_u64(value: usize) -> Result<u64> {
    u64::try_from(value).map_err(|_| LayoutError::SizeOverflow {
        what: "a dimension",
    })
}

fn mul(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_mul(b).ok_or(LayoutError::SizeOverflow { what })
}

/// Checks that a byte count is addressable on this machine as well.
pub(crate) fn fits_usize(bytes: u64, what: &'static str) -> Result<u64> {
    usize::try_from(bytes)
        .map(|_| bytes)
        .map_err(|_| LayoutError::SizeOverflow { what })
}

impl LayoutConfig {
    /// Validates a block shape, with no alignment padding (alignment 1).
    ///
    /// Errors: any zero dimension, `outer_dim` other than 1 or 2,
    /// `dtype_bytes` other than 1, 2, 4 or 8, and sizes that overflow.
    pub fn new(
        num_blocks: usize,
        num_layers: usize,
        outer_dim: usize,
        page_size: usize,
        inner_dim: usize,
        dtype_bytes: usize,
    ) -> Result<Self> {
        for (name, value) in [
            ("num_blocks", num_blocks),
            ("num_layers", num_layers),
            ("outer_dim", outer_dim),
            ("page_size", page_size),
            ("inner_dim", inner_dim),
            ("dtype_bytes", dtype_bytes),
        ] {
            if value == 0 {
                return Err(LayoutError::ZeroDimension { name });
            }
        }
        if !matches!(outer_dim, 1 | 2) {
            return Err(LayoutError::InvalidOuterDim(outer_dim));
        }
        if !matches!(dtype_bytes, 1 | 2 | 4 | 8) {
            return Err(LayoutError::InvalidDtypeBytes(dtype_bytes));
        }
        let config = LayoutConfig {
            num_blocks,
            num_layers,
            outer_dim,
            page_size,
            inner_dim,
            dtype_bytes,
            alignment: 1,
        };
        config.check_sizes()?;
        Ok(config)
    }

    /// Returns the config with blocks padded to a multiple of `alignment`
    /// bytes (a power of two; 1 means no padding).
    pub fn with_alignment(self, alignment: u64) -> Result<Self> {
        if !alignment.is_power_of_two() {
            return Err(LayoutError::InvalidAlignment(alignment));
        }
        let config = LayoutConfig { alignment, ..self };
        config.check_sizes()?;
        Ok(config)
    }

    /// Returns the config with a different block count (validated again).
    pub fn with_num_blocks(self, num_blocks: usize) -> Result<Self> {
        if num_blocks == 0 {
            return Err(LayoutError::ZeroDimension { name: "num_blocks" });
        }
        let config = LayoutConfig { num_blocks, ..self };
        config.check_sizes()?;
        Ok(config)
    }

    /// Checks every size derived from the config for overflow; after this the
    /// getters below cannot overflow.
    fn check_sizes(&self) -> Result<()> {
        let elems = mul(
            to_u64(self.page_size)?,
            to_u64(self.inner_dim)?,
            "chunk size",
        )?;
        let chunk = fits_usize(
            mul(elems, to_u64(self.dtype_bytes)?, "chunk size")?,
            "chunk size",
        )?;
        let per_layer = mul(chunk, to_u64(self.outer_dim)?, "block size")?;
        let block = fits_usize(
            mul(per_layer, to_u64(self.num_layers)?, "block size")?,
            "block size",
        )?;
        let padded = align_up(block, self.alignment).ok_or(LayoutError::SizeOverflow {
            what: "padded block size",
        })?;
        fits_usize(
            mul(padded, to_u64(self.num_blocks)?, "total cache size")?,
            "total cache size",
        )?;
        Ok(())
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Number of model layers.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Planes per layer: 2 for K and V, 1 for MLA's latent cache.
    pub fn outer_dim(&self) -> usize {
        self.outer_dim
    }

    /// Tokens per block.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Elements per token in one plane (e.g. `num_kv_heads * head_size`).
    pub fn inner_dim(&self) -> usize {
        self.inner_dim
    }

    /// Bytes per element (2 for bf16/fp16).
    pub fn dtype_bytes(&self) -> usize {
        self.dtype_bytes
    }

    /// Alignment in bytes that layouts pad each block to (1 = none).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Bytes of one `(block, layer, outer)` chunk:
    /// `page_size * inner_dim * dtype_bytes`.
    pub fn chunk_bytes(&self) -> u64 {
        // Cannot overflow: checked in `check_sizes`.
        (self.page_size as u64) * (self.inner_dim as u64) * (self.dtype_bytes as u64)
    }

    /// Data bytes of one block over all layers and planes, without padding.
    /// This is what a transfer of one block moves, and what benchmarks count.
    pub fn block_bytes(&self) -> u64 {
        // Cannot overflow: checked in `check_sizes`.
        self.chunk_bytes() * (self.outer_dim as u64) * (self.num_layers as u64)
    }

    /// Chunks per block: `num_layers * outer_dim`.
    pub fn chunks_per_block(&self) -> usize {
        self.num_layers * self.outer_dim
    }

    /// Whether two configs describe the same block (everything but the block
    /// count and alignment agrees), so blocks can be copied between them.
    pub fn same_block_shape(&self, other: &LayoutConfig) -> Result<()> {
        for (field, a, b) in [
            ("num_layers", self.num_layers, other.num_layers),
            ("outer_dim", self.outer_dim, other.outer_dim),
            ("page_size", self.page_size, other.page_size),
            ("inner_dim", self.inner_dim, other.inner_dim),
            ("dtype_bytes", self.dtype_bytes, other.dtype_bytes),
        ] {
            if a != b {
                return Err(LayoutError::ShapeMismatch {
                    field,
                    src: a as u64,
                    dst: b as u64,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> LayoutConfig {
        LayoutConfig::new(4, 32, 2, 16, 8 * 128, 2).unwrap()
    }

    #[test]
    fn sizes_of_a_llama_like_block() {
        let c = ok();
        assert_eq!(c.chunk_bytes(), 16 * 1024 * 2);
        assert_eq!(c.block_bytes(), 32 * 2 * 16 * 1024 * 2);
        assert_eq!(c.alignment(), 1);
        assert_eq!(c.chunks_per_block(), 64);
    }

    #[test]
    fn each_zero_dimension_is_named() {
        let cases = [
            ((0, 1, 1, 1, 1, 1), "num_blocks"),
            ((1, 0, 1, 1, 1, 1), "num_layers"),
            ((1, 1, 0, 1, 1, 1), "outer_dim"),
            ((1, 1, 1, 0, 1, 1), "page_size"),
            ((1, 1, 1, 1, 0, 1), "inner_dim"),
            ((1, 1, 1, 1, 1, 0), "dtype_bytes"),
        ];
        for ((a, b, c, d, e, f), name) in cases {
            assert_eq!(
                LayoutConfig::new(a, b, c, d, e, f),
                Err(LayoutError::ZeroDimension { name })
            );
        }
    }

    #[test]
    fn outer_dim_must_be_one_or_two() {
        assert!(LayoutConfig::new(1, 1, 1, 1, 1, 1).is_ok());
        assert!(LayoutConfig::new(1, 1, 2, 1, 1, 1).is_ok());
        assert_eq!(
            LayoutConfig::new(1, 1, 3, 1, 1, 1),
            Err(LayoutError::InvalidOuterDim(3))
        );
    }

    #[test]
    fn dtype_bytes_must_be_a_real_element_size() {
        for d in [1, 2, 4, 8] {
            assert!(LayoutConfig::new(1, 1, 1, 1, 1, d).is_ok());
        }
        for d in [3, 5, 16] {
            assert_eq!(
                LayoutConfig::new(1, 1, 1, 1, 1, d),
                Err(LayoutError::InvalidDtypeBytes(d))
            );
        }
    }

    #[test]
    fn alignment_must_be_a_power_of_two() {
        for a in [0u64, 3, 6, 4097] {
            assert_eq!(
                ok().with_alignment(a),
                Err(LayoutError::InvalidAlignment(a))
            );
        }
        assert_eq!(ok().with_alignment(4096).unwrap().alignment(), 4096);
    }

    #[test]
    fn overflowing_sizes_are_errors() {
        assert!(matches!(
            LayoutConfig::new(1, 1, 1, usize::MAX, 2, 1),
            Err(LayoutError::SizeOverflow { .. })
        ));
        assert!(matches!(
            LayoutConfig::new(usize::MAX, 32, 2, 16, 1024, 2),
            Err(LayoutError::SizeOverflow { .. })
        ));
        assert!(matches!(
            LayoutConfig::new(1, usize::MAX / 2, 2, 1, 1, 8),
            Err(LayoutError::SizeOverflow { .. })
        ));
        // Padding alone can overflow the total.
        let big = LayoutConfig::new(1 << 20, 1, 1, 1, 1, 1).unwrap();
        assert!(matches!(
            big.with_alignment(1 << 63),
            Err(LayoutError::SizeOverflow { .. })
        ));
        assert!(matches!(
            ok().with_num_blocks(usize::MAX),
            Err(LayoutError::SizeOverflow { .. })
        ));
    }

    #[test]
    fn shape_mismatch_names_the_field() {
        let a = ok();
        let b = LayoutConfig::new(4, 32, 2, 16, 8 * 64, 2).unwrap();
        assert_eq!(
            a.same_block_shape(&b),
            Err(LayoutError::ShapeMismatch {
                field: "inner_dim",
                src: 1024,
                dst: 512
            })
        );
        let more_blocks = a.with_num_blocks(100).unwrap().with_alignment(64).unwrap();
        assert_eq!(a.same_block_shape(&more_blocks), Ok(()));
    }

    #[test]
    fn serde_validates() {
        let c = ok().with_alignment(256).unwrap();
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<LayoutConfig>(&json).unwrap(), c);
        let bad = json.replace("\"outer_dim\":2", "\"outer_dim\":3");
        assert!(serde_json::from_str::<LayoutConfig>(&bad).is_err());
        let bad = json.replace("\"alignment\":256", "\"alignment\":255");
        assert!(serde_json::from_str::<LayoutConfig>(&bad).is_err());
    }
}
