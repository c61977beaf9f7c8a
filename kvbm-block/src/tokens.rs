//! Tokens, page sizes and complete token blocks.
//!
//! A KV block holds the keys and values of exactly `page_size` consecutive
//! tokens, so the logical layer cuts a token stream into blocks of that many
//! tokens. Only a *complete* block has a name (its sequence hash): a partial
//! tail can still change, so it is never registered, matched or offloaded.
//! [`TokenBlock`] is that complete block, owned and self-contained, ready to
//! be handed to a pool; [`crate::sequence::TokenBlockSequence`] produces them.

use crate::hash::{BlockHash, SequenceDigest, SequenceHash, SequenceHasher};

/// One token id, as the engine's tokenizer produced it.
pub type Token = u32;

/// Errors of the token layer: bad page sizes, blocks of the wrong length,
/// and edits that reach past either end of a sequence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// A page size must be a power of two between 1 and [`PageSize::MAX`].
    #[error("page size {0} is not a power of two in 1..=1024")]
    InvalidPageSize(u32),
    /// A complete block must hold exactly `page_size` tokens.
    #[error("a block of page size {page_size} cannot hold {len} tokens")]
    WrongBlockLength {
        /// The page size the block was built for.
        page_size: usize,
        /// How many tokens were given.
        len: usize,
    },
    /// `truncate(len)` with `len` greater than the sequence's length.
    #[error("cannot truncate a sequence of {total} tokens to {len}")]
    TruncatePastEnd {
        /// The requested length.
        len: usize,
        /// The sequence's length.
        total: usize,
    },
    /// `unwind(count)` with `count` greater than the sequence's length.
    #[error("cannot unwind {count} tokens from a sequence of {total}")]
    UnwindPastStart {
        /// How many tokens were to be removed.
        count: usize,
        /// The sequence's length.
        total: usize,
    },
}

/// The number of tokens per block: a power of two in `1..=1024`.
///
/// Validated once here so that every block and sequence can rely on it
/// (block boundaries are `index * page_size`, a shift).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageSize(u32);

impl PageSize {
    /// The largest page size kvbm accepts.
    pub const MAX: u32 = 1024;

    /// Validates `tokens_per_block`.
    pub fn new(tokens_per_block: u32) -> Result<Self, TokenError> {
        if tokens_per_block.is_power_of_two() && tokens_per_block <= Self::MAX {
            Ok(Self(tokens_per_block))
        } else {
            Err(TokenError::InvalidPageSize(tokens_per_block))
        }
    }

    /// The page size as a `u32`.
    pub fn get(self) -> u32 {
        self.0
    }

    /// The page size as a `usize`, for indexing.
    pub fn as_usize(self) -> usize {
        // Lossless: the value is at most 1024.
        self.0 as usize
    }
}

impl TryFrom<u32> for PageSize {
    type Error = TokenError;

    fn try_from(value: u32) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

/// A complete block of `page_size` tokens with its hashes.
///
/// `D` is the scheme's full-width sequence digest ([`SequenceHash`] itself
/// for dynamo-xxh3, [`crate::hash::VllmBlockHash`] for vLLM); every scheme
/// also yields the 64-bit [`SequenceHash`] that pools key on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBlock<D = SequenceHash> {
    tokens: Box<[Token]>,
    position: usize,
    block_hash: BlockHash,
    digest: D,
    parent: Option<D>,
}

impl<D: SequenceDigest> TokenBlock<D> {
    /// Hashes `tokens` as the block at `position` (0 for the first block of
    /// a sequence) whose parent block has digest `parent` (`None` for the
    /// first block).
    ///
    /// Errors with [`TokenError::WrongBlockLength`] unless `tokens` holds
    /// exactly `page_size` tokens.
    pub fn new<H>(
        hasher: &H,
        page_size: PageSize,
        position: usize,
        parent: Option<&D>,
        tokens: &[Token],
    ) -> Result<Self, TokenError>
    where
        H: SequenceHasher<Digest = D>,
    {
        if tokens.len() != page_size.as_usize() {
            return Err(TokenError::WrongBlockLength {
                page_size: page_size.as_usize(),
                len: tokens.len(),
            });
        }
        let hashed = hasher.hash_block(position, parent, tokens);
        Ok(Self {
            tokens: tokens.into(),
            position,
            block_hash: hashed.block_hash,
            digest: hashed.digest,
            parent: parent.copied(),
        })
    }

    /// Assembles a block from parts already computed (by a sequence).
    pub(crate) fn from_parts(
        tokens: &[Token],
        position: usize,
        block_hash: BlockHash,
        digest: D,
        parent: Option<D>,
    ) -> Self {
        Self {
            tokens: tokens.into(),
            position,
            block_hash,
            digest,
            parent,
        }
    }

    /// The block's tokens (exactly `page_size` of them).
    pub fn tokens(&self) -> &[Token] {
        &self.tokens
    }

    /// The block's index in its sequence (0 for the first block).
    pub fn position(&self) -> usize {
        self.position
    }

    /// The hash of this block's tokens and salt alone, independent of the
    /// blocks before it.
    pub fn block_hash(&self) -> BlockHash {
        self.block_hash
    }

    /// The 64-bit name of the block's whole prefix: the pool key.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.digest.sequence_hash()
    }

    /// The pool key of the previous block; `None` for the first block.
    pub fn parent_sequence_hash(&self) -> Option<SequenceHash> {
        self.parent.map(|p| p.sequence_hash())
    }

    /// The scheme's full-width digest of the block's prefix.
    pub fn digest(&self) -> &D {
        &self.digest
    }

    /// The full-width digest of the previous block; `None` for the first.
    pub fn parent_digest(&self) -> Option<&D> {
        self.parent.as_ref()
    }
}
