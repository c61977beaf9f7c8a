//! The dynamo-xxh3 scheme: the wire format of Dynamo's KV router.
//!
//! - salt hash = xxh3-64 of the salt bytes, seed 0 (computed once per request);
//! - block hash = xxh3-64 of the block's tokens as little-endian `u32`s,
//!   seeded with the salt hash;
//! - sequence hash of the first block = its block hash; of each next block =
//!   xxh3-64 of the 16 bytes `parent_sequence_hash ‖ block_hash` (each
//!   little-endian), seed [`DynamoXxh3::CHAIN_SEED`].
//!
//! Blocks overlapping a multimodal placeholder run hash a different byte
//! string instead of the raw tokens: 13 bytes per token, `0x00 ‖ token ‖ 0u64`
//! for a text token and `0x01 ‖ offset_in_run ‖ mm_hash` for a placeholder
//! (all little-endian), so the image's identity, not the placeholder token
//! id, names the block. Blocks that touch no run keep the plain encoding.
//!
//! These are exactly the values of the `dynamo-tokens` crate (1.6.1); a
//! property test in `tests/dynamo_compat.rs` checks it. Nothing here
//! allocates per block: the plain path hashes the token slice in place and
//! the multimodal path streams frames through a stack buffer.

use super::{BlockHash, HashError, HashedBlock, SequenceHash, SequenceHasher, validate_runs};
use crate::tokens::Token;
use std::sync::Arc;
use xxhash_rust::xxh3::{Xxh3, xxh3_64_with_seed};

/// A multimodal placeholder run: `length` token slots from `offset` (in
/// tokens from the start of the request) stand for the object `mm_hash`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmRun {
    /// The hash identifying the multimodal object (image, audio clip...).
    pub mm_hash: u64,
    /// The first token slot of the run.
    pub offset: usize,
    /// The number of slots; at least 1.
    pub length: usize,
}

impl MmRun {
    fn end(&self) -> usize {
        // Validated at construction: offset + length does not overflow.
        self.offset + self.length
    }
}

/// The dynamo-xxh3 scheme, bound to one request's salt (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct DynamoXxh3 {
    salt_hash: u64,
    mm_runs: Option<Arc<[MmRun]>>,
}

const TAG_TOKEN: u8 = 0x00;
const TAG_PLACEHOLDER: u8 = 0x01;
const FRAME: usize = 13;

impl DynamoXxh3 {
    /// The constant seed of every chain step (Dynamo's router uses it too).
    pub const CHAIN_SEED: u64 = 1337;

    /// A hasher salted with `salt` (e.g. the canonical bytes of the cache
    /// salt and LoRA name): its salt hash is xxh3-64 of `salt`, seed 0.
    pub fn new(salt: &[u8]) -> Self {
        Self::from_salt_hash(xxh3_64_with_seed(salt, 0))
    }

    /// A hasher with a precomputed salt hash. `from_salt_hash(0)` (also
    /// [`Default`]) is Dynamo's unsalted sequence; note it differs from
    /// `new(b"")`, whose salt hash is the hash of no bytes.
    pub fn from_salt_hash(salt_hash: u64) -> Self {
        Self {
            salt_hash,
            mm_runs: None,
        }
    }

    /// Adds multimodal placeholder runs (any order; they must not be empty
    /// or overlap).
    pub fn with_mm_runs(mut self, runs: &[MmRun]) -> Result<Self, HashError> {
        let runs = validate_runs(runs.to_vec(), |r| (r.offset, r.length))?;
        self.mm_runs = if runs.is_empty() {
            None
        } else {
            Some(runs.into())
        };
        Ok(self)
    }

    /// The salt hash: the seed of every block hash.
    pub fn salt_hash(&self) -> u64 {
        self.salt_hash
    }

    /// The multimodal runs, sorted by offset.
    pub fn mm_runs(&self) -> &[MmRun] {
        self.mm_runs.as_deref().unwrap_or(&[])
    }

    /// The block hash of `tokens` starting at token `start` of the request.
    #[inline]
    pub fn block_hash(&self, start: usize, tokens: &[Token]) -> BlockHash {
        if let Some(runs) = self.mm_runs.as_deref() {
            // Runs are sorted and disjoint, so their ends are sorted too.
            let first = runs.partition_point(|r| r.end() <= start);
            let end = start.saturating_add(tokens.len());
            if runs.get(first).is_some_and(|run| run.offset < end) {
                return BlockHash(self.hash_mm_block(start, tokens, &runs[first..]));
            }
        }
        BlockHash(hash_tokens_le(tokens, self.salt_hash))
    }

    /// One chain step: the sequence hash after `parent` for a block whose
    /// block hash is `block`.
    #[inline]
    pub fn chain(parent: SequenceHash, block: BlockHash) -> SequenceHash {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
        bytes[8..].copy_from_slice(&block.0.to_le_bytes());
        SequenceHash(xxh3_64_with_seed(&bytes, Self::CHAIN_SEED))
    }

