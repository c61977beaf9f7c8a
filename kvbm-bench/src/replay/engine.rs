//! The data plane of the replay: kvbm-pool's [`TierEngine`] over three
//! real tiers, driven the way an inference engine drives it.
//!
//! G1 is an engine-shaped layout (layer-separate, K and V planes apart, as
//! vLLM allocates it) in host memory standing in for GPU memory; G2 is
//! kvbm's fully contiguous host layout; G3 a fully contiguous `O_DIRECT`
//! file. For each request, following the simulators' rules
//! ([`crate::sim::replay()`]): match the prompt (G1, then G2/G3, one
//! contiguous prefix), onboard what kvbm holds and check every byte of
//! every onboarded block, compute the rest into fresh G1 blocks (their
//! bytes a function of their sequence hash) and register them (the engine
//! offloads them to G2 when G1 evicts them, or at once in write-through
//! mode), release the request, and wait for the offload worker to drain so
//! each request's transfers are timed on their own. An onboard whose copy
//! fails is not fatal: the request computes those blocks again, as an
//! inference engine would, and they count as misses (the engine counts the
//! failure; [`super::failures`] reports it).

use std::time::Instant;

use kvbm_block::SequenceHash;
use kvbm_pool::TierError;
use kvbm_pool::metrics::TierStats;
use kvbm_pool::tier::{G1Lookup, OnboardTarget, Onboarded, TierEngine, TierMatch};
use kvbm_pool::{ImmutableBlock, MutableBlock};

use super::super::error::{BenchError, Result};
use super::super::host_view::{HostTier, Mismatch};
use crate::sim::Tier;
use kvbm_testkit::trace::Request;

/// Paths in the engine's stats order.
pub const PATHS: [&str; 5] = ["G1->G2", "G2->G3", "G2->G1", "G3->G1", "G1->G3"];
/// The index of G3 → G1 in [`PATHS`].
const G3_TO_G1: usize = 3;

/// Bytes moved on each path and the time of the phases in which that path
/// alone moved bytes (phases that mix paths give no per-path speed).
#[derive(Debug, Clone, Default)]
pub struct PathTotals {
    /// Blocks moved (engine counters).
    pub blocks: u64,
    /// Bytes moved (engine counters, counted from the layouts).
    pub bytes: u64,
    /// Bytes moved in single-path phases.
    pub timed_bytes: u64,
    /// Seconds of single-path phases.
    pub timed_secs: f64,
}

/// What one request did.
#[derive(Debug, Clone, Default)]
pub struct RequestOutcome {
    /// The tier that served each block of the hit prefix, in prompt order.
    pub prefix: Vec<Tier>,
    /// Seconds from the match to the last onboarded byte in G1 (G2/G3 →
    /// G1), when there was an onboard.
    pub onboard_secs: Option<f64>,
    /// Blocks onboarded from G2 and from G3.
    pub onboard_blocks: [usize; 2],
    /// Bytes the onboard moved G3 → G1.
    pub onboard_g3_bytes: u64,
    /// Seconds from the match until kvbm had allocated the onboard's G1
    /// blocks.
    pub onboard_alloc_secs: f64,
    /// Matched blocks the engine's cost model left to recompute.
    pub declined_blocks: usize,
}

/// G1's memory: host memory standing in for the GPU, or the GPU.
pub enum G1Memory {
    /// A host-memory stand-in.
    Host(HostTier),
    /// Device memory (feature `cuda`).
    #[cfg(feature = "cuda")]
    Device(super::gpu::DeviceTier),
    /// Every worker's own G1, reached through the leader (tensor
    /// parallelism: [`super::dist`]).
    Distributed(std::sync::Arc<kvbm_dist::leader::Leader>),
}

impl G1Memory {
    /// The physical layout, for the engine (none in this process when
    /// the workers own G1).
    pub fn physical(&self) -> Option<&kvbm_transfer::PhysicalLayout> {
        match self {
            G1Memory::Host(h) => Some(h.physical()),
            #[cfg(feature = "cuda")]
            G1Memory::Device(d) => Some(d.physical()),
            G1Memory::Distributed(_) => None,
        }
    }

    /// Writes block `block`'s pattern for `hash`.
    ///
    /// # Safety
    /// No transfer may touch this block while the call runs.
    pub(crate) unsafe fn fill(&self, block: usize, hash: u64) -> Result<()> {
        match self {
            // SAFETY: forwarded from the caller.
            G1Memory::Host(h) => unsafe { h.fill(block, hash) },
            #[cfg(feature = "cuda")]
            G1Memory::Device(d) => d.fill(block, hash),
            G1Memory::Distributed(l) => super::dist::fill(l, block, hash),
        }
    }

