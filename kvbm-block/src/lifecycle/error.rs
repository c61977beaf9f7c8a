//! Errors of the lifecycle transitions: each one hands the block back.

use std::fmt;

/// Why a mutable block could not be completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompleteErrorKind {
    /// The block holds some tokens but fewer than a full block.
    Partial {
        /// Tokens it holds.
        tokens: usize,
        /// Tokens a full block holds.
        block_size: usize,
    },
}

impl fmt::Display for CompleteErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Partial { tokens, block_size } => write!(
                f,
                "block holds {tokens} of {block_size} tokens: only full blocks complete"
            ),
        }
    }
}

/// A failed transition: the reason, and the block, handed back unchanged.
pub struct CompleteError<B> {
    /// Why the transition failed.
    pub kind: CompleteErrorKind,
    /// The block, as it was before the call.
    pub block: B,
}

impl<B> CompleteError<B> {
    /// Takes the block back.
    pub fn into_block(self) -> B {
        self.block
    }
}

impl<B> fmt::Debug for CompleteError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompleteError")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl<B> fmt::Display for CompleteError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.kind, f)
    }
}

impl<B> std::error::Error for CompleteError<B> {}
