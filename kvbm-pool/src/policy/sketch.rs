//! A count-min sketch with aging: approximate access counts in a few bytes
//! per block.

use kvbm_block::SequenceHash;

const ROWS: usize = 4;
const MAX_COUNT: u8 = 15;
const SEEDS: [u64; ROWS] = [
    0x9E37_79B9_7F4A_7C15,
    0xC2B2_AE3D_27D4_EB4F,
    0x1656_67B1_9E37_79F9,
    0xD6E8_FEB8_6659_FD93,
];

/// Four rows of 4-bit-range counters (kept in bytes). An estimate is the
/// minimum over the rows, so it never undercounts (until aging). After
/// `10 × width` increments every counter is halved: old popularity fades,
/// as in TinyLFU.
#[derive(Debug, Clone)]
pub(crate) struct CountMinSketch {
    rows: Vec<u8>,
    mask: usize,
    increments: usize,
    reset_after: usize,
}

impl CountMinSketch {
    /// A sketch sized for about `items` distinct hot keys.
    pub fn new(items: usize) -> Self {
        let width = items.max(16).next_power_of_two();
        Self {
            rows: vec![0; width * ROWS],
            mask: width - 1,
            increments: 0,
            reset_after: width.saturating_mul(10),
        }
    }

    fn slot(&self, row: usize, key: SequenceHash) -> usize {
        let h = (key.0 ^ (row as u64)).wrapping_mul(SEEDS[row]);
        row * (self.mask + 1) + ((h >> 32) as usize & self.mask)
    }

    /// Counts one access of `key`.
    pub fn increment(&mut self, key: SequenceHash) {
        for row in 0..ROWS {
            let slot = self.slot(row, key);
            let c = &mut self.rows[slot];
            if *c < MAX_COUNT {
                *c += 1;
            }
        }
        self.increments += 1;
        if self.increments >= self.reset_after {
            self.age();
        }
    }

    /// The estimated access count of `key` (0–15).
    pub fn estimate(&self, key: SequenceHash) -> u8 {
        (0..ROWS)
            .map(|row| self.rows[self.slot(row, key)])
            .min()
            .unwrap_or(0)
    }

    /// Halves every counter.
    pub fn age(&mut self) {
        for c in &mut self.rows {
            *c >>= 1;
        }
        self.increments /= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_never_undercount_before_aging() {
        let mut s = CountMinSketch::new(1024);
        for k in 0..200u64 {
            for _ in 0..(k % 7) {
                s.increment(SequenceHash(k));
            }
        }
        for k in 0..200u64 {
            assert!(u64::from(s.estimate(SequenceHash(k))) >= (k % 7));
        }
    }

    #[test]
    fn aging_halves() {
        let mut s = CountMinSketch::new(16);
        for _ in 0..10 {
            s.increment(SequenceHash(42));
        }
        assert!(s.estimate(SequenceHash(42)) >= 10);
        s.age();
        let e = s.estimate(SequenceHash(42));
        assert!((5..=7).contains(&e), "{e}");
    }
}
