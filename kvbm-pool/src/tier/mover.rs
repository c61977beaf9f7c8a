//! The seam between the tier engine's books and the bytes.
//!
//! The engine decides *which* blocks move (pool block `i` of a tier is
//! memory block `i` of that tier); a [`TierMover`] owns the memory and
//! moves them. In one process that is [`LocalMover`]: the tiers'
//! [`PhysicalLayout`]s and one [`Executor`]. With tensor parallelism every
//! block is sliced across several processes, and a distributed mover
//! (kvbm-dist) broadcasts the same copy to every worker instead; the engine
//! does not change.

use kvbm_transfer::{CancelToken, Completion, Executor, PhysicalLayout, TransferOutcome};

use super::{TierError, TierLayouts};
use crate::config::Tier;
use kvbm_block::SequenceHash;

/// What a block written into G2 or G3 holds: its sequence hash and its
/// parent's.
pub type BlockLabel = (SequenceHash, Option<SequenceHash>);

/// Moves block bytes between tiers for a [`super::TierEngine`].
///
/// Contract: a copy completes once every target in its outcome's completed
/// set holds its source's bytes; the engine registers exactly those targets
/// and frees the others. A mover must never report a pair completed whose
/// bytes did not land everywhere they live (on every worker, for a
/// distributed mover).
pub trait TierMover: Send + Sync + 'static {
    /// Blocks of `tier`'s memory; `None` when the tier is absent. G1 must
    /// be present.
    fn capacity(&self, tier: Tier) -> Option<usize>;

    /// Bytes of one block of `tier` (for a distributed mover: summed over
    /// its workers). Used for metrics only.
    fn block_bytes(&self, tier: Tier) -> u64;

    /// Copies block `s` of `src` into block `d` of `dst` for every `(s, d)`
    /// in `pairs`. Setting `cancel` stops work not yet started; the outcome
    /// then reports which pairs did land.
    fn copy(
        &self,
        src: Tier,
        dst: Tier,
        pairs: Vec<(usize, usize)>,
        cancel: CancelToken,
    ) -> Completion<TransferOutcome>;

    /// [`TierMover::copy`] into a pool block of G2 or G3, with what each
    /// target block holds (`labels[i]`, its sequence hash and its
    /// parent's, for `pairs[i]`): a mover whose tier outlives the engine
    /// records it with the bytes, so a restarted engine finds the block
    /// again; others ignore it.
    fn copy_labelled(
        &self,
        src: Tier,
        dst: Tier,
        pairs: Vec<(usize, usize)>,
        labels: Vec<BlockLabel>,
        cancel: CancelToken,
    ) -> Completion<TransferOutcome> {
        let _ = labels;
        self.copy(src, dst, pairs, cancel)
    }

    /// The tier's memory in this process, where there is one (tests and
    /// benchmarks fill and check bytes through it).
    fn local_layout(&self, _tier: Tier) -> Option<&PhysicalLayout> {
        None
    }
}

/// The tiers' memory in this process, moved by one [`Executor`].
pub struct LocalMover {
    layouts: TierLayouts,
    executor: Executor,
}

impl std::fmt::Debug for LocalMover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalMover")
            .field("layouts", &self.layouts)
            .finish_non_exhaustive()
    }
}

impl LocalMover {
    /// Binds `layouts` to `executor`. Every tier must have G1's block shape
    /// (the same bytes per block, split the same way).
    pub fn new(layouts: TierLayouts, executor: Executor) -> Result<Self, TierError> {
        let g1 = layouts.g1.layout().config();
        for l in [&layouts.g2, &layouts.g3].into_iter().flatten() {
            g1.same_block_shape(l.layout().config())
                .map_err(|e| TierError::InvalidConfig(format!("tier block shapes differ: {e}")))?;
        }
        Ok(Self { layouts, executor })
    }

    /// The executor that moves the bytes.
    pub fn executor(&self) -> &Executor {
        &self.executor
    }

    fn layout(&self, tier: Tier) -> Option<&PhysicalLayout> {
        match tier {
            Tier::G1 => Some(&self.layouts.g1),
            Tier::G2 => self.layouts.g2.as_ref(),
            Tier::G3 => self.layouts.g3.as_ref(),
            Tier::G4 => None,
        }
    }
}

impl TierMover for LocalMover {
    fn capacity(&self, tier: Tier) -> Option<usize> {
        self.layout(tier).map(|l| l.layout().config().num_blocks())
    }

    fn block_bytes(&self, tier: Tier) -> u64 {
        self.layout(tier)
            .map_or(0, |l| l.layout().config().block_bytes())
    }

    fn copy(
        &self,
        src: Tier,
        dst: Tier,
        pairs: Vec<(usize, usize)>,
        cancel: CancelToken,
    ) -> Completion<TransferOutcome> {
        match (self.layout(src), self.layout(dst)) {
            (Some(s), Some(d)) => self
                .executor
                .transfer_with(s, d, &pairs, cancel)
                .into_completion(),
            _ => Completion::ready(Err(Box::new(kvbm_transfer::TransferFailure {
                error: kvbm_transfer::TransferError::InvalidRequest(format!(
                    "no memory for {src:?} -> {dst:?} in this engine"
                )),
                completed: Vec::new(),
                failed: pairs,
                culprit: None,
            }))),
        }
    }

    fn local_layout(&self, tier: Tier) -> Option<&PhysicalLayout> {
        self.layout(tier)
    }
}
