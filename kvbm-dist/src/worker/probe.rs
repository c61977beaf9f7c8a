//! Test patterns in G1, written and checked by the worker that owns it.
//!
//! With no model running, benches and tests play the engine: they write a
//! block's bytes before it is offloaded and check them after it is
//! onboarded. G1 lives in the worker process (device memory on a GPU), so
//! the worker does that on the leader's behalf through a [`BlockProbe`]
//! its embedder provides; the pattern depends on the seed (the block's
//! sequence hash) and the rank, so every rank's slice is checked as its
//! own.

use kvbm_layout::Chunk;
use kvbm_transfer::PhysicalLayout;

/// Writes and checks per-block patterns in a worker's G1.
pub trait BlockProbe: Send {
    /// Writes the pattern of `(seed, rank)` into G1 block `block`.
    fn fill(&self, g1: &PhysicalLayout, block: usize, seed: u64, rank: u32) -> Result<(), String>;

    /// True when G1 block `block` holds the pattern of `(seed, rank)`.
    fn check(
        &self,
        g1: &PhysicalLayout,
        block: usize,
        seed: u64,
        rank: u32,
    ) -> Result<bool, String>;
}

/// The seed of a rank's slice: every rank's bytes differ.
pub fn rank_seed(seed: u64, rank: u32) -> u64 {
    seed ^ (u64::from(rank) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Calls `f(chunk, index of its first byte in the block)` for every chunk
/// of `block`, in layer, K/V order: the walk every probe's pattern follows.
pub(crate) fn for_each_chunk(
    g1: &PhysicalLayout,
    block: usize,
    mut f: impl FnMut(Chunk, u64) -> Result<(), String>,
) -> Result<(), String> {
    let layout = g1.layout();
    let c = *layout.config();
    let mut i = 0u64;
    for layer in 0..c.num_layers() {
        for outer in 0..c.outer_dim() {
            let chunk = layout
                .chunk(block, layer, outer)
                .map_err(|e| e.to_string())?;
            let len = chunk.len;
            f(chunk, i)?;
            i += len;
        }
    }
    Ok(())
}
