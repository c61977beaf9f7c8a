//! Sequence hashes: the names of blocks.
//!
//! A block is named by a *chained* hash over its whole token prefix, so two
//! blocks share a [`SequenceHash`] only when every token before and in them
//! (and the salt) is equal. Pools and the tier engine key everything by it.

/// The hash of one block's tokens (and salt), independent of its prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// The chained hash naming a block by its whole token prefix; the key of
/// every registry, match and KV event. Values are uniformly distributed, so
/// maps keyed by it may use an identity hasher.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);
