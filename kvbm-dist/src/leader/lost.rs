//! Which G2/G3 blocks lost their bytes with a worker.
//!
//! A block's bytes exist once per worker; when one worker is lost, its
//! slices of every G2 and G3 block are gone, so every such block is marked
//! lost. A copy that reads a lost block fails; a copy that lands a block on
//! every worker makes it whole again. Only the leader's event loop touches
//! this, so the marks and the copies they guard are ordered.

use kvbm_pool::Tier;

/// A bitset per tier.
#[derive(Debug, Default)]
pub(crate) struct LostBlocks {
    g2: Vec<u64>,
    g3: Vec<u64>,
    g2_len: usize,
    g3_len: usize,
}

impl LostBlocks {
    pub(crate) fn new(g2: usize, g3: usize) -> Self {
        LostBlocks {
            g2: vec![0; g2.div_ceil(64)],
            g3: vec![0; g3.div_ceil(64)],
            g2_len: g2,
            g3_len: g3,
        }
    }

    fn bits(&mut self, tier: Tier) -> Option<(&mut Vec<u64>, usize)> {
        match tier {
            Tier::G2 => Some((&mut self.g2, self.g2_len)),
            Tier::G3 => Some((&mut self.g3, self.g3_len)),
            Tier::G1 | Tier::G4 => None,
        }
    }

    /// Marks every G2 and G3 block lost.
    pub(crate) fn lose_all(&mut self) {
        for tier in [Tier::G2, Tier::G3] {
            if let Some((bits, len)) = self.bits(tier) {
                bits.fill(u64::MAX);
                if len % 64 != 0
                    && let Some(last) = bits.last_mut()
                {
                    *last = (1u64 << (len % 64)) - 1;
                }
            }
        }
    }

    /// True when block `b` of `tier` is lost.
    pub(crate) fn is_lost(&mut self, tier: Tier, b: usize) -> bool {
        self.bits(tier)
            .is_some_and(|(bits, len)| b < len && bits[b / 64] & (1 << (b % 64)) != 0)
    }

    /// Block `b` of `tier` landed on every worker.
    pub(crate) fn restore(&mut self, tier: Tier, b: usize) {
        if let Some((bits, len)) = self.bits(tier)
            && b < len
        {
            bits[b / 64] &= !(1 << (b % 64));
        }
    }

    /// Lost blocks of `tier`.
    pub(crate) fn count(&self, tier: Tier) -> usize {
        let bits = match tier {
            Tier::G2 => &self.g2,
            Tier::G3 => &self.g3,
            Tier::G1 | Tier::G4 => return 0,
        };
        bits.iter().map(|w| w.count_ones() as usize).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn marks_follow_a_model(g2 in 0usize..200, ops in prop::collection::vec((any::<bool>(), 0usize..220), 0..50)) {
            let mut lost = LostBlocks::new(g2, 3);
            let mut model = vec![false; g2];
            lost.lose_all();
            model.iter_mut().for_each(|m| *m = true);
            for (restore, b) in ops {
                if restore {
                    lost.restore(Tier::G2, b);
                    if b < g2 { model[b] = false; }
                }
                prop_assert_eq!(lost.is_lost(Tier::G2, b), b < g2 && model[b]);
            }
            prop_assert_eq!(lost.count(Tier::G2), model.iter().filter(|m| **m).count());
            prop_assert_eq!(lost.count(Tier::G3), 3);
            prop_assert!(!lost.is_lost(Tier::G1, 0));
        }
    }
}
