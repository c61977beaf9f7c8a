//! Load or recompute: a match may leave the tail of a prefix for the
//! engine to recompute when loading it would take longer.
//!
//! Each matched block saves the engine `tokens / recompute rate` seconds of
//! prefill and costs `bytes / rate of its tier` seconds of loading. The
//! running sum of (saving − cost) along the prefix says where to cut: the
//! match keeps the prefix up to the point where that sum is highest, so a
//! slow G3 tail is dropped while a G2 part before it is kept, and a slow
//! block in the middle is loaded when the fast ones after it pay for it.
//! The rates are the configured ones until the engine has measured its own
//! (an average over recent copies into G1 and G3 reads, each timed from its
//! submission); while matches decline blocks, the estimates drift back
//! towards the configured rates, so a tier measured slow once is tried
//! again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kvbm_transfer::TransferOutcome;

/// The rates a match weighs loading against recomputing.
///
/// Off by default (`recompute_tokens_per_s: None`): how fast the engine
/// recomputes depends on the model, its parallelism, the GPU and the batch
/// the prefill shares, none of which kvbm sees. A guess too high would make
/// kvbm decline loads that pay; one too low would never decline. Without a
/// rate every matched block is loaded, which is right whenever the tiers
/// are faster than prefill — the common case for G2, and for G3 on a local
/// NVMe drive. Set it when G3 is a slow disk (or a network file system) and
/// the engine's prefill rate is known.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoadCost {
    /// The engine's prefill rate, tokens per second; `None`: load every
    /// matched block.
    pub recompute_tokens_per_s: Option<f64>,
    /// G2 → G1 rate assumed until onboards have measured one, bytes per
    /// second.
    pub g2_bytes_per_s: f64,
    /// G3 read rate assumed until reads have measured one, bytes per
    /// second.
    pub g3_bytes_per_s: f64,
}

impl Default for LoadCost {
    /// Off; until measured, a host → GPU link of 20 GB/s and a disk of
    /// 1 GB/s.
    fn default() -> Self {
        Self {
            recompute_tokens_per_s: None,
            g2_bytes_per_s: 20e9,
            g3_bytes_per_s: 1e9,
        }
    }
}

impl LoadCost {
    /// Declines loads slower than recomputing at `tokens_per_s`.
    pub fn recompute_at(tokens_per_s: f64) -> Self {
        Self {
            recompute_tokens_per_s: Some(tokens_per_s),
            ..Self::default()
        }
    }

    /// Checks the rates given; the error says which one is wrong.
    pub(crate) fn validate(&self) -> Result<(), String> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if let Some(r) = self.recompute_tokens_per_s
            && !positive(r)
        {
            return Err("load_cost.recompute_tokens_per_s must be positive".into());
        }
        if !positive(self.g2_bytes_per_s) || !positive(self.g3_bytes_per_s) {
            return Err("load_cost rates must be positive".into());
        }
        Ok(())
    }

    /// How many leading blocks of a matched run to load: `from_g3[i]` says
    /// whether block `i` (in prefix order) is read from G3 (else G2), each
    /// block holds `tokens_per_block` tokens and weighs `block_bytes[0]`
    /// (G2) or `block_bytes[1]` (G3) bytes, moved at `rates` (G2, G3) bytes
    /// per second. All of them when the model is off.
    pub fn blocks_worth_loading(
        &self,
        rates: [f64; 2],
        tokens_per_block: usize,
        block_bytes: [u64; 2],
        from_g3: &[bool],
    ) -> usize {
        let Some(recompute) = self.recompute_tokens_per_s else {
            return from_g3.len();
        };
        let saving = tokens_per_block as f64 / recompute;
        let cost = [0, 1].map(|t| {
            let rate = rates[t];
            if rate.is_finite() && rate > 0.0 {
                block_bytes[t] as f64 / rate
            } else {
                f64::INFINITY
            }
        });
        let (mut best, mut best_at, mut sum) = (0.0f64, 0usize, 0.0f64);
        for (i, &g3) in from_g3.iter().enumerate() {
            sum += saving - cost[usize::from(g3)];
            if sum > best {
                best = sum;
                best_at = i + 1;
            }
        }
        best_at
    }
}

/// A rate measured by the engine: an exponential average of observed
/// transfers, starting from a configured value.
#[derive(Debug, Default)]
pub(crate) struct MeasuredRate(AtomicU64);

impl MeasuredRate {
    /// Weight of the newest observation.
    const WEIGHT: f64 = 0.2;
    /// Weight of the configured rate at each declined match.
    const RELAX: f64 = 0.05;

    /// The measured rate, or `assumed` before any observation.
    pub(crate) fn get(&self, assumed: f64) -> f64 {
        match self.0.load(Ordering::Relaxed) {
            0 => assumed,
            bits => f64::from_bits(bits),
        }
    }

    /// Adds an observation of `bytes` moved in `secs`.
    pub(crate) fn observe(&self, bytes: u64, secs: f64) {
        if bytes == 0 || !(secs.is_finite() && secs > 0.0) {
            return;
        }
        let now = bytes as f64 / secs;
        // A lost race drops one observation, which an average can afford.
        let old = self.0.load(Ordering::Relaxed);
        let next = match old {
            0 => now,
            bits => {
                let prev = f64::from_bits(bits);
                prev + Self::WEIGHT * (now - prev)
            }
        };
        let _ = self
            .0
            .compare_exchange(old, next.to_bits(), Ordering::Relaxed, Ordering::Relaxed);
    }
}

