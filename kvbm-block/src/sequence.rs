//! A request's token stream, cut into complete hashed blocks and a tail.
//!
//! The scheduler extends a sequence as prompt and generated tokens arrive,
//! and shortens it when speculative tokens are rejected. Because a block's
//! hashes depend only on its prefix and the salt, shortening never rehashes:
//! it drops the blocks past the cut, and extending hashes only the blocks
//! that become complete. Tokens live in one contiguous vector and per-block
//! state is just the two hashes, so extending costs no allocation per block
//! (beyond amortised vector growth).
//!
//! ```
//! use kvbm_block::{DynamoXxh3, PageSize, TokenBlockSequence, VllmSha256};
//!
//! let page = PageSize::new(4)?;
//! // Dynamo's router format, salted per request (e.g. by LoRA name).
//! let mut seq = TokenBlockSequence::new(DynamoXxh3::new(b"lora:sql"), page);
//! assert_eq!(seq.extend(&[1, 2, 3, 4, 5, 6, 7, 8, 9]), 0..2); // two blocks completed
//! assert_eq!(seq.tail(), &[9]);
//! let keys: Vec<_> = seq.sequence_hashes().collect(); // pool keys, in order
//! seq.truncate(6)?; // rejected speculative tokens: block 1 is incomplete again
//! assert_eq!(seq.num_blocks(), 1);
//! assert_eq!(seq.block(0).map(|b| b.sequence_hash()), Some(keys[0]));
//!
//! // vLLM's prefix-cache hash for the same tokens, full 32 bytes kept.
//! let vllm = TokenBlockSequence::from_tokens(VllmSha256::from_env(), page, &[1, 2, 3, 4]);
//! let first = vllm.block(0).map(|b| *b.digest());
//! assert!(first.is_some());
//! # Ok::<(), kvbm_block::TokenError>(())
//! ```

use crate::hash::{DynamoXxh3, HashedBlock, SequenceDigest, SequenceHash, SequenceHasher};
use crate::tokens::{PageSize, Token, TokenBlock, TokenError};
use std::ops::Range;

/// A token stream as complete, hashed blocks of `page_size` tokens plus a
/// partial tail of fewer than `page_size` tokens, named by the hash scheme
/// `H` (dynamo-xxh3 unless chosen otherwise).
#[derive(Clone, Debug)]
pub struct TokenBlockSequence<H: SequenceHasher = DynamoXxh3> {
    hasher: H,
    page_size: PageSize,
    tokens: Vec<Token>,
    blocks: Vec<HashedBlock<H::Digest>>,
}

impl<H: SequenceHasher> TokenBlockSequence<H> {
    /// An empty sequence.
    pub fn new(hasher: H, page_size: PageSize) -> Self {
        Self {
            hasher,
            page_size,
            tokens: Vec::new(),
            blocks: Vec::new(),
        }
    }

    /// A sequence holding `tokens`.
    pub fn from_tokens(hasher: H, page_size: PageSize, tokens: &[Token]) -> Self {
        let mut sequence = Self::new(hasher, page_size);
        sequence.extend(tokens);
        sequence
    }

    /// A sequence that takes ownership of `tokens` (no copy).
    pub fn from_vec(hasher: H, page_size: PageSize, tokens: Vec<Token>) -> Self {
        let mut sequence = Self::new(hasher, page_size);
        sequence.tokens = tokens;
        sequence.hash_complete_blocks();
        sequence
    }

    /// Appends `tokens`; returns the indices of the blocks they completed
    /// (empty when none).
    pub fn extend(&mut self, tokens: &[Token]) -> Range<usize> {
        let first_new = self.blocks.len();
        self.tokens.extend_from_slice(tokens);
        self.hash_complete_blocks();
        first_new..self.blocks.len()
    }

    /// Appends one token; returns the index of the block it completed.
    pub fn push(&mut self, token: Token) -> Option<usize> {
        self.tokens.push(token);
        let before = self.blocks.len();
        self.hash_complete_blocks();
        (self.blocks.len() > before).then_some(before)
    }

    /// Removes and returns the last token; `None` when empty. Popping the
    /// first token of the tail's block uncompletes that block.
    pub fn pop(&mut self) -> Option<Token> {
        let token = self.tokens.pop()?;
        self.blocks
            .truncate(self.tokens.len() / self.page_size.as_usize());
        Some(token)
    }

    /// Shortens the sequence to its first `len` tokens.
    pub fn truncate(&mut self, len: usize) -> Result<(), TokenError> {
        if len > self.tokens.len() {
            return Err(TokenError::TruncatePastEnd {
                len,
                total: self.tokens.len(),
            });
        }
        self.tokens.truncate(len);
        self.blocks.truncate(len / self.page_size.as_usize());
        Ok(())
    }

