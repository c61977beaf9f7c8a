//! The bytes of an onboard: which copies load a request's blocks into G1,
//! and submitting them.
//!
//! Each block the request copies comes from G2 (one G2 → G1 copy), from a
//! staging slot its G3 prefetch read it into (a G2 → G1 copy once the read
//! landed), or straight from G3 (one G3 → G1 read, once the block's write
//! to G3 landed). Every copy counts as one arrival of the job.

use std::sync::Arc;
use std::time::Instant;

use kvbm_transfer::TransferError;

use super::job::OnboardJob;
use crate::config::Tier;
use crate::tier::Shared;
use crate::tier::prefetch::Prefetch;

/// Copy path 0: G2 → G1 (on the job's and the metrics' books).
const FROM_G2: usize = 0;
/// Copy path 1: G3 → G1, straight or through a staging slot.
const FROM_G3: usize = 1;

/// The copies of one onboard, as `(source block, G1 block)` pairs.
pub(super) struct CopyPlan {
    /// From G2.
    g2: Vec<(usize, usize)>,
    /// Straight from G3.
    g3: Vec<(usize, usize)>,
    /// From the staging slots of the prefetch read (slot, G1 block).
    staged: Vec<(usize, usize)>,
}

impl CopyPlan {
    /// The copies of the blocks `own` (indices into the request's blocks,
    /// in `dst_ids` order): `sources[i]` is block `i`'s id in its tier,
    /// `from_g3[i]` whether that is G3; blocks `prefetch` staged come from
    /// their slot.
    pub(super) fn new(
        own: &[usize],
        dst_ids: &[u32],
        from_g3: &[bool],
        sources: &[u32],
        prefetch: Option<&Prefetch>,
    ) -> Self {
        let mut slot_of: Vec<Option<u32>> = vec![None; from_g3.len()];
        if let Some(p) = prefetch {
            for &(i, slot) in p.staged() {
                if i < slot_of.len() {
                    slot_of[i] = Some(slot);
                }
            }
        }
        let mut plan = CopyPlan {
            g2: Vec::new(),
            g3: Vec::new(),
            staged: Vec::new(),
        };
        for (k, &i) in own.iter().enumerate() {
            let d = dst_ids[k] as usize;
            match (from_g3[i], slot_of[i]) {
                (true, Some(slot)) => plan.staged.push((slot as usize, d)),
                (true, None) => plan.g3.push((sources[i] as usize, d)),
                (false, _) => plan.g2.push((sources[i] as usize, d)),
            }
        }
        plan
    }

    /// Whether any block comes from a staging slot.
    pub(super) fn uses_staging(&self) -> bool {
        !self.staged.is_empty()
    }

    /// The transfers the job waits for: one per path used (the staged
    /// copies count once, with the prefetch).
    pub(super) fn transfers(&self, prefetch: bool) -> usize {
        usize::from(!self.g2.is_empty()) + usize::from(!self.g3.is_empty()) + usize::from(prefetch)
    }

    /// Waits until the blocks read straight from G3 may be read (their
    /// writes to G3 landed, write-behind); fails when a write failed.
    pub(super) fn g3_ready(&self, shared: &Shared) -> Result<(), TransferError> {
        if self.g3.is_empty() {
            return Ok(());
        }
        let ids: Vec<u32> = self.g3.iter().map(|&(s, _)| s as u32).collect();
        crate::tier::behind::wait_readable(shared, &ids)
    }

    /// Submits the copies for `job`: G2 → G1, G3 → G1 (failed at once with
    /// `g3_ready`'s error), and the staged ones once `prefetch`'s read
    /// landed.
    pub(super) fn submit(
        self,
        shared: &Arc<Shared>,
        job: &Arc<OnboardJob>,
        g3_ready: Result<(), TransferError>,
        prefetch: Option<Arc<Prefetch>>,
    ) {
        if !self.g2.is_empty() {
            copy_path(shared, job, FROM_G2, self.g2);
        }
        if !self.g3.is_empty() {
            match g3_ready {
                Ok(()) => copy_path(shared, job, FROM_G3, self.g3),
                Err(error) => job.fail_path(shared, FROM_G3, error, self.g3),
            }
        }
        if let Some(p) = prefetch {
            copy_staged(shared, job, p, self.staged);
        }
    }
}

/// Copies `pairs` from G2 (`path` 0) or G3 (`path` 1) into G1, recording
/// the outcome on `job` and the read rate for the cost model.
fn copy_path(shared: &Arc<Shared>, job: &Arc<OnboardJob>, path: usize, pairs: Vec<(usize, usize)>) {
    let tier = if path == FROM_G2 {
        shared.books.g2()
    } else {
        shared.books.g3()
    };
    let Some(tier) = tier else {
        // Blocks held in a tier the engine lacks cannot exist.
        let error = TransferError::InvalidRequest("no such tier".into());
        job.fail_path(shared, path, error, pairs);
        return;
    };
    let (shared2, job2) = (Arc::clone(shared), Arc::clone(job));
    let submitted = Instant::now();
    shared
        .mover
        .copy(tier.tier, Tier::G1, pairs, job.cancel_token().clone())
        .on_complete(move |outcome| {
            let rate = if path == FROM_G2 {
                &shared2.rates.g2
            } else {
                &shared2.rates.g3
            };
            rate.observe_outcome(&outcome, submitted);
            if path == FROM_G3 {
                crate::tier::behind::reads_ended(&shared2, &outcome);
            }
            job2.record(path, outcome);
            job2.arrive(&shared2);
        });
}

/// Copies staged blocks (`(slot, G1 block)` pairs) into G1 once `p`'s read
/// has landed; a failed or cancelled read fails the job instead. Counts as
/// one of the job's transfers (G3 → G1 bytes).
fn copy_staged(
    shared: &Arc<Shared>,
    job: &Arc<OnboardJob>,
    p: Arc<Prefetch>,
    pairs: Vec<(usize, usize)>,
) {
    let (shared2, job2, keep) = (Arc::clone(shared), Arc::clone(job), Arc::clone(&p));
    p.when_read(Box::new(move |read| {
        let read = match read {
            Ok(()) if job2.cancel_token().is_cancelled() => Err(TransferError::Cancelled),
            r => r,
        };
        match read {
            Ok(()) => {
                let (shared3, job3) = (Arc::clone(&shared2), Arc::clone(&job2));
                let submitted = Instant::now();
                shared2
                    .mover
                    .copy(Tier::G2, Tier::G1, pairs, job2.cancel_token().clone())
                    .on_complete(move |outcome| {
                        // The slots stay ours until the copy has ended.
                        drop(keep);
                        shared3.rates.g2.observe_outcome(&outcome, submitted);
                        job3.record(FROM_G3, outcome);
                        job3.arrive(&shared3);
                    });
            }
            Err(error) => {
                drop(keep);
                job2.fail_path(&shared2, FROM_G3, error, pairs);
            }
        }
    }));
}
