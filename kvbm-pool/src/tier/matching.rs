//! Hierarchical prefix match: G1, then G2, then G3, one contiguous prefix.

use std::sync::Arc;

use kvbm_block::SequenceHash;

use super::onboard::OnboardJob;
use super::prefetch::{self, Prefetch};
use super::{RequestId, Shared, TierError};
use crate::pool::ImmutableBlocks;

/// Blocks queued for the use history that wake the offload worker to
/// apply them: half the queue's bound. The worker applies the queue
/// whenever it is awake anyway (offloads, releases), so this wake-up is
/// for an engine that matches many requests and finishes none; it keeps
/// the matching thread from ever applying the queue itself.
const WAKE_AT_BLOCKS: usize = crate::policy::MAX_PENDING_BLOCKS / 2;

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
    /// Blocks after those that kvbm holds in G3, ready to onboard. (The
    /// walk takes each next block from whichever of G2 and G3 holds it, so
    /// G2 and G3 blocks may alternate along the prefix.)
    pub g3_blocks: usize,
    /// Whether one block was given back because the whole prompt hit.
    pub gave_back: bool,
    /// Matched G2/G3 blocks left for the engine to recompute because the
    /// cost model ([`super::LoadCost`]) found loading them slower (they
    /// follow the blocks above and are not held).
    pub declined_blocks: usize,
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

/// A run of consecutive matched blocks held in one kvbm tier.
pub(crate) struct Segment {
    /// `true` for G3, `false` for G2.
    pub(crate) g3: bool,
    pub(crate) blocks: ImmutableBlocks,
}

/// What the engine keeps per live request.
pub(crate) struct RequestState {
    /// The prompt's block hashes.
    pub(crate) hashes: Vec<SequenceHash>,
    /// Index of the first block to onboard (the G1 prefix length).
    pub(crate) start: usize,
    /// Held runs of G2 and G3 blocks, in prefix order.
    pub(crate) segments: Vec<Segment>,
    /// The onboard, once started.
    pub(crate) onboard: Option<Arc<OnboardJob>>,
    /// The G3 read started at match time, until the onboard takes it.
    pub(crate) prefetch: Option<Arc<Prefetch>>,
}

impl Drop for RequestState {
    /// A request forgotten before its onboard took its prefetch stops the
    /// read (its slots and holds return once the read has stopped).
    fn drop(&mut self) {
        if let Some(p) = self.prefetch.take() {
            p.cancel();
        }
    }
}

/// Keeps the first `keep` blocks of `segments` (prefix order), dropping
/// the holds of the others; returns the G2 and G3 blocks dropped.
fn truncate_segments(segments: &mut Vec<Segment>, keep: usize) -> [usize; 2] {
    let mut dropped = [0usize; 2];
    let mut left = keep;
    segments.retain_mut(|seg| {
        let n = seg.blocks.len();
        let kept = n.min(left);
        left -= kept;
        dropped[usize::from(seg.g3)] += n - kept;
        seg.blocks.truncate(kept);
        kept > 0
    });
    dropped
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
    // The use history feeds the reuse-score ranking and `min_uses`
    // admission; with write-through tiers nothing reads it. Recording
    // costs a table update per prompt block, so the request is only
    // queued here: any reader of the history applies the queue before it
    // reads, the offload worker applies it whenever it is awake with
    // nothing else to do (and releases wake it), and a queue this long
    // wakes it too.
    if first_time && shared.config.uses_history() {
        let queued = shared.books.record_use_later(hashes);
        if queued >= WAKE_AT_BLOCKS && queued - hashes.len() < WAKE_AT_BLOCKS {
            shared.offload.apply_history();
        }
    }

    let (mut g1_held, g1_blocks) = match g1 {
        G1Lookup::Pool => {
            let held = shared.books.g1().pool.match_prefix(hashes);
            let n = held.len();
            (held, n)
        }
        G1Lookup::Engine { blocks } => (ImmutableBlocks::empty(), blocks.min(usable)),
    };
    // Walk on in G2 and G3 block by block: each run is taken from whichever
    // tier holds the next block, so the prefix may alternate between them.
    let mut at = g1_blocks;
    let mut segments: Vec<Segment> = Vec::new();
    let (mut in_g2, mut in_g3) = (0usize, 0usize);
    loop {
        let before = at;
        for (is_g3, tier) in [(false, shared.books.g2()), (true, shared.books.g3())] {
            let Some(tier) = tier else { continue };
            let mut run = tier.pool.match_prefix(&hashes[at..]);
            if is_g3 {
                // A block whose write to G3 failed is not there.
                let written = super::behind::written_prefix(shared, run.block_ids());
                run.truncate(written);
            }
            if run.is_empty() {
                continue;
            }
            at += run.len();
            if is_g3 {
                in_g3 += run.len();
            } else {
                in_g2 += run.len();
            }
            segments.push(Segment {
                g3: is_g3,
                blocks: run,
            });
        }
        if at == before || at == hashes.len() {
            break;
        }
    }
    shared.metrics.matched(
        hashes.len() as u64,
        [g1_blocks as u64, in_g2 as u64, in_g3 as u64],
    );

    // The full-prompt rule: the engine must compute at least one token.
    let mut gave_back = false;
    if at > 0 && at * bs >= prompt_tokens {
        gave_back = true;
        if let Some(last) = segments.last_mut() {
            if last.g3 {
                in_g3 -= 1;
            } else {
                in_g2 -= 1;
            }
            last.blocks.truncate(last.blocks.len() - 1);
            if last.blocks.is_empty() {
                segments.pop();
            }
        } else if !g1_held.is_empty() {
            g1_held.truncate(g1_held.len() - 1);
        } else {
            // The engine's own G1 prefix covers it: its rule, not ours.
            gave_back = false;
        }
    }
    // Load or recompute: the cost model may leave the tail to the engine.
    let external = in_g2 + in_g3;
    let mut declined = 0;
    if shared.config.load_cost.recompute_tokens_per_s.is_some() && external > 0 {
        let from_g3: Vec<bool> = segments
            .iter()
            .flat_map(|seg| std::iter::repeat_n(seg.g3, seg.blocks.len()))
            .collect();
        let bytes = |t: Option<&super::TierSlot>| t.map_or(0, |t| t.block_bytes);
        let keep = shared.config.load_cost.blocks_worth_loading(
            shared.rates.current(&shared.config.load_cost),
            bs,
            [bytes(shared.books.g2()), bytes(shared.books.g3())],
            &from_g3,
        );
        if keep < external {
            shared.rates.declined(&shared.config.load_cost);
            let [d2, d3] = truncate_segments(&mut segments, keep);
            in_g2 -= d2;
            in_g3 -= d3;
            declined = d2 + d3;
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
        g2_blocks: in_g2,
        g3_blocks: in_g3,
        gave_back,
        declined_blocks: declined,
        block_size: bs,
    };
    // The disk starts now, while the engine allocates G1 — unless an
    // earlier match of this request already reads the same blocks.
    let prefetch = if in_g3 > 0 {
        let earlier = match shared.requests.lock().get_mut(&request) {
            Some(old) if old.onboard.is_none() && old.start == g1_blocks => {
                old.prefetch.take_if(|p| p.serves(&segments))
            }
            _ => None,
        };
        earlier.or_else(|| prefetch::start(shared, &segments))
    } else {
        None
    };
    let state = RequestState {
        hashes: hashes.to_vec(),
        start: g1_blocks,
        segments,
        onboard: None,
        prefetch,
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