    fn hash_mm_block(&self, start: usize, tokens: &[Token], runs: &[MmRun]) -> u64 {
        let mut state = Xxh3::with_seed(self.salt_hash);
        let mut buf = [0u8; FRAME * 32];
        let mut used = 0;
        let mut run_idx = 0;
        for (slot, &token) in tokens.iter().enumerate() {
            let position = start + slot;
            while run_idx < runs.len() && runs[run_idx].end() <= position {
                run_idx += 1;
            }
            let frame = &mut buf[used..used + FRAME];
            match runs.get(run_idx) {
                Some(run) if run.offset <= position => {
                    frame[0] = TAG_PLACEHOLDER;
                    // Dynamo writes the offset within the run as a u32; runs
                    // longer than 4 Gi tokens do not exist in practice.
                    let within = (position - run.offset) as u32;
                    frame[1..5].copy_from_slice(&within.to_le_bytes());
                    frame[5..].copy_from_slice(&run.mm_hash.to_le_bytes());
                }
                _ => {
                    frame[0] = TAG_TOKEN;
                    frame[1..5].copy_from_slice(&token.to_le_bytes());
                    frame[5..].copy_from_slice(&0u64.to_le_bytes());
                }
            }
            used += FRAME;
            if used == buf.len() {
                state.update(&buf);
                used = 0;
            }
        }
        state.update(&buf[..used]);
        state.digest()
    }
}

/// xxh3-64 of `tokens` as little-endian bytes, without copying on
/// little-endian machines.
#[cfg(target_endian = "little")]
#[inline]
fn hash_tokens_le(tokens: &[Token], seed: u64) -> u64 {
    xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed)
}

/// xxh3-64 of `tokens` as little-endian bytes, through a stack buffer.
#[cfg(not(target_endian = "little"))]
fn hash_tokens_le(tokens: &[Token], seed: u64) -> u64 {
    let mut state = Xxh3::with_seed(seed);
    let mut buf = [0u8; 256];
    for chunk in tokens.chunks(buf.len() / 4) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        state.update(&buf[..chunk.len() * 4]);
    }
    state.digest()
}

impl SequenceHasher for DynamoXxh3 {
    type Digest = SequenceHash;

    #[inline]
    fn hash_block(
        &self,
        position: usize,
        parent: Option<&SequenceHash>,
        tokens: &[Token],
    ) -> HashedBlock<SequenceHash> {
        let block_hash = self.block_hash(position.saturating_mul(tokens.len()), tokens);
        let digest = match parent {
            Some(&parent) => Self::chain(parent, block_hash),
            None => SequenceHash(block_hash.0),
        };
        HashedBlock { block_hash, digest }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_mm_run_is_an_error() {
        let err = DynamoXxh3::default()
            .with_mm_runs(&[MmRun {
                mm_hash: 1,
                offset: 4,
                length: 0,
            }])
            .unwrap_err();
        assert_eq!(err, HashError::EmptyRun { offset: 4 });
    }

    #[test]
    fn overflowing_mm_run_is_an_error() {
        let err = DynamoXxh3::default()
            .with_mm_runs(&[MmRun {
                mm_hash: 1,
                offset: usize::MAX,
                length: 2,
            }])
            .unwrap_err();
        assert_eq!(
            err,
            HashError::RunOverflow {
                offset: usize::MAX,
                length: 2
            }
        );
    }

    #[test]
    fn overlapping_mm_runs_are_an_error() {
        let runs = [
            MmRun {
                mm_hash: 1,
                offset: 10,
                length: 5,
            },
            MmRun {
                mm_hash: 2,
                offset: 2,
                length: 9,
            },
        ];
        let err = DynamoXxh3::default().with_mm_runs(&runs).unwrap_err();
        assert_eq!(err, HashError::OverlappingRuns { position: 10 });
    }

    #[test]
    fn mm_block_differs_from_plain_and_depends_on_mm_hash() {
        let tokens: Vec<Token> = (0..16).collect();
        let plain = DynamoXxh3::default();
        let run = |mm_hash| MmRun {
            mm_hash,
            offset: 3,
            length: 4,
        };
        let a = plain.clone().with_mm_runs(&[run(7)]).unwrap();
        let b = plain.clone().with_mm_runs(&[run(8)]).unwrap();
        let pa = a.hash_block(0, None, &tokens);
        assert_ne!(pa, plain.hash_block(0, None, &tokens));
        assert_ne!(pa, b.hash_block(0, None, &tokens));
        // A block past the run hashes its tokens plainly.
        assert_eq!(
            a.hash_block(1, None, &tokens),
            plain.hash_block(1, None, &tokens)
        );
    }
}
