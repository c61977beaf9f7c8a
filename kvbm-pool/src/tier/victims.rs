//! Write-back and victim caching: G1's victims go to G2 (through its
//! admission), blocks G2 refuses or evicts go to G3.
//!
//! Write-back offers G1's victims to G2 one at a time, in eviction order,
//! each admitted against what G2 would evict at that point (as the
//! simulator does); a victim G2 refuses is offered to G3 the same way
//! (a G1 → G3 copy). The caller of a write-back waits for the G1 → G2
//! copies (the slots they free are about to be written), unless they are
//! G1's free reserve being refilled, whose slots stay held until saved;
//! copies to G3 go through [`super::behind`], which keeps the disk off that
//! wait.

use std::collections::HashSet;
use std::time::Instant;

use kvbm_block::SequenceHash;
use kvbm_transfer::{CancelToken, TransferOutcome};

use super::offload::batch_limit;
use super::{Shared, TierPolicy, TierSlot};
use crate::metrics::{FailureCause, Path, SkipReason};
use crate::policy::Evicted;
use crate::pool::MutableBlock;
use crate::rate_limit::{RateLimit, WARN_EVERY, held_back_note};

/// Whether `tier`'s admission `policy` takes the block `hash`.
pub(super) fn admitted(
    shared: &Shared,
    tier: &TierSlot,
    policy: TierPolicy,
    hash: SequenceHash,
) -> bool {
    match policy {
        TierPolicy::WriteThrough => true,
        TierPolicy::MinUses(n) => shared.books.uses(hash) >= n,
        TierPolicy::ReuseScore => tier.pool.admit(hash),
    }
}

/// Admits and places `victims` in `tier` one at a time, in order: each is
/// skipped when the tier holds it already (or receives it from a batch in
/// `flying`), else asked of the admission policy and, if admitted, given a
/// target at once, so the next one is compared with what the tier would
/// evict after that. Returns the admitted victims and their targets (the
/// others are counted as skipped).
pub(super) fn place_victims(
    shared: &Shared,
    tier: &TierSlot,
    policy: TierPolicy,
    victims: Vec<Evicted>,
    flying: &HashSet<SequenceHash>,
) -> (Vec<Evicted>, Vec<MutableBlock>, Vec<Evicted>) {
    let mut keep = Vec::with_capacity(victims.len());
    let mut refused_victims = Vec::new();
    let mut targets = Vec::with_capacity(victims.len());
    let (mut present, mut refused, mut full) = (0u64, 0u64, 0u64);
    let mut placed = HashSet::with_capacity(victims.len());
    for v in victims {
        if flying.contains(&v.hash) || placed.contains(&v.hash) || tier.pool.contains(v.hash) {
            present += 1;
        } else if !admitted(shared, tier, policy, v.hash) {
            refused += 1;
            refused_victims.push(v);
        } else {
            match allocate_or_fewer(tier, 1).pop() {
                Some(t) => {
                    placed.insert(v.hash);
                    keep.push(v);
                    targets.push(t);
                }
                None => full += 1,
            }
        }
    }
    shared.metrics.skipped(SkipReason::Present, present);
    shared.metrics.skipped(SkipReason::NotAdmitted, refused);
    shared.metrics.skipped(SkipReason::TierFull, full);
    (keep, targets, refused_victims)
}

/// Up to `n` target blocks: all of them, or as many as the pool can give.
/// Blocks that found no target are counted as skipped (tier full).
pub(super) fn allocate_up_to(shared: &Shared, tier: &TierSlot, n: usize) -> Vec<MutableBlock> {
    let targets = allocate_or_fewer(tier, n);
    shared
        .metrics
        .skipped(SkipReason::TierFull, (n - targets.len()) as u64);
    targets
}

fn allocate_or_fewer(tier: &TierSlot, n: usize) -> Vec<MutableBlock> {
    match tier.pool.allocate(n) {
        Ok(b) => b,
        Err(crate::PoolError::Exhausted {
            free, evictable, ..
        }) => {
            let can = (free + evictable).min(n);
            if can == 0 {
                return Vec::new();
            }
            tier.pool.allocate(can).unwrap_or_default()
        }
        Err(_) => Vec::new(),
    }
}

/// Write-back: copies G1's victims (whose slots nobody writes until this
/// returns) to G2, through G2's admission. `flying`: hashes batches in
/// flight are copying to G2 already.
pub(super) fn save_g1_victims(
    shared: &Shared,
    victims: Vec<Evicted>,
    flying: &HashSet<SequenceHash>,
) {
    let Some(g2) = shared.books.g2() else {
        shared
            .metrics
            .skipped(SkipReason::NoTier, victims.len() as u64);
        return;
    };
    let limit = batch_limit(shared);
    let mut victims = victims.into_iter().peekable();
    while victims.peek().is_some() {
        let part: Vec<Evicted> = victims.by_ref().take(limit).collect();
        let (part, targets, refused) =
            place_victims(shared, g2, shared.config.g2_policy, part, flying);
        if let Some(g3) = shared.books.g3()
            && !refused.is_empty()
        {
            // Refused by G2, the block is offered to G3 (as G2's own
            // victims are); a copy an onboard left there ranks again.
            shared.books.clear_demoted_g3(&refused);
            let none = HashSet::new();
            let (keep, g3_targets, _) =
                place_victims(shared, g3, shared.config.g3_policy, refused, &none);
            if !g3_targets.is_empty() {
                super::behind::write(shared, shared.books.g1(), Path::G1ToG3, &keep, g3_targets);
            }
        }
        // The blocks G2 evicted for these still hold their bytes: save
        // them before their slots are written.
        let g2_victims = shared.books.take_g2_victims();
        spill_to_g3(shared, g2, g2_victims);
        if !targets.is_empty() {
            copy_victims(shared, shared.books.g1(), g2, Path::G1ToG2, &part, targets);
        }
    }
}

