//! Verify mode: a checksum of every block written into G2 or G3, checked
//! when the block is read back.
//!
//! Defence in depth against bytes that change at rest (a stray write into
//! host memory, a disk that returns other bytes than it was given): with
//! `Configure::verify` on, the worker that owns the bytes records the
//! checksum of each block (`kvbm_transfer::checksum`) as it lands in G2 or
//! G3 and checks it when the block is copied out again. A block that fails
//! is a failed pair of the copy (the engine recomputes it), never served.
//!
//! One table per worker ([`Checksums`]), keyed by `(tier, slot)`, lives in
//! the worker's tiers, so the copies the worker runs for its socket and
//! the ones its leader runs on the lent executor (see `loan`) settle
//! through the same code ([`Checksums::settle_later`]). A block's sum is
//! taken over its chunks in layer, K/V order, so it does not depend on the
//! layout: a block in G2, in G3 (padded) and in a host G1 sums alike.
//!
//! What is checked, per copy, once its bytes landed:
//! - into G2 (from G1, G3, G2 or a peer's G2): the sum of the destination
//!   block, read from the destination, is recorded; from a G1 on a GPU,
//!   the sum of the source taken on the GPU while the copy runs (module
//!   `device`);
//! - out of G2 (to G1, G2 or G3): the source block is checked against its
//!   recorded sum; into a G1 on a GPU, the destination is summed on the
//!   GPU once it landed; into G3 the verified sum is recorded for the G3
//!   slot (the disk is not read back);
//! - G1 → G3: the sum of the G1 source is recorded (taken on the GPU for a
//!   device G1);
//! - out of G3: the destination is summed (on the GPU for a device G1) and
//!   compared with the G3 slot's sum. Without the GPU summer (no feature
//!   `cuda`, or its kernel failed to load), G1 blocks in GPU memory cannot
//!   be read: a G1 → G2/G3 copy is checked by reading the destination, and
//!   a G3 → G1 copy by reading the G3 block from the file again, which
//!   catches what changed on disk but not a fault of the device copy.
//!
//! A slot read with no recorded sum (never written while verify was on)
//! fails the check. A slot whose copy failed loses its sum; an overwritten
//! slot gets the new one. Mismatches are counted and logged at most once
//! every [`WARN_EVERY`](kvbm_pool::rate_limit::WARN_EVERY).

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvbm_pool::Tier;
use kvbm_pool::rate_limit::RateLimit;
use kvbm_transfer::checksum::BlockChecksum;
use kvbm_transfer::{Completion, PhysicalLayout, TransferError, TransferFailure, TransferOutcome};
use parking_lot::Mutex;

pub(crate) use self::device::{DeviceSums, Prepared};
use crate::error::DistError;

mod device;
pub(crate) mod pieces;

/// Most threads one copy's hashing uses.
const MAX_THREADS: usize = 8;
/// Bytes below which another hashing thread is not worth its start.
const BYTES_PER_THREAD: u64 = 8 << 20;

/// One end of a copy: the tier and its memory.
#[derive(Clone)]
pub(crate) struct End {
    /// G1, G2, G3, or G4 for a peer instance's G2 (never read here).
    pub(crate) tier: Tier,
    /// The memory of the tier on this worker.
    pub(crate) layout: PhysicalLayout,
}

/// Which tiers keep checksums: both in verify mode; G3 alone where G3
/// outlives the engine (its records carry the sums) and verify is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tracked {
    pub(crate) g2: bool,
    pub(crate) g3: bool,
}

impl Tracked {
    /// Both G2 and G3.
    pub(crate) const ALL: Tracked = Tracked { g2: true, g3: true };

    /// Whether `tier` keeps checksums.
    fn of(self, tier: Tier) -> bool {
        match tier {
            Tier::G2 => self.g2,
            Tier::G3 => self.g3,
            _ => false,
        }
    }
}

impl Default for Tracked {
    fn default() -> Self {
        Tracked::ALL
    }
}

