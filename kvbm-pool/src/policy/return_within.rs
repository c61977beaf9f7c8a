//! The reuse score's "return within a horizon" model: the probability,
//! learned online, that a block of a given use-count class that has gone
//! unused for a given age is used again within the next `horizon`
//! requests.
//!
//! Each class counts the blocks that *entered* it (a use left them there)
//! and, per quarter-octave age bucket, those that *returned* (were used
//! again) at that age. From these counters a table gives, per class and
//! age bucket, `P(return in (age, age + horizon] | no return by age)`. The
//! table is made non-increasing in age within a class and non-decreasing
//! along the use count, so that (a) a class's least recently used block is
//! its lowest-scored one and (b) a parent, used at least as often and as
//! recently as its child, never scores below it.

use super::use_history::USE_CLASSES;

/// Age buckets: quarter octaves of the age in requests.
const AGE_BUCKETS: usize = 80;

/// The bucket of an age in requests: `floor(4 log2(age + 1))`, capped;
/// computed as `floor(log2((age + 1)^4))` in integers (the reuse score
/// buckets every block of every recorded request).
fn age_bucket(age: u64) -> usize {
    let x = u128::from(age) + 1;
    // 4 log2(2^20) = 80: every larger age is in the last bucket.
    if x >= 1 << 20 {
        return AGE_BUCKETS - 1;
    }
    let x4 = (x * x) * (x * x);
    ((127 - x4.leading_zeros()) as usize).min(AGE_BUCKETS - 1)
}

/// Learned return statistics per use-count class and the score table
/// derived from them.
#[derive(Debug, Clone)]
pub(crate) struct ReturnTable {
    horizon: u64,
    entered: [f64; USE_CLASSES],
    returned: [[f64; AGE_BUCKETS]; USE_CLASSES],
    table: [[f64; AGE_BUCKETS]; USE_CLASSES],
}

impl ReturnTable {
    /// A table for a look-ahead of `horizon` requests, starting from a weak
    /// prior: of eight blocks per class, two return at ages 16 to 4096.
    pub fn new(horizon: u64) -> Self {
        let mut returned = [[0.0; AGE_BUCKETS]; USE_CLASSES];
        for row in &mut returned {
            for slot in row.iter_mut().take(48).skip(16) {
                *slot = 2.0 / 32.0;
            }
        }
        let mut t = Self {
            horizon: horizon.max(1),
            entered: [8.0; USE_CLASSES],
            returned,
            table: [[0.0; AGE_BUCKETS]; USE_CLASSES],
        };
        t.refresh();
        t
    }

    /// The look-ahead window in requests.
    pub fn horizon(&self) -> u64 {
        self.horizon
    }

    /// Records a use that moved a block from `previous` (its class and its
    /// age since the last use, when it had been seen) into class `now`.
    pub fn observe(&mut self, previous: Option<(usize, u64)>, now: usize) {
        if let Some((class, age)) = previous {
            self.returned[class.min(USE_CLASSES - 1)][age_bucket(age)] += 1.0;
        }
        self.entered[now.min(USE_CLASSES - 1)] += 1.0;
    }

    /// Recomputes the score table from the counters.
    pub fn refresh(&mut self) {
        for c in 0..USE_CLASSES {
            let r = &self.returned[c];
            let total: f64 = r.iter().sum();
            let n = self.entered[c].max(total).max(1.0);
            // suffix[i]: returns at ages in bucket i or later.
            let mut suffix = [0.0; AGE_BUCKETS + 1];
            for i in (0..AGE_BUCKETS).rev() {
                suffix[i] = suffix[i + 1] + r[i];
            }
            let row = &mut self.table[c];
            for (i, slot) in row.iter_mut().enumerate() {
                let alive = (n - (total - suffix[i])).max(1e-9);
                let age = 2f64.powf(i as f64 / 4.0) - 1.0;
                let end = age_bucket(age as u64 + self.horizon);
                *slot = (suffix[i] - suffix[end]) / alive;
            }
            for i in (0..AGE_BUCKETS - 1).rev() {
                row[i] = row[i].max(row[i + 1]);
            }
        }
        for c in 1..USE_CLASSES {
            for i in 0..AGE_BUCKETS {
                self.table[c][i] = self.table[c][i].max(self.table[c - 1][i]);
            }
        }
    }

    /// The score of a block of `class` unused for `age` requests; within a
    /// bucket the younger block scores a little higher.
    pub fn score(&self, class: usize, age: u64) -> f64 {
        self.table[class.min(USE_CLASSES - 1)][age_bucket(age)] - age as f64 * 1e-15
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_age_buckets_are_the_logarithms_floors() {
        let by_log = |age: u64| {
            ((age.saturating_add(1) as f64).log2() * 4.0)
                .floor()
                .min((AGE_BUCKETS - 1) as f64) as usize
        };
        for age in (0..1 << 21).chain([u64::MAX - 1, u64::MAX, 1 << 40]) {
            assert_eq!(age_bucket(age), by_log(age), "age {age}");
        }
    }

    #[test]
    fn scores_fall_with_age_and_rise_with_uses() {
        let mut t = ReturnTable::new(250);
        // Class 0 returns rarely and late; class 3 often and soon.
        for _ in 0..1000 {
            t.observe(None, 0);
        }
        for _ in 0..100 {
            t.observe(Some((0, 2000)), 1);
        }
        for _ in 0..500 {
            t.observe(Some((3, 50)), 3);
        }
        t.refresh();
        for c in 0..USE_CLASSES {
            for age in [0u64, 10, 100, 1000, 10_000] {
                assert!(t.score(c, age) >= t.score(c, age * 2 + 1));
            }
            if c > 0 {
                assert!(t.score(c, 100) >= t.score(c - 1, 100));
            }
        }
        assert!(t.score(3, 10) > t.score(0, 10));
    }
}
