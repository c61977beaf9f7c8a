//! What onboarding costs a request, next to what recomputing would.
//!
//! Each onboard is timed from the match (where G3 reads start) to its last
//! byte in G1. The recompute time of the same blocks is the tokens they
//! store divided by the prefill rate the user states: the bytes that move
//! are those of `block_tokens / scale` tokens per block, so the tokens they
//! stand for are counted the same way. The G3 onboard rate is over the
//! onboards served from G3 alone (their G3 → G1 bytes over their times),
//! against a raw sequential `O_DIRECT` read of a scratch file next to the
//! G3 file in the same run (as large as G3, 64–256 MiB). The scratch file
//! is reserved at start-up, right after G3, and kept until the end, so a
//! disk without room for it says so before the replay, never after; when
//! the reference cannot be measured the report says it was skipped, and
//! why, and is printed all the same.

use std::path::Path;

use kvbm_transfer::memory::{DiskAllocator, DiskFile, DiskOptions};
use serde::Serialize;

use super::super::error::Result;
use super::super::matrix::reference_disk;
use super::super::shutdown::Guard;
use super::super::stats::percentile;
use super::engine::RequestOutcome;

/// Onboard latency against recompute time, and the G3 onboard rate.
#[derive(Debug, Clone, Serialize, Default)]
pub struct OnboardCost {
    /// Onboards timed.
    pub onboards: usize,
    /// Onboard latency (match → landed in G1) median, milliseconds.
    pub p50_ms: f64,
    /// Onboard latency 99th percentile, milliseconds.
    pub p99_ms: f64,
    /// Recompute time of the same onboards' stored tokens, median, ms.
    pub recompute_p50_ms: f64,
    /// Recompute time, 99th percentile, ms.
    pub recompute_p99_ms: f64,
    /// Onboards that took longer than recomputing their tokens.
    pub slower_than_recompute: usize,
    /// Onboards served from G3 alone.
    pub g3_onboards: usize,
    /// Their G3 → G1 bytes over their summed latency, GB/s.
    pub g3_gbps: f64,
    /// Share of their latency spent until kvbm had allocated their G1
    /// blocks (with write-back, saving G1's victims to G2 and G2's to G3).
    pub g3_alloc_share: f64,
    /// Raw sequential `O_DIRECT` read of a scratch file in the G3
    /// directory, same run, GB/s (0 when not measured).
    pub raw_read_gbps: f64,
    /// `g3_gbps / raw_read_gbps`.
    pub g3_vs_raw: f64,
    /// Why the raw read reference was not measured, when it was not (no
    /// room for its scratch file, an I/O error); `None` when it was, or
    /// when there was no G3 to compare.
    pub raw_read_skipped: Option<String>,
}

/// One timed onboard.
#[derive(Debug, Clone, Copy)]
pub struct OnboardSample {
    secs: f64,
    recompute_secs: f64,
    blocks: [usize; 2],
    g3_bytes: u64,
    alloc_secs: f64,
}

impl OnboardSample {
    /// The onboard of `out` (`None` without one), its blocks holding
    /// `stored_tokens` tokens each, recomputed at `tokens_per_s`.
    pub fn of(out: &RequestOutcome, stored_tokens: usize, tokens_per_s: f64) -> Option<Self> {
        let secs = out.onboard_secs?;
        let blocks = out.onboard_blocks;
        Some(Self {
            secs,
            recompute_secs: ((blocks[0] + blocks[1]) * stored_tokens) as f64 / tokens_per_s,
            blocks,
            g3_bytes: out.onboard_g3_bytes,
            alloc_secs: out.onboard_alloc_secs,
        })
    }
}

/// Sums up `samples`; `raw_read_gbps` is the same run's disk reference.
pub fn summarise(samples: &[OnboardSample], raw_read_gbps: f64) -> OnboardCost {
    let ms: Vec<f64> = samples.iter().map(|s| s.secs * 1e3).collect();
    let recompute: Vec<f64> = samples.iter().map(|s| s.recompute_secs * 1e3).collect();
    let g3: Vec<&OnboardSample> = samples
        .iter()
        .filter(|s| s.blocks[0] == 0 && s.blocks[1] > 0)
        .collect();
    let g3_secs: f64 = g3.iter().map(|s| s.secs).sum();
    let g3_bytes: u64 = g3.iter().map(|s| s.g3_bytes).sum();
    let g3_alloc: f64 = g3.iter().map(|s| s.alloc_secs).sum();
    let g3_gbps = if g3_secs > 0.0 {
        g3_bytes as f64 / g3_secs / 1e9
    } else {
        0.0
    };
    OnboardCost {
        onboards: samples.len(),
        p50_ms: percentile(&ms, 50.0),
        p99_ms: percentile(&ms, 99.0),
        recompute_p50_ms: percentile(&recompute, 50.0),
        recompute_p99_ms: percentile(&recompute, 99.0),
        slower_than_recompute: samples.iter().filter(|s| s.secs > s.recompute_secs).count(),
        g3_onboards: g3.len(),
        g3_gbps,
        g3_alloc_share: if g3_secs > 0.0 {
            g3_alloc / g3_secs
        } else {
            0.0
        },
        raw_read_gbps,
        g3_vs_raw: if raw_read_gbps > 0.0 {
            g3_gbps / raw_read_gbps
        } else {
            0.0
        },
        raw_read_skipped: None,
    }
}

