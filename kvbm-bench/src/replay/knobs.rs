//! The tier engine's knobs a replay sets, kept apart from the engine so
//! that every instance of a run (the in-process engine, the tensor-parallel
//! one, each restart) is built with the same ones.

use std::sync::Arc;

use kvbm_pool::tier::{LoadCost, OffloadMode, TierEngine, TierMover, TierPolicy};

use crate::error::{BenchError, Result};

/// What a replay changes from the tier engine's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierKnobs {
    /// Tokens per block (the trace's).
    pub block_tokens: usize,
    /// Admission and eviction in G2 and G3.
    pub policy: TierPolicy,
    /// When G1 blocks are copied to G2.
    pub offload_mode: OffloadMode,
    /// Bytes at the end of the mover's G2 set aside for G3 prefetch (0:
    /// none; the in-process replay allocates them beyond G2's pool).
    pub g3_staging_bytes: u64,
    /// The load-or-recompute cost model (`None`: every match is loaded).
    pub load_cost: Option<LoadCost>,
    /// G1 slots kept free ahead of need (`None`: the engine's own size).
    pub g1_free_reserve: Option<usize>,
    /// Offload batches in flight at once (`None`: the engine's default).
    pub offload_in_flight: Option<usize>,
}

impl TierKnobs {
    /// A tier engine with these knobs over the memory `mover` owns.
    pub fn build(&self, mover: Arc<dyn TierMover>) -> Result<TierEngine> {
        let mut builder = TierEngine::builder_with_mover(mover, self.block_tokens)
            .g2_policy(self.policy)
            .g3_policy(self.policy)
            .offload_mode(self.offload_mode)
            .g3_staging_bytes(self.g3_staging_bytes);
        if let Some(cost) = self.load_cost {
            builder = builder.load_cost(cost);
        }
        if let Some(n) = self.g1_free_reserve {
            builder = builder.g1_free_reserve(n);
        }
        if let Some(n) = self.offload_in_flight {
            builder = builder.offload_in_flight(n);
        }
        builder.build().map_err(|e| BenchError::Tier(e.to_string()))
    }
}
