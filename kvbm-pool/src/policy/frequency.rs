//! Frequency-aware eviction and admission (TinyLFU-style).

use kvbm_block::SequenceHash;

use super::{BlockRef, BlockView, CountMinSketch, EvictionPolicy, LruPolicy, Victim};

/// Counts every registration and match in a count-min sketch. Eviction
/// takes the `sample` least recently released blocks and evicts the one
/// seen least often (the oldest among equals); the others keep their place.
/// Admission compares a candidate's count with that victim's: a one-off
/// block does not push out a popular one.
#[derive(Debug)]
// Aligned to its own cache lines: the shards of a sharded policy are
// written by different threads and must not share a line.
#[repr(align(128))]
pub struct FrequencyPolicy {
    lru: LruPolicy,
    sketch: CountMinSketch,
    sample: usize,
    /// (stamp, id, hash) of the candidates of one eviction.
    candidates: Vec<(u64, u32, SequenceHash)>,
    /// The last peeked victim, out of the queue until popped.
    peeked: Option<(u64, u32, SequenceHash)>,
}

impl FrequencyPolicy {
    /// A policy for a pool of `capacity` blocks comparing `sample`
    /// candidates per eviction.
    pub fn new(capacity: usize, sample: usize) -> Self {
        Self {
            lru: LruPolicy::with_capacity(capacity),
            sketch: CountMinSketch::new(capacity),
            sample: sample.max(1),
            candidates: Vec::with_capacity(sample.max(1)),
            peeked: None,
        }
    }

    /// The estimated access count of a hash.
    pub fn frequency(&self, hash: SequenceHash) -> u8 {
        self.sketch.estimate(hash)
    }

    /// Fills `candidates` with up to `sample` valid LRU entries, oldest
    /// first, and returns the index of the least frequent one.
    fn gather(&mut self, view: &BlockView<'_>) -> Option<usize> {
        self.candidates.clear();
        while self.candidates.len() < self.sample {
            match self.lru.pop_valid(view) {
                Some(b) => self.candidates.push((b.stamp(), b.id(), b.hash())),
                None => break,
            }
        }
        let mut best: Option<(usize, u8)> = None;
        for (i, &(_, _, hash)) in self.candidates.iter().enumerate() {
            let f = self.sketch.estimate(hash);
            if best.is_none_or(|(_, bf)| f < bf) {
                best = Some((i, f));
            }
        }
        best.map(|(i, _)| i)
    }

    /// Puts the gathered candidates except `skip` back in front, in order.
    fn restore(&mut self, skip: Option<usize>) {
        for (i, &(stamp, id, _)) in self.candidates.iter().enumerate().rev() {
            if Some(i) != skip {
                self.lru.push_front(stamp, id);
            }
        }
        self.candidates.clear();
    }
}

impl EvictionPolicy for FrequencyPolicy {
    fn name(&self) -> &'static str {
        "tinylfu"
    }

    fn on_release(&mut self, block: BlockRef<'_>) {
        self.lru.on_release(block);
    }

    fn peek_victim(&mut self, view: &BlockView<'_>) -> Option<Victim> {
        if let Some((stamp, id, _)) = self.peeked.take() {
            self.lru.push_front(stamp, id);
        }
        let pick = self.gather(view);
        let victim = pick.map(|i| self.candidates[i]);
        self.restore(pick);
        // The victim stays out of the queue until popped (or peeked again).
        self.peeked = victim;
        victim.map(|(stamp, id, _)| Victim {
            id,
            key: u128::from(stamp),
        })
    }

    fn warm(&self, view: &BlockView<'_>, n: usize) {
        self.lru.warm(view, n);
    }

    fn pop_victim(&mut self) {
        self.peeked = None;
    }

    fn tracks_access(&self) -> bool {
        true
    }

    fn on_access(&mut self, hash: SequenceHash) {
        self.sketch.increment(hash);
    }

    fn admit(&mut self, candidate: SequenceHash, view: &BlockView<'_>) -> bool {
        if let Some((stamp, id, _)) = self.peeked.take() {
            self.lru.push_front(stamp, id);
        }
        let pick = self.gather(view);
        let admit = match pick {
            Some(i) => self.sketch.estimate(candidate) > self.sketch.estimate(self.candidates[i].2),
            None => false,
        };
        self.restore(None);
        admit
    }

    fn compact(&mut self, view: &BlockView<'_>) {
        self.lru.compact(view);
    }

    fn queued(&self) -> usize {
        self.lru.queued()
    }
}
