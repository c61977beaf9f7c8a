//! Blocks a G2 or G3 kept across a restart holds, registered again in a
//! new engine's books (the bytes and their records are the mover's).

use std::collections::HashMap;

use kvbm_block::SequenceHash;

use super::{BlockLabel, TierEngine};
use crate::config::Tier;
use crate::policy::{HistorySnapshot, HistorySource};
use crate::pool::{BlockPool, CompleteBlock};

impl TierEngine {
    /// Registers the blocks a G2 or G3 (`tier`) kept across a restart
    /// holds, each in the slot that holds its bytes: `(slot, (hash,
    /// parent))`. Returns how many were registered; a slot beyond the
    /// tier's pool, taken or listed twice, or a hash the tier already holds
    /// or listed twice, is skipped. `rejected` counts what the caller left
    /// out (torn records, blocks not every rank held), for the metrics.
    /// Call it before the first request, G2 first.
    pub fn restore(&self, tier: Tier, blocks: &[(u32, BlockLabel)], rejected: u64) -> usize {
        let n = self.register_kept(tier, blocks);
        let skipped = (blocks.len() - n) as u64;
        self.shared
            .metrics
            .reopened(tier, n as u64, rejected + skipped);
        n
    }

    /// What the engine's use history knows now: written down beside kept
    /// tiers, it lets a restarted engine rank their blocks as this one
    /// does ([`TierEngine::restore_history`]).
    pub fn history_snapshot(&self) -> HistorySnapshot {
        self.history_changes(0)
    }

    /// What changed in the engine's use history since the snapshot or
    /// change whose `seq` is `seq`: cheap to take often, in proportion to
    /// the blocks used since ([`HistorySnapshot::combine`] joins them).
    pub fn history_changes(&self, seq: u64) -> HistorySnapshot {
        // Requests recorded but not applied yet count too.
        self.shared.books.history_changes(seq)
    }

    /// Takes up a use history written by an engine of kept tiers before a
    /// restart. Call it before [`TierEngine::restore`] and the first
    /// request: the tiers rank blocks as they are registered.
    pub fn restore_history(&self, snapshot: &HistorySnapshot) {
        self.shared.books.restore_history(snapshot);
    }

    fn register_kept(&self, tier: Tier, blocks: &[(u32, BlockLabel)]) -> usize {
        let slot = match tier {
            Tier::G2 => self.shared.books.g2(),
            Tier::G3 => self.shared.books.g3(),
            _ => None,
        };
        let Some(kept) = slot else {
            return 0;
        };
        register_in_slots(&kept.pool, tier, blocks)
    }
}

/// Registers in `pool` the blocks a tier kept across a restart holds,
/// each in the slot that holds its bytes (`(slot, (hash, parent))`),
/// parents before their children; a slot or hash listed twice comes back
/// once, and a slot the pool does not have free is skipped. Returns how
/// many were registered.
pub(crate) fn register_in_slots(
    pool: &BlockPool,
    tier: Tier,
    blocks: &[(u32, BlockLabel)],
) -> usize {
    // One block per slot and one slot per hash (a hash kept twice, in
    // a slot it was evicted from and in one it went to later, comes
    // back once).
    let mut slots = std::collections::HashSet::with_capacity(blocks.len());
    let mut hashes = std::collections::HashSet::with_capacity(blocks.len());
    let blocks: Vec<(u32, BlockLabel)> = blocks
        .iter()
        .copied()
        .filter(|&(slot, (hash, _))| slots.insert(slot) && hashes.insert(hash))
        .collect();
    // Parents before their children, as registration wants them: each
    // block's depth in the kept chains, memoized (chains share
    // prefixes and can be thousands of blocks long).
    let parent_of: HashMap<SequenceHash, Option<SequenceHash>> =
        blocks.iter().map(|&(_, (h, p))| (h, p)).collect();
    let mut depths: HashMap<SequenceHash, usize> = HashMap::with_capacity(blocks.len());
    let mut depth = |start: SequenceHash| {
        let mut path = Vec::new();
        let mut h = start;
        // The depth of the last block on `path`, the one nearest the root.
        let base = loop {
            if let Some(&d) = depths.get(&h) {
                break d + 1;
            }
            match parent_of.get(&h) {
                // A cycle in damaged labels: any order will do.
                Some(Some(p)) if path.len() <= parent_of.len() => {
                    path.push(h);
                    h = *p;
                }
                _ => {
                    path.push(h);
                    break 0;
                }
            }
        };
        for (i, h) in path.iter().rev().enumerate() {
            depths.insert(*h, base + i);
        }
        depths[&start]
    };
    let mut ordered: Vec<(usize, u32, BlockLabel)> = blocks
        .iter()
        .map(|&(slot, label)| (depth(label.0), slot, label))
        .collect();
    ordered.sort_unstable_by_key(|&(d, slot, _)| (d, slot));
    let ids: Vec<u32> = ordered.iter().map(|&(_, slot, _)| slot).collect();
    let label_of: HashMap<u32, BlockLabel> =
        ordered.iter().map(|&(_, slot, l)| (slot, l)).collect();
    let complete: Vec<CompleteBlock> = pool
        .allocate_ids(&ids)
        .into_iter()
        .filter_map(|t| {
            let (hash, parent) = label_of[&t.block_id()];
            t.complete(hash, parent).ok()
        })
        .collect();
    let n = complete.len();
    // The handles drop here: the blocks wait in the tier like any
    // others.
    match pool.register(complete) {
        Ok(held) => held.len().min(n),
        Err(e) => {
            tracing::warn!("{tier:?} refused its own kept blocks: {e}");
            0
        }
    }
}

