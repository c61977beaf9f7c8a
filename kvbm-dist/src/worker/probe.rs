//! Test patterns in G1, written and checked by the worker that owns it
//! (feature `probe`: a test hook, absent from a release build).
//!
//! With no model running, benches and tests play the engine: they write a
//! block's bytes before it is offloaded and check them after it is
//! onboarded. G1 lives in the worker process (device memory on a GPU), so
//! the worker does that on the leader's behalf through a [`BlockProbe`]
//! its embedder provides; the pattern depends on the seed (the block's
//! sequence hash) and the rank, so every rank's slice is checked as its
//! own.

use kvbm_transfer::PhysicalLayout;

use crate::verify::for_each_chunk;

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

/// Byte `i` of the pattern of `seed` (a rank's seed).
pub(crate) fn pattern_byte(seed: u64, i: u64) -> u8 {
    let x = seed ^ i.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (x ^ (x >> 29) ^ (x >> 47)) as u8
}

/// A [`BlockProbe`] for G1 in host memory: the pattern's byte `i` of a
/// block (counting its chunks in layer, K/V order) mixes the rank's seed
/// with `i`.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostProbe;

/// Calls `f(chunk bytes, index of its first byte)` for every chunk of
/// `block` of a host G1.
fn for_each_host_chunk(
    g1: &PhysicalLayout,
    block: usize,
    mut f: impl FnMut(&mut [u8], u64),
) -> Result<(), String> {
    if !g1.kind().is_host() {
        return Err(format!(
            "the host probe cannot reach {:?} memory",
            g1.kind()
        ));
    }
    for_each_chunk(g1, block, |chunk, start| {
        let region = &g1.regions()[chunk.region];
        let addr = region
            .addr()
            .ok_or_else(|| "a host region without an address".to_string())?;
        // SAFETY: host memory (checked above) that the region's owner
        // keeps alive; the layout proved the chunk lies inside its
        // region; the leader probes a block only while no transfer
        // touches it, and this thread is the only one probing.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut((addr + chunk.offset) as *mut u8, chunk.len as usize)
        };
        f(bytes, start);
        Ok(())
    })
}

impl BlockProbe for HostProbe {
    fn fill(&self, g1: &PhysicalLayout, block: usize, seed: u64, rank: u32) -> Result<(), String> {
        let seed = rank_seed(seed, rank);
        for_each_host_chunk(g1, block, |bytes, start| {
            for (j, b) in bytes.iter_mut().enumerate() {
                *b = pattern_byte(seed, start + j as u64);
            }
        })
    }

    fn check(
        &self,
        g1: &PhysicalLayout,
        block: usize,
        seed: u64,
        rank: u32,
    ) -> Result<bool, String> {
        let seed = rank_seed(seed, rank);
        let mut ok = true;
        for_each_host_chunk(g1, block, |bytes, start| {
            ok &= bytes
                .iter()
                .enumerate()
                .all(|(j, &b)| b == pattern_byte(seed, start + j as u64));
        })?;
        Ok(ok)
    }
}
