//! The data plane of the replay: three real tiers, real transfers, every
//! onboarded block checked.
//!
//! G1 is an engine-shaped layout (layer-separate, K and V planes apart, as
//! vLLM allocates it) in host memory standing in for GPU memory; G2 is
//! kvbm's fully contiguous host layout; G3 is a fully contiguous `O_DIRECT`
//! file. Bytes move only through kvbm-transfer's [`Executor`].
//!
//! Which block sits where is decided by LRU victim caching, kept in
//! [`LruSim`]s exactly as the reference model
//! [`LruTiers`](crate::sim::LruTiers) with [`LruFeed::Victim`](crate::sim::LruFeed)
//! does it, so the hit counts this driver reports must equal that model's —
//! a check every run prints. The driver adds what the model cannot: slots,
//! transfer ordering that never overwrites a block before it has been read,
//! bytes, times and verification.

use std::collections::HashMap;
use std::time::Instant;

use kvbm_transfer::{Executor, PhysicalLayout, TransferHandle};

use super::super::error::{BenchError, Result};
use super::super::host_view::HostTier;
use crate::sim::{LruSim, Tier, TouchOrder};
use crate::trace::{BlockId, Request};

/// Slot bookkeeping of one tier: which block is in which slot.
#[derive(Debug)]
struct Slots {
    of: HashMap<BlockId, usize>,
    free: Vec<usize>,
}

impl Slots {
    fn new(n: usize) -> Self {
        Slots {
            of: HashMap::with_capacity(n),
            free: (0..n).rev().collect(),
        }
    }

    fn take(&mut self, block: BlockId, tier: &str) -> Result<usize> {
        let slot = self.free.pop().ok_or_else(|| {
            BenchError::Config(format!("{tier} ran out of slots (driver bookkeeping bug)"))
        })?;
        self.of.insert(block, slot);
        Ok(slot)
    }

    fn release(&mut self, block: BlockId) {
        if let Some(s) = self.of.remove(&block) {
            self.free.push(s);
        }
    }
}

/// Per-path totals.
#[derive(Debug, Clone, Default)]
pub struct PathTotals {
    /// Transfers issued.
    pub transfers: u64,
    /// Blocks moved.
    pub blocks: u64,
    /// Bytes moved, as the copy planner counted them.
    pub bytes: u64,
    /// Seconds from submission to completion, summed.
    pub secs: f64,
}

/// The paths the driver uses, in report order.
pub const PATHS: [&str; 5] = ["G1->G2", "G2->G3", "G1->G3", "G2->G1", "G3->G1"];

/// What one request did.
#[derive(Debug, Clone, Default)]
pub struct RequestOutcome {
    /// The tier that served each block of the hit prefix, in prompt order.
    pub prefix: Vec<Tier>,
    /// Seconds the onboard took (G2/G3 → G1), when there was one.
    pub onboard_secs: Option<f64>,
}

/// Three tiers and the LRU placement over them.
pub struct TierDriver {
    exec: Executor,
    g1: HostTier,
    g2: HostTier,
    g3: PhysicalLayout,
    s1: Slots,
    s2: Slots,
    s3: Slots,
    l1: LruSim,
    l2: LruSim,
    l3: LruSim,
    /// Totals indexed like [`PATHS`].
    pub paths: [PathTotals; 5],
    /// Blocks whose bytes were checked after an onboard.
    pub verified_blocks: u64,
}

struct Pending {
    path: usize,
    blocks: usize,
    handle: TransferHandle,
}

