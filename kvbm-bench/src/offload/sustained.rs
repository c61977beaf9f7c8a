//! Offloads without a pause, for the GEMM's loss over long windows.
//!
//! A rep of the offload bench lasts 20–80 ms on the H200 machine: a dozen
//! to fifty GEMMs, so the GEMM's rate inside one window moves by a couple
//! of percent with the host's wake-ups alone. The sustained measurement
//! offloads round after round (every round half the shape's blocks under
//! fresh hashes, so nothing is skipped as present) for a span of seconds
//! beside the GEMM, against windows as long of the same GEMM loop alone
//! just before and after. The engine's queue never drains: each round is
//! queued before the one before it is waited for (the two halves of G1
//! alternate), as offloads arrive from a busy engine. (Rounds that each
//! ended in `flush` read 0.82–0.83 of the link at 8 KiB chunks in 512 MiB
//! rounds and 0.89–0.92 in 2 GiB ones: every round paid the first
//! staging kernel's wait for SMs with nothing queued behind it.) G2 evicts
//! earlier rounds as later ones land, so its bytes are not checked here
//! (every row's timed reps check them); the engine's counters must say
//! every block of every round was copied.
// It runs beside the GEMM, so only in GPU builds; the type is reported in
// every build.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::time::{Duration, Instant};

use kvbm_block::SequenceHash;
use kvbm_pool::metrics::TierStats;
use kvbm_pool::tier::TierEngine;
use serde::Serialize;

use super::super::error::{BenchError, Result};
use super::super::thread_cpu::{CpuSample, ThreadCpu};
use super::{Counted, Reference, Rep, Shape, hash_of, register_chain};

/// The sustained measurement of a busy row.
#[derive(Debug, Clone, Serialize)]
pub struct Sustained {
    /// Seconds from the first round's `offload` to the final `flush`
    /// (registering each round's blocks in G1 included; the copies run
    /// meanwhile).
    pub secs: f64,
    /// Rounds run (half the shape's blocks each).
    pub rounds: u64,
    /// Offload GB/s over the span.
    pub gbps: f64,
    /// `gbps` ÷ the device → pinned reference.
    pub ratio_to_d2h: f64,
    /// GEMM TFLOP/s alone: the mean of a window as long as the span just
    /// before it and one just after it, in the same GEMM loop.
    pub gemm_alone_tflops: Option<f64>,
    /// GEMM TFLOP/s over the span.
    pub gemm_during_tflops: Option<f64>,
    /// 100 × (1 − during ÷ alone).
    pub gemm_loss_pct: Option<f64>,
    /// CPU time per thread over the span (Linux).
    pub cpu: Option<ThreadCpu>,
}

impl Sustained {
    /// The summary of `rep` (from [`offload_for`] beside the GEMM), or why
    /// it failed.
    pub(super) fn of(rep: &Rep, d2h: &Reference) -> std::result::Result<Sustained, String> {
        if let Some(f) = &rep.failure {
            return Err(f.clone());
        }
        let gbps = rep.bytes as f64 / rep.secs.max(1e-9) / 1e9;
        let loss = match (rep.gemm_tflops, rep.gemm_alone_tflops) {
            (Some(d), Some(a)) if a > 0.0 => Some(100.0 * (1.0 - d / a)),
            _ => None,
        };
        Ok(Sustained {
            secs: rep.secs,
            rounds: rep.rounds,
            gbps,
            ratio_to_d2h: if d2h.gbps.median > 0.0 {
                gbps / d2h.gbps.median
            } else {
                0.0
            },
            gemm_alone_tflops: rep.gemm_alone_tflops,
            gemm_during_tflops: rep.gemm_tflops,
            gemm_loss_pct: loss,
            cpu: rep.cpu.clone(),
        })
    }
}

/// The salt of round `round`'s hashes (bits `hash_of` leaves alone above
/// the block id's and below the tokens').
fn salted(hash: u64, round: u64) -> SequenceHash {
    SequenceHash(hash ^ (round << 24))
}