/// Copies G2's victims to G3 (those G3 admits and does not hold yet).
pub(super) fn spill_to_g3(shared: &Shared, g2: &TierSlot, victims: Vec<Evicted>) {
    let Some(g3) = shared.books.g3() else {
        return;
    };
    // Write-back: a victim G1 holds (loaded there from G2) comes back to G2
    // when G1 evicts it, so a G3 copy would only duplicate it.
    let write_back = shared.config.offload_mode == super::OffloadMode::WriteBack;
    let (victims, in_g1): (Vec<Evicted>, Vec<Evicted>) = victims
        .into_iter()
        .partition(|v| !(write_back && shared.books.g1().pool.contains(v.hash)));
    // A G3 copy left from an onboard is this block again: it ranks by its
    // score once more.
    shared.books.clear_demoted_g3(&victims);
    shared
        .metrics
        .skipped(SkipReason::Present, in_g1.len() as u64);
    if victims.is_empty() {
        return;
    }
    // G3 targets are registered as they are placed (write-behind
    // registers before the disk write), so none is in flight unseen.
    let none = HashSet::new();
    let (keep, targets, _) = place_victims(shared, g3, shared.config.g3_policy, victims, &none);
    if keep.is_empty() {
        return;
    }
    super::behind::write(shared, g2, Path::G2ToG3, &keep, targets);
}

/// Copies evicted blocks (`victims[i]` into `targets[i]`) and registers
/// each target whose bytes landed.
pub(super) fn copy_victims(
    shared: &Shared,
    src: &TierSlot,
    dst: &TierSlot,
    path: Path,
    victims: &[Evicted],
    targets: Vec<MutableBlock>,
) {
    let pairs: Vec<(usize, usize)> = victims
        .iter()
        .zip(&targets)
        .map(|(v, t)| (v.id as usize, t.block_id() as usize))
        .collect();
    let items: Vec<_> = victims.iter().map(|v| (v.hash, v.parent)).collect();
    copy_and_register(shared, src, dst, path, &pairs, targets, &items);
}

/// Copies `pairs` from `src` to `dst` and registers each target whose
/// bytes landed under its `(hash, parent)`; the others go back to the free
/// list.
fn copy_and_register(
    shared: &Shared,
    src: &TierSlot,
    dst: &TierSlot,
    path: Path,
    pairs: &[(usize, usize)],
    targets: Vec<MutableBlock>,
    items: &[(SequenceHash, Option<SequenceHash>)],
) {
    let started = Instant::now();
    let outcome = shared
        .mover
        .copy_labelled(
            src.tier,
            dst.tier,
            pairs.to_vec(),
            items.to_vec(),
            CancelToken::new(),
        )
        .wait();
    let (landed, cause) = landed_pairs(path, pairs, &outcome);
    register_landed(
        shared,
        dst,
        path,
        targets,
        items,
        (&landed, cause),
        started.elapsed(),
    );
}

/// Which of `pairs` landed, by `outcome`, and what made the others fail.
pub(super) fn landed_pairs(
    path: Path,
    pairs: &[(usize, usize)],
    outcome: &TransferOutcome,
) -> (Vec<bool>, FailureCause) {
    match outcome {
        Ok(_) => (vec![true; pairs.len()], FailureCause::Other),
        Err(failure) => {
            let cause = FailureCause::of(&failure.error);
            static WARN: RateLimit = RateLimit::new(WARN_EVERY);
            if let Some(held_back) = WARN.check() {
                let more = held_back_note(held_back);
                tracing::warn!(?path, %cause, "offload copy failed: {failure}{more}");
            }
            let ok: HashSet<(usize, usize)> = failure.completed.iter().copied().collect();
            (pairs.iter().map(|p| ok.contains(p)).collect(), cause)
        }
    }
}

/// Registers in `dst` each target whose bytes landed (`landed.0[i]`, in
/// the order of `targets` and `items`); the others go back to the free
/// list and count as copy failures for `landed.1`. `took`: the copy's
/// time, for the metrics.
pub(super) fn register_landed(
    shared: &Shared,
    dst: &TierSlot,
    path: Path,
    targets: Vec<MutableBlock>,
    items: &[(SequenceHash, Option<SequenceHash>)],
    (landed, cause): (&[bool], FailureCause),
    took: std::time::Duration,
) {
    let mut complete = Vec::with_capacity(targets.len());
    let mut failed = 0u64;
    let mut unregistered = 0u64;
    for ((target, &(hash, parent)), ok) in targets.into_iter().zip(items).zip(landed) {
        if !ok {
            failed += 1;
            continue; // dropped: back to the free list
        }
        match target.complete(hash, parent) {
            Ok(c) => complete.push(c),
            Err(e) => {
                tracing::warn!("cannot complete an offload target: {e}");
                unregistered += 1;
            }
        }
    }
    let n = complete.len() as u64;
    // Registered and released at once: cached, evictable, matchable.
    if let Err(e) = dst.pool.register(complete) {
        tracing::warn!("offload targets refused by their own pool: {e}");
        unregistered += n;
    } else {
        shared.metrics.copied(path, n, n * dst.block_bytes, took);
    }
    shared.metrics.copy_failed(path, cause, failed);
    shared
        .metrics
        .copy_failed(path, FailureCause::Other, unregistered);
}
