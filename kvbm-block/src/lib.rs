//! # kvbm-block
//!
//! The logical view of a KV block, with no memory attached: tokens, token
//! blocks and sequences, the chained sequence hashes that name a block by
//! the token prefix it holds (pluggable schemes, wire-compatible with
//! Dynamo's router and vLLM's prefix cache), and the block lifecycle as
//! typestate RAII handles. It sits beside kvbm-layout at the bottom of the
//! stack; kvbm-pool builds pools and the tier engine on top of it.

pub mod hash;
pub mod lifecycle;
pub mod sequence;
pub mod tokens;

pub use hash::{BlockHash, BuildSequenceHasher, SequenceHash, SequenceHasherFn};
pub use hash::{DynamoXxh3, HashError, SequenceDigest, SequenceHasher, VllmBlockHash, VllmSha256};
pub use sequence::{BlockRef, TokenBlockSequence, sequence_hashes};
pub use tokens::Token;
pub use tokens::{PageSize, TokenBlock, TokenError};