    /// Checks block `block` against the pattern of `hash`.
    ///
    /// # Safety
    /// No transfer may write this block while the call runs.
    pub(crate) unsafe fn check(&self, block: usize, hash: u64) -> Result<Option<Mismatch>> {
        match self {
            // SAFETY: forwarded from the caller.
            G1Memory::Host(h) => unsafe { h.check(block, hash) },
            #[cfg(feature = "cuda")]
            G1Memory::Device(d) => d.check(block, hash),
            G1Memory::Distributed(l) => super::dist::check(l, block, hash),
        }
    }
}

/// Drives a [`TierEngine`] whose G1 is `g1`.
pub struct EngineDriver {
    engine: TierEngine,
    g1: G1Memory,
    trace_block_tokens: u32,
    /// Per-path totals, indexed like [`PATHS`].
    pub paths: [PathTotals; 5],
    /// Blocks whose bytes were checked after an onboard.
    pub verified_blocks: u64,
    /// Onboards whose copy failed; their blocks were computed again.
    pub failed_onboards: usize,
    /// Onboard phases (G2/G3 → G1): bytes and seconds.
    pub onboard_phase: (u64, f64),
    /// Offload phases (G1 → G2 → G3, drained by `flush`): bytes and seconds.
    pub offload_phase: (u64, f64),
    /// The last stats of the engines this driver drove before a restart
    /// ([`EngineDriver::crash`]), oldest first.
    pub earlier: Vec<TierStats>,
    last: TierStats,
}

/// What a driver carries over a restart: its counters, without the engine
/// and G1 it drove ([`EngineDriver::crash`], [`EngineDriver::resume`]).
pub struct Carried {
    paths: [PathTotals; 5],
    verified_blocks: u64,
    failed_onboards: usize,
    onboard_phase: (u64, f64),
    offload_phase: (u64, f64),
    earlier: Vec<TierStats>,
}

fn tier_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Tier(e.to_string())
}

impl EngineDriver {
    /// Wraps `engine`, whose G1 layout is `g1`'s.
    pub fn new(engine: TierEngine, g1: G1Memory, trace_block_tokens: u32) -> Self {
        let last = engine.stats();
        EngineDriver {
            engine,
            g1,
            trace_block_tokens,
            paths: Default::default(),
            verified_blocks: 0,
            failed_onboards: 0,
            onboard_phase: (0, 0.0),
            offload_phase: (0, 0.0),
            earlier: Vec::new(),
            last,
        }
    }

    /// Drops the engine and G1 as a crash would: no flush, no goodbye
    /// (whatever it had queued is lost with it). Returns the counters, to
    /// go on with [`EngineDriver::resume`]; the engine's last stats join
    /// [`EngineDriver::earlier`].
    pub fn crash(self) -> Carried {
        let mut earlier = self.earlier;
        earlier.push(self.engine.stats());
        // `engine` and `g1` are dropped here.
        Carried {
            paths: self.paths,
            verified_blocks: self.verified_blocks,
            failed_onboards: self.failed_onboards,
            onboard_phase: self.onboard_phase,
            offload_phase: self.offload_phase,
            earlier,
        }
    }

    /// Drives `engine` (a fresh one, after a restart) on with the counters
    /// `carried` over from the last one.
    pub fn resume(
        engine: TierEngine,
        g1: G1Memory,
        trace_block_tokens: u32,
        carried: Carried,
    ) -> Self {
        EngineDriver {
            paths: carried.paths,
            verified_blocks: carried.verified_blocks,
            failed_onboards: carried.failed_onboards,
            onboard_phase: carried.onboard_phase,
            offload_phase: carried.offload_phase,
            earlier: carried.earlier,
            ..EngineDriver::new(engine, g1, trace_block_tokens)
        }
    }

    /// The stats of every engine driven, oldest first: those before each
    /// restart, then the current one's.
    pub fn all_stats(&self) -> Vec<TierStats> {
        let mut all = self.earlier.clone();
        all.push(self.engine.stats());
        all
    }

    /// The engine (for its stats).
    pub fn engine(&self) -> &TierEngine {
        &self.engine
    }
    /// Forgets request `index` after its replay failed half-way: releases
    /// what it holds and lets queued offloads finish (their bytes are not
    /// booked to any phase).
    pub fn abandon(&mut self, index: usize) {
        self.engine.release(index as u64);
        self.engine.flush();
        self.last = self.engine.stats();
    }