impl TierDriver {
    /// A driver over G1/G2/G3 of `caps` blocks; `g1` must have at least
    /// `caps[0] + longest request` slots (room for a request's new blocks
    /// before G1's victims have been copied out).
    pub fn new(
        exec: Executor,
        g1: HostTier,
        g2: HostTier,
        g3: PhysicalLayout,
        caps: [usize; 3],
    ) -> Self {
        let n1 = g1.physical().layout().config().num_blocks();
        let n2 = g2.physical().layout().config().num_blocks();
        let n3 = g3.layout().config().num_blocks();
        TierDriver {
            exec,
            g1,
            g2,
            g3,
            s1: Slots::new(n1),
            s2: Slots::new(n2),
            s3: Slots::new(n3),
            l1: LruSim::with_order(caps[0], TouchOrder::LeafFirst),
            l2: LruSim::with_order(caps[1], TouchOrder::LeafFirst),
            l3: LruSim::with_order(caps[2], TouchOrder::LeafFirst),
            paths: Default::default(),
            verified_blocks: 0,
        }
    }

    fn start(&self, path: usize, pairs: &[(usize, usize)], pending: &mut Vec<Pending>) {
        if pairs.is_empty() {
            return;
        }
        let (src, dst): (&PhysicalLayout, &PhysicalLayout) = match path {
            0 => (self.g1.physical(), self.g2.physical()),
            1 => (self.g2.physical(), &self.g3),
            2 => (self.g1.physical(), &self.g3),
            3 => (self.g2.physical(), self.g1.physical()),
            _ => (&self.g3, self.g1.physical()),
        };
        pending.push(Pending {
            path,
            blocks: pairs.len(),
            handle: self.exec.transfer(src, dst, pairs),
        });
    }

    /// Waits for every pending transfer; returns the wall time from `t0`.
    fn finish(&mut self, t0: Instant, pending: Vec<Pending>) -> Result<f64> {
        let mut err = None;
        for p in pending {
            let outcome = p.handle.wait();
            let secs = t0.elapsed().as_secs_f64();
            match outcome {
                Ok(r) => {
                    let t = &mut self.paths[p.path];
                    t.transfers += 1;
                    t.blocks += p.blocks as u64;
                    t.bytes += r.bytes;
                    t.secs += secs;
                }
                Err(f) => {
                    err.get_or_insert(BenchError::TransferFailed {
                        path: PATHS[p.path].to_string(),
                        detail: f.to_string(),
                    });
                }
            }
        }
        match err {
            Some(e) => Err(e),
            None => Ok(t0.elapsed().as_secs_f64()),
        }
    }

    /// Replays one request: lookup, onboard and check the kvbm hits,
    /// prefill the rest into G1, then offload G1's victims down the tiers.
    pub fn request(&mut self, request: &Request) -> Result<RequestOutcome> {
        let blocks = &request.hash_ids;
        let mut out = RequestOutcome::default();
        // 1. Lookup: the contiguous prefix held anywhere.
        let mut hits: Vec<(BlockId, Tier)> = Vec::new();
        for &b in blocks {
            let tier = if self.l1.contains(b) {
                Tier::G1
            } else if self.l2.contains(b) {
                Tier::G2
            } else if self.l3.contains(b) {
                Tier::G3
            } else {
                break;
            };
            out.prefix.push(tier);
            hits.push((b, tier));
        }
        // 2. Onboard kvbm hits into fresh G1 slots, all at once, and check
        // every byte.
        let (mut from2, mut from3) = (Vec::new(), Vec::new());
        let mut onboarded = Vec::new();
        for &(b, tier) in &hits {
            if tier == Tier::G1 {
                continue;
            }
            let dst = self.s1.take(b, "G1")?;
            onboarded.push((b, dst, tier));
            match tier {
                Tier::G2 => from2.push((self.s2.of[&b], dst)),
                _ => from3.push((self.s3.of[&b], dst)),
            }
        }
        if !onboarded.is_empty() {
            let mut pending = Vec::new();
            let t0 = Instant::now();
            self.start(3, &from2, &mut pending);
            self.start(4, &from3, &mut pending);
            out.onboard_secs = Some(self.finish(t0, pending)?);
            for &(b, slot, tier) in &onboarded {
                // SAFETY: every transfer touching G1 has been waited on.
                if let Some(m) = unsafe { self.g1.check(slot, b)? } {
                    return Err(BenchError::Corrupt {
                        block: b,
                        path: if tier == Tier::G2 { "G2->G1" } else { "G3->G1" }.into(),
                        layer: m.layer,
                        outer: m.outer,
                        offset: m.offset,
                    });
                }
                self.verified_blocks += 1;
            }
        }
        // Victim caching: a block served from kvbm now lives in G1 only
        // (it may have been in both G2 and G3; it leaves both).
        for &(b, tier) in &hits {
            if tier != Tier::G1 {
                self.l2.remove(b);
                self.s2.release(b);
                self.l3.remove(b);
                self.s3.release(b);
            }
        }
        // 3. Prefill: every other block not in G1 is computed into G1.
        for &b in blocks {
            if !self.s1.of.contains_key(&b) {
                let slot = self.s1.take(b, "G1")?;
                // SAFETY: no transfer is in flight (all were waited on).
                unsafe { self.g1.fill(slot, b)? };
            }
        }
        // 4. Placement: G1 refreshes the request, its victims enter G2, G2's
        // enter G3, G3's are dropped.
        let evicted1 = self.l1.touch_all(blocks).to_vec();
        let mut spilled2 = Vec::new();
        let mut dropped3 = Vec::new();
        for &b in &evicted1 {
            let spill = self.l2.touch_all(&[b]).to_vec();
            dropped3.extend_from_slice(self.l3.touch_all(&spill));
            spilled2.extend(spill);
        }
        self.offload(&evicted1, &spilled2, &dropped3)?;
        Ok(out)
    }