/// Offloads half the shape's blocks round after round under fresh hashes
/// until `span` has passed, each round queued before the one before it is
/// waited for; one [`Rep`] for the whole (nothing checked byte for byte).
pub(super) fn offload_for(engine: &TierEngine, shape: &Shape, span: Duration) -> Result<Rep> {
    let half = (shape.blocks / 2).max(1);
    let before = engine.stats();
    let cpu_before = CpuSample::now();
    let t0 = Instant::now();
    let mut round = 0u64;
    // The round before this one: still held until its copies ran.
    let mut earlier = None;
    while t0.elapsed() < span || round == 0 {
        round += 1;
        let chain = register_chain(engine, half, |b| salted(hash_of(shape.tokens, b), round))?;
        engine.offload(chain.items);
        if let Some(held) = earlier.replace(chain.held) {
            // Every block up to the earlier round copied (or skipped, which
            // the counters below report), so its sources can go; then the
            // engine lets go of them too, and the next round has room.
            let done = (round - 1) * half as u64;
            wait_for("copied", round - 1, || {
                handled(&before, &engine.stats()) >= done
            })?;
            drop(held);
            wait_for("released in G1", round - 1, || {
                let c = engine.g1().counts();
                c.free + c.inactive >= half
            })?;
        }
    }
    engine.flush();
    drop(earlier);
    let t1 = Instant::now();
    let cpu = ThreadCpu::over(cpu_before.as_ref());
    let Counted {
        copied,
        bytes,
        skipped,
    } = Counted::between(&before, &engine.stats());
    let expected = round * half as u64;
    Ok(Rep {
        window: (t0, t1),
        secs: (t1 - t0).as_secs_f64(),
        bytes,
        copied,
        skipped,
        verified: 0,
        rounds: round,
        gemm_tflops: None,
        gemm_alone_tflops: None,
        backend_load: None,
        cpu,
        failure: (copied != expected || skipped != 0)
            .then(|| format!("the engine copied {copied} of {expected} blocks, skipped {skipped}")),
    })
}

/// How long a round may take to be copied before the engine is deemed
/// stuck (a round is at most a few GiB: well under a second).
const STALL: Duration = Duration::from_secs(60);

/// Sleeps until `done()` holds; an error naming `what` and `round` after
/// [`STALL`].
fn wait_for(what: &str, round: u64, mut done: impl FnMut() -> bool) -> Result<()> {
    let waited = Instant::now();
    while !done() {
        if waited.elapsed() > STALL {
            return Err(BenchError::Tier(format!(
                "round {round} of the sustained offloads not {what} after {STALL:?}"
            )));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    Ok(())
}

/// G1 → G2 blocks the engine copied or skipped since `before`.
fn handled(before: &TierStats, now: &TierStats) -> u64 {
    let c = Counted::between(before, now);
    c.copied + c.skipped
}

#[cfg(test)]
mod tests {
    use super::super::tests::tiny_host_config;
    use super::super::{Side, allocate_shape, engine_for};
    use super::*;

    #[test]
    fn every_round_offloads_every_block_under_fresh_hashes() {
        let cfg = tiny_host_config(2, 4);
        let side = Side::Host { threads: 1 };
        let shape = allocate_shape(&cfg, &side, 4, 32).unwrap();
        let (executor, _) = side.executor().unwrap();
        let engine = engine_for(executor, &shape, 2, 4, Some(0)).unwrap();
        let rep = offload_for(&engine, &shape, Duration::from_millis(30)).unwrap();
        assert!(rep.failure.is_none(), "{:?}", rep.failure);
        // A round whose hashes repeated an earlier one's would be skipped
        // as present, and the rep would fail.
        assert!(rep.rounds >= 2, "one round in 30 ms of 16 tiny blocks");
        assert_eq!(rep.copied, rep.rounds * 16);
        assert_eq!(rep.bytes, rep.copied * shape.block_bytes);
    }
}
