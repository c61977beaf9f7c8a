//! Layout kinds and the address math: `(block, layer, outer)` → where the
//! chunk lives.
//!
//! Every layout is described the same way underneath: a number of regions
//! (one, or one per layer) and three byte strides, for the block, layer and
//! outer (K/V) indices, within a region. The kinds only fix which index picks
//! the region and the default strides:
//!
//! | kind | regions | chunk offset |
//! |---|---|---|
//! | `FullyContiguous` | 1 | `block*Sb + layer*Sl + outer*So` |
//! | `LayerSeparate(BlockFirst)` | one per layer | `block*Sb + outer*So` |
//! | `LayerSeparate(OuterFirst)` | one per layer | `outer*So + block*Sb` |
//!
//! Keeping the strides explicit (rather than recomputing them from the kind
//! each time) is what lets an engine's tensor with padding between blocks be
//! described exactly, and lets the copy planner treat every pair of layouts
//! with one loop. Constructors prove once that chunks never overlap and stay
//! inside their region, so the hot paths use plain arithmetic.

use serde::{Deserialize, Serialize};

use crate::config::{LayoutConfig, align_up, fits_usize};
use crate::error::{LayoutError, Result};

/// Order of the two indices inside a per-layer region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BlockOrder {
    /// `[block][outer][page*inner]`: one block's K and V sit together
    /// (FlashInfer-style `[num_blocks, 2, ...]`).
    BlockFirst,
    /// `[outer][block][page*inner]`: all K blocks, then all V blocks
    /// (vLLM flash-attention `[2, num_blocks, ...]`).
    OuterFirst,
}

/// How blocks are spread over memory regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LayoutKind {
    /// One region, `[block][layer][outer][page*inner]`: a whole block is one
    /// contiguous range (kvbm's own host and disk tiers).
    FullyContiguous,
    /// One region per layer (an engine's per-layer KV tensors).
    LayerSeparate(BlockOrder),
}

/// Byte strides of the block, layer and outer indices inside a region.
///
/// For `LayerSeparate` layouts the layer picks the region, so `layer` is 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayoutStrides {
    /// Bytes from one block to the next.
    pub block: u64,
    /// Bytes from one layer to the next (0 for `LayerSeparate`).
    pub layer: u64,
    /// Bytes from one outer (K/V) plane to the next.
    pub outer: u64,
}

/// Where one `(block, layer, outer)` chunk lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Chunk {
    /// Region index (0 for `FullyContiguous`, the layer for `LayerSeparate`).
    pub region: usize,
    /// Byte offset of the chunk inside its region.
    pub offset: u64,
    /// Chunk length in bytes (`LayoutConfig::chunk_bytes`).
    pub len: u64,
}

/// A validated layout: a config, a kind and strides whose chunks provably
/// never overlap and stay inside their regions.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    config: LayoutConfig,
    kind: LayoutKind,
    strides: LayoutStrides,
    region_size: u64,
    num_regions: usize,
}

/// The strides a kind uses when nothing else is asked for: chunks packed
/// densely, each block padded to the config's alignment.
fn default_strides(config: &LayoutConfig, kind: LayoutKind) -> Result<LayoutStrides> {
    let chunk = config.chunk_bytes();
    let padded = |bytes: u64| {
        align_up(bytes, config.alignment()).ok_or(LayoutError::SizeOverflow {
            what: "padded block size",
        })
    };
    Ok(match kind {
        LayoutKind::FullyContiguous => LayoutStrides {
            block: padded(config.block_bytes())?,
            layer: chunk * config.outer_dim() as u64,
            outer: chunk,
        },
        LayoutKind::LayerSeparate(BlockOrder::BlockFirst) => LayoutStrides {
            block: padded(chunk * config.outer_dim() as u64)?,
            layer: 0,
            outer: chunk,
        },
        LayoutKind::LayerSeparate(BlockOrder::OuterFirst) => {
            let block = padded(chunk)?;
            let outer =
                block
                    .checked_mul(config.num_blocks() as u64)
                    .ok_or(LayoutError::SizeOverflow {
                        what: "outer plane size",
                    })?;
            LayoutStrides {
                block,
                layer: 0,
                outer,
            }
        }
    })
}

