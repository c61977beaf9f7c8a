//! Blocks that reach G2's slots from outside the worker's own copies.
//!
//! A store that several engines share (G4) reads a block straight out of
//! a G2 slot and writes one straight into it: its client is handed the
//! slots' host memory ([`PagedWorker::slot_memory`]) and moves the bytes
//! itself. The worker's part is the checksums: the sum a block is
//! published with ([`PagedWorker::slot_sums`]), and the check of a block
//! that arrived against the sum it was published with
//! ([`PagedWorker::adopt`]) before any load may copy it into the engine's
//! pages.

use super::{PagedWorker, invalid};
use crate::error::Result;
use crate::verify::block_sum;

impl PagedWorker {
    /// Where G2's slots lie in host memory: the address of slot 0 and the
    /// bytes of all [`slots`](Self::slots) slots, one
    /// [`slot_stride`](Self::slot_stride) apart. A client of an outside
    /// store registers this memory and moves blocks in and out of it; the
    /// caller keeps such moves off slots a job copies (the books do).
    pub fn slot_memory(&self) -> Result<(u64, u64)> {
        let addr = self.shared.region.regions()[0]
            .addr()
            .ok_or_else(|| invalid("slots without a host address"))?;
        Ok((addr, self.shared.slots as u64 * self.stride))
    }

    /// Bytes of one block of KV cache group `group`: a slot holding such a
    /// block holds it in its first this many bytes.
    pub fn block_bytes(&self, group: usize) -> Result<u64> {
        self.block_bytes.get(group).copied().ok_or_else(|| {
            invalid(format!(
                "KV cache group {group} beyond {}",
                self.block_bytes.len()
            ))
        })
    }

    fn check_slots(&self, group: usize, slots: impl IntoIterator<Item = usize>) -> Result<()> {
        self.block_bytes(group)?;
        match slots.into_iter().find(|&s| s >= self.shared.slots) {
            Some(s) => Err(invalid(format!("slot {s} beyond {}", self.shared.slots))),
            None => Ok(()),
        }
    }

    /// The checksum of the block of `group` in each of `slots`, the one a
    /// verified load checks: what a block is published with. In verify
    /// mode a slot whose bytes no longer match the sum recorded when it
    /// was written gets `None` (it must not be published). The caller
    /// keeps the slots unwritten meanwhile.
    pub fn slot_sums(&self, group: usize, slots: &[usize]) -> Result<Vec<Option<u64>>> {
        self.check_slots(group, slots.iter().copied())?;
        let g2 = &self.shared.g2[group];
        slots
            .iter()
            .map(|&s| {
                let sum = block_sum(g2, s).map_err(invalid)?;
                let recorded = self.shared.sums.as_ref().map(|sums| sums.lock()[s]);
                Ok(match recorded {
                    Some(want) if want != Some(sum) => None,
                    _ => Some(sum),
                })
            })
            .collect()
    }

    /// Moves `(G2 slot, G3 slot)` blocks to G3 and waits until they
    /// landed: what a store does before writing slots it took from them,
    /// for blocks an outside store is about to write into those slots.
    pub fn move_to_disk(&self, moves: &[(usize, usize)]) -> Result<()> {
        if let Some(why) = self.bad_move(moves) {
            return Err(invalid(why));
        }
        super::disk::demote(&self.shared, moves).map_err(invalid)
    }

    /// Checks blocks of `group` that arrived in slots from outside, each
    /// `(slot, the sum it was published with)`: per slot whether its bytes
    /// match. A slot that fails must not be loaded. In verify mode the
    /// sums of matching slots are recorded (loads check them again) and
    /// those of failing slots cleared.
    pub fn adopt(&self, group: usize, arrived: &[(usize, u64)]) -> Result<Vec<bool>> {
        self.check_slots(group, arrived.iter().map(|&(s, _)| s))?;
        let g2 = &self.shared.g2[group];
        let good: Vec<bool> = arrived
            .iter()
            .map(|&(slot, want)| block_sum(g2, slot).is_ok_and(|got| got == want))
            .collect();
        if let Some(sums) = &self.shared.sums {
            let mut sums = sums.lock();
            for (&(slot, want), &ok) in arrived.iter().zip(&good) {
                sums[slot] = ok.then_some(want);
            }
        }
        Ok(good)
    }
}
