//! The distributed mover: the tier engine's copies, run on every worker.
//!
//! A copy is checked here against the tiers every worker holds (a bad
//! request fails at once, nothing is sent), then handed to the leader's
//! event loop, which broadcasts it and resolves the completion when every
//! worker has answered. Capacities are per worker (every worker holds the
//! same blocks); a block's bytes are summed over workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use kvbm_pool::Tier;
use kvbm_pool::tier::{BlockLabel as PoolLabel, TierMover};
use kvbm_transfer::{
    CancelToken, Completer, Completion, TransferError, TransferFailure, TransferOutcome,
    completion_pair,
};

use crate::loan::{LocalRoute, RouteSlot};
use crate::proto::BlockLabel;
use crate::proto::TierBounds;
use crate::transport::WakeSender;

use super::{Cluster, Command, StatusCell};

/// A copy on its way to the event loop.
pub(crate) struct CopyRequest {
    pub(crate) src: Tier,
    pub(crate) dst: Tier,
    pub(crate) pairs: Vec<(usize, usize)>,
    /// Into G3: what each pair's block holds (or nothing).
    pub(crate) labels: Vec<BlockLabel>,
    pub(crate) cancel: CancelToken,
    pub(crate) completer: Completer<TransferOutcome>,
}

/// Moves blocks between tiers on every worker of an instance.
pub struct DistMover {
    tx: mpsc::Sender<Command>,
    wake: Arc<WakeSender>,
    bounds: TierBounds,
    block_bytes: u64,
    /// Where the only worker, when it runs in this process, lends its
    /// executor (see `loan`).
    local: Option<RouteSlot>,
    status: Arc<StatusCell>,
    /// Whether copies into kept tiers still carry their labels (a reset
    /// stops it: [`DistMover::stop_keeping`]).
    keeping: AtomicBool,
}

impl std::fmt::Debug for DistMover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistMover")
            .field("bounds", &self.bounds)
            .field("block_bytes", &self.block_bytes)
            .finish_non_exhaustive()
    }
}

/// The error of a copy the leader refused or a worker failed.
pub(crate) fn dist_error(message: String) -> TransferError {
    TransferError::Backend {
        backend: "kvbm-dist",
        message,
    }
}

/// A failure in which nothing landed.
pub(crate) fn nothing_landed(message: String, pairs: Vec<(usize, usize)>) -> TransferOutcome {
    Err(Box::new(TransferFailure {
        error: dist_error(message),
        completed: Vec::new(),
        failed: pairs,
        culprit: None,
    }))
}

impl DistMover {
    pub(crate) fn new(
        tx: mpsc::Sender<Command>,
        wake: Arc<WakeSender>,
        cluster: &Cluster,
        local: Option<RouteSlot>,
        status: Arc<StatusCell>,
    ) -> Self {
        let world = cluster.identities.len() as u64;
        DistMover {
            tx,
            wake,
            local,
            status,
            bounds: TierBounds {
                g1: cluster.reference.device_blocks,
                g2: cluster.configure.g2_blocks,
                g3: cluster.configure.g3_blocks,
            },
            block_bytes: cluster.reference.bytes_per_block.saturating_mul(world),
            keeping: AtomicBool::new(true),
        }
    }

    /// From now on a copy into a kept tier records nothing, and every
    /// worker empties its kept records (one that is lost now, when it
    /// rejoins), so a restarted engine finds none of the blocks: the
    /// engine's cache was reset, and what it computes after a reset may
    /// come from other weights than those a restarted engine loads (vLLM
    /// resets the cache around an in-place weight update), while what it
    /// stored before may be from weights a restarted engine no longer
    /// loads. The tiers go on serving this engine. Returns at once; the
    /// workers empty their records in order with the copies sent before.
    pub fn stop_keeping(&self) {
        self.keeping.store(false, Ordering::Release);
        if self.tx.send(Command::StopKeeping).is_ok() {
            self.wake.wake();
        }
    }