/// Bounds of the scratch file the disk reference reads.
const RAW_READ_BYTES: (u64, u64) = (64 << 20, 256 << 20);

/// The disk reference: a scratch file in the G3 directory (as much as G3
/// holds, within 64–256 MiB), reserved in full when made and removed when
/// dropped, which [`measure`](Self::measure) writes and reads back
/// sequentially with `O_DIRECT`. It is a kvbm disk file (named, locked
/// and reserved like G3's), so one a killed run left behind is swept at
/// the next start.
pub struct RawReadReference {
    file: std::sync::Arc<DiskFile>,
    bytes: u64,
    _guard: Guard,
}

impl RawReadReference {
    /// Reserves the scratch file in `dir` for a G3 of `g3_bytes`.
    pub fn reserve(dir: &Path, g3_bytes: u64) -> Result<Self> {
        let bytes = g3_bytes.clamp(RAW_READ_BYTES.0, RAW_READ_BYTES.1);
        let file = DiskAllocator::new(dir, DiskOptions::default())?.allocate(bytes)?;
        // A run stopped by force still removes it.
        let guard = crate::shutdown::guard_path(file.path());
        Ok(Self {
            file,
            bytes,
            _guard: guard,
        })
    }

    /// The disk's sequential read rate, GB/s.
    pub fn measure(&self) -> Result<f64> {
        let path = self.file.path();
        reference_disk(path, self.bytes, true).and_then(|_| reference_disk(path, self.bytes, false))
    }
}

/// The raw read rate of the disk in `dir` for a G3 of `g3_bytes`, measured
/// before and after a replay (the best counts), or why it was not.
#[derive(Default)]
pub struct RawRead {
    reference: Option<RawReadReference>,
    /// The best rate measured, GB/s (0 when none was).
    pub gbps: f64,
    /// Why it was not measured (or only once).
    pub skipped: Option<String>,
}

impl RawRead {
    /// Reserves the scratch file and measures once; a failure is kept as
    /// the reason the reference was skipped.
    pub fn start(dir: &Path, g3_bytes: u64) -> Self {
        let mut raw = RawRead::default();
        match RawReadReference::reserve(dir, g3_bytes) {
            Ok(r) => {
                raw.reference = Some(r);
                raw.measure();
            }
            Err(e) => raw.skipped = Some(format!("no room for its scratch file: {e}")),
        }
        raw
    }

    /// Measures again (after the replay), then removes the scratch file.
    pub fn finish(&mut self) {
        self.measure();
        self.reference = None;
    }

    fn measure(&mut self) {
        let Some(r) = &self.reference else { return };
        match r.measure() {
            Ok(gbps) => self.gbps = self.gbps.max(gbps),
            Err(e) => {
                self.skipped = Some(format!("reading its scratch file failed: {e}"));
                self.reference = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(secs: f64, blocks: [usize; 2], g3_bytes: u64) -> RequestOutcome {
        RequestOutcome {
            prefix: Vec::new(),
            onboard_secs: Some(secs),
            onboard_blocks: blocks,
            onboard_g3_bytes: g3_bytes,
            onboard_alloc_secs: secs / 2.0,
            declined_blocks: 0,
        }
    }

    #[test]
    fn counts_slow_onboards_and_rates_g3_alone() {
        // 8 stored tokens per block at 8 000 tokens/s: 1 ms per block.
        let samples: Vec<OnboardSample> = [
            out(0.0005, [1, 0], 0),
            out(0.003, [0, 2], 2_000_000),
            out(0.001, [0, 2], 2_000_000),
            out(0.010, [1, 1], 1_000_000),
        ]
        .iter()
        .filter_map(|o| OnboardSample::of(o, 8, 8_000.0))
        .collect();
        let c = summarise(&samples, 2.0);
        assert_eq!(c.onboards, 4);
        assert_eq!(c.slower_than_recompute, 2);
        assert_eq!(c.g3_onboards, 2);
        // 4 MB in 4 ms.
        assert!((c.g3_gbps - 1.0).abs() < 1e-9, "{}", c.g3_gbps);
        assert!((c.g3_vs_raw - 0.5).abs() < 1e-9);
        assert!((c.g3_alloc_share - 0.5).abs() < 1e-9);
        assert!(OnboardSample::of(&RequestOutcome::default(), 8, 1.0).is_none());
    }
}