impl MeasuredRate {
    /// Adds the copy that ended with `outcome`, submitted at `submitted`
    /// (failures say nothing about the rate).
    pub(crate) fn observe_outcome(&self, outcome: &TransferOutcome, submitted: Instant) {
        if let Ok(report) = outcome {
            self.observe(report.bytes, submitted.elapsed().as_secs_f64());
        }
    }

    /// Moves the estimate a step towards `assumed`: a tier whose loads are
    /// all declined is measured no more, so its estimate drifts back to
    /// the configured rate and is tried again, instead of a slow moment
    /// declining it for good.
    pub(crate) fn relax(&self, assumed: f64) {
        let old = self.0.load(Ordering::Relaxed);
        if old == 0 {
            return;
        }
        let prev = f64::from_bits(old);
        let next = prev + Self::RELAX * (assumed - prev);
        let _ = self
            .0
            .compare_exchange(old, next.to_bits(), Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// The engine's measured G2 → G1 and G3 read rates.
#[derive(Debug, Default)]
pub(crate) struct MeasuredRates {
    /// G2 → G1 copies.
    pub(crate) g2: MeasuredRate,
    /// G3 reads (into G1, or into the staging area).
    pub(crate) g3: MeasuredRate,
}

impl MeasuredRates {
    /// The rates to decide with: measured, or `cost`'s assumptions.
    pub(crate) fn current(&self, cost: &LoadCost) -> [f64; 2] {
        [
            self.g2.get(cost.g2_bytes_per_s),
            self.g3.get(cost.g3_bytes_per_s),
        ]
    }

    /// A match declined blocks: both estimates drift towards `cost`'s.
    pub(crate) fn declined(&self, cost: &LoadCost) {
        self.g2.relax(cost.g2_bytes_per_s);
        self.g3.relax(cost.g3_bytes_per_s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // 16 tokens per block at 16 000 tokens/s: each block saves 1 ms.
    const MIB: u64 = 1 << 20;

    #[test]
    fn off_loads_everything() {
        let c = LoadCost::default();
        assert_eq!(
            c.blocks_worth_loading([1.0, 1.0], 16, [MIB, MIB], &[true; 5]),
            5
        );
    }

    #[test]
    fn declines_a_g3_tail_slower_than_recompute() {
        let c = LoadCost::recompute_at(16_000.0);
        // G2 at 2 GiB/s: 0.5 ms per MiB block, worth it; G3 at 0.5 GiB/s:
        // 2 ms per block, not.
        let rates = [2.0 * 1024.0 * MIB as f64, 0.5 * 1024.0 * MIB as f64];
        let blocks = [false, false, true, true, true];
        assert_eq!(c.blocks_worth_loading(rates, 16, [MIB, MIB], &blocks), 2);
        // All G3: nothing is worth loading.
        assert_eq!(c.blocks_worth_loading(rates, 16, [MIB, MIB], &[true; 3]), 0);
        // A faster disk (4 GiB/s: 0.25 ms per block) loads them all.
        let fast = [rates[0], 4.0 * 1024.0 * MIB as f64];
        assert_eq!(c.blocks_worth_loading(fast, 16, [MIB, MIB], &blocks), 5);
    }

    #[test]
    fn a_slow_block_is_loaded_when_the_fast_ones_after_it_pay() {
        let c = LoadCost::recompute_at(16_000.0);
        // G2 blocks gain 0.75 ms each, the G3 block loses 1 ms.
        let rates = [4.0 * 1024.0 * MIB as f64, 0.5 * 1024.0 * MIB as f64];
        let blocks = [false, true, false, false];
        assert_eq!(c.blocks_worth_loading(rates, 16, [MIB, MIB], &blocks), 4);
        // One G2 block after it does not make up for it.
        let blocks = [false, true, false];
        assert_eq!(c.blocks_worth_loading(rates, 16, [MIB, MIB], &blocks), 1);
    }

    #[test]
    fn bad_rates_are_refused_or_never_chosen() {
        assert!(LoadCost::recompute_at(0.0).validate().is_err());
        assert!(LoadCost::recompute_at(f64::NAN).validate().is_err());
        let c = LoadCost {
            g3_bytes_per_s: -1.0,
            ..LoadCost::default()
        };
        assert!(c.validate().is_err());
        let c = LoadCost::recompute_at(16_000.0);
        assert_eq!(
            c.blocks_worth_loading([0.0, 0.0], 16, [MIB, MIB], &[false]),
            0
        );
    }

    #[test]
    fn measured_rates_average_from_the_first_observation() {
        let r = MeasuredRate::default();
        assert_eq!(r.get(5.0), 5.0);
        r.observe(100, 1.0);
        assert_eq!(r.get(5.0), 100.0);
        r.observe(200, 1.0);
        assert!((r.get(5.0) - 120.0).abs() < 1e-9);
        r.observe(0, 1.0);
        r.observe(10, 0.0);
        assert!((r.get(5.0) - 120.0).abs() < 1e-9);
        // Declined matches pull it back towards the assumption.
        for _ in 0..200 {
            r.relax(1000.0);
        }
        assert!((r.get(5.0) - 1000.0).abs() < 1.0);
        let fresh = MeasuredRate::default();
        fresh.relax(7.0);
        assert_eq!(fresh.get(7.0), 7.0);
    }
}