fn invalid(reason: String) -> LayoutError {
    LayoutError::InvalidStrides { reason }
}

/// One index that moves within a region: its name, its extent and its byte
/// stride.
type MovingIndex<'a> = (&'a str, u64, u64);

/// Checks that chunks of `chunk` bytes never overlap under the strides in
/// `dims`, and that `outermost` has the largest stride among the indices
/// that move, as `kind`'s index order says.
fn check_no_overlap(
    kind: LayoutKind,
    dims: &[MovingIndex<'_>],
    outermost: &str,
    chunk: u64,
) -> Result<()> {
    // Non-overlap: visiting the moving indices from the smallest stride
    // up, each stride must clear everything the smaller ones span.
    let mut moving: Vec<MovingIndex<'_>> =
        dims.iter().copied().filter(|&(_, n, _)| n > 1).collect();
    moving.sort_by_key(|&(_, _, s)| s);
    let mut extent = chunk;
    for &(name, n, s) in &moving {
        if s < extent {
            return Err(invalid(format!(
                "the {name} stride {s} is smaller than the {extent} bytes spanned by \
                 everything inside it (chunk {chunk} bytes): chunks would overlap"
            )));
        }
        extent = (n - 1)
            .checked_mul(s)
            .and_then(|v| v.checked_add(extent))
            .ok_or(LayoutError::SizeOverflow {
                what: "region size",
            })?;
    }
    if let Some(&(last, _, _)) = moving.last()
        && moving.iter().any(|&(name, _, _)| name == outermost)
        && last != outermost
    {
        return Err(invalid(format!(
            "{kind:?} needs the {outermost} index outermost (largest stride), but the \
             {last} stride is larger"
        )));
    }
    Ok(())
}

/// The bytes one region spans: every index's full extent, padding included.
/// Errors when the region, or all `num_regions` of them, overflow.
fn region_size(dims: &[MovingIndex<'_>], chunk: u64, num_regions: usize) -> Result<u64> {
    let mut region_size = chunk;
    for &(_, n, s) in dims {
        let span = n.checked_mul(s).ok_or(LayoutError::SizeOverflow {
            what: "region size",
        })?;
        region_size = region_size.max(span);
    }
    fits_usize(region_size, "region size")?;
    region_size
        .checked_mul(num_regions as u64)
        .ok_or(LayoutError::SizeOverflow {
            what: "layout size",
        })?;
    Ok(region_size)
}

impl Layout {
    /// A layout of `kind` with the default strides: chunks packed densely,
    /// every block padded to `config.alignment()`.
    pub fn new(config: LayoutConfig, kind: LayoutKind) -> Result<Layout> {
        let strides = default_strides(&config, kind)?;
        Layout::with_strides(config, kind, strides)
    }

    /// A layout with explicit strides (e.g. an engine tensor with padding
    /// between blocks). Errors when chunks would overlap, when the strides
    /// contradict the kind's index order, or when sizes overflow.
    pub fn with_strides(
        config: LayoutConfig,
        kind: LayoutKind,
        strides: LayoutStrides,
    ) -> Result<Layout> {
        let chunk = config.chunk_bytes();
        let num_regions = match kind {
            LayoutKind::FullyContiguous => 1,
            LayoutKind::LayerSeparate(_) => config.num_layers(),
        };
        if u32::try_from(num_regions).is_err() {
            return Err(LayoutError::TooManyRegions(num_regions));
        }
        let block = ("block", config.num_blocks() as u64, strides.block);
        let layer = ("layer", config.num_layers() as u64, strides.layer);
        let outer = ("outer", config.outer_dim() as u64, strides.outer);
        // The indices that move within one region, and which one must be the
        // outermost (largest stride) for the kind's name to be true.
        let (dims, outermost): (&[(&str, u64, u64)], &str) = match kind {
            LayoutKind::FullyContiguous => (&[block, layer, outer], "block"),
            LayoutKind::LayerSeparate(order) => {
                if strides.layer != 0 {
                    return Err(invalid(format!(
                        "LayerSeparate layouts put each layer in its own region, so the layer \
                         stride must be 0, got {}",
                        strides.layer
                    )));
                }
                match order {
                    BlockOrder::BlockFirst => (&[block, outer], "block"),
                    BlockOrder::OuterFirst => (&[block, outer], "outer"),
                }
            }
        };

        check_no_overlap(kind, dims, outermost, chunk)?;
        let region_size = region_size(dims, chunk, num_regions)?;

        Ok(Layout {
            config,
            kind,
            strides,
            region_size,
            num_regions,
        })
    }

    /// The block shape.
    pub fn config(&self) -> &LayoutConfig {
        &self.config
    }

    /// The layout kind.
    pub fn kind(&self) -> LayoutKind {
        self.kind
    }

    /// The byte strides inside a region.
    pub fn strides(&self) -> LayoutStrides {
        self.strides
    }

    /// Number of memory regions (1, or one per layer).
    pub fn num_regions(&self) -> usize {
        self.num_regions
    }

    /// Bytes of `region`, padding included; every region has the same size.
    pub fn region_size(&self, region: usize) -> Result<u64> {
        if region >= self.num_regions {
            return Err(LayoutError::RegionOutOfRange {
                index: region,
                count: self.num_regions,
            });
        }
        Ok(self.region_size)
    }

    /// Bytes of every region (they are all the same size).
    pub fn uniform_region_size(&self) -> u64 {
        self.region_size
    }

    /// Bytes of all regions together, padding included.
    pub fn total_bytes(&self) -> u64 {
        // Cannot overflow: checked in `with_strides`.
        self.region_size * self.num_regions as u64
    }

    /// Where chunk `(block, layer, outer)` lives; out-of-range indices are
    /// errors.
    pub fn chunk(&self, block: usize, layer: usize, outer: usize) -> Result<Chunk> {
        let c = &self.config;
        if block >= c.num_blocks() {
            return Err(LayoutError::BlockOutOfRange {
                index: block,
                count: c.num_blocks(),
            });
        }
        if layer >= c.num_layers() {
            return Err(LayoutError::LayerOutOfRange {
                index: layer,
                count: c.num_layers(),
            });
        }
        if outer >= c.outer_dim() {
            return Err(LayoutError::OuterOutOfRange {
                index: outer,
                count: c.outer_dim(),
            });
        }
        let (region, offset) = self.locate(block, layer, outer);
        Ok(Chunk {
            region: region as usize,
            offset,
            len: c.chunk_bytes(),
        })
    }

    /// Region and offset of an in-range chunk. Callers guarantee the indices
    /// are in range; then nothing overflows (`offset < region_size`).
    #[inline(always)]
    fn locate(&self, block: usize, layer: usize, outer: usize) -> (u32, u64) {
        let s = &self.strides;
        let base = block as u64 * s.block + outer as u64 * s.outer;
        match self.kind {
            LayoutKind::FullyContiguous => (0, base + layer as u64 * s.layer),
            // `layer < num_regions`, which fits u32 (checked at construction).
            LayoutKind::LayerSeparate(_) => (layer as u32, base),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FC: LayoutKind = LayoutKind::FullyContiguous;
    const BF: LayoutKind = LayoutKind::LayerSeparate(BlockOrder::BlockFirst);
    const OF: LayoutKind = LayoutKind::LayerSeparate(BlockOrder::OuterFirst);

    fn cfg() -> LayoutConfig {
        // chunk = 4 tokens * 8 elems * 2 bytes = 64 bytes; block = 3*2*64.
        LayoutConfig::new(5, 3, 2, 4, 8, 2).unwrap()
    }

    #[test]
    fn fully_contiguous_math() {
        let l = Layout::new(cfg(), FC).unwrap();
        assert_eq!(l.num_regions(), 1);
        assert_eq!(l.region_size(0).unwrap(), 5 * 384);
        let c = l.chunk(2, 1, 1).unwrap();
        assert_eq!(
            c,
            Chunk {
                region: 0,
                offset: 2 * 384 + 128 + 64,
                len: 64
            }
        );
    }

    #[test]
    fn block_first_math() {
        let l = Layout::new(cfg(), BF).unwrap();
        assert_eq!(l.num_regions(), 3);
        assert_eq!(l.region_size(2).unwrap(), 5 * 128);
        assert_eq!(
            l.chunk(3, 2, 1).unwrap(),
            Chunk {
                region: 2,
                offset: 3 * 128 + 64,
                len: 64
            }
        );
    }

    #[test]
    fn outer_first_math() {
        let l = Layout::new(cfg(), OF).unwrap();
        assert_eq!(l.region_size(0).unwrap(), 2 * 5 * 64);
        assert_eq!(
            l.chunk(3, 1, 1).unwrap(),
            Chunk {
                region: 1,
                offset: 5 * 64 + 3 * 64,
                len: 64
            }
        );
    }

    #[test]
    fn alignment_pads_each_block() {
        let c = cfg().with_alignment(512).unwrap();
        let fc = Layout::new(c, FC).unwrap();
        assert_eq!(fc.strides().block, 512);
        assert_eq!(fc.region_size(0).unwrap(), 5 * 512);
        let bf = Layout::new(c, BF).unwrap();
        assert_eq!(bf.strides().block, 512);
        let of = Layout::new(c, OF).unwrap();
        assert_eq!(of.strides().block, 512);
        assert_eq!(of.strides().outer, 5 * 512);
        assert_eq!(of.chunk(1, 0, 1).unwrap().offset, 5 * 512 + 512);
    }

    #[test]
    fn out_of_range_indices_are_errors() {
        let l = Layout::new(cfg(), BF).unwrap();
        assert_eq!(
            l.chunk(5, 0, 0),
            Err(LayoutError::BlockOutOfRange { index: 5, count: 5 })
        );
        assert_eq!(
            l.chunk(0, 3, 0),
            Err(LayoutError::LayerOutOfRange { index: 3, count: 3 })
        );
        assert_eq!(
            l.chunk(0, 0, 2),
            Err(LayoutError::OuterOutOfRange { index: 2, count: 2 })
        );
        assert_eq!(
            l.region_size(3),
            Err(LayoutError::RegionOutOfRange { index: 3, count: 3 })
        );
    }

    #[test]
    fn padded_strides_are_accepted() {
        let s = LayoutStrides {
            block: 200,
            layer: 0,
            outer: 64,
        };
        let l = Layout::with_strides(cfg(), BF, s).unwrap();
        assert_eq!(l.chunk(4, 0, 1).unwrap().offset, 800 + 64);
        assert_eq!(l.region_size(0).unwrap(), 1000);
    }

    #[test]
    fn overlapping_strides_are_rejected() {
        let s = LayoutStrides {
            block: 100,
            layer: 0,
            outer: 64,
        };
        let err = Layout::with_strides(cfg(), BF, s).unwrap_err();
        assert!(matches!(err, LayoutError::InvalidStrides { .. }), "{err}");
        let s = LayoutStrides {
            block: 384,
            layer: 64,
            outer: 64,
        };
        assert!(Layout::with_strides(cfg(), FC, s).is_err());
        let s = LayoutStrides {
            block: 0,
            layer: 0,
            outer: 64,
        };
        assert!(Layout::with_strides(cfg(), BF, s).is_err());
    }

    #[test]
    fn strides_must_match_the_kind() {
        // Outer-first strides labelled block-first.
        let s = LayoutStrides {
            block: 64,
            layer: 0,
            outer: 320,
        };
        assert!(Layout::with_strides(cfg(), OF, s).is_ok());
        let err = Layout::with_strides(cfg(), BF, s).unwrap_err();
        assert!(err.to_string().contains("block index outermost"), "{err}");
        // A layer stride in a per-layer layout.
        let s = LayoutStrides {
            block: 128,
            layer: 640,
            outer: 64,
        };
        assert!(Layout::with_strides(cfg(), BF, s).is_err());
        // Fully contiguous with the layer outermost.
        let s = LayoutStrides {
            block: 128,
            layer: 640,
            outer: 64,
        };
        assert!(Layout::with_strides(cfg(), FC, s).is_err());
    }

    #[test]
    fn too_many_regions() {
        if usize::BITS > 32 {
            let c = LayoutConfig::new(1, (u32::MAX as usize) + 1, 1, 1, 1, 1).unwrap();
            assert_eq!(
                Layout::new(c, BF),
                Err(LayoutError::TooManyRegions(c.num_layers()))
            );
        }
    }
}
