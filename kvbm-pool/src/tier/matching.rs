//! Hierarchical prefix match: G1, then G2, then G3, one contiguous prefix.

use std::sync::Arc;

use kvbm_block::SequenceHash;

use super::prefetch::{self, Prefetch};
use super::requests::{RequestState, Segment};
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

/// What a match found: the G1 prefix and the held G2/G3 runs after it.
struct Found {
    /// The G1 prefix, held ([`G1Lookup::Pool`] only).
    g1_held: ImmutableBlocks,
    /// Leading blocks in G1 (held above, or the engine's own count).
    g1_blocks: usize,
    /// Held runs of G2 and G3 blocks after the G1 prefix, in prefix order.
    segments: Vec<Segment>,
    /// Blocks in `segments` from G2 and from G3.
    in_g2: usize,
    in_g3: usize,
}

impl Found {
    /// Blocks matched in all tiers together.
    fn total(&self) -> usize {
        self.g1_blocks + self.in_g2 + self.in_g3
    }

    /// Takes blocks dropped from `segments` (G2's, G3's) off the counts.
    fn count_dropped(&mut self, [d2, d3]: [usize; 2]) {
        self.in_g2 -= d2;
        self.in_g3 -= d3;
    }

    /// Whether each external block comes from G3, in prefix order.
    fn g3_flags(&self) -> Vec<bool> {
        self.segments
            .iter()
            .flat_map(|seg| std::iter::repeat_n(seg.g3, seg.blocks.len()))
            .collect()
    }
}

/// Matches `request`: see [`super::TierEngine::match_request`].
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
    if shared.requests.first_match(&request)? {
        record_use(shared, hashes);
    }
    let mut found = find(shared, hashes, g1);
    shared.metrics.matched(
        hashes.len() as u64,
        [
            found.g1_blocks as u64,
            found.in_g2 as u64,
            found.in_g3 as u64,
        ],
    );
    let gave_back = give_back_last(&mut found, bs, prompt_tokens);
    let declined = decline_slow_tail(shared, &mut found);
    if let G1Lookup::Pool = g1 {
        found.g1_blocks = found.g1_held.len();
    }
    let prefetch = prefetch_for(shared, &request, &found);
    let result = TierMatch {
        g1: found.g1_held,
        g1_blocks: found.g1_blocks,
        g2_blocks: found.in_g2,
        g3_blocks: found.in_g3,
        gave_back,
        declined_blocks: declined,
        block_size: bs,
    };
    let state = RequestState::matched(hashes.to_vec(), found.g1_blocks, found.segments, prefetch);
    shared.requests.insert(request, state)?;
    Ok(result)
}

/// Records a request's first match as a use of its blocks.
///
/// The use history feeds the reuse-score ranking and `min_uses`
/// admission; with write-through tiers nothing reads it. Recording costs
/// a table update per prompt block, so the request is only queued here:
/// any reader of the history applies the queue before it reads, the
/// offload worker applies it whenever it is awake with nothing else to do
/// (and releases wake it), and a queue this long wakes it too.
fn record_use(shared: &Shared, hashes: &[SequenceHash]) {
    if !shared.config.uses_history() {
        return;
    }
    let queued = shared.books.record_use_later(hashes);
    if queued >= WAKE_AT_BLOCKS && queued - hashes.len() < WAKE_AT_BLOCKS {
        shared.offload.apply_history();
    }
}

/// The longest prefix of `hashes` in G1 (as `g1` says), continued in G2
/// and G3 block by block: each run is taken from whichever tier holds the
/// next block, so the prefix may alternate between them.
fn find(shared: &Shared, hashes: &[SequenceHash], g1: G1Lookup) -> Found {
    let (g1_held, g1_blocks) = match g1 {
        G1Lookup::Pool => {
            let held = shared.books.g1().pool.match_prefix(hashes);
            let n = held.len();
            (held, n)
        }
        G1Lookup::Engine { blocks } => (ImmutableBlocks::empty(), blocks.min(hashes.len())),
    };
    let mut found = Found {
        g1_held,
        g1_blocks,
        segments: Vec::new(),
        in_g2: 0,
        in_g3: 0,
    };
    loop {
        let before = found.total();
        for (is_g3, tier) in [(false, shared.books.g2()), (true, shared.books.g3())] {
            let Some(tier) = tier else { continue };
            let mut run = tier.pool.match_prefix(&hashes[found.total()..]);
            if is_g3 {
                // A block whose write to G3 failed is not there.
                let written = super::behind::written_prefix(shared, run.block_ids());
                run.truncate(written);
            }
            if run.is_empty() {
                continue;
            }
            if is_g3 {
                found.in_g3 += run.len();
            } else {
                found.in_g2 += run.len();
            }
            found.segments.push(Segment {
                g3: is_g3,
                blocks: run,
            });
        }
        let at = found.total();
        if at == before || at == hashes.len() {
            return found;
        }
    }
}

/// The full-prompt rule: the engine must compute at least one token, so
/// a match covering the whole prompt gives its last block back. Returns
/// whether it did.
fn give_back_last(found: &mut Found, block_size: usize, prompt_tokens: usize) -> bool {
    let at = found.total();
    if at == 0 || at * block_size < prompt_tokens {
        return false;
    }
    if let Some(last) = found.segments.last_mut() {
        if last.g3 {
            found.in_g3 -= 1;
        } else {
            found.in_g2 -= 1;
        }
        last.blocks.truncate(last.blocks.len() - 1);
        if last.blocks.is_empty() {
            found.segments.pop();
        }
        true
    } else if !found.g1_held.is_empty() {
        found.g1_held.truncate(found.g1_held.len() - 1);
        true
    } else {
        // The engine's own G1 prefix covers it: its rule, not ours.
        false
    }
}

/// Load or recompute: the cost model may leave the tail of the external
/// blocks to the engine. Returns how many blocks it left.
fn decline_slow_tail(shared: &Shared, found: &mut Found) -> usize {
    let cost = &shared.config.load_cost;
    let external = found.in_g2 + found.in_g3;
    if cost.recompute_tokens_per_s.is_none() || external == 0 {
        return 0;
    }
    let bytes = |t: Option<&super::TierSlot>| t.map_or(0, |t| t.block_bytes);
    let keep = cost.blocks_worth_loading(
        shared.rates.current(cost),
        shared.config.block_size,
        [bytes(shared.books.g2()), bytes(shared.books.g3())],
        &found.g3_flags(),
    );
    if keep >= external {
        return 0;
    }
    shared.rates.declined(cost);
    let dropped = truncate_segments(&mut found.segments, keep);
    found.count_dropped(dropped);
    dropped[0] + dropped[1]
}

/// The G3 read of a match: the disk starts now, while the engine allocates
/// G1 — unless an earlier match of this request already reads the same
/// blocks.
fn prefetch_for(shared: &Arc<Shared>, request: &RequestId, found: &Found) -> Option<Arc<Prefetch>> {
    if found.in_g3 == 0 {
        return None;
    }
    shared
        .requests
        .take_prefetch_serving(request, found.g1_blocks, &found.segments)
        .or_else(|| prefetch::start(shared, &found.segments))
}
