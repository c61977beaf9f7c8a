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

/// Books that keep a use history another process can write down and a
/// restarted engine take up: the tier engine, and the ledger of an engine
/// that keeps its own books.
pub trait HistorySource: Send + Sync {
    /// The whole history now.
    fn history_snapshot(&self) -> HistorySnapshot {
        self.history_changes(0)
    }

    /// What changed since the snapshot or change whose `seq` is `seq`.
    fn history_changes(&self, seq: u64) -> HistorySnapshot;

    /// Takes up a history written before a restart; call it before the
    /// kept blocks are registered, so they rank by it.
    fn restore_history(&self, snapshot: &HistorySnapshot);
}

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

impl HistorySnapshot {
    /// A snapshot followed by the changes taken after it
    /// ([`UseHistory::changes_since`]), in the order they were taken, as
    /// one snapshot: the last part's clock and weights, each block as its
    /// latest part has it, least recently used first. `None` for no parts.
    pub fn combine(mut parts: Vec<HistorySnapshot>) -> Option<HistorySnapshot> {
        let mut whole = parts.pop()?;
        let total = whole.blocks.len() + parts.iter().map(|p| p.blocks.len()).sum::<usize>();
        let mut taken = std::collections::HashSet::with_capacity(total);
        let mut blocks = Vec::with_capacity(total);
        // Newest first, keeping each block's first (latest) entry.
        let newest_first = std::iter::once(std::mem::take(&mut whole.blocks))
            .chain(parts.into_iter().rev().map(|p| p.blocks));
        for part in newest_first {
            for (hash, seen) in part.into_iter().rev() {
                if taken.insert(hash) {
                    blocks.push((hash, seen));
                }
            }
        }
        blocks.reverse();
        whole.blocks = blocks;
        Some(whole)
    }
}

impl UseHistory {
    /// What this history knows now.
    pub fn snapshot(&self) -> HistorySnapshot {
        self.changes_since(0)
    }

    /// What changed since the snapshot or change whose `seq` is `seq`: the
    /// clock, the weights and the blocks used since. It takes time in the
    /// blocks used since, not in the blocks remembered, so a history can
    /// be written down often; [`HistorySnapshot::combine`] puts the parts
    /// back together.
    pub fn changes_since(&self, seq: u64) -> HistorySnapshot {
        let (reached, repeats) = self.weights().counters();
        let mut blocks: Vec<_> = self.used_after(seq).collect();
        blocks.reverse();
        HistorySnapshot {
            now: self.now(),
            seq: self.seq(),
            reached,
            repeats,
            blocks,
        }
    }

    /// Takes up what `snapshot` knew, as if this history had lived through
    /// it: its clock (when ahead of this one's), learned weights and every
    /// block it remembered that this history does not (a block seen since
    /// keeps what it has), the most recently used where not all fit. Call
    /// it before the engine's first request.
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
    use proptest::prelude::*;

    use super::*;

    fn h(v: u64) -> SequenceHash {
        SequenceHash(v)
    }

    proptest! {
        /// A full snapshot and the changes taken after it, combined and
        /// restored, give the history the old one had at the last change,
        /// whatever it forgot in between.
        #[test]
        fn changes_combine_into_the_whole_history(
            capacity in 1usize..24,
            requests in prop::collection::vec(
                (prop::collection::vec(0u64..40, 1..6), any::<bool>()),
                0..60,
            ),
        ) {
            let mut old = UseHistory::new(capacity);
            let mut parts = Vec::new();
            let mut taken: Option<u64> = None;
            let mut take = |u: &UseHistory, parts: &mut Vec<HistorySnapshot>| {
                let part = match taken {
                    None => u.snapshot(),
                    Some(seq) => u.changes_since(seq),
                };
                taken = Some(part.seq);
                // Through the encoding, as the parts go to a file.
                parts.push(HistorySnapshot::from_bytes(&part.to_bytes()).unwrap());
            };
            for (blocks, write) in &requests {
                let hashes: Vec<_> = blocks.iter().map(|&b| h(b)).collect();
                old.record_request(&hashes);
                if *write {
                    take(&old, &mut parts);
                }
            }
            take(&old, &mut parts);
            let whole = HistorySnapshot::combine(parts).unwrap();
            let mut new = UseHistory::new(capacity);
            new.restore(&whole);
            prop_assert_eq!(new.snapshot(), old.snapshot());
        }
    }

    #[test]
    fn changes_hold_only_the_blocks_used_since() {
        let mut u = UseHistory::new(64);
        u.record_request(&[h(1), h(2)]);
        let first = u.snapshot();
        u.record_request(&[h(3)]);
        u.record_request(&[h(1)]);
        let since = u.changes_since(first.seq);
        let blocks: Vec<_> = since.blocks.iter().map(|&(b, _)| b).collect();
        assert_eq!(blocks, [h(3), h(1)]);
        assert_eq!(since.now, u.now());
        assert!(u.changes_since(since.seq).blocks.is_empty());
        assert!(HistorySnapshot::combine(Vec::new()).is_none());
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
