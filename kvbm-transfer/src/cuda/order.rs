//! Ordering a staged copy's runs by host address when its plan scatters
//! the host side, a part at a time.
//!
//! An onboard's plan lists runs in the device layout's order, which puts
//! consecutive host bytes far apart; staged in that order, each slot's DMA
//! would be thousands of small pieces. Sorting the whole plan first would
//! hold the copy's first DMA back by the sort. Instead one counting pass
//! splits the runs into buckets of nearby host addresses (buckets in
//! address order), and a bucket is sorted only when the chunker reaches
//! it: the first chunk waits for the split and one small sort, the rest is
//! sorted while earlier chunks move.

/// Runs a few dozen apart per bucket on average: small sorts, and the
/// split's counts stay in cache.
const RUNS_PER_BUCKET: usize = 64;

/// The most buckets one split makes.
const MAX_BUCKETS: usize = 1 << 14;

/// A staged copy's runs in increasing host address order (ties in plan
/// order), sorted lazily bucket by bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostOrder {
    /// `(host address, run index)`, grouped by bucket in address order;
    /// sorted up to `bounds[sorted]`.
    keyed: Vec<(u64, u32)>,
    /// Where each bucket starts in `keyed`, plus the end.
    bounds: Vec<usize>,
    /// Buckets sorted so far.
    sorted: usize,
}

impl HostOrder {
    /// Splits `keyed` (`(host address, run index)` in plan order) into
    /// buckets of nearby addresses; nothing is sorted yet.
    pub(crate) fn new(keyed: Vec<(u64, u32)>) -> Self {
        let Some(min) = keyed.iter().map(|&(k, _)| k).min() else {
            return HostOrder {
                keyed,
                bounds: vec![0],
                sorted: 0,
            };
        };
        let span = keyed.iter().map(|&(k, _)| k - min).max().unwrap_or(0);
        let buckets = (keyed.len() / RUNS_PER_BUCKET)
            .next_power_of_two()
            .clamp(1, MAX_BUCKETS);
        let bucket_bits = buckets.trailing_zeros();
        let used = u64::BITS - span.leading_zeros();
        let shift = used.saturating_sub(bucket_bits);
        let bucket = |k: u64| (k - min).checked_shr(shift).unwrap_or(0) as usize;
        let mut bounds = vec![0usize; buckets + 1];
        for &(k, _) in &keyed {
            bounds[bucket(k) + 1] += 1;
        }
        for b in 0..buckets {
            bounds[b + 1] += bounds[b];
        }
        let mut next = bounds.clone();
        let mut split = vec![(0u64, 0u32); keyed.len()];
        for &e in &keyed {
            let b = bucket(e.0);
            split[next[b]] = e;
            next[b] += 1;
        }
        HostOrder {
            keyed: split,
            bounds,
            sorted: 0,
        }
    }

    /// Runs in the order.
    pub(crate) fn len(&self) -> usize {
        self.keyed.len()
    }

    /// The index of the `i`-th run in host order, sorting the buckets up
    /// to the one that holds it first.
    pub(crate) fn get(&mut self, i: usize) -> Option<u32> {
        if i >= self.keyed.len() {
            return None;
        }
        while self.bounds[self.sorted] <= i {
            let (from, to) = (self.bounds[self.sorted], self.bounds[self.sorted + 1]);
            // Bucket contents keep plan order, so sorting by the pair
            // sorts ties by run index.
            self.keyed[from..to].sort_unstable();
            self.sorted += 1;
        }
        Some(self.keyed[i].1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn yields_runs_by_address_then_index(
            keys in proptest::collection::vec(
                prop_oneof![0u64..64, any::<u64>(), (1u64 << 40)..(1u64 << 40) + 4096],
                0..600,
            ),
            probe in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let keyed: Vec<(u64, u32)> =
                keys.iter().enumerate().map(|(i, &k)| (k, i as u32)).collect();
            let mut want = keyed.clone();
            want.sort_unstable();
            let want: Vec<u32> = want.into_iter().map(|(_, i)| i).collect();
            let mut order = HostOrder::new(keyed);
            prop_assert_eq!(order.len(), want.len());
            // Random lookups first (they sort ahead), then every position.
            for p in &probe {
                if !want.is_empty() {
                    let i = p.index(want.len());
                    prop_assert_eq!(order.get(i), Some(want[i]));
                }
            }
            let got: Vec<u32> = (0..want.len()).map(|i| order.get(i).unwrap()).collect();
            prop_assert_eq!(got, want.clone());
            prop_assert_eq!(order.get(want.len()), None);
        }
    }
}
