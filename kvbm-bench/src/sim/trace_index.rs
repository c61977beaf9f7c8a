//! Per-use facts of a trace, computed once: for every block reference,
//! when the block was used before and will be used next, how often it was
//! used so far; for every request, the shape features an online policy can
//! see. The bound studies ([`super::hindsight`], [`super::scored_tiers`])
//! read everything from here so that each policy variant costs one replay,
//! not one more pass over the trace.
//!
//! A *use* is one (request, position) pair of the flattened block stream;
//! times are request indices (the study's clock ticks once per request).

use std::collections::HashMap;

use kvbm_testkit::trace::{BlockId, Request};

/// "No such request" (never used before, or never used again).
pub const NO_REQUEST: u32 = u32::MAX;

/// What is known about one use of a block, in hindsight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UseFacts {
    /// Index of the next request carrying the same block, or [`NO_REQUEST`].
    pub next_request: u32,
    /// Index of the previous request carrying it, or [`NO_REQUEST`].
    pub prev_request: u32,
    /// Requests that carried the block so far, this one included.
    pub count: u32,
}

/// Request-level features an online policy can observe when the request
/// arrives or finishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestFacts {
    /// Prompt blocks of the request.
    pub prompt_blocks: u32,
    /// Blocks never seen in any earlier request.
    pub new_blocks: u32,
    /// Leading blocks seen in some earlier request.
    pub seen_prefix: u32,
    /// Turn number: 1 for a request whose first block is new, else one
    /// more than the turn of the request that introduced its deepest
    /// already-seen block.
    pub turn: u32,
    /// Requests that arrived in the 10 s before this one.
    pub arrivals_10s: u32,
}

/// Per-use and per-request facts of a trace.
#[derive(Debug, Clone)]
pub struct TraceIndex {
    /// One entry per position of the flattened block stream.
    pub uses: Vec<UseFacts>,
    /// Per request, the position of its first block in the flattened stream.
    pub first_position: Vec<usize>,
    /// Per request, its observable shape.
    pub requests: Vec<RequestFacts>,
    /// Per request, its arrival time in ms.
    pub timestamps_ms: Vec<u64>,
    /// Per request, its output length in tokens.
    pub output_lengths: Vec<u32>,
    /// Per request, its prompt length in tokens.
    pub input_lengths: Vec<u32>,
    /// Every block that some request carried directly after `parent` (the
    /// chained hash makes the parent of a block unique).
    pub children: HashMap<BlockId, Vec<BlockId>>,
}

impl TraceIndex {
    /// Indexes `requests`.
    pub fn new(requests: &[Request]) -> Self {
        let total: usize = requests.iter().map(|r| r.hash_ids.len()).sum();
        let mut uses = vec![
            UseFacts {
                next_request: NO_REQUEST,
                prev_request: NO_REQUEST,
                count: 0,
            };
            total
        ];
        let mut first_position = Vec::with_capacity(requests.len());
        let mut facts = Vec::with_capacity(requests.len());
        let mut children: HashMap<BlockId, Vec<BlockId>> = HashMap::new();
        // Block -> (last request, last position, uses so far, turn of the
        // request that introduced it).
        let mut last: HashMap<BlockId, (u32, usize, u32, u32)> = HashMap::new();
        let mut window_start = 0usize;
        let mut pos = 0usize;
        for (r, req) in requests.iter().enumerate() {
            first_position.push(pos);
            while requests[window_start].timestamp_ms + 10_000 < req.timestamp_ms {
                window_start += 1;
            }
            let seen_prefix = req
                .hash_ids
                .iter()
                .take_while(|b| last.contains_key(b))
                .count();
            let turn = if seen_prefix == 0 {
                1
            } else {
                last[&req.hash_ids[seen_prefix - 1]].3 + 1
            };
            let mut new_blocks = 0;
            for (i, &b) in req.hash_ids.iter().enumerate() {
                if i > 0 {
                    let parent = req.hash_ids[i - 1];
                    let kids = children.entry(parent).or_default();
                    if !kids.contains(&b) {
                        kids.push(b);
                    }
                }
                let entry = last.entry(b).or_insert_with(|| {
                    new_blocks += 1;
                    (NO_REQUEST, usize::MAX, 0, turn)
                });
                if entry.1 != usize::MAX {
                    uses[entry.1].next_request = r as u32;
                }
                uses[pos + i] = UseFacts {
                    next_request: NO_REQUEST,
                    prev_request: entry.0,
                    count: entry.2 + 1,
                };
                *entry = (r as u32, pos + i, entry.2 + 1, entry.3);
            }
            facts.push(RequestFacts {
                prompt_blocks: req.hash_ids.len() as u32,
                new_blocks,
                seen_prefix: seen_prefix as u32,
                turn,
                arrivals_10s: (r - window_start) as u32,
            });
            pos += req.hash_ids.len();
        }
        Self {
            uses,
            first_position,
            requests: facts,
            timestamps_ms: requests.iter().map(|r| r.timestamp_ms).collect(),
            output_lengths: requests.iter().map(|r| r.output_length).collect(),
            input_lengths: requests.iter().map(|r| r.input_length).collect(),
            children,
        }
    }

    /// Number of requests indexed.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether the trace was empty.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Facts of the block at `position` of request `request`.
    pub fn use_at(&self, request: usize, position: usize) -> UseFacts {
        self.uses[self.first_position[request] + position]
    }

    /// Requests between this use and the next one (`None`: never again).
    pub fn gap(&self, request: usize, position: usize) -> Option<u32> {
        let u = self.use_at(request, position);
        (u.next_request != NO_REQUEST).then(|| u.next_request - request as u32)
    }
}