/// The checksums of one worker's G2 and G3 blocks, and its mismatches.
#[derive(Default)]
pub(crate) struct Checksums {
    tracked: Tracked,
    sums: Mutex<HashMap<(Tier, u32), u64>>,
    /// Sums G1 blocks on the GPU, when G1 is device memory.
    device: Option<DeviceSums>,
    mismatches: AtomicU64,
    /// At most one mismatch warning every [`WARN_EVERY`](kvbm_pool::rate_limit::WARN_EVERY).
    warned: RateLimit,
}

/// Calls `f(chunk, index of its first byte in the block)` for every chunk
/// of `block`, in layer, K/V order: the walk a block's checksum (and a test
/// pattern, feature `probe`) follows, whatever the layout.
pub(crate) fn for_each_chunk(
    g1: &PhysicalLayout,
    block: usize,
    mut f: impl FnMut(kvbm_layout::Chunk, u64) -> Result<(), String>,
) -> Result<(), String> {
    let layout = g1.layout();
    let c = *layout.config();
    let mut i = 0u64;
    for layer in 0..c.num_layers() {
        for outer in 0..c.outer_dim() {
            let chunk = layout
                .chunk(block, layer, outer)
                .map_err(|e| e.to_string())?;
            let len = chunk.len;
            f(chunk, i)?;
            i += len;
        }
    }
    Ok(())
}

/// The checksum of `block` of `layout`, over its chunks in layer, K/V
/// order; host memory and disk files can be read, device memory cannot
/// (see [`DeviceSums`]).
pub(crate) fn block_sum(layout: &PhysicalLayout, block: usize) -> Result<u64, String> {
    let host = layout.kind().is_host();
    let mut hasher = BlockChecksum::new();
    let mut file: Option<(usize, File)> = None;
    let mut buf = Vec::new();
    for_each_chunk(layout, block, |chunk, _| {
        let region = layout
            .regions()
            .get(chunk.region)
            .ok_or_else(|| format!("chunk in region {} beyond the layout", chunk.region))?;
        if host {
            let addr = region
                .addr()
                .ok_or_else(|| "a host region without an address".to_string())?;
            // SAFETY: host memory (checked above) that the region's owner
            // keeps alive while `layout` lives; the layout proved the chunk
            // lies inside its region. The block is not written while its
            // copy is being settled (the tier engine holds it), and the
            // bytes are only read.
            let bytes = unsafe {
                std::slice::from_raw_parts((addr + chunk.offset) as *const u8, chunk.len as usize)
            };
            hasher.update(bytes);
            return Ok(());
        }
        let Some((disk, base)) = region.file_location() else {
            return Err(format!("{:?} memory cannot be read here", layout.kind()));
        };
        if file.as_ref().is_none_or(|(r, _)| *r != chunk.region) {
            let f = File::open(disk.path())
                .map_err(|e| format!("open {}: {e}", disk.path().display()))?;
            file = Some((chunk.region, f));
        }
        let Some((_, f)) = &file else {
            return Err("no file".into());
        };
        buf.resize(chunk.len as usize, 0);
        f.read_exact_at(&mut buf, base + chunk.offset)
            .map_err(|e| format!("read {}: {e}", disk.path().display()))?;
        hasher.update(&buf);
        Ok(())
    })?;
    Ok(hasher.digest())
}

impl Checksums {
    /// An empty table of the `tracked` tiers for a worker whose G1 is
    /// `g1`.
    pub(crate) fn new(g1: &PhysicalLayout, tracked: Tracked) -> Self {
        Checksums {
            tracked,
            device: DeviceSums::for_g1(g1),
            ..Self::default()
        }
    }

    /// Records `sum` for `slot` of `tier` (a block found again in a G3
    /// that outlived its engine).
    pub(crate) fn seed(&self, tier: Tier, sums: impl IntoIterator<Item = (u32, u64)>) {
        let mut table = self.sums.lock();
        for (slot, sum) in sums {
            table.insert((tier, slot), sum);
        }
    }

    /// Whether copies between `src` and `dst` are checked at all.
    pub(crate) fn checks(&self, src: Tier, dst: Tier) -> bool {
        self.tracked.of(src) || self.tracked.of(dst)
    }

