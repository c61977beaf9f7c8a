//! Tokens and token blocks.

/// One token id, as the engine's tokenizer produced it.
pub type Token = u32;
