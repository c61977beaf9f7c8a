//! KV shapes: what one token of KV cache weighs for a given model.
//!
//! Block sizes, and so every GB/s figure, follow from the model, so the
//! shape is named once (a preset or explicit dimensions) and every layout
//! is built from it — bytes are always counted from the layout, never by
//! hand.

use kvbm_layout::LayoutConfig;
use serde::Serialize;

use super::error::{BenchError, Result};

/// Alignment of every block and chunk the benchmarks lay out: disk tiers
/// use `O_DIRECT`, which wants 4 KiB.
pub const BENCH_ALIGNMENT: u64 = 4096;

/// The per-token KV shape of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KvModel {
    /// Preset name, or `custom` for explicit dimensions.
    pub name: &'static str,
    /// Transformer layers.
    pub num_layers: usize,
    /// 2 for separate K and V, 1 for a latent cache (MLA).
    pub outer_dim: usize,
    /// Elements per token per plane (KV heads × head dim, or the latent
    /// width for MLA).
    pub inner_dim: usize,
    /// Bytes per element.
    pub dtype_bytes: usize,
}

/// The presets `--model` knows.
pub const MODEL_PRESETS: &[KvModel] = &[
    // 8 KV heads × 128, bf16.
    KvModel {
        name: "llama-3.1-8b",
        num_layers: 32,
        outer_dim: 2,
        inner_dim: 1024,
        dtype_bytes: 2,
    },
    // 8 KV heads × 128, bf16.
    KvModel {
        name: "llama-3.1-70b",
        num_layers: 80,
        outer_dim: 2,
        inner_dim: 1024,
        dtype_bytes: 2,
    },
    // DeepSeek-V3/R1: one latent plane of 512 + 64 rope dims, bf16.
    KvModel {
        name: "deepseek-mla",
        num_layers: 61,
        outer_dim: 1,
        inner_dim: 576,
        dtype_bytes: 2,
    },
    // A toy shape for tests and smoke runs.
    KvModel {
        name: "tiny",
        num_layers: 4,
        outer_dim: 2,
        inner_dim: 256,
        dtype_bytes: 2,
    },
];

impl KvModel {
    /// A preset by name, or explicit dimensions `LxOxIxD` (layers, outer
    /// dim, inner dim, dtype bytes).
    pub fn parse(spec: &str) -> Result<KvModel> {
        if let Some(m) = MODEL_PRESETS.iter().find(|m| m.name == spec) {
            return Ok(*m);
        }
        let unknown = || BenchError::UnknownModel {
            name: spec.to_string(),
            known: MODEL_PRESETS
                .iter()
                .map(|m| m.name)
                .collect::<Vec<_>>()
                .join(", "),
        };
        let dims: Vec<usize> = spec
            .split('x')
            .map(|d| d.trim().parse::<usize>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| unknown())?;
        let [num_layers, outer_dim, inner_dim, dtype_bytes] = dims[..] else {
            return Err(unknown());
        };
        let model = KvModel {
            name: "custom",
            num_layers,
            outer_dim,
            inner_dim,
            dtype_bytes,
        };
        // Validate the shape the same way every layout will.
        model.layout_config(1, 1)?;
        Ok(model)
    }

    /// KV bytes one token occupies over all layers and planes.
    pub fn bytes_per_token(&self) -> u64 {
        (self.num_layers * self.outer_dim * self.inner_dim * self.dtype_bytes) as u64
    }

    /// The layout config of `num_blocks` blocks of `page_size` tokens,
    /// padded to [`BENCH_ALIGNMENT`].
    pub fn layout_config(&self, num_blocks: usize, page_size: usize) -> Result<LayoutConfig> {
        Ok(LayoutConfig::new(
            num_blocks,
            self.num_layers,
            self.outer_dim,
            page_size,
            self.inner_dim,
            self.dtype_bytes,
        )?
        .with_alignment(BENCH_ALIGNMENT)?)
    }

    /// Tokens stored per block when a trace's blocks of `block_tokens`
    /// tokens are shrunk by `scale` so the workload fits the machine.
    ///
    /// Hit rates and tokens avoided are counted in the trace's tokens; the
    /// bytes moved are those of the shrunk blocks.
    pub fn scaled_page(&self, block_tokens: u32, scale: u32) -> Result<usize> {
        if scale == 0 || !block_tokens.is_multiple_of(scale) {
            return Err(BenchError::Config(format!(
                "--scale {scale} must divide the trace's {block_tokens}-token blocks"
            )));
        }
        Ok((block_tokens / scale) as usize)
    }
}

/// Checks that chunks of `page_size` tokens can live on an `O_DIRECT`
/// disk tier (every chunk a multiple of 4 KiB).
pub fn check_disk_alignment(model: &KvModel, page_size: usize) -> Result<()> {
    let chunk = (page_size * model.inner_dim * model.dtype_bytes) as u64;
    if !chunk.is_multiple_of(BENCH_ALIGNMENT) {
        return Err(BenchError::Config(format!(
            "a chunk of {page_size} tokens of {} is {chunk} bytes, not a multiple of {BENCH_ALIGNMENT}: O_DIRECT disk tiers need aligned chunks; choose more tokens per block (a smaller --scale)",
            model.name
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_explicit_dimensions_parse() {
        assert_eq!(
            KvModel::parse("llama-3.1-8b").unwrap().bytes_per_token(),
            131_072
        );
        let m = KvModel::parse("2x1x64x4").unwrap();
        assert_eq!(
            (m.num_layers, m.outer_dim, m.inner_dim, m.dtype_bytes),
            (2, 1, 64, 4)
        );
    }

    #[test]
    fn unknown_model_lists_presets() {
        let e = KvModel::parse("gpt-5").unwrap_err().to_string();
        assert!(
            e.contains("llama-3.1-70b") && e.contains("deepseek-mla"),
            "{e}"
        );
        assert!(
            KvModel::parse("2x3x64x2").is_err(),
            "outer dim 3 is refused"
        );
        assert!(KvModel::parse("2x2x64").is_err());
    }

    #[test]
    fn scale_must_divide_the_block() {
        let m = MODEL_PRESETS[0];
        assert_eq!(m.scaled_page(512, 64).unwrap(), 8);
        assert!(m.scaled_page(512, 3).is_err());
        assert!(m.scaled_page(512, 0).is_err());
    }
}
