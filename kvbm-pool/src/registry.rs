//! The registry: sequence hash → block id.
//!
//! Sequence hashes are already uniformly distributed 64-bit values, so the
//! map does not hash them again with SipHash; one multiplication (Fibonacci
//! hashing) spreads any structured test values over the table's high bits,
//! which the table uses for its control bytes.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use kvbm_block::SequenceHash;

/// Hashes a `u64` key with one multiplication.
#[derive(Default, Clone, Copy)]
pub(crate) struct SpreadHasher(u64);

impl Hasher for SpreadHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The registry map.
pub(crate) type Registry = HashMap<SequenceHash, u32, BuildHasherDefault<SpreadHasher>>;

/// An empty registry sized for `capacity` blocks (it never grows after).
pub(crate) fn new_registry(capacity: usize) -> Registry {
    Registry::with_capacity_and_hasher(capacity, BuildHasherDefault::default())
}
