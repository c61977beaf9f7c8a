//! Workload traces: what requests arrive, when, and which prompt blocks
//! they carry.
//!
//! A request is reduced to what a KV cache can see of it: its arrival time,
//! its prompt and output lengths in tokens, and the chained hash of every
//! prompt block (`hash_ids`). Equal ids at equal positions mean a reusable
//! prefix, exactly as kvbm's sequence hashes do, so a trace can drive the
//! cache simulators and the replay benchmark of kvbm-bench.
//!
//! Three sources: the public Mooncake traces ([`mooncake`], JSONL, 512-token
//! blocks), a deterministic synthetic multi-turn workload ([`synthetic`])
//! that needs no data files, and an agentic mode of it ([`agentic`]: tool
//! loops with heavy-tailed pauses among chat traffic, each request knowing
//! when its program calls next). A trace read from a file is checked for
//! consistency across its lines ([`validate`]). Tests find the published
//! traces with [`mooncake_trace_or_skip`], which skips without them unless
//! `KVBM_REQUIRE_TRACES=1` makes that a failure.

pub mod agentic;
pub mod mooncake;
pub mod synthetic;
pub mod validate;

pub use agentic::{AgenticConfig, AgenticTrace, NextCall, generate_agentic};
pub use mooncake::{
    LineError, MOONCAKE_DATA_DIR, MissingTrace, MooncakeReader, REQUIRE_TRACES_ENV,
    TRACE_SKIP_LINE, TraceError, find_mooncake_dir, mooncake_file_name, mooncake_trace_or_skip,
    read_mooncake,
};
pub use synthetic::{SyntheticConfig, generate_synthetic};
pub use validate::{ChainError, ChainValidator};

/// Tokens per block in the Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// Identifier of one prompt block: a chained prefix hash, remapped to a
/// small integer by the trace's producer.
pub type BlockId = u64;

/// One request of a workload trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp_ms: u64,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Generated tokens.
    pub output_length: u32,
    /// Chained hash of every prompt block, the last one possibly partial:
    /// `hash_ids.len() == ceil(input_length / block_tokens)`.
    pub hash_ids: Vec<BlockId>,
}

impl Request {
    /// Number of prompt blocks a request of `input_length` tokens has with
    /// blocks of `block_tokens` tokens (the last one may be partial).
    pub fn blocks_for(input_length: u32, block_tokens: u32) -> usize {
        input_length.div_ceil(block_tokens.max(1)) as usize
    }

    /// Whether the last prompt block is only partly filled. An engine never
    /// registers a partial block under a hash, so the next turn of the same
    /// conversation names that position with a new id.
    pub fn last_block_partial(&self, block_tokens: u32) -> bool {
        block_tokens != 0 && !self.input_length.is_multiple_of(block_tokens)
    }

    /// Prompt blocks an engine can cache and reuse: all but a partial last
    /// block.
    pub fn full_blocks(&self, block_tokens: u32) -> usize {
        let n = self.hash_ids.len();
        n - usize::from(n > 0 && self.last_block_partial(block_tokens))
    }
}

/// Summary figures of a trace, used to size caches and to check that a
/// file was read completely.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceFacts {
    /// Requests in the trace.
    pub requests: usize,
    /// Prompt block references (sum of `hash_ids.len()`).
    pub block_references: usize,
    /// Distinct block ids.
    pub unique_blocks: usize,
}

impl TraceFacts {
    /// Counts the facts of `requests`.
    pub fn of(requests: &[Request]) -> Self {
        let mut unique = std::collections::HashSet::new();
        let mut refs = 0;
        for r in requests {
            refs += r.hash_ids.len();
            unique.extend(r.hash_ids.iter().copied());
        }
        Self {
            requests: requests.len(),
            block_references: refs,
            unique_blocks: unique.len(),
        }
    }
}