    fn check(&self, src: Tier, dst: Tier, pairs: &[(usize, usize)]) -> Result<(), String> {
        for t in [src, dst] {
            if self.capacity(t).is_none() {
                return Err(format!("{t:?} is absent on this instance"));
            }
        }
        if src == dst && src != Tier::G2 {
            return Err(format!("source and destination are both {src:?}"));
        }
        if pairs.len() > crate::proto::MAX_PAIRS {
            return Err(format!(
                "{} pairs in one copy (at most {})",
                pairs.len(),
                crate::proto::MAX_PAIRS
            ));
        }
        // An id beyond u32 is beyond every tier (tiers hold at most
        // u32::MAX blocks), so mapping it to u32::MAX keeps it refused.
        let wire: Vec<(u32, u32)> = pairs
            .iter()
            .map(|&(s, d)| {
                (
                    u32::try_from(s).unwrap_or(u32::MAX),
                    u32::try_from(d).unwrap_or(u32::MAX),
                )
            })
            .collect();
        self.bounds
            .check_pairs(src, dst, &wire)
            .map_err(|e| e.to_string())
    }

    /// The route the in-process worker lent, while the instance never lost
    /// a rank.
    fn local_route(&self) -> Option<Arc<LocalRoute>> {
        let route = self.local.as_ref()?.lock().clone()?;
        let s = self.status.status.lock();
        (s.is_whole() && s.losses.is_empty()).then_some(route)
    }

    /// Whether copies now run on the in-process worker's executor.
    #[cfg(test)]
    pub(crate) fn is_local(&self) -> bool {
        self.local_route().is_some()
    }
}

impl TierMover for DistMover {
    /// Blocks of `tier` on each worker; `None` when the tier is absent.
    fn capacity(&self, tier: Tier) -> Option<usize> {
        match self.bounds.capacity(tier) {
            0 => None,
            n => Some(n as usize),
        }
    }

    /// Bytes of one block of `tier`, summed over workers.
    fn block_bytes(&self, tier: Tier) -> u64 {
        match self.capacity(tier) {
            Some(_) => self.block_bytes,
            None => 0,
        }
    }

    /// Copies `pairs` from `src` to `dst` on every worker. Resolves when
    /// every worker has answered: `Ok` when every pair landed everywhere;
    /// otherwise a failure whose `completed` pairs landed on every worker
    /// and whose error names the rank.
    fn copy(
        &self,
        src: Tier,
        dst: Tier,
        pairs: Vec<(usize, usize)>,
        cancel: CancelToken,
    ) -> Completion<TransferOutcome> {
        self.run(src, dst, pairs, Vec::new(), cancel)
    }

    /// [`TierMover::copy`] into G2 or G3, the labels sent with the pairs:
    /// a worker whose tier outlives the engine records them.
    fn copy_labelled(
        &self,
        src: Tier,
        dst: Tier,
        pairs: Vec<(usize, usize)>,
        labels: Vec<PoolLabel>,
        cancel: CancelToken,
    ) -> Completion<TransferOutcome> {
        let keeping = self.keeping.load(Ordering::Acquire);
        let labels = labels
            .into_iter()
            .filter(|_| keeping)
            .map(|(hash, parent)| BlockLabel {
                hash: hash.0,
                parent: parent.map(|p| p.0),
            })
            .collect();
        self.run(src, dst, pairs, labels, cancel)
    }
}

impl DistMover {
    /// Copies `pairs` on every worker (the in-process one's executor when
    /// it lent it), with `labels` for a copy into G2 or G3.
    fn run(
        &self,
        src: Tier,
        dst: Tier,
        pairs: Vec<(usize, usize)>,
        labels: Vec<BlockLabel>,
        cancel: CancelToken,
    ) -> Completion<TransferOutcome> {
        if let Err(e) = self.check(src, dst, &pairs) {
            return Completion::ready(nothing_landed(e, pairs));
        }
        if pairs.is_empty() {
            return Completion::ready(Ok(kvbm_transfer::TransferReport::default()));
        }
        if let Some(route) = self.local_route()
            && route.tiers.end(src).is_some()
            && route.tiers.end(dst).is_some()
        {
            // The same checks and records as on the worker's socket.
            let (completer, settled) = completion_pair();
            let status = Arc::clone(&self.status);
            route.tiers.copy(
                &route.executor,
                src,
                dst,
                pairs,
                labels,
                cancel,
                move |outcome, mismatches| {
                    if mismatches > 0 {
                        status.update(|st| st.verify_mismatches += u64::from(mismatches));
                    }
                    completer.complete(outcome);
                },
            );
            return settled;
        }
        let (completer, completion) = completion_pair();
        let request = CopyRequest {
            src,
            dst,
            pairs,
            labels,
            cancel,
            completer,
        };
        // A stopped loop drops the request, and with it the completer: the
        // completion then resolves as abandoned rather than hanging.
        let _ = self.tx.send(Command::Copy(request));
        self.wake.wake();
        completion
    }
}
