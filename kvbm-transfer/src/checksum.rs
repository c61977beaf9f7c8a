//! The block checksum: one 64-bit sum of a KV block's bytes that host code
//! and the GPU compute alike, so a block summed on the GPU as it leaves G1
//! can be checked on the host as it leaves G2, and the other way round.
//!
//! A block is a list of chunks (one per layer and K/V, in that order; the
//! layout decides where each chunk lives, not what it sums to). Chunk `c`'s
//! bytes are read as little-endian 64-bit words `w[j]`, the last one
//! padded with zeros, and each word adds one term to a wrapping sum:
//!
//! ```text
//! key(c, j) = (c << 40 | j) * K1 + K2            (wrapping)
//! x         = w[j] ^ key(c, j)
//! term      = lo32(x) * hi32(x) + swap32(w[j])   (wrapping)
//! ```
//!
//! The block's checksum is [`finish`] of that sum and the block's length.
//! Every term is keyed by its word's position, so moved, zeroed or changed
//! words change the sum; terms add, so any number of threads (a GPU's
//! warps) can sum parts of a block in any order and get the same value.
//! It detects accidents (stale, torn or misplaced bytes), not an adversary.

/// Multiplier of a word's position in its key.
pub const KEY_MUL: u64 = 0x9E37_79B9_7F4A_7C15;
/// Offset of every key.
pub const KEY_ADD: u64 = 0x1656_67B1_9E37_79F9;
/// Bits of a word's index within its chunk in a key (chunks up to 8 TiB).
pub const CHUNK_SHIFT: u32 = 40;

/// The key of word `word` of chunk `chunk`.
#[inline]
fn key(chunk: u32, word: u64) -> u64 {
    ((u64::from(chunk) << CHUNK_SHIFT) | word)
        .wrapping_mul(KEY_MUL)
        .wrapping_add(KEY_ADD)
}

/// The term of word `w` under key `k`.
#[inline]
fn term(w: u64, k: u64) -> u64 {
    let x = w ^ k;
    (x & 0xFFFF_FFFF)
        .wrapping_mul(x >> 32)
        .wrapping_add(w.rotate_left(32))
}

/// The little-endian word at the start of `b` (8 bytes or more).
#[inline]
fn word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    u64::from_le_bytes(w)
}

/// The sum of the terms of chunk `chunk`'s bytes (before [`finish`]).
pub fn chunk_terms(chunk: u32, bytes: &[u8]) -> u64 {
    let quads = bytes.len() / 32 * 32;
    let whole = bytes.len() / 8 * 8;
    let k = key(chunk, 0);
    let (mut sum, mut k) = quad_terms(k, &bytes[..quads]);
    for w in bytes[quads..whole].chunks_exact(8) {
        sum = sum.wrapping_add(term(word(w), k));
        k = k.wrapping_add(KEY_MUL);
    }
    let tail = &bytes[whole..];
    if !tail.is_empty() {
        let mut last = [0u8; 8];
        last[..tail.len()].copy_from_slice(tail);
        sum = sum.wrapping_add(term(u64::from_le_bytes(last), k));
    }
    sum
}

/// The terms of `quads` (a multiple of 32 bytes) whose first word has key
/// `k`, and the key of the word after them: with AVX2 where the CPU has
/// it, else four scalar lanes.
fn quad_terms(k: u64, quads: &[u8]) -> (u64, u64) {
    let next = k.wrapping_add(KEY_MUL.wrapping_mul((quads.len() / 8) as u64));
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return (unsafe { avx2::quad_terms(k, quads) }, next);
    }
    let mut k = k;
    let mut acc = [0u64; 4];
    for q in quads.chunks_exact(32) {
        for (lane, a) in acc.iter_mut().enumerate() {
            let kl = k.wrapping_add(KEY_MUL.wrapping_mul(lane as u64));
            *a = a.wrapping_add(term(word(&q[lane * 8..]), kl));
        }
        k = k.wrapping_add(KEY_MUL.wrapping_mul(4));
    }
    (acc.iter().fold(0u64, |s, a| s.wrapping_add(*a)), next)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::KEY_MUL;

    /// The terms of `quads` (a multiple of 32 bytes, four words a load)
    /// whose first word has key `k`.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quad_terms(k: u64, quads: &[u8]) -> u64 {
        let lane = |i: u64| k.wrapping_add(KEY_MUL.wrapping_mul(i)) as i64;
        let step = KEY_MUL.wrapping_mul(4) as i64;
        let mut keys = _mm256_set_epi64x(lane(3), lane(2), lane(1), lane(0));
        let step = _mm256_set1_epi64x(step);
        let mut acc = _mm256_setzero_si256();
        for q in quads.chunks_exact(32) {
            // SAFETY: `q` holds 32 bytes; the load takes no alignment.
            let w = unsafe { _mm256_loadu_si256(q.as_ptr().cast::<__m256i>()) };
            let x = _mm256_xor_si256(w, keys);
            // lo32(x) * hi32(x) in each 64-bit lane.
            let product = _mm256_mul_epu32(x, _mm256_srli_epi64::<32>(x));
            // The word with its halves swapped.
            let swapped = _mm256_shuffle_epi32::<0b10_11_00_01>(w);
            acc = _mm256_add_epi64(acc, _mm256_add_epi64(product, swapped));
            keys = _mm256_add_epi64(keys, step);
        }
        let mut lanes = [0u64; 4];
        // SAFETY: `lanes` holds 32 bytes; the store takes no alignment.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), acc) };
        lanes.iter().fold(0u64, |s, a| s.wrapping_add(*a))
    }
}

