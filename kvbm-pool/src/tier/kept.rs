//! Blocks a G3 kept across a restart holds, registered again in a new
//! engine's books (the bytes and their records are the mover's).

use std::collections::HashMap;

use kvbm_block::SequenceHash;

use super::{G3Label, TierEngine};
use crate::pool::CompleteBlock;

impl TierEngine {
    /// Registers the blocks a G3 kept across a restart holds, each in the
    /// slot that holds its bytes: `(slot, (hash, parent))`. Returns how many
    /// were registered; a slot beyond G3 or taken, or a hash G3 already
    /// holds, is skipped. `rejected` counts what the caller left out (torn
    /// records, blocks not every rank held), for the metrics. Call it
    /// before the first request.
    pub fn restore_g3(&self, blocks: &[(u32, G3Label)], rejected: u64) -> usize {
        let n = self.register_kept_g3(blocks);
        let skipped = (blocks.len() - n) as u64;
        self.shared
            .metrics
            .g3_reopened(n as u64, rejected + skipped);
        n
    }

    fn register_kept_g3(&self, blocks: &[(u32, G3Label)]) -> usize {
        let Some(g3) = self.shared.g3.as_ref() else {
            return 0;
        };
        // Parents before their children, as registration wants them.
        let parent_of: HashMap<SequenceHash, Option<SequenceHash>> =
            blocks.iter().map(|&(_, (h, p))| (h, p)).collect();
        let depth = |mut h: SequenceHash| {
            let mut d = 0usize;
            while let Some(Some(p)) = parent_of.get(&h) {
                d += 1;
                h = *p;
                if d > parent_of.len() {
                    break; // a cycle in damaged labels: any order will do
                }
            }
            d
        };
        let mut ordered: Vec<(usize, u32, G3Label)> = blocks
            .iter()
            .map(|&(slot, label)| (depth(label.0), slot, label))
            .collect();
        ordered.sort_unstable_by_key(|&(d, slot, _)| (d, slot));
        let ids: Vec<u32> = ordered.iter().map(|&(_, slot, _)| slot).collect();
        let label_of: HashMap<u32, G3Label> =
            ordered.iter().map(|&(_, slot, l)| (slot, l)).collect();
        let complete: Vec<CompleteBlock> = g3
            .pool
            .allocate_ids(&ids)
            .into_iter()
            .filter_map(|t| {
                let (hash, parent) = label_of[&t.block_id()];
                t.complete(hash, parent).ok()
            })
            .collect();
        let n = complete.len();
        // The handles drop here: the blocks wait in G3 like any others.
        match g3.pool.register(complete) {
            Ok(held) => held.len().min(n),
            Err(e) => {
                tracing::warn!("G3 refused its own kept blocks: {e}");
                0
            }
        }
    }
}
