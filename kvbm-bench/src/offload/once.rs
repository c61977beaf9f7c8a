//! One timed offload of a shape's blocks, G1 to G2, and the checks of
//! what the engine counted and what G2 holds.

use std::time::Instant;

use kvbm_block::SequenceHash;
use kvbm_pool::metrics::TierStats;
use kvbm_pool::tier::TierEngine;
use kvbm_pool::{ImmutableBlocks, WeakBlock};

use super::super::error::{BenchError, Result};
use super::super::host_view::HostLayoutView;
use super::super::thread_cpu::{CpuSample, ThreadCpu};
use super::{Rep, Shape, cpu_threads, hash_of, tier_err};

/// Registers every block of the shape in G1, times `offload` of all of
/// them through `flush`, and checks what the engine counted and what G2
/// holds.
pub(super) fn offload_once(engine: &TierEngine, shape: &Shape) -> Result<Rep> {
    let chain = register_chain(engine, shape.blocks, |b| {
        SequenceHash(hash_of(shape.tokens, b))
    })?;
    let hashes = chain.hashes;
    let before = engine.stats();
    let cpu_before = CpuSample::now();
    let t0 = Instant::now();
    engine.offload(chain.items);
    engine.flush();
    let t1 = Instant::now();
    let cpu = ThreadCpu::over(cpu_before.as_ref());
    let secs = (t1 - t0).as_secs_f64();
    let after = engine.stats();
    drop(chain.held);
    let Counted {
        copied,
        bytes,
        skipped,
    } = Counted::between(&before, &after);
    let mut rep = Rep {
        window: (t0, t1),
        secs,
        bytes,
        copied,
        skipped,
        verified: 0,
        rounds: 1,
        gemm_tflops: None,
        gemm_alone_tflops: None,
        backend_load: None,
        failure: None,
        cpu,
    };
    if copied != shape.blocks as u64 || skipped != 0 {
        rep.failure = Some(format!(
            "the engine copied {copied} of {} blocks, skipped {skipped} ({:?}); copy failures {:?}",
            shape.blocks, after.skipped, after.copy_failures
        ));
        return Ok(rep);
    }
    let g2 = engine
        .pool(kvbm_pool::Tier::G2)
        .ok_or_else(|| BenchError::Tier("the engine has no G2".into()))?;
    let found = g2.match_prefix(&hashes).into_blocks();
    if found.len() != hashes.len() {
        rep.failure = Some(format!(
            "G2 holds {} of the {} offloaded blocks",
            found.len(),
            hashes.len()
        ));
        return Ok(rep);
    }
    let pairs: Vec<(usize, u64)> = found
        .iter()
        .map(|b| (b.block_id() as usize, b.sequence_hash().0))
        .collect();
    match check_g2(&shape.g2_view, &pairs)? {
        None => rep.verified = pairs.len() as u64,
        Some(e) => rep.failure = Some(e.to_string()),
    }
    Ok(rep)
}

/// Fresh G1 blocks registered as one chain, ready to offload.
pub(super) struct Chain {
    /// The blocks, held so that none is evicted before its offload starts.
    pub(super) held: ImmutableBlocks,
    /// Their hashes, in chain order.
    pub(super) hashes: Vec<SequenceHash>,
    /// `(block, parent)` for [`TierEngine::offload`].
    pub(super) items: Vec<(WeakBlock, Option<SequenceHash>)>,
}

/// Allocates `shape.blocks` G1 blocks and registers them as one chain,
/// block `b` under `name(b)`.
pub(super) fn register_chain(
    engine: &TierEngine,
    count: usize,
    name: impl Fn(usize) -> SequenceHash,
) -> Result<Chain> {
    let blocks = engine.g1().allocate(count).map_err(tier_err)?;
    let mut complete = Vec::with_capacity(blocks.len());
    let mut hashes = Vec::with_capacity(blocks.len());
    let mut parents = Vec::with_capacity(blocks.len());
    for b in blocks {
        let h = name(b.block_id() as usize);
        let parent = hashes.last().copied();
        complete.push(b.complete(h, parent).map_err(tier_err)?);
        hashes.push(h);
        parents.push(parent);
    }
    let held = engine.g1().register(complete).map_err(tier_err)?;
    let items = (0..held.len())
        .filter_map(|i| held.get(i).map(|b| (b.downgrade(), parents[i])))
        .collect();
    Ok(Chain {
        held,
        hashes,
        items,
    })
}

/// What the engine counted for G1 → G2 between two readings of its stats.
pub(super) struct Counted {
    pub(super) copied: u64,
    pub(super) bytes: u64,
    pub(super) skipped: u64,
}

impl Counted {
    /// The G1 → G2 blocks copied, their bytes and the offloads skipped
    /// from `before` to `after`.
    pub(super) fn between(before: &TierStats, after: &TierStats) -> Counted {
        Counted {
            copied: after.blocks[0] - before.blocks[0],
            bytes: after.bytes[0] - before.bytes[0],
            skipped: after
                .skipped
                .iter()
                .zip(before.skipped.iter())
                .map(|(a, b)| a - b)
                .sum(),
        }
    }
}

/// Checks every `(G2 block, hash)` on several threads; the first
/// mismatch found, as a [`BenchError::Corrupt`].
pub(super) fn check_g2(
    view: &HostLayoutView,
    pairs: &[(usize, u64)],
) -> Result<Option<BenchError>> {
    let threads = cpu_threads();
    let per = pairs.len().div_ceil(threads).max(1);
    let results: Vec<Result<Option<BenchError>>> = std::thread::scope(|s| {
        let handles: Vec<_> = pairs
            .chunks(per)
            .map(|part| {
                s.spawn(move || {
                    for &(block, hash) in part {
                        // SAFETY: the engine was flushed: no offload writes
                        // G2 while we read it.
                        if let Some(m) = unsafe { view.check(block, hash)? } {
                            return Ok(Some(BenchError::Corrupt {
                                block: hash,
                                path: "G1->G2".into(),
                                layer: m.layer,
                                outer: m.outer,
                                offset: m.offset,
                            }));
                        }
                    }
                    Ok(None)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(BenchError::Tier("a check thread panicked".into())))
            })
            .collect()
    });
    for r in results {
        if let Some(e) = r? {
            return Ok(Some(e));
        }
    }
    Ok(None)
}
