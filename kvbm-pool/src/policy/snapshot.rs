//! A use history written down, so that an engine restarted over tiers kept
//! across the restart ranks their blocks by what it knew before: without
//! it every kept block looks used once, and the popular ones go first.
//!
//! The snapshot is advisory (it moves no byte and decides nothing about
//! correctness), so a damaged or missing one is only a colder start: its
//! encoding ends with a checksum, and [`HistorySnapshot::from_bytes`]
//! refuses anything that does not match.

use kvbm_block::SequenceHash;

use super::use_history::{ReuseWeights, Seen, USE_CLASSES, UseHistory};

/// Marks an encoded snapshot.
const MAGIC: &[u8; 8] = b"KVBMUSE1";
/// Bytes of one block's entry: hash, count, last, seq.
const ENTRY_BYTES: usize = 8 + 4 + 8 + 8;
/// Bytes of the fixed part before the entries.
const HEAD_BYTES: usize = 8 + 8 + 8 + 8 * (USE_CLASSES + 1) + 8 + 8;

/// What a [`UseHistory`] knows, as it was when taken.
#[derive(Debug, Clone, PartialEq)]
pub struct HistorySnapshot {
    /// The request clock.
    pub now: u64,
    /// The last use stamp handed out.
    pub seq: u64,
    /// The learned reuse counters (see [`ReuseWeights`]).
    pub reached: [f64; USE_CLASSES + 1],
    /// Uses beyond the last class, pooled.
    pub repeats: f64,
    /// Every remembered block, least recently used first.
    pub blocks: Vec<(SequenceHash, Seen)>,
}

impl HistorySnapshot {
    /// The snapshot as bytes: a header, the entries, a checksum.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEAD_BYTES + self.blocks.len() * ENTRY_BYTES + 8);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.now.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        for r in self.reached {
            out.extend_from_slice(&r.to_le_bytes());
        }
        out.extend_from_slice(&self.repeats.to_le_bytes());
        out.extend_from_slice(&(self.blocks.len() as u64).to_le_bytes());
        for (h, s) in &self.blocks {
            out.extend_from_slice(&h.0.to_le_bytes());
            out.extend_from_slice(&s.count.to_le_bytes());
            out.extend_from_slice(&s.last.to_le_bytes());
            out.extend_from_slice(&s.seq.to_le_bytes());
        }
        let sum = fnv1a(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// Reads what [`HistorySnapshot::to_bytes`] wrote; `None` for anything
    /// else (another format, a torn or damaged file).
    pub fn from_bytes(bytes: &[u8]) -> Option<HistorySnapshot> {
        let (body, sum) = bytes.split_at_checked(bytes.len().checked_sub(8)?)?;
        if fnv1a(body) != u64::from_le_bytes(sum.try_into().ok()?) {
            return None;
        }
        let mut r = Reader(body);
        if r.take(8)? != MAGIC {
            return None;
        }
        let now = r.u64()?;
        let seq = r.u64()?;
        let mut reached = [0.0; USE_CLASSES + 1];
        for v in &mut reached {
            *v = f64::from_bits(r.u64()?);
        }
        let repeats = f64::from_bits(r.u64()?);
        let n = usize::try_from(r.u64()?).ok()?;
        if r.0.len() != n.checked_mul(ENTRY_BYTES)? {
            return None;
        }
        let blocks = (0..n)
            .map(|_| {
                let hash = SequenceHash(r.u64()?);
                let count = u32::from_le_bytes(r.take(4)?.try_into().ok()?);
                let seen = Seen {
                    count,
                    last: r.u64()?,
                    seq: r.u64()?,
                };
                Some((hash, seen))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(HistorySnapshot {
            now,
            seq,
            reached,
            repeats,
            blocks,
        })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// FNV-1a, 64 bits: enough to tell a torn or damaged file.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl UseHistory {
    /// What this history knows now.
    pub fn snapshot(&self) -> HistorySnapshot {
        let (reached, repeats) = self.weights().counters();
        HistorySnapshot {
            now: self.now(),
            seq: self.seq(),
            reached,
            repeats,
            blocks: self.remembered().collect(),
        }
    }

    /// Takes up what `snapshot` knew, as if this history had lived through
    /// it: its clock (when ahead of this one's), learned weights and every
    /// block it remembered that this history does not (a block seen since
    /// keeps what it has). Call it before the engine's first request.
    pub fn restore(&mut self, snapshot: &HistorySnapshot) {
        self.advance_to(snapshot.now, snapshot.seq);
        self.set_weights(ReuseWeights::from_counters(
            snapshot.reached,
            snapshot.repeats,
        ));
        for &(hash, seen) in &snapshot.blocks {
            self.remember(hash, seen);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: u64) -> SequenceHash {
        SequenceHash(v)
    }

    #[test]
    fn a_restored_history_ranks_blocks_as_the_old_one_did() {
        let mut old = UseHistory::new(64);
        for _ in 0..5 {
            old.record_request(&[h(1), h(2)]);
        }
        old.record_request(&[h(3)]);
        for _ in 0..300 {
            old.record_request(&[h(9)]);
        }
        let snap = HistorySnapshot::from_bytes(&old.snapshot().to_bytes()).unwrap();
        assert_eq!(snap, old.snapshot());
        let mut new = UseHistory::new(64);
        new.restore(&snap);
        for b in [1, 2, 3, 9] {
            assert_eq!(new.get(h(b)), old.get(h(b)), "block {b}");
        }
        assert_eq!(new.weights().counters(), old.weights().counters());
        // Popular before the restart still outranks a block seen once, as
        // in the old history; an empty history ranks them alike.
        assert!(new.score(h(1)) > new.score(h(3)));
        assert!(old.score(h(1)) > old.score(h(3)));
        let empty = UseHistory::new(64);
        assert_eq!(empty.score(h(1)), empty.score(h(3)));
        // The next request goes on from the old clock.
        new.record_request(&[h(3)]);
        assert_eq!(new.now(), old.now() + 1);
        assert_eq!(new.uses(h(3)), 2);
    }

    #[test]
    fn damaged_or_foreign_bytes_are_refused() {
        let mut u = UseHistory::new(8);
        u.record_request(&[h(1), h(2)]);
        let bytes = u.snapshot().to_bytes();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x20;
            assert_eq!(HistorySnapshot::from_bytes(&b), None, "byte {i}");
        }
        for n in 0..bytes.len() {
            assert_eq!(HistorySnapshot::from_bytes(&bytes[..n]), None, "{n} bytes");
        }
        assert!(HistorySnapshot::from_bytes(b"not a snapshot at all").is_none());
    }
}