    /// Drops every cached block of G1, G2 and G3 from kvbm's books, none
    /// of them saved to another tier (what a worker's loss calls for: its
    /// slice of each is gone, G1's too when the workers own G1); returns
    /// how many. Call it between requests.
    pub fn forget_cached(&self) -> usize {
        self.engine.drop_cached()
    }

    /// Books the bytes moved since the last call against a phase of
    /// `secs` seconds; returns the bytes.
    fn account(&mut self, secs: f64) -> u64 {
        let now = self.engine.stats();
        let n = PATHS.len();
        let total: u64 = (0..n).map(|p| now.bytes[p] - self.last.bytes[p]).sum();
        let moved: Vec<usize> = (0..n)
            .filter(|&p| now.bytes[p] > self.last.bytes[p])
            .collect();
        for p in 0..n {
            self.paths[p].blocks += now.blocks[p] - self.last.blocks[p];
            self.paths[p].bytes += now.bytes[p] - self.last.bytes[p];
        }
        if let [p] = moved[..] {
            self.paths[p].timed_bytes += now.bytes[p] - self.last.bytes[p];
            self.paths[p].timed_secs += secs;
        }
        self.last = now;
        total
    }

    /// Replays request number `index`.
    pub fn request(&mut self, index: usize, request: &Request) -> Result<RequestOutcome> {
        let hashes: Vec<SequenceHash> = request.hash_ids.iter().map(|&h| SequenceHash(h)).collect();
        let id = index as u64;
        // Onboard latency runs from the match: G3 reads start there.
        let t0 = Instant::now();
        let g3_bytes_before = self.engine.stats().bytes[G3_TO_G1];
        let full_end = request.full_blocks(self.trace_block_tokens);
        let m = self.match_prefix(id, &hashes, full_end)?;
        let mut out = RequestOutcome {
            declined_blocks: m.declined_blocks,
            ..RequestOutcome::default()
        };
        out.prefix
            .extend(std::iter::repeat_n(Tier::G1, m.g1_blocks));
        // The walk may alternate G2 and G3; the engine reports counts only,
        // which is all the token accounting needs (tokens per block are
        // equal but for a partial last block, counted by position).
        out.prefix
            .extend(std::iter::repeat_n(Tier::G2, m.g2_blocks));
        out.prefix
            .extend(std::iter::repeat_n(Tier::G3, m.g3_blocks));
        let external = m.external_blocks();
        let g1_hits = m.g1_blocks;
        let mut held = m.g1.into_blocks();
        let mut onboard_secs = None;
        let onboarded = if external > 0 {
            self.onboard(index, t0, g1_hits, &mut out)?
        } else {
            None
        };
        if let Some((done, secs)) = onboarded {
            onboard_secs = Some(secs);
            out.onboard_blocks = [m.g2_blocks, m.g3_blocks];
            out.onboard_g3_bytes = self.engine.stats().bytes[G3_TO_G1] - g3_bytes_before;
            held.extend(self.verify_onboarded(done)?);
        }
        let (offload_start, partial_slot) = self.compute_rest(&hashes, full_end, &mut held)?;
        if let Some(s) = onboard_secs {
            let bytes = self.account(s);
            self.onboard_phase.0 += bytes;
            self.onboard_phase.1 += s;
        }
        drop(held);
        drop(partial_slot);
        self.engine.release(id);
        let t0 = offload_start.unwrap_or_else(Instant::now);
        self.engine.flush();
        let secs = t0.elapsed().as_secs_f64();
        let bytes = self.account(secs);
        if bytes > 0 {
            self.offload_phase.0 += bytes;
            self.offload_phase.1 += secs;
        }
        out.onboard_secs = onboard_secs;
        Ok(out)
    }

    /// Matches request `id`'s blocks `hashes`, of which the first
    /// `full_end` are full, against G1, G2 and G3.
    fn match_prefix(&self, id: u64, hashes: &[SequenceHash], full_end: usize) -> Result<TierMatch> {
        let bs = self.engine.block_size();
        // One token past the full blocks: hit rates count every matched
        // full block, as the simulators do (the full-prompt give-back is
        // accounted in the tokens avoided instead); a partial last block is
        // never matched, so it is not recorded either.
        self.engine
            .match_request(id, hashes, full_end * bs + 1, G1Lookup::Pool)
            .map_err(tier_err)
    }