impl HistorySource for TierEngine {
    fn history_snapshot(&self) -> HistorySnapshot {
        TierEngine::history_snapshot(self)
    }

    fn history_changes(&self, seq: u64) -> HistorySnapshot {
        TierEngine::history_changes(self, seq)
    }

    fn restore_history(&self, snapshot: &HistorySnapshot) {
        TierEngine::restore_history(self, snapshot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tier;
    use crate::tier::KvShape;

    fn engine(dir: &std::path::Path) -> TierEngine {
        let shape = KvShape::mha(2, 1, 128);
        let block = shape.block_bytes();
        TierEngine::builder(shape)
            .g1_host(4)
            .g2_host_bytes(4 * block)
            .g3_disk(dir, 16 * block)
            .build()
            .unwrap()
    }

    fn label(hash: u64, parent: Option<u64>) -> BlockLabel {
        (SequenceHash(hash), parent.map(SequenceHash))
    }

    #[test]
    fn kept_blocks_come_back_in_their_slots_children_listed_first_or_not() {
        let dir = tempfile::tempdir().unwrap();
        let e = engine(dir.path());
        // A chain 1 <- 2 <- 3 listed child first, a root 9, a slot beyond G3,
        // a duplicate slot and a duplicate hash.
        let blocks = [
            (5, label(3, Some(2))),
            (7, label(2, Some(1))),
            (2, label(1, None)),
            (11, label(9, None)),
            (40, label(20, None)),
            (11, label(21, None)),
            (12, label(9, None)),
        ];
        let n = e.restore(Tier::G3, &blocks, 2);
        assert_eq!(n, 4);
        let g3 = e.pool(Tier::G3).unwrap();
        for h in [1, 2, 3, 9] {
            assert!(g3.contains(SequenceHash(h)), "block {h} not restored");
        }
        assert!(!g3.contains(SequenceHash(20)) && !g3.contains(SequenceHash(21)));
        let stats = e.stats();
        assert_eq!((stats.g3_recovered, stats.g3_rejected), (4, 2 + 3));
        // The whole chain matches as a G3 prefix.
        assert_eq!(
            g3.cached_prefix_len(&[SequenceHash(1), SequenceHash(2), SequenceHash(3)]),
            3
        );
    }

    #[test]
    fn a_cycle_in_damaged_labels_does_not_hang() {
        let dir = tempfile::tempdir().unwrap();
        let e = engine(dir.path());
        let blocks = [(0, label(1, Some(2))), (1, label(2, Some(1)))];
        assert!(e.restore(Tier::G3, &blocks, 0) <= 2);
    }
}