    /// The GPU summer, when it can read `end`'s memory.
    fn device_for(&self, end: &End) -> Option<&DeviceSums> {
        self.device.as_ref().filter(|d| d.covers(end))
    }

    /// Mismatches found since the table was made.
    pub(crate) fn mismatches(&self) -> u64 {
        self.mismatches.load(Ordering::Relaxed)
    }

    /// The sum recorded for `slot` of `tier`.
    pub(crate) fn get(&self, tier: Tier, slot: u32) -> Option<u64> {
        self.sums.lock().get(&(tier, slot)).copied()
    }

    /// Checks and records what a copy moved, on a thread of its own (so
    /// hashing never holds the executor's): sources that stay unchanged
    /// while the copy runs (a G2 block, a G3 block bound for device memory)
    /// are hashed while it runs, the rest once `completion` resolves. Then
    /// calls `done` with the settled outcome and the number of pairs that
    /// failed their check.
    pub(crate) fn settle_later(
        self: &Arc<Self>,
        src: End,
        dst: End,
        pairs: Vec<(usize, usize)>,
        completion: Completion<TransferOutcome>,
        done: impl FnOnce(TransferOutcome, u32) + Send + 'static,
    ) {
        if !self.checks(src.tier, dst.tier) {
            completion.on_complete(move |outcome| done(outcome, 0));
            return;
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        completion.on_complete(move |outcome| {
            let _ = tx.send(outcome);
        });
        let this = Arc::clone(self);
        let job = move || {
            let early = this.sum_sources(&src, &dst, &pairs);
            let landing = this.prepare_landing(&src, &dst, &pairs);
            let outcome = rx.recv().unwrap_or_else(|_| {
                Err(Box::new(TransferFailure {
                    error: TransferError::Backend {
                        backend: "kvbm-dist verify",
                        message: "the copy ended without an outcome".into(),
                    },
                    completed: Vec::new(),
                    failed: pairs.clone(),
                    culprit: None,
                }))
            });
            let (outcome, mismatches) =
                this.settle_with(&src, &dst, &pairs, outcome, &early, landing);
            done(outcome, mismatches);
        };
        // A thread of its own; when none can be had, here (waiting for the
        // copy).
        let slot = Arc::new(Mutex::new(Some(job)));
        let theirs = Arc::clone(&slot);
        let spawned = std::thread::Builder::new()
            .name("kvbm-verify".into())
            .spawn(move || {
                if let Some(job) = theirs.lock().take() {
                    job();
                }
            });
        if spawned.is_err()
            && let Some(job) = slot.lock().take()
        {
            job();
        }
    }

    /// The sums of `pairs`' sources that no copy changes while this one
    /// reads them (see [`Checksums::settle_later`]), in pair order; `None`
    /// where the source is summed after the copy, or not at all.
    fn sum_sources(
        &self,
        src: &End,
        dst: &End,
        pairs: &[(usize, usize)],
    ) -> Vec<Option<Result<u64, String>>> {
        if self.tracked.of(dst.tier)
            && let Some(device) = self.device_for(src)
        {
            let blocks: Vec<usize> = pairs.iter().map(|p| p.0).collect();
            return match device.sums(&src.layout, &blocks) {
                Ok(sums) => sums.into_iter().map(|s| Some(Ok(s))).collect(),
                Err(e) => vec![Some(Err(e)); pairs.len()],
            };
        }
        // A destination the GPU sums once it landed needs no source sum.
        let early = self.device_for(dst).is_none()
            && match src.tier {
                Tier::G2 => true,
                Tier::G3 => !dst.layout.kind().is_host(),
                _ => false,
            };
        if !early {
            return vec![None; pairs.len()];
        }
        par_map(src, pairs.len(), true, |i| {
            Some(block_sum(&src.layout, pairs[i].0))
        })
    }

    /// The destinations of `pairs` ready to be summed on the GPU once the
    /// copy landed, when the source keeps sums and the destination is
    /// device memory the GPU summer reads (worked out while the copy runs).
    fn prepare_landing(
        &self,
        src: &End,
        dst: &End,
        pairs: &[(usize, usize)],
    ) -> Option<Result<Prepared, String>> {
        let device = self.device_for(dst).filter(|_| self.tracked.of(src.tier))?;
        let blocks: Vec<usize> = pairs.iter().map(|p| p.1).collect();
        Some(device.prepare(&dst.layout, &blocks))
    }

    /// The sums of the destinations `landing` prepared, in pair order.
    fn sum_landing(
        &self,
        landing: Option<Result<Prepared, String>>,
        n: usize,
    ) -> Vec<Option<Result<u64, String>>> {
        let summed = match (landing, &self.device) {
            (None, _) | (_, None) => return vec![None; n],
            (Some(Err(e)), _) => Err(e),
            (Some(Ok(prepared)), Some(device)) => device.sums_of(&prepared),
        };
        match summed {
            Ok(sums) => sums.into_iter().map(|s| Some(Ok(s))).collect(),
            Err(e) => vec![Some(Err(e)); n],
        }
    }

    /// Checks and records what a copy of `pairs` from `src` to `dst` moved
    /// (see the module): pairs that fail become failed pairs of the
    /// returned outcome. Returns it with the number of checksum
    /// mismatches among them.
    #[cfg(test)]
    pub(crate) fn settle(
        &self,
        src: &End,
        dst: &End,
        pairs: &[(usize, usize)],
        outcome: TransferOutcome,
    ) -> (TransferOutcome, u32) {
        let early = self.sum_sources(src, dst, pairs);
        let landing = self.prepare_landing(src, dst, pairs);
        self.settle_with(src, dst, pairs, outcome, &early, landing)
    }

    /// [`Checksums::settle`] with the sources' sums taken while the copy
    /// ran (`early`, in pair order).
    fn settle_with(
        &self,
        src: &End,
        dst: &End,
        pairs: &[(usize, usize)],
        outcome: TransferOutcome,
        early: &[Option<Result<u64, String>>],
        landing: Option<Result<Prepared, String>>,
    ) -> (TransferOutcome, u32) {
        let landed: Vec<(usize, usize)> = match &outcome {
            Ok(_) => pairs.to_vec(),
            Err(f) => f.completed.clone(),
        };
        let index: HashMap<(usize, usize), usize> =
            pairs.iter().enumerate().map(|(i, &p)| (p, i)).collect();
        let in_pair_order =
            |sums: &[Option<Result<u64, String>>]| -> Vec<Option<Result<u64, String>>> {
                landed
                    .iter()
                    .map(|p| index.get(p).and_then(|&i| sums.get(i).cloned().flatten()))
                    .collect()
            };
        let early = in_pair_order(early);
        let on_device = in_pair_order(&self.sum_landing(landing, pairs.len()));
        let recorded: Vec<Option<u64>> = {
            let sums = self.sums.lock();
            landed
                .iter()
                .map(|&(s, _)| sums.get(&(src.tier, slot(s))).copied())
                .collect()
        };
        // Judging reads memory or files here unless each pair's sum was
        // taken already: on the GPU, or from a source that needs no
        // second reading (its destination keeps no sum, or is G3, or the
        // source is a G1 summed on the GPU).
        let taken = |sums: &[Option<Result<u64, String>>]| sums.iter().all(Option::is_some);
        let source_suffices =
            !self.tracked.of(dst.tier) || dst.tier == Tier::G3 || src.tier == Tier::G1;
        let reads = !(taken(&on_device) || taken(&early) && source_suffices);
        let verdicts = par_map(src, landed.len(), reads, |i| {
            let sums = Sums {
                recorded: recorded[i],
                source: early[i].clone(),
                landed: on_device[i].clone(),
            };
            judge(self.tracked, src, dst, landed[i], sums)
        });
        let rejected = self.record_verdicts(dst, pairs, &landed, verdicts);
        if rejected.is_empty() {
            return (outcome, 0);
        }
        self.fail_rejected(pairs, landed, outcome, rejected)
    }

    /// Records the sums of the `landed` pairs' destinations as `verdicts`
    /// (in `landed` order) say, and forgets those of the pairs that did not
    /// land or were rejected; returns the rejected pairs with their errors.
    fn record_verdicts(
        &self,
        dst: &End,
        pairs: &[(usize, usize)],
        landed: &[(usize, usize)],
        verdicts: Vec<Result<Option<u64>, DistError>>,
    ) -> Vec<((usize, usize), DistError)> {
        let landed_set: HashSet<(usize, usize)> = landed.iter().copied().collect();
        let mut rejected: Vec<((usize, usize), DistError)> = Vec::new();
        let mut sums = self.sums.lock();
        if self.tracked.of(dst.tier) {
            for &(_, d) in pairs.iter().filter(|p| !landed_set.contains(p)) {
                sums.remove(&(dst.tier, slot(d)));
            }
        }
        for (&pair, verdict) in landed.iter().zip(verdicts) {
            match verdict {
                Ok(Some(sum)) => {
                    sums.insert((dst.tier, slot(pair.1)), sum);
                }
                Ok(None) => {}
                Err(e) => {
                    sums.remove(&(dst.tier, slot(pair.1)));
                    rejected.push((pair, e));
                }
            }
        }
        rejected
    }

    /// The copy's outcome once the `rejected` pairs (at least one) are
    /// failed too, with the number of checksum mismatches among them; a copy
    /// that failed on its own keeps its error, one that succeeded fails with
    /// the first rejection. Counts and reports the rejections.
    fn fail_rejected(
        &self,
        pairs: &[(usize, usize)],
        landed: Vec<(usize, usize)>,
        outcome: TransferOutcome,
        rejected: Vec<((usize, usize), DistError)>,
    ) -> (TransferOutcome, u32) {
        let mismatches = rejected
            .iter()
            .filter(|(_, e)| matches!(e, DistError::ChecksumMismatch { .. }))
            .count();
        self.report(mismatches as u64, &rejected[0].1, rejected.len());
        let bad: HashSet<(usize, usize)> = rejected.iter().map(|(p, _)| *p).collect();
        let completed: Vec<_> = landed.into_iter().filter(|p| !bad.contains(p)).collect();
        let kept: HashSet<(usize, usize)> = completed.iter().copied().collect();
        let failed = pairs
            .iter()
            .copied()
            .filter(|p| !kept.contains(p))
            .collect();
        let more = match rejected.len() {
            1 => String::new(),
            n => format!(" (and {} more pairs)", n - 1),
        };
        let error = match outcome {
            // A copy that failed on its own keeps its first error.
            Err(f) => f.error,
            Ok(_) => TransferError::Backend {
                backend: "kvbm-dist verify",
                message: format!("{}{more}", rejected[0].1),
            },
        };
        let failure = TransferFailure {
            error,
            completed,
            failed,
            culprit: Some(rejected[0].0),
        };
        (Err(Box::new(failure)), mismatches as u32)
    }

    /// Counts `mismatches` and warns, at most once every [`WARN_EVERY`](kvbm_pool::rate_limit::WARN_EVERY)
    /// (`suppressed`: the warnings held back since the last one).
    fn report(&self, mismatches: u64, first: &DistError, failed: usize) {
        self.mismatches.fetch_add(mismatches, Ordering::Relaxed);
        let Some(suppressed) = self.warned.check() else {
            return;
        };
        tracing::warn!(
            failed,
            suppressed,
            total_mismatches = self.mismatches(),
            "verify: {first}; the blocks are reported as failed copies"
        );
    }
}

/// `f(0..n)` for `n` blocks of `end`, on several threads when `f` reads
/// the blocks' bytes and they are many.
fn par_map<T: Send>(end: &End, n: usize, reads: bool, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    if !reads {
        return (0..n).map(f).collect();
    }
    let block_bytes = end.layout.layout().config().block_bytes();
    let total = block_bytes.saturating_mul(n as u64);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = (total / BYTES_PER_THREAD)
        .clamp(1, MAX_THREADS as u64)
        .min(cores as u64)
        .min(n.max(1) as u64) as usize;
    let range = |from: usize, to: usize| (from..to).map(&f).collect::<Vec<_>>();
    if threads <= 1 {
        return range(0, n);
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .step_by(per)
            .map(|from| {
                let to = (from + per).min(n);
                let range = &range;
                let spawned = std::thread::Builder::new()
                    .name("kvbm-verify-hash".into())
                    .spawn_scoped(scope, move || range(from, to));
                (from, to, spawned)
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|(from, to, spawned)| match spawned.map(|h| h.join()) {
                Ok(Ok(v)) => v,
                // A thread that could not start (or died) leaves its share
                // to this one.
                _ => range(from, to),
            })
            .collect()
    })
}

/// A block id as the table keys it (every id came off the wire as a u32,
/// or was checked against a tier of at most `u32::MAX` blocks).
fn slot(id: usize) -> u32 {
    u32::try_from(id).unwrap_or(u32::MAX)
}

/// What is known of one pair's sums before it is judged.
struct Sums {
    /// The source slot's recorded sum.
    recorded: Option<u64>,
    /// The source's sum, taken while the copy ran, if it was.
    source: Option<Result<u64, String>>,
    /// The destination's sum taken on the GPU once it landed, if it was.
    landed: Option<Result<u64, String>>,
}

/// The verdict of one pair that landed: `Ok(sum to record for the
/// destination slot)`, `None` when the destination keeps no sums; `Err`
/// when the pair fails the check.
fn judge(
    tracked: Tracked,
    src: &End,
    dst: &End,
    (s, d): (usize, usize),
    sums: Sums,
) -> Result<Option<u64>, DistError> {
    let unavailable = |end: &End, block: usize, reason| DistError::ChecksumUnavailable {
        tier: end.tier,
        slot: slot(block),
        reason,
    };
    let sum = |end: &End, block: usize| {
        block_sum(&end.layout, block).map_err(|reason| unavailable(end, block, reason))
    };
    let source_sum = || match sums.source.clone() {
        Some(r) => r.map_err(|reason| unavailable(src, s, reason)),
        None => sum(src, s),
    };
    // The destination's sum: taken on the GPU, or read here.
    let landed_sum = || match sums.landed.clone() {
        Some(r) => r.map_err(|reason| unavailable(dst, d, reason)),
        None => sum(dst, d),
    };
    let expect = |tier: Tier, slot_id: usize, expected: Option<u64>, found: u64| {
        if expected == Some(found) {
            Ok(())
        } else {
            Err(DistError::ChecksumMismatch {
                tier,
                slot: slot(slot_id),
                expected,
                found,
            })
        }
    };
    let record = tracked.of(dst.tier);
    match src.tier {
        Tier::G2 => {
            let found = if sums.landed.is_some() {
                landed_sum()?
            } else {
                source_sum()?
            };
            if tracked.g2 {
                expect(Tier::G2, s, sums.recorded, found)?;
            }
            match dst.tier {
                Tier::G2 if record => {
                    let landed = landed_sum()?;
                    expect(Tier::G2, d, Some(found), landed)?;
                    Ok(Some(landed))
                }
                Tier::G3 => Ok(Some(found)),
                _ => Ok(None),
            }
        }
        Tier::G3 => {
            let found = if sums.landed.is_some() || dst.layout.kind().is_host() {
                landed_sum()?
            } else {
                source_sum()?
            };
            expect(Tier::G3, s, sums.recorded, found)?;
            Ok(record.then_some(found))
        }
        // From G1 (the engine's, unchecked) or a peer's G2.
        _ if !record => Ok(None),
        // A G1 source summed on the GPU, or a host G1 bound for G3.
        Tier::G1 if sums.source.is_some() => Ok(Some(source_sum()?)),
        Tier::G1 if dst.tier == Tier::G3 && src.layout.kind().is_host() => Ok(Some(sum(src, s)?)),
        _ => Ok(Some(landed_sum()?)),
    }
}

#[cfg(test)]
mod tests;
