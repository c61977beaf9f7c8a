//! Reads checked piece by piece: a copy whose destination can only be
//! summed once it landed (out of G3 into host memory) is cut into pieces
//! of about [`PIECE_BYTES`], each settled as soon as it lands, so hashing
//! one piece overlaps reading the next instead of following the whole
//! copy.

use std::sync::Arc;

use kvbm_pool::Tier;
use kvbm_transfer::{CancelToken, Executor, TransferFailure, TransferOutcome, TransferReport};
use parking_lot::Mutex;

use super::{Checksums, End};

/// Bytes of one piece.
pub(crate) const PIECE_BYTES: u64 = 16 << 20;

/// Blocks per piece for a copy of `pairs` between `src` and `dst`: more
/// than `pairs.len()` when the copy is settled whole.
pub(crate) fn piece_blocks(src: &End, dst: &End, piece_bytes: u64) -> usize {
    if src.tier != Tier::G3 || !dst.layout.kind().is_host() {
        return usize::MAX;
    }
    let block = dst.layout.layout().config().block_bytes().max(1);
    (piece_bytes / block).max(1) as usize
}

/// Copies `pairs` in pieces of `per_piece` blocks, settles each as it
/// lands, and calls `done` with the merged outcome and mismatches once
/// every piece has.
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_in_pieces(
    sums: &Arc<Checksums>,
    executor: &Executor,
    src: End,
    dst: End,
    pairs: Vec<(usize, usize)>,
    per_piece: usize,
    cancel: CancelToken,
    done: impl FnOnce(TransferOutcome, u32) + Send + 'static,
) {
    let pieces: Vec<Vec<(usize, usize)>> = pairs.chunks(per_piece).map(<[_]>::to_vec).collect();
    let join = Arc::new(Join {
        left: Mutex::new((pieces.len(), Vec::with_capacity(pieces.len()))),
        done: Mutex::new(Some(Box::new(done))),
    });
    for piece in pieces {
        let completion = executor
            .transfer_with(&src.layout, &dst.layout, &piece, cancel.clone())
            .into_completion();
        let join = Arc::clone(&join);
        let settled = piece.clone();
        sums.settle_later(
            src.clone(),
            dst.clone(),
            settled,
            completion,
            move |o, m| {
                join.arrive(piece, o, m);
            },
        );
    }
}

type Done = Box<dyn FnOnce(TransferOutcome, u32) + Send>;

/// A piece's pairs, its settled outcome and its checksum mismatches.
pub(crate) type Settled = (Vec<(usize, usize)>, TransferOutcome, u32);

/// Pieces still to land, the outcomes of those that did, and who to tell.
struct Join {
    left: Mutex<(usize, Vec<Settled>)>,
    done: Mutex<Option<Done>>,
}

impl Join {
    fn arrive(&self, pairs: Vec<(usize, usize)>, outcome: TransferOutcome, mismatches: u32) {
        let all = {
            let mut left = self.left.lock();
            left.1.push((pairs, outcome, mismatches));
            left.0 -= 1;
            if left.0 > 0 {
                return;
            }
            std::mem::take(&mut left.1)
        };
        if let Some(done) = self.done.lock().take() {
            let (outcome, mismatches) = merge(all);
            done(outcome, mismatches);
        }
    }
}

/// One outcome of the pieces' outcomes: `Ok` when every piece landed;
/// otherwise the first error that is not a cancellation (or the first),
/// every landed pair completed and the rest failed.
pub(crate) fn merge(outcomes: Vec<Settled>) -> (TransferOutcome, u32) {
    let mismatches = outcomes.iter().map(|(_, _, m)| m).sum();
    let mut report = TransferReport::default();
    let (mut completed, mut failed, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    let mut culprit = None;
    for (pairs, outcome, _) in outcomes {
        match outcome {
            Ok(r) => {
                report.blocks += r.blocks;
                report.bytes += r.bytes;
                completed.extend(pairs);
            }
            Err(f) => {
                let f = *f;
                culprit = culprit.or(f.culprit);
                completed.extend(f.completed);
                failed.extend(f.failed);
                errors.push(f.error);
            }
        }
    }
    if errors.is_empty() {
        return (Ok(report), mismatches);
    }
    let first = errors
        .iter()
        .position(|e| !matches!(e, kvbm_transfer::TransferError::Cancelled))
        .unwrap_or(0);
    let error = errors.swap_remove(first);
    (
        Err(Box::new(TransferFailure {
            error,
            completed,
            failed,
            culprit,
        })),
        mismatches,
    )
}

#[cfg(test)]
mod tests {
    use kvbm_transfer::TransferError;

    use super::*;

    fn failure(
        error: TransferError,
        completed: &[(usize, usize)],
        failed: &[(usize, usize)],
    ) -> TransferOutcome {
        Err(Box::new(TransferFailure {
            error,
            completed: completed.to_vec(),
            failed: failed.to_vec(),
            culprit: failed.first().copied(),
        }))
    }

    #[test]
    fn pieces_merge_into_one_outcome() {
        let ok = |blocks| {
            Ok(TransferReport {
                blocks,
                bytes: blocks as u64 * 10,
            })
        };
        let (all, m) = merge(vec![
            (vec![(0, 0), (1, 1)], ok(2), 0),
            (vec![(2, 2)], ok(1), 0),
        ]);
        let r = all.unwrap();
        assert_eq!((r.blocks, r.bytes, m), (3, 30, 0));
        let (mixed, m) = merge(vec![
            (
                vec![(9, 9)],
                failure(TransferError::Cancelled, &[], &[(9, 9)]),
                0,
            ),
            (vec![(5, 5)], ok(1), 0),
            (
                vec![(1, 1), (2, 2)],
                failure(
                    TransferError::InvalidRequest("bad".into()),
                    &[(1, 1)],
                    &[(2, 2)],
                ),
                1,
            ),
        ]);
        let f = mixed.unwrap_err();
        assert_eq!(m, 1);
        assert!(
            matches!(f.error, TransferError::InvalidRequest(_)),
            "{}",
            f.error
        );
        assert_eq!(f.failed, vec![(9, 9), (2, 2)]);
        assert_eq!(f.completed, vec![(5, 5), (1, 1)]);
        assert_eq!(f.culprit, Some((9, 9)));
    }
}
