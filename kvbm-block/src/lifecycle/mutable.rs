//! Blocks before registration: mutable (being filled) and complete (full,
//! named by its sequence hash, not yet shared).

use std::fmt;
use std::sync::Arc;

use super::error::{CompleteError, CompleteErrorKind};
use super::{BlockStore, DEFAULT_PRIORITY};
use crate::{SequenceHash, Token};

/// A block the engine is filling: reset or partial.
///
/// Tokens are optional bookkeeping: an engine that keeps its tokens itself
/// never pushes any, and the block costs no allocation. Dropping it returns
/// the block to its pool's free list.
pub struct MutableBlock<S: BlockStore> {
    store: Option<Arc<S>>,
    id: u32,
    block_size: u32,
    tokens: Vec<Token>,
}

impl<S: BlockStore> MutableBlock<S> {
    /// Wraps block `id` of `store`, just taken from its free list.
    ///
    /// For pool implementations: the handle will hand `id` back through
    /// [`BlockStore::release_unregistered`] when dropped.
    pub fn from_store(store: Arc<S>, id: u32) -> Self {
        let block_size = u32::try_from(store.block_size()).unwrap_or(u32::MAX);
        Self {
            store: Some(store),
            id,
            block_size,
            tokens: Vec::new(),
        }
    }

    /// The block's index in its pool, which is its index in the tier's
    /// memory layout.
    pub fn block_id(&self) -> u32 {
        self.id
    }

    /// Tokens a full block holds.
    pub fn block_size(&self) -> usize {
        self.block_size as usize
    }

    /// The tokens pushed so far.
    pub fn tokens(&self) -> &[Token] {
        &self.tokens
    }

    /// Room left, in tokens.
    pub fn remaining(&self) -> usize {
        self.block_size() - self.tokens.len()
    }

    /// Appends one token; hands it back when the block is full.
    pub fn push_token(&mut self, token: Token) -> Result<(), Token> {
        if self.tokens.len() >= self.block_size() {
            return Err(token);
        }
        if self.tokens.capacity() == 0 {
            self.tokens.reserve_exact(self.block_size());
        }
        self.tokens.push(token);
        Ok(())
    }

    /// Appends as many of `tokens` as fit; returns how many were taken.
    pub fn extend_tokens(&mut self, tokens: &[Token]) -> usize {
        let take = tokens.len().min(self.remaining());
        if take > 0 && self.tokens.capacity() == 0 {
            self.tokens.reserve_exact(self.block_size());
        }
        self.tokens.extend_from_slice(&tokens[..take]);
        take
    }

    /// Removes the last token (the engine rolled back a speculative one).
    pub fn pop_token(&mut self) -> Option<Token> {
        self.tokens.pop()
    }

    /// Forgets all tokens; the block stays allocated.
    pub fn reset(&mut self) {
        self.tokens.clear();
    }

    /// Completes the block: it now holds a full block of tokens named by
    /// `hash`, whose prefix is the block named `parent` (`None` for the first
    /// block of a sequence). Hashing is the caller's job.
    ///
    /// A block that tracks no tokens completes as is; one that tracks some
    /// must be full, otherwise it comes back inside the error.
    pub fn complete(
        self,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Result<CompleteBlock<S>, CompleteError<Self>> {
        let tokens = self.tokens.len();
        if tokens != 0 && tokens != self.block_size() {
            return Err(CompleteError {
                kind: CompleteErrorKind::Partial {
                    tokens,
                    block_size: self.block_size(),
                },
                block: self,
            });
        }
        let mut this = self;
        Ok(CompleteBlock {
            store: this.store.take(),
            id: this.id,
            hash,
            parent,
            priority: DEFAULT_PRIORITY,
            tokens: std::mem::take(&mut this.tokens),
        })
    }
}

impl<S: BlockStore> Drop for MutableBlock<S> {
    fn drop(&mut self) {
        if let Some(store) = self.store.take() {
            store.release_unregistered(&[self.id]);
        }
    }
}

impl<S: BlockStore> fmt::Debug for MutableBlock<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MutableBlock")
            .field("id", &self.id)
            .field("tokens", &self.tokens.len())
            .field("block_size", &self.block_size)
            .finish()
    }
}

/// A full block named by its sequence hash, ready to be registered.
///
/// Dropping it (instead of registering it) returns the block to the free
/// list: its contents are never published.
pub struct CompleteBlock<S: BlockStore> {
    store: Option<Arc<S>>,
    id: u32,
    hash: SequenceHash,
    parent: Option<SequenceHash>,
    priority: u8,
    tokens: Vec<Token>,
}

/// What a pool takes out of a [`CompleteBlock`] when it registers it.
#[derive(Debug)]
pub struct CompleteParts<S: BlockStore> {
    /// The pool the block belongs to.
    pub store: Arc<S>,
    /// The block's index in its pool.
    pub id: u32,
    /// Its sequence hash.
    pub hash: SequenceHash,
    /// Its parent's sequence hash (`None` for a first block).
    pub parent: Option<SequenceHash>,
    /// Its eviction priority (0–100, higher is kept longer).
    pub priority: u8,
}

impl<S: BlockStore> CompleteBlock<S> {
    /// The block's index in its pool, which is its index in the tier's
    /// memory layout.
    pub fn block_id(&self) -> u32 {
        self.id
    }

    /// The sequence hash naming the block.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.hash
    }

    /// The parent's sequence hash (`None` for the first block of a sequence).
    pub fn parent(&self) -> Option<SequenceHash> {
        self.parent
    }

    /// The tokens it holds, when the engine tracked them in the block.
    pub fn tokens(&self) -> &[Token] {
        &self.tokens
    }

    /// Its eviction priority.
    pub fn priority(&self) -> u8 {
        self.priority
    }

    /// Sets the eviction priority the block will be registered with
    /// (0–100, higher is kept longer; larger values are clamped to 100).
    pub fn set_priority(&mut self, priority: u8) {
        self.priority = priority.min(100);
    }

    /// The same, builder style.
    pub fn with_priority(mut self, priority: u8) -> Self {
        self.set_priority(priority);
        self
    }

    /// Whether the block belongs to `store`.
    pub fn belongs_to(&self, store: &Arc<S>) -> bool {
        self.store
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(s, store) || s.same_store(store))
    }

    /// Takes the block apart for registration.
    ///
    /// For pool implementations: from here on the pool owns the block; the
    /// handle no longer returns it on drop.
    pub fn into_parts(mut self) -> Option<CompleteParts<S>> {
        let store = self.store.take()?;
        Some(CompleteParts {
            store,
            id: self.id,
            hash: self.hash,
            parent: self.parent,
            priority: self.priority,
        })
    }
}

impl<S: BlockStore> Drop for CompleteBlock<S> {
    fn drop(&mut self) {
        if let Some(store) = self.store.take() {
            store.release_unregistered(&[self.id]);
        }
    }
}

impl<S: BlockStore> fmt::Debug for CompleteBlock<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompleteBlock")
            .field("id", &self.id)
            .field("hash", &self.hash)
            .field("parent", &self.parent)
            .field("priority", &self.priority)
            .finish()
    }
}
