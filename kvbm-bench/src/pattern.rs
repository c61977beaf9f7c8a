//! Block contents as a function of the block's sequence hash.
//!
//! Every chunk `(layer, plane)` of a block named `hash` holds 64-bit words
//! drawn from a SplitMix64 stream seeded by `(hash, layer, plane)`. A block
//! that comes back from any tier can then be checked without keeping a
//! copy: a misplaced chunk, a block from another request, a torn or stale
//! write all change the words.

/// The seed of one chunk's stream.
fn seed(hash: u64, layer: usize, outer: usize) -> u64 {
    mix(hash ^ mix(((layer as u64) << 8) | outer as u64 | 0x6b76_626d_0000_0000))
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The `i`-th word of a chunk's stream: cheap enough to write and check at
/// memory bandwidth, and different for every word, chunk and block.
fn word(seed: u64, i: usize) -> u64 {
    mix(seed.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
}

/// Fills `chunk` with the bytes of `(hash, layer, outer)`.
pub fn fill_chunk(chunk: &mut [u8], hash: u64, layer: usize, outer: usize) {
    let s = seed(hash, layer, outer);
    let full_words = chunk.len() / 8;
    let mut words = chunk.chunks_exact_mut(8);
    for (i, w) in words.by_ref().enumerate() {
        w.copy_from_slice(&word(s, i).to_le_bytes());
    }
    let tail = words.into_remainder();
    let last = word(s, full_words).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// The offset of the first byte of `chunk` that differs from what
/// [`fill_chunk`] writes for `(hash, layer, outer)`, or `None` when it all
/// matches.
pub fn check_chunk(chunk: &[u8], hash: u64, layer: usize, outer: usize) -> Option<usize> {
    let s = seed(hash, layer, outer);
    let mut words = chunk.chunks_exact(8);
    for (i, w) in words.by_ref().enumerate() {
        let want = word(s, i).to_le_bytes();
        if w != want {
            let j = w.iter().zip(want).position(|(a, b)| *a != b).unwrap_or(0);
            return Some(i * 8 + j);
        }
    }
    let tail = words.remainder();
    let last = word(s, chunk.len() / 8).to_le_bytes();
    tail.iter()
        .zip(last)
        .position(|(a, b)| *a != b)
        .map(|j| chunk.len() - tail.len() + j)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn filled_chunks_check_and_any_flip_is_found(
            len in 1usize..300, hash: u64, layer in 0usize..100, outer in 0usize..2,
            flip in any::<prop::sample::Index>(), bit in 0u8..8,
        ) {
            let mut c = vec![0u8; len];
            fill_chunk(&mut c, hash, layer, outer);
            prop_assert_eq!(check_chunk(&c, hash, layer, outer), None);
            let at = flip.index(len);
            c[at] ^= 1 << bit;
            prop_assert_eq!(check_chunk(&c, hash, layer, outer), Some(at));
        }

        #[test]
        fn other_blocks_and_chunks_differ(hash: u64, other: u64, layer in 0usize..100) {
            prop_assume!(hash != other);
            let mut c = vec![0u8; 64];
            fill_chunk(&mut c, hash, layer, 0);
            prop_assert!(check_chunk(&c, other, layer, 0).is_some());
            prop_assert!(check_chunk(&c, hash, layer + 1, 0).is_some());
            prop_assert!(check_chunk(&c, hash, layer, 1).is_some());
        }
    }
}
