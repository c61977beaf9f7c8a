//! Hierarchical prefix match: G1, then G2, then G3, one contiguous prefix.

use std::sync::Arc;

use kvbm_block::SequenceHash;

use super::onboard::OnboardJob;
use super::{RequestId, Shared, TierError};
use crate::pool::ImmutableBlocks;

/// Where the G1 part of a match comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum G1Lookup {
    /// kvbm keeps the G1 books: match in its G1 pool and hand the held
    /// blocks back in [`TierMatch::g1`].
    Pool,
    /// The engine keeps its own G1 prefix cache and already found this many
    /// leading blocks there (vLLM's `num_computed_tokens / block_size`).
    Engine {
        /// Leading blocks the engine holds.
        blocks: usize,
    },
}

/// The outcome of a match.
#[derive(Debug)]
pub struct TierMatch {
    /// The G1 prefix, held ([`G1Lookup::Pool`] only; empty otherwise).
    pub g1: ImmutableBlocks,
    /// Leading blocks in G1 (held above, or the engine's own count).
    pub g1_blocks: usize,
    /// Blocks after those that kvbm holds in G2, ready to onboard.
    pub g2_blocks: usize,
    /// Blocks after those that kvbm holds in G3, ready to onboard.
    pub g3_blocks: usize,
    /// Whether one block was given back because the whole prompt hit.
    pub gave_back: bool,
    /// Tokens per block.
    pub block_size: usize,
}

impl TierMatch {
    /// Blocks kvbm can load (G2 + G3).
    pub fn external_blocks(&self) -> usize {
        self.g2_blocks + self.g3_blocks
    }

    /// Tokens kvbm can load, beyond what G1 has (vLLM's
    /// `get_num_new_matched_tokens`).
    pub fn external_tokens(&self) -> usize {
        self.external_blocks() * self.block_size
    }

    /// Tokens already in G1.
    pub fn g1_tokens(&self) -> usize {
        self.g1_blocks * self.block_size
    }

    /// All matched blocks.
    pub fn total_blocks(&self) -> usize {
        self.g1_blocks + self.external_blocks()
    }
}

/// What the engine keeps per live request.
pub(crate) struct RequestState {
    /// The prompt's block hashes.
    pub(crate) hashes: Vec<SequenceHash>,
    /// Index of the first block to onboard (the G1 prefix length).
    pub(crate) start: usize,
    /// Held G2 blocks, then held G3 blocks, in prefix order.
    pub(crate) g2: ImmutableBlocks,
    pub(crate) g3: ImmutableBlocks,
    /// The onboard, once started.
    pub(crate) onboard: Option<Arc<OnboardJob>>,
}

pub(crate) fn match_request(
    shared: &Arc<Shared>,
    request: RequestId,
    hashes: &[SequenceHash],
    prompt_tokens: usize,
    g1: G1Lookup,
) -> Result<TierMatch, TierError> {
    let bs = shared.config.block_size;
    // Only whole blocks can be reused: never match past the prompt.
    let usable = hashes.len().min(prompt_tokens / bs);
    let hashes = &hashes[..usable];

    let first_time = {
        let requests = shared.requests.lock();
        match requests.get(&request) {
            Some(state) if state.onboard.is_some() => {
                return Err(TierError::AlreadyOnboarding(request));
            }
            Some(_) => false,
            None => true,
        }
    };
    if first_time {
        shared.history.lock().record_request(hashes);
    }

    let (mut g1_held, g1_blocks) = match g1 {
        G1Lookup::Pool => {
            let held = shared.g1.pool.match_prefix(hashes);
            let n = held.len();
            (held, n)
        }
        G1Lookup::Engine { blocks } => (ImmutableBlocks::empty(), blocks.min(usable)),
    };
    let mut at = g1_blocks;
    let mut g2 = match &shared.g2 {
        Some(t) => t.pool.match_prefix(&hashes[at..]),
        None => ImmutableBlocks::empty(),
    };
    at += g2.len();
    let mut g3 = match &shared.g3 {
        Some(t) => t.pool.match_prefix(&hashes[at..]),
        None => ImmutableBlocks::empty(),
    };
    at += g3.len();
    shared.metrics.matched(
        hashes.len() as u64,
        [g1_blocks as u64, g2.len() as u64, g3.len() as u64],
    );

    // The full-prompt rule: the engine must compute at least one token.
    let mut gave_back = false;
    if at > 0 && at * bs >= prompt_tokens {
        gave_back = true;
        if !g3.is_empty() {
            g3.truncate(g3.len() - 1);
        } else if !g2.is_empty() {
            g2.truncate(g2.len() - 1);
        } else if !g1_held.is_empty() {
            g1_held.truncate(g1_held.len() - 1);
        } else {
            // The engine's own G1 prefix covers it: its rule, not ours.
            gave_back = false;
        }
    }
    let g1_blocks = match g1 {
        G1Lookup::Pool => g1_held.len(),
        // The engine applies its own rule to its own prefix.
        G1Lookup::Engine { .. } => g1_blocks,
    };

    let result = TierMatch {
        g1: g1_held,
        g1_blocks,
        g2_blocks: g2.len(),
        g3_blocks: g3.len(),
        gave_back,
        block_size: bs,
    };
    let state = RequestState {
        hashes: hashes.to_vec(),
        start: g1_blocks,
        g2,
        g3,
        onboard: None,
    };
    let mut requests = shared.requests.lock();
    if requests.get(&request).is_some_and(|s| s.onboard.is_some()) {
        return Err(TierError::AlreadyOnboarding(request));
    }
    // A replaced match drops its holds here, after the lock is released.
    let old = requests.insert(request, state);
    drop(requests);
    drop(old);
    Ok(result)
}