    /// Moves bytes to match the placement after G1 evicted `evicted1`,
    /// G2 spilled `spilled2` and G3 dropped `dropped3`, reading every
    /// block before its slot is reused.
    fn offload(
        &mut self,
        evicted1: &[BlockId],
        spilled2: &[BlockId],
        dropped3: &[BlockId],
    ) -> Result<()> {
        for &b in dropped3 {
            if !self.l3.contains(b) {
                self.s3.release(b);
            }
        }
        // Into G3: from G2 when the block was there, else straight from G1.
        let (mut g2g3, mut g1g3) = (Vec::new(), Vec::new());
        for &b in spilled2.iter().chain(evicted1) {
            if self.l3.contains(b) && !self.s3.of.contains_key(&b) {
                let src2 = self.s2.of.get(&b).copied();
                let src1 = self.s1.of.get(&b).copied();
                let dst = self.s3.take(b, "G3")?;
                match (src2, src1) {
                    (Some(s), _) => g2g3.push((s, dst)),
                    (None, Some(s)) => g1g3.push((s, dst)),
                    (None, None) => {
                        return Err(BenchError::Config(format!(
                            "block {b:#x} entered G3 from nowhere (driver bookkeeping bug)"
                        )));
                    }
                }
            }
        }
        let mut pending = Vec::new();
        let t0 = Instant::now();
        self.start(1, &g2g3, &mut pending);
        self.start(2, &g1g3, &mut pending);
        self.finish(t0, pending)?;
        for &b in spilled2 {
            if !self.l2.contains(b) {
                self.s2.release(b);
            }
        }
        // Into G2: from G1.
        let mut g1g2 = Vec::new();
        for &b in evicted1 {
            if self.l2.contains(b) && !self.s2.of.contains_key(&b) {
                let src = self.s1.of.get(&b).copied().ok_or_else(|| {
                    BenchError::Config(format!(
                        "block {b:#x} left G1 without a G1 slot (driver bookkeeping bug)"
                    ))
                })?;
                let dst = self.s2.take(b, "G2")?;
                g1g2.push((src, dst));
            }
        }
        let mut pending = Vec::new();
        let t0 = Instant::now();
        self.start(0, &g1g2, &mut pending);
        self.finish(t0, pending)?;
        for &b in evicted1 {
            if !self.l1.contains(b) {
                self.s1.release(b);
            }
        }
        Ok(())
    }
}