    /// Onboards request `index`'s matched G2/G3 blocks into G1 (matched at
    /// `t0`); returns them with the seconds since `t0`, or `None` when
    /// the copy failed and the prefix past its `g1_hits` G1 blocks is to
    /// be computed again.
    fn onboard(
        &mut self,
        index: usize,
        t0: Instant,
        g1_hits: usize,
        out: &mut RequestOutcome,
    ) -> Result<Option<(Onboarded, f64)>> {
        // `onboard` returns once kvbm has allocated the G1 targets (in
        // write-back mode, after G1's victims were saved).
        let handle = self
            .engine
            .onboard(index as u64, OnboardTarget::Pool)
            .map_err(tier_err)?;
        out.onboard_alloc_secs = t0.elapsed().as_secs_f64();
        match handle.wait() {
            Ok(done) => Ok(Some((done, t0.elapsed().as_secs_f64()))),
            // The copy failed (counted by the engine): as an engine
            // would, compute the blocks kvbm could not deliver; they
            // are misses.
            Err(e @ (TierError::Onboard { .. } | TierError::SharedOnboardFailed(_))) => {
                tracing::warn!(request = index, "computing the prefix again: {e}");
                self.failed_onboards += 1;
                out.prefix.truncate(g1_hits);
                Ok(None)
            }
            Err(e) => Err(tier_err(e)),
        }
    }

    /// Checks the bytes of every block an onboard loaded into G1; returns
    /// the blocks, held.
    fn verify_onboarded(&mut self, done: Onboarded) -> Result<Vec<ImmutableBlock>> {
        let loaded = done.blocks.into_blocks();
        for b in &loaded {
            let hash = b.sequence_hash().0;
            // SAFETY: the onboard has completed and no offload is in
            // flight (the previous request was flushed; this one has
            // registered nothing yet), so nothing touches G1 now.
            if let Some(mm) = unsafe { self.g1.check(b.block_id() as usize, hash)? } {
                return Err(BenchError::Corrupt {
                    block: hash,
                    path: "G2/G3->G1".into(),
                    layer: mm.layer,
                    outer: mm.outer,
                    offset: mm.offset,
                });
            }
            self.verified_blocks += 1;
        }
        Ok(loaded)
    }

    /// Computes the blocks past the hit prefix `held`: the full ones up to
    /// `full_end` are filled and registered (queuing their offloads, and
    /// joining `held`), a partial last block takes a G1 slot. Returns when
    /// the offloads started, if any did, and the partial block's slot.
    fn compute_rest(
        &self,
        hashes: &[SequenceHash],
        full_end: usize,
        held: &mut Vec<ImmutableBlock>,
    ) -> Result<(Option<Instant>, Option<MutableBlock>)> {
        let engine = &self.engine;
        let (n, at) = (hashes.len(), held.len());
        // Offload starts when blocks are registered; the phase ends when
        // the worker has drained.
        let mut offload_start = None;
        let mut partial_slot = None;
        if at < n {
            let mut parent = at.checked_sub(1).map(|p| hashes[p]);
            if at < full_end {
                // Through the engine: in write-back mode the blocks G1
                // evicts for these are saved to G2 before this returns.
                let blocks = engine.allocate_g1(full_end - at).map_err(tier_err)?;
                let mut complete = Vec::with_capacity(blocks.len());
                for (b, &h) in blocks.into_iter().zip(&hashes[at..full_end]) {
                    // SAFETY: as in `verify_onboarded`, nothing else touches G1
                    // now; the block was just allocated to us.
                    unsafe { self.g1.fill(b.block_id() as usize, h.0)? };
                    complete.push(b.complete(h, parent).map_err(tier_err)?);
                    parent = Some(h);
                }
                offload_start = Some(Instant::now());
                held.extend(
                    engine
                        .register_g1(complete)
                        .map_err(tier_err)?
                        .into_blocks(),
                );
            }
            if full_end < n {
                // A partial last block takes a G1 slot while the request
                // runs and is not cached after it (vLLM's prefix cache holds
                // full blocks only): its slot is freed with the request.
                let b = engine
                    .allocate_g1(1)
                    .map_err(tier_err)?
                    .pop()
                    .ok_or_else(|| BenchError::Tier("G1 allocated no block".into()))?;
                // SAFETY: the offloads just queued read other blocks; this
                // block is fresh and only this thread touches it.
                unsafe { self.g1.fill(b.block_id() as usize, hashes[n - 1].0)? };
                partial_slot = Some(b);
            }
        }
        Ok((offload_start, partial_slot))
    }
}