    /// Removes the last `count` tokens.
    pub fn unwind(&mut self, count: usize) -> Result<(), TokenError> {
        let total = self.tokens.len();
        let len = total
            .checked_sub(count)
            .ok_or(TokenError::UnwindPastStart { count, total })?;
        self.truncate(len)
    }

    fn hash_complete_blocks(&mut self) {
        let page = self.page_size.as_usize();
        let complete = self.tokens.len() / page;
        self.blocks
            .reserve(complete.saturating_sub(self.blocks.len()));
        for position in self.blocks.len()..complete {
            let tokens = &self.tokens[position * page..(position + 1) * page];
            let parent = self.blocks.last().map(|b| &b.digest);
            let hashed = self.hasher.hash_block(position, parent, tokens);
            self.blocks.push(hashed);
        }
    }

    /// All tokens, complete blocks and tail.
    pub fn tokens(&self) -> &[Token] {
        &self.tokens
    }

    /// The number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the sequence holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The tokens after the last complete block (fewer than `page_size`).
    pub fn tail(&self) -> &[Token] {
        &self.tokens[self.blocks.len() * self.page_size.as_usize()..]
    }

    /// The number of complete blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The page size.
    pub fn page_size(&self) -> PageSize {
        self.page_size
    }

    /// The hasher (with the request's salt).
    pub fn hasher(&self) -> &H {
        &self.hasher
    }

    /// Complete block `index`, borrowed.
    pub fn block(&self, index: usize) -> Option<BlockRef<'_, H::Digest>> {
        (index < self.blocks.len()).then(|| self.block_at(index))
    }

    /// Block `index`; the caller guarantees `index < num_blocks()`, so every
    /// slice below is in bounds (`blocks.len() * page <= tokens.len()`).
    fn block_at(&self, index: usize) -> BlockRef<'_, H::Digest> {
        let page = self.page_size.as_usize();
        BlockRef {
            tokens: &self.tokens[index * page..(index + 1) * page],
            position: index,
            hashed: &self.blocks[index],
            parent: index.checked_sub(1).map(|p| &self.blocks[p].digest),
        }
    }

    /// The complete blocks, in order.
    pub fn blocks(&self) -> impl ExactSizeIterator<Item = BlockRef<'_, H::Digest>> + '_ {
        (0..self.blocks.len()).map(|i| self.block_at(i))
    }

    /// The pool keys of the complete blocks, in order.
    pub fn sequence_hashes(&self) -> impl ExactSizeIterator<Item = SequenceHash> + '_ {
        self.blocks.iter().map(|b| b.digest.sequence_hash())
    }

    /// The last complete block's digest; `None` when there is none.
    pub fn last_digest(&self) -> Option<&H::Digest> {
        self.blocks.last().map(|b| &b.digest)
    }
}

/// A complete block of a [`TokenBlockSequence`], borrowed.
#[derive(Clone, Copy, Debug)]
pub struct BlockRef<'a, D> {
    tokens: &'a [Token],
    position: usize,
    hashed: &'a HashedBlock<D>,
    parent: Option<&'a D>,
}

impl<'a, D: SequenceDigest> BlockRef<'a, D> {
    /// The block's tokens.
    pub fn tokens(&self) -> &'a [Token] {
        self.tokens
    }

    /// The block's index in the sequence.
    pub fn position(&self) -> usize {
        self.position
    }

    /// The hash of the block's tokens and salt alone.
    pub fn block_hash(&self) -> crate::hash::BlockHash {
        self.hashed.block_hash
    }

    /// The pool key of the block's prefix.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.hashed.digest.sequence_hash()
    }

    /// The pool key of the previous block; `None` for the first.
    pub fn parent_sequence_hash(&self) -> Option<SequenceHash> {
        self.parent.map(|p| p.sequence_hash())
    }

    /// The scheme's full-width digest.
    pub fn digest(&self) -> &'a D {
        &self.hashed.digest
    }

    /// The previous block's full-width digest; `None` for the first.
    pub fn parent_digest(&self) -> Option<&'a D> {
        self.parent
    }

    /// An owned copy, to hand to a pool.
    pub fn to_token_block(&self) -> TokenBlock<D> {
        TokenBlock::from_parts(
            self.tokens,
            self.position,
            self.hashed.block_hash,
            self.hashed.digest,
            self.parent.copied(),
        )
    }
}

/// The sequence hashes of every complete block of `tokens`, in `block_tokens`
/// token blocks, under `hasher`'s scheme and salt: the names a tier engine
/// matches and registers. A trailing partial block has no name.
pub fn sequence_hashes<H: SequenceHasher>(
    hasher: H,
    block_tokens: usize,
    tokens: &[Token],
) -> Result<Vec<SequenceHash>, TokenError> {
    let page = u32::try_from(block_tokens).map_err(|_| TokenError::InvalidPageSize(u32::MAX))?;
    let sequence = TokenBlockSequence::from_tokens(hasher, PageSize::new(page)?, tokens);
    Ok(sequence.sequence_hashes().collect())
}
