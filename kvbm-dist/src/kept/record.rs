//! One record of a kept store: a block's label and checksum, sealed by a
//! check of its own, so a torn or damaged record reads as neither empty
//! nor sound.

use super::{BlockLabel, RECORD_BYTES};

/// The check sealing a record of `slot`.
fn seal(slot: u32, label: BlockLabel, sum: u64) -> u64 {
    let mut h = kvbm_transfer::checksum::BlockChecksum::new();
    h.update(&u64::from(slot).to_le_bytes());
    h.update(&label.hash.to_le_bytes());
    h.update(&label.parent.unwrap_or(0).to_le_bytes());
    h.update(&[u8::from(label.parent.is_some()); 8]);
    h.update(&sum.to_le_bytes());
    // Never 0: an all-zero record is an empty one.
    h.digest() | 1
}

/// The record bytes of `slot` holding `label` and `sum`.
pub(super) fn encode(slot: u32, label: BlockLabel, sum: u64) -> [u8; RECORD_BYTES as usize] {
    let mut r = [0u8; RECORD_BYTES as usize];
    r[0..8].copy_from_slice(&label.hash.to_le_bytes());
    let parent = label.parent.unwrap_or(0);
    r[8..16].copy_from_slice(&parent.to_le_bytes());
    r[16..24].copy_from_slice(&sum.to_le_bytes());
    // The low bit of the seal is always 1; the next one says whether there
    // is a parent.
    let flag = if label.parent.is_some() { 2 } else { 0 };
    r[24..32].copy_from_slice(&((seal(slot, label, sum) & !2) | flag).to_le_bytes());
    r
}

/// What record `r` of `slot` says: `Ok(None)` for an empty one, `Err(())`
/// for one that is neither empty nor sound.
pub(super) fn decode(slot: u32, r: &[u8]) -> Result<Option<(BlockLabel, u64)>, ()> {
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&r[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    };
    let (hash, parent, sum, check) = (word(0), word(1), word(2), word(3));
    if check == 0 {
        return if hash == 0 && parent == 0 && sum == 0 {
            Ok(None)
        } else {
            Err(())
        };
    }
    let label = BlockLabel {
        hash,
        parent: (check & 2 != 0).then_some(parent),
    };
    if label.parent.is_none() && parent != 0 {
        return Err(());
    }
    if (seal(slot, label, sum) & !2) | (check & 2) != check {
        return Err(());
    }
    Ok(Some((label, sum)))
}