/// The checksum of a block whose terms add up to `terms` and whose chunks
/// hold `len` bytes in all.
pub fn finish(terms: u64, len: u64) -> u64 {
    let mut z = terms ^ len.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A block's checksum taken chunk by chunk, in the block's chunk order.
#[derive(Debug, Clone, Default)]
pub struct BlockChecksum {
    terms: u64,
    chunks: u32,
    len: u64,
}

impl BlockChecksum {
    /// A block with no chunks yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the block's next chunk.
    pub fn update(&mut self, chunk: &[u8]) {
        self.terms = self.terms.wrapping_add(chunk_terms(self.chunks, chunk));
        self.chunks = self.chunks.wrapping_add(1);
        self.len = self.len.wrapping_add(chunk.len() as u64);
    }

    /// The checksum of the chunks added so far.
    pub fn digest(&self) -> u64 {
        finish(self.terms, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition, one word at a time.
    fn reference(chunk: u32, bytes: &[u8]) -> u64 {
        let mut sum = 0u64;
        for (j, b) in bytes.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..b.len()].copy_from_slice(b);
            sum = sum.wrapping_add(term(u64::from_le_bytes(w), key(chunk, j as u64)));
        }
        sum
    }

    fn digest(chunks: &[Vec<u8>]) -> u64 {
        let mut c = BlockChecksum::new();
        for chunk in chunks {
            c.update(chunk);
        }
        c.digest()
    }

    proptest! {
        #[test]
        fn the_fast_loop_is_the_definition(
            chunk in 0u32..1000,
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            prop_assert_eq!(chunk_terms(chunk, &bytes), reference(chunk, &bytes));
        }

        #[test]
        fn any_changed_byte_changes_the_sum(
            bytes in proptest::collection::vec(any::<u8>(), 1..600),
            at in any::<prop::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let mut changed = bytes.clone();
            changed[at.index(bytes.len())] ^= flip;
            prop_assert_ne!(digest(&[bytes]), digest(&[changed]));
        }

        #[test]
        fn words_that_trade_places_change_the_sum(
            bytes in proptest::collection::vec(any::<u8>(), 16..600),
            a in any::<prop::sample::Index>(),
            b in any::<prop::sample::Index>(),
        ) {
            let words = bytes.len() / 8;
            let (a, b) = (a.index(words), b.index(words));
            prop_assume!(bytes[a * 8..a * 8 + 8] != bytes[b * 8..b * 8 + 8]);
            let mut swapped = bytes.clone();
            for i in 0..8 {
                swapped.swap(a * 8 + i, b * 8 + i);
            }
            prop_assert_ne!(digest(&[bytes]), digest(&[swapped]));
        }

        #[test]
        fn chunks_that_trade_places_change_the_sum(
            x in proptest::collection::vec(any::<u8>(), 8..100),
            y in proptest::collection::vec(any::<u8>(), 8..100),
        ) {
            prop_assume!(x != y);
            prop_assert_ne!(digest(&[x.clone(), y.clone()]), digest(&[y, x]));
        }
    }

    #[test]
    fn a_zeroed_block_does_not_pass_for_its_bytes() {
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let zeros = vec![0u8; bytes.len()];
        assert_ne!(digest(&[bytes]), digest(std::slice::from_ref(&zeros)));
        // Nor does an empty one, or zeros of another length.
        assert_ne!(
            digest(std::slice::from_ref(&zeros)),
            digest(&[vec![0u8; 4088]])
        );
        assert_ne!(digest(&[zeros]), digest(&[]));
    }
}
