//! Sequence hashes: the names of blocks.
//!
//! A block is named by a *chained* hash over its whole token prefix, so two
//! blocks share a [`SequenceHash`] only when every token before and in them
//! (and the salt) is equal. Pools and the tier engine key everything by it.
//!
//! The hash function is not ours to choose: a KV-aware router and the
//! engine's own prefix cache must compute the same names as we do, or a
//! routed request finds nothing. So the scheme is pluggable behind
//! [`SequenceHasher`], and each scheme reproduces an existing wire format
//! bit for bit:
//!
//! - [`DynamoXxh3`] (the default): Dynamo's KV router and `dynamo-tokens`.
//! - [`VllmSha256`]: vLLM's prefix cache with `sha256_cbor`.
//!
//! A hasher is built once per request from its salt (LoRA adapter, cache
//! salt, multimodal placeholders) and then hashes each complete block given
//! its parent's digest. Salt enters every scheme's first block and, through
//! the chain, every block after it, so sequences with different salts never
//! share a block.

mod cbor;
mod vllm;
mod xxh3;

pub use cbor::{CborSink, CborValue, encode_canonical};
pub use vllm::{VllmBlockHash, VllmMmFeature, VllmSha256, vllm_hash_block, vllm_none_hash};
pub use xxh3::{DynamoXxh3, MmRun};

use crate::tokens::Token;
use std::fmt::Debug;

/// The hash of one block's tokens (and salt), independent of its prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// The chained hash naming a block by its whole token prefix; the key of
/// every registry, match and KV event. Values are uniformly distributed, so
/// maps keyed by it may use an identity hasher.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);

/// Hasher of [`SequenceHash`] keys for maps and sets: the values are
/// uniformly distributed already, so one multiply spreads them over the
/// table, where SipHash would cost more than the rest of a lookup.
#[derive(Clone, Copy, Default)]
pub struct SequenceHasherFn(u64);

/// Odd multiplier (2^64 / golden ratio) of [`SequenceHasherFn`].
const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;

impl std::hash::Hasher for SequenceHasherFn {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(SPREAD);
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0 ^ x ^ (x >> 32)).wrapping_mul(SPREAD);
    }
}

/// The `BuildHasher` of maps and sets keyed by [`SequenceHash`].
pub type BuildSequenceHasher = std::hash::BuildHasherDefault<SequenceHasherFn>;

/// Errors in the salt given to a hash scheme.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    /// A multimodal placeholder run or feature covers no token.
    #[error("multimodal run at offset {offset} has length 0")]
    EmptyRun {
        /// Where the run starts.
        offset: usize,
    },
    /// A multimodal run's end does not fit in `usize`.
    #[error("multimodal run at offset {offset} with length {length} overflows")]
    RunOverflow {
        /// Where the run starts.
        offset: usize,
        /// Its length.
        length: usize,
    },
    /// Two multimodal runs cover the same token.
    #[error("multimodal runs overlap at token {position}")]
    OverlappingRuns {
        /// The first token covered twice.
        position: usize,
    },
}

/// A scheme's full-width digest of a block's prefix, reducible to the 64-bit
/// pool key.
pub trait SequenceDigest: Copy + Eq + std::hash::Hash + Debug + Send + Sync + 'static {
    /// The pool key for this digest.
    fn sequence_hash(&self) -> SequenceHash;
}

impl SequenceDigest for SequenceHash {
    fn sequence_hash(&self) -> SequenceHash {
        *self
    }
}

/// The two hashes of one complete block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HashedBlock<D> {
    /// The hash of the block's tokens and salt alone.
    pub block_hash: BlockHash,
    /// The chained digest of the whole prefix up to and including the block.
    pub digest: D,
}

/// A sequence-hash scheme, bound to one request's salt.
///
/// Implementations must be pure: the result depends only on the salt given
/// at construction and the arguments, so that the same prefix always gets
/// the same name, in any process.
pub trait SequenceHasher: Clone + Debug + Send + Sync {
    /// The scheme's full-width chained digest.
    type Digest: SequenceDigest;

    /// Hashes the complete block at `position` (its index in the sequence;
    /// it covers tokens `position * tokens.len() ..` of the request) whose
    /// previous block has digest `parent` (`None` for the first block).
    fn hash_block(
        &self,
        position: usize,
        parent: Option<&Self::Digest>,
        tokens: &[Token],
    ) -> HashedBlock<Self::Digest>;
}

/// Validates multimodal runs given as `(offset, length)`: each non-empty,
/// ends in range, none overlapping. Returns them sorted by offset.
fn validate_runs<T: Clone>(
    mut runs: Vec<T>,
    span: impl Fn(&T) -> (usize, usize),
) -> Result<Vec<T>, HashError> {
    runs.sort_by_key(|r| span(r).0);
    let mut prev_end = 0usize;
    for (i, run) in runs.iter().enumerate() {
        let (offset, length) = span(run);
        if length == 0 {
            return Err(HashError::EmptyRun { offset });
        }
        let end = offset
            .checked_add(length)
            .ok_or(HashError::RunOverflow { offset, length })?;
        if i > 0 && offset < prev_end {
            return Err(HashError::OverlappingRuns { position: offset });
        }
        prev_end = end;
    }
    Ok(runs)
}
