//! Blocks that reach G2's slots from outside the worker's own copies.
//!
//! A store that several engines share (G4) reads a block straight out of
//! a G2 slot and writes one straight into it: its client is handed the
//! slots' host memory ([`PagedWorker::slot_memory`]) and moves the bytes
//! itself. Each block travels with its checksum in the
//! [`SUM_BYTES`] right after it in the slot (a worker built with
//! `sum_tail` leaves that room), so a block and its sum are one
//! contiguous run of memory and one object of the store. The worker's
//! part is the checksums: it writes the sum a block is published with
//! ([`PagedWorker::seal`]) and checks a block that arrived against the sum
//! that came with it ([`PagedWorker::adopt`]) before any load may copy it
//! into the engine's pages. A sum travels salted with the worker's
//! [`PagedConfig::tail_salt`](super::PagedConfig::tail_salt): a block
//! published by an engine that lays its bytes out otherwise fails the
//! check, however sound its bytes.

use super::{PagedWorker, invalid};
use crate::error::Result;
use crate::verify::block_sum;

/// Bytes of the checksum after a block in its slot (little-endian).
pub const SUM_BYTES: u64 = 8;

/// What a slot with room for a checksum is padded to.
pub(super) const TAIL_ALIGNMENT: u64 = 256;

/// The bytes after a block that carry its checksum `sum` salted with
/// `salt` (see [`PagedConfig::tail_salt`](super::PagedConfig::tail_salt)).
pub(super) fn tail_of(sum: u64, salt: u64) -> [u8; 8] {
    (sum ^ salt).to_le_bytes()
}

/// The checksum the bytes after a block carry, salted with `salt`.
pub(super) fn sum_of(tail: [u8; 8], salt: u64) -> u64 {
    u64::from_le_bytes(tail) ^ salt
}

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

    /// Where the checksum after the block of `group` lies in each of
    /// `slots`. Errors without `sum_tail`, for a group beyond the worker's,
    /// and for a slot beyond G2's.
    pub(super) fn tails(&self, group: usize, slots: &[usize]) -> Result<Vec<*mut u8>> {
        if !self.sum_tail {
            return Err(invalid("slots without room for a checksum (sum_tail off)"));
        }
        let bytes = self.block_bytes(group)?;
        if let Some(s) = slots.iter().find(|&&s| s >= self.shared.slots) {
            return Err(invalid(format!("slot {s} beyond {}", self.shared.slots)));
        }
        let (base, _) = self.slot_memory()?;
        Ok(slots
            .iter()
            .map(|&s| (base + s as u64 * self.stride + bytes) as *mut u8)
            .collect())
    }

    /// Writes the checksum of the block of `group` in each of `slots` right
    /// after it (the sum a verified load checks: what a block is published
    /// with). Per slot whether it was sealed: in verify mode a slot whose
    /// bytes no longer match the sum recorded when it was written is not
    /// (it must not be published). The caller keeps the slots unwritten
    /// meanwhile.
    pub fn seal(&self, group: usize, slots: &[usize]) -> Result<Vec<bool>> {
        let tails = self.tails(group, slots)?;
        let g2 = &self.shared.g2[group];
        slots
            .iter()
            .zip(tails)
            .map(|(&s, tail)| {
                let sum = block_sum(g2, s).map_err(invalid)?;
                let recorded = self.shared.sums.as_ref().map(|sums| sums.lock()[s]);
                if recorded.is_some_and(|want| want != Some(sum)) {
                    return Ok(false);
                }
                // SAFETY: `tail` points at the SUM_BYTES after the group's
                // block inside slot `s` of the region (room `sum_tail`
                // left in every slot's stride), host memory the region
                // owns; no job copies those bytes, and the caller keeps
                // the slot's block unwritten meanwhile.
                unsafe { (tail as *mut [u8; 8]).write_unaligned(tail_of(sum, self.tail_salt)) };
                Ok(true)
            })
            .collect()
    }

    /// Moves blocks to G3 and waits until they landed: what a store does
    /// before writing slots it took from them, for blocks an outside store
    /// is about to write into those slots.
    pub fn move_to_disk(&self, moves: &[super::DiskMove]) -> Result<()> {
        if let Some(why) = self.bad_move(moves) {
            return Err(invalid(why));
        }
        super::disk::demote(&self.shared, moves).map_err(invalid)
    }

    /// Empties the records of `slots` in a kept G2, before something
    /// outside the worker writes them (a block fetched from G4 is not kept
    /// across a restart); a no-op without a kept G2.
    pub fn unrecord(&self, slots: &[usize]) -> Result<()> {
        let Some(kept) = &self.shared.host_kept else {
            return Ok(());
        };
        if let Some(s) = slots.iter().find(|&&s| s >= self.shared.slots) {
            return Err(invalid(format!("slot {s} beyond {}", self.shared.slots)));
        }
        let ids: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
        kept.forget(&ids)
            .map_err(|e| invalid(format!("emptying {} G2 records: {e}", ids.len())))
    }

    /// Checks blocks of `group` that arrived in `slots` from outside, each
    /// with the sum it was published with right after it: per slot whether
    /// its bytes match. A slot that fails must not be loaded. In verify
    /// mode (or with G2 kept) the sums of matching slots are recorded
    /// (loads check them again) and those of failing slots cleared. A kept
    /// G2 does not record them (see [`Self::unrecord`]).
    pub fn adopt(&self, group: usize, slots: &[usize]) -> Result<Vec<bool>> {
        let tails = self.tails(group, slots)?;
        let g2 = &self.shared.g2[group];
        let mut arrived = Vec::with_capacity(slots.len());
        for (&s, tail) in slots.iter().zip(tails) {
            // SAFETY: as in `seal`: the SUM_BYTES after the block inside
            // the slot, which the caller keeps unwritten while it checks.
            let sum = unsafe { (tail as *const [u8; 8]).read_unaligned() };
            arrived.push((s, sum_of(sum, self.tail_salt)));
        }
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
