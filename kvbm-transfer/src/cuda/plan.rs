//! Pure planning for the copy paths: no driver calls, testable anywhere.
//!
//! A copy plan arrives as a list of [`CopyRun`]s over numbered source and
//! destination regions. The copy-engine path needs absolute (source,
//! destination, length) triples, merged where both sides are contiguous.
//! The staged path needs the plan cut into staging-slot-sized chunks: on
//! the device side a gather/scatter kernel moves each run between its place
//! in the device layout and a dense staging slot; on the host side the slot
//! moves as a few large DMA copies, because runs are ordered by their host
//! address and so land next to each other in the slot.

/// One contiguous piece of a copy plan: kvbm-layout's run, whose
/// `#[repr(C)]` layout (40 bytes) the copy kernel reads as is.
pub use kvbm_layout::CopyRun;

use super::error::CudaError;
use super::order::HostOrder;

const _: () = assert!(std::mem::size_of::<CopyRun>() == 40);

/// An absolute copy: `len` bytes from address `src` to address `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
}

/// The byte lengths of a copy's source and destination regions, read once
/// when the copy was asked for: what every run is checked against before
/// any of its bytes move.
#[derive(Debug, Clone, Default)]
pub(crate) struct RegionLens {
    pub src: Vec<u64>,
    pub dst: Vec<u64>,
}

impl RegionLens {
    /// Whether run `r` lies inside its regions (branch-free, for passes).
    pub(crate) fn fits(&self, r: &CopyRun) -> bool {
        let fits = |region: u32, offset: u64, lens: &[u64]| {
            let cap = lens.get(region as usize).copied().unwrap_or(0);
            offset <= cap && r.len <= cap - offset
        };
        fits(r.src_region, r.src_offset, &self.src) & fits(r.dst_region, r.dst_offset, &self.dst)
    }

    /// Checks run number `i`; the error names the side and the bytes.
    pub(crate) fn check(&self, i: usize, r: &CopyRun) -> Result<(), CudaError> {
        if self.fits(r) {
            return Ok(());
        }
        let sides = [
            (r.src_region, r.src_offset, &self.src, "source"),
            (r.dst_region, r.dst_offset, &self.dst, "destination"),
        ];
        for (region, offset, lens, side) in sides {
            let region_len = lens.get(region as usize).copied();
            if region_len.is_none_or(|cap| offset > cap || r.len > cap - offset) {
                return Err(CudaError::OutOfBounds {
                    run: i,
                    side,
                    region,
                    offset,
                    len: r.len,
                    region_len,
                });
            }
        }
        Ok(())
    }

    /// Checks every run (appending each to `copy_to` on the way, one pass);
    /// returns the total bytes and the number of non-empty runs.
    pub(crate) fn check_plan(
        &self,
        runs: &[CopyRun],
        copy_to: Option<&mut Vec<CopyRun>>,
    ) -> Result<(u64, usize), CudaError> {
        // One branch-free pass; the error is looked for only when it failed.
        let (mut ok, mut total, mut n) = (true, 0u64, 0usize);
        let mut check = |r: &CopyRun| {
            ok &= self.fits(r);
            total = total.saturating_add(r.len);
            n += usize::from(r.len > 0);
        };
        match copy_to {
            Some(v) => v.extend(runs.iter().map(|r| {
                check(r);
                *r
            })),
            None => runs.iter().for_each(check),
        }
        if ok {
            return Ok((total, n));
        }
        for (i, r) in runs.iter().enumerate() {
            self.check(i, r)?;
        }
        // `fits` and `check` agree, so the loop above returned.
        Err(CudaError::InvalidCopy(
            "a run lies outside its region".into(),
        ))
    }
}

/// Splits spans so that none crosses an address in `bounds` (sorted) on
/// either side. The driver refuses a DMA copy that spans two separate host
/// registrations, and pinned memory is registered in chunks.
pub(crate) fn split_at_bounds(spans: &[Span], bounds: &[u64]) -> Vec<Span> {
    let next_bound = |from: u64, to: u64| -> Option<u64> {
        let i = bounds.partition_point(|&b| b <= from);
        bounds.get(i).copied().filter(|&b| b < to)
    };
    let mut out = Vec::with_capacity(spans.len());
    for s in spans {
        let mut s = *s;
        loop {
            let cut = [
                next_bound(s.src, s.src + s.len).map(|b| b - s.src),
                next_bound(s.dst, s.dst + s.len).map(|b| b - s.dst),
            ]
            .into_iter()
            .flatten()
            .min();
            match cut {
                Some(c) if c > 0 && c < s.len => {
                    out.push(Span { len: c, ..s });
                    s = Span {
                        src: s.src + c,
                        dst: s.dst + c,
                        len: s.len - c,
                    };
                }
                _ => {
                    out.push(s);
                    break;
                }
            }
        }
    }
    out
}

/// `bases[region] + offset`, total: 0 for an unknown region, wrapping.
fn address(bases: &[u64], region: u32, offset: u64) -> u64 {
    bases
        .get(region as usize)
        .copied()
        .unwrap_or(0)
        .wrapping_add(offset)
}

/// Which side of a staged copy the host is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostSide {
    /// Host → staging by DMA, then staging → device (onboard).
    Source,
    /// Device → staging, then staging → host by DMA (offload).
    Destination,
}

/// Plan order is kept when its host pieces average at least this many runs.
const MIN_RUNS_PER_PIECE: usize = 4;

/// Runs from the start of a plan that decide whether plan order is kept.
const ORDER_SAMPLE: usize = 1024;

/// The first chunks are smaller (by default an eighth of a slot, then a
/// quarter, a half): the first DMA starts as soon as a few runs are
/// planned, and each chunk is planned faster than the one before it moves.
const RAMP_STEPS: u32 = 3;

/// Cuts a staged copy into staging-slot chunks, one chunk at a time, so the
/// first chunk can be on the GPU before the rest is planned.
///
/// For each chunk it writes the device-side copies (absolute addresses,
/// between the layout and the slot: region 0 of a base table holding 0) and
/// the host-side DMA pieces (absolute, merged where both sides continue).
/// Runs go through the slots in plan order when that order already keeps
/// host bytes together (a KV plan lists a block's runs one after another,
/// and a FullyContiguous host block is one range: one DMA piece per block,
/// large enough for line rate). Only a plan whose host side is scattered in
/// plan order is sorted by host address, a part at a time as the chunks
/// reach it (see [`HostOrder`]). A run larger than the room left in a slot
/// continues in the next one.
///
/// Every run is checked against the region lengths before any of its bytes
/// is planned (the ordering guess reads unchecked addresses, safely), so a
/// staged copy needs no pass over its plan before the first chunk: a run
/// outside its regions is an error before any chunk holding it is launched
/// (the chunks before it may be on the GPU already).
pub(crate) struct StagedChunker<'a> {
    runs: &'a [CopyRun],
    src_bases: &'a [u64],
    dst_bases: &'a [u64],
    lens: &'a RegionLens,
    host: HostSide,
    slot_bytes: u64,
    at: ChunkCursor,
}

/// Where a [`StagedChunker`] stands, without the plan it reads: a copy whose
/// first chunks the caller enqueued is continued on another thread from
/// here (see [`StagedChunker::resume`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkCursor {
    /// The order runs are staged in when it is not plan order (see
    /// [`HostOrder`]); `None`: plan order.
    order: Option<HostOrder>,
    /// Position in the order, and bytes of that run already staged.
    next: usize,
    done: u64,
    chunks: u32,
    /// Chunks before full slots: chunk `i < ramp` holds `slot >> (ramp - i)`.
    ramp: u32,
    /// Bytes planned so far.
    bytes: u64,
}

impl<'a> StagedChunker<'a> {
    /// Starts planning `runs`; each run is checked against `lens` when
    /// [`StagedChunker::next_chunk`] reaches it.
    pub(crate) fn new(
        runs: &'a [CopyRun],
        src_bases: &'a [u64],
        dst_bases: &'a [u64],
        lens: &'a RegionLens,
        host: HostSide,
        slot_bytes: u64,
    ) -> Self {
        let start = ChunkCursor {
            order: None,
            next: 0,
            done: 0,
            chunks: 0,
            ramp: RAMP_STEPS,
            bytes: 0,
        };
        let mut me = Self::resume(runs, src_bases, dst_bases, lens, host, slot_bytes, start);
        // Judged on a sample from the start of the plan (a full pass would
        // delay the first chunk): plans list their runs block by block or
        // not at all.
        let mut prev_end = None;
        let (mut pieces, mut n) = (0usize, 0usize);
        // (Runs are not checked yet: a bad one only skews this guess.)
        for r in runs.iter().take(ORDER_SAMPLE) {
            if r.len == 0 {
                continue;
            }
            let at = me.host_addr(r);
            if prev_end != Some(at) {
                pieces += 1;
            }
            prev_end = Some(at.wrapping_add(r.len));
            n += 1;
        }
        if pieces * MIN_RUNS_PER_PIECE > n {
            let key = |r: &CopyRun| me.host_addr(r);
            let live = || runs.iter().filter(|r| r.len > 0);
            let sorted = live().zip(live().skip(1)).all(|(a, b)| key(a) <= key(b));
            if !sorted {
                // One pass computes the keys (the plan read in order); the
                // order is then sorted as the chunks reach it.
                let keyed: Vec<(u64, u32)> = (0..runs.len() as u32)
                    .filter(|&i| runs[i as usize].len > 0)
                    .map(|i| (key(&runs[i as usize]), i))
                    .collect();
                me.at.order = Some(HostOrder::new(keyed));
            }
        }
        me
    }

    /// The same chunker with `steps` ramp chunks (at most 16) before full
    /// slots.
    pub(crate) fn with_ramp(mut self, steps: u32) -> Self {
        self.at.ramp = steps.min(16);
        self
    }

    /// Continues a copy where `at` left it, over the same plan (`runs` and
    /// bases equal to those the cursor was taken from).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn resume(
        runs: &'a [CopyRun],
        src_bases: &'a [u64],
        dst_bases: &'a [u64],
        lens: &'a RegionLens,
        host: HostSide,
        slot_bytes: u64,
        at: ChunkCursor,
    ) -> Self {
        StagedChunker {
            runs,
            src_bases,
            dst_bases,
            lens,
            host,
            slot_bytes: slot_bytes.max(1),
            at,
        }
    }

    /// Where the chunker stands, for [`StagedChunker::resume`].
    pub(crate) fn into_cursor(self) -> ChunkCursor {
        self.at
    }

    /// A run's host-side address. Total on unchecked runs (an unknown
    /// region reads as base 0, sums wrap): only checked runs are planned.
    fn host_addr(&self, r: &CopyRun) -> u64 {
        match self.host {
            HostSide::Source => address(self.src_bases, r.src_region, r.src_offset),
            HostSide::Destination => address(self.dst_bases, r.dst_region, r.dst_offset),
        }
    }

    /// A run's device-side address (see [`StagedChunker::host_addr`]).
    fn device_addr(&self, r: &CopyRun) -> u64 {
        match self.host {
            HostSide::Source => address(self.dst_bases, r.dst_region, r.dst_offset),
            HostSide::Destination => address(self.src_bases, r.src_region, r.src_offset),
        }
    }

    /// The `i`-th run in staging order, with its index in the plan.
    fn run_at(&mut self, i: usize) -> Option<(usize, &'a CopyRun)> {
        let runs = self.runs;
        match &mut self.at.order {
            Some(o) => o.get(i).map(|j| (j as usize, &runs[j as usize])),
            None => self.runs.get(i).map(|r| (i, r)),
        }
    }

    /// Bytes the chunks planned so far hold (the whole copy once planned).
    pub(crate) fn bytes(&self) -> u64 {
        self.at.bytes
    }

    /// Runs not yet wholly planned.
    pub(crate) fn runs_left(&self) -> usize {
        let total = self
            .at
            .order
            .as_ref()
            .map_or(self.runs.len(), HostOrder::len);
        total.saturating_sub(self.at.next)
    }

    /// Plans the next chunk into a slot at address `slot`: writes its
    /// device-side copies to the front of `device` and its host pieces to
    /// `pieces` (cleared first). Returns how many device-side copies it
    /// wrote; 0 when the copy is fully planned. A chunk ends early when
    /// `device` is full, so `device` must not be empty while runs are left.
    /// A run outside its regions is an error (the chunk is then not to be
    /// launched).
    pub(crate) fn next_chunk(
        &mut self,
        slot: u64,
        device: &mut [CopyRun],
        pieces: &mut Vec<Span>,
    ) -> Result<usize, CudaError> {
        pieces.clear();
        if device.is_empty() && self.runs_left() > 0 {
            return Err(CudaError::InvalidCopy(
                "no room for a staged chunk's descriptors".into(),
            ));
        }
        let ramp = self.at.ramp;
        let limit = (self.slot_bytes >> (ramp - self.at.chunks.min(ramp))).max(1);
        self.at.chunks += 1;
        let mut used = 0u64;
        let mut n = 0usize;
        while used < limit && n < device.len() {
            let Some((i, r)) = self.run_at(self.at.next) else {
                break;
            };
            if self.at.done == 0 {
                // First sight of this run: checked before its addresses
                // are read.
                self.lens.check(i, r)?;
            }
            if r.len == 0 {
                self.at.next += 1;
                continue;
            }
            let len = (r.len - self.at.done).min(limit - used);
            let (dev, host, at) = (
                self.device_addr(r) + self.at.done,
                self.host_addr(r) + self.at.done,
                slot + used,
            );
            let (d, p) = match self.host {
                HostSide::Source => ((at, dev), (host, at)),
                HostSide::Destination => ((dev, at), (at, host)),
            };
            device[n] = CopyRun {
                src_region: 0,
                src_offset: d.0,
                dst_region: 0,
                dst_offset: d.1,
                len,
            };
            n += 1;
            match pieces.last_mut() {
                Some(q) if q.src + q.len == p.0 && q.dst + q.len == p.1 => q.len += len,
                _ => pieces.push(Span {
                    src: p.0,
                    dst: p.1,
                    len,
                }),
            }
            used += len;
            self.at.bytes += len;
            self.at.done += len;
            if self.at.done == r.len {
                self.at.next += 1;
                self.at.done = 0;
            }
        }
        Ok(n)
    }

    /// Device-side copies a copy of this plan needs when it moves at most
    /// `total_bytes`: one per run, plus one per chunk boundary a run may
    /// straddle (the ramp adds its chunks).
    pub(crate) fn device_copies_for(&self, total_bytes: u64) -> usize {
        self.runs.len() + (total_bytes / self.slot_bytes) as usize + 2 + self.at.ramp as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_runs() -> impl Strategy<Value = Vec<CopyRun>> {
        // Non-overlapping runs: run i owns [i*1024, i*1024+len) on both sides,
        // with the destination order shuffled by a permutation.
        (1usize..40)
            .prop_flat_map(|n| {
                (
                    proptest::collection::vec(1u64..1024, n),
                    Just((0..n).collect::<Vec<_>>()).prop_shuffle(),
                    proptest::collection::vec(0u32..3, n),
                )
            })
            .prop_map(|(lens, perm, regions)| {
                lens.iter()
                    .enumerate()
                    .map(|(i, &len)| CopyRun {
                        src_region: regions[i],
                        src_offset: i as u64 * 1024,
                        dst_region: 0,
                        dst_offset: perm[i] as u64 * 1024,
                        len,
                    })
                    .collect()
            })
    }

    /// Replays a staged plan on byte arrays through a simulated ring of slots
    /// and checks the result equals a direct copy.
    ///
    /// With `handoff = Some(k)`, the chunker is turned into a cursor after
    /// `k` chunks and the rest planned by a resumed one (over a copy of the
    /// plan, as the feeder thread does). Descriptors go to buffers of
    /// `room` entries; a full one is replaced by a fresh one, as the staged
    /// path leases another.
    fn replay(
        runs: &[CopyRun],
        host: HostSide,
        slot: u64,
        handoff: Option<usize>,
        ramp: u32,
        room: usize,
    ) {
        let src_bases = [0u64, 64 << 10, 128 << 10];
        let dst_bases = [192 << 10];
        let lens = test_lens();
        let mem_len = 256 << 10;
        let mut rng = 0x1234_5678u64;
        let src: Vec<u8> = (0..mem_len)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng as u8
            })
            .collect();
        let mut want = src.clone();
        for r in runs {
            let s = (src_bases[r.src_region as usize] + r.src_offset) as usize;
            let d = (dst_bases[r.dst_region as usize] + r.dst_offset) as usize;
            want.copy_within(s..s + r.len as usize, d);
        }
        // Memory below STAGE is the user's; the slot lives at STAGE.
        const STAGE: u64 = 1 << 30;
        let mut got = src.clone();
        let mut staging = vec![0u8; slot as usize];
        let mut chunker =
            StagedChunker::new(runs, &src_bases, &dst_bases, &lens, host, slot).with_ramp(ramp);
        let total: u64 = runs.iter().map(|r| r.len).sum();
        let cap = chunker.device_copies_for(total);
        let mut device = vec![CopyRun::default(); cap];
        let mut pieces = Vec::new();
        let mut used_copies = 0;
        let mut buffers = 1;
        let owned = runs.to_vec();
        let empty = RegionLens::default();
        let mut resumed: Option<StagedChunker<'_>> = None;
        let mut chunk_no = 0;
        loop {
            if handoff == Some(chunk_no) && resumed.is_none() {
                let at = std::mem::replace(
                    &mut chunker,
                    StagedChunker::new(&[], &src_bases, &dst_bases, &empty, host, slot),
                )
                .into_cursor();
                resumed = Some(StagedChunker::resume(
                    &owned, &src_bases, &dst_bases, &lens, host, slot, at,
                ));
            }
            chunk_no += 1;
            let active = resumed.as_mut().unwrap_or(&mut chunker);
            // Room left in the current descriptor buffer; a fresh one when
            // it is full.
            if used_copies == buffers * room {
                buffers += 1;
                device.resize(buffers * room, CopyRun::default());
            }
            let end = (buffers * room).min(device.len());
            let free = &mut device[used_copies..end];
            let n = active.next_chunk(STAGE, free, &mut pieces).unwrap();
            if n == 0 {
                assert!(pieces.is_empty());
                assert_eq!(active.runs_left(), 0);
                break;
            }
            let krs = &device[used_copies..used_copies + n];
            used_copies += n;
            let staged: u64 = krs.iter().map(|r| r.len).sum();
            assert!(staged <= slot);
            assert_eq!(staged, pieces.iter().map(|p| p.len).sum::<u64>());
            // Apply copies in pipeline order: host side into the slot first
            // for an onboard, device side first for an offload.
            let mut apply = |spans: Vec<(u64, u64, u64)>, got: &mut Vec<u8>| {
                for (s, d, len) in spans {
                    let bytes: Vec<u8> = if s >= STAGE {
                        staging[(s - STAGE) as usize..][..len as usize].to_vec()
                    } else {
                        got[s as usize..][..len as usize].to_vec()
                    };
                    if d >= STAGE {
                        staging[(d - STAGE) as usize..][..len as usize].copy_from_slice(&bytes);
                    } else {
                        got[d as usize..][..len as usize].copy_from_slice(&bytes);
                    }
                }
            };
            let dev: Vec<_> = krs
                .iter()
                .map(|r| (r.src_offset, r.dst_offset, r.len))
                .collect();
            let host_side: Vec<_> = pieces.iter().map(|p| (p.src, p.dst, p.len)).collect();
            match host {
                HostSide::Source => {
                    apply(host_side, &mut got);
                    apply(dev, &mut got);
                }
                HostSide::Destination => {
                    apply(dev, &mut got);
                    apply(host_side, &mut got);
                }
            }
        }
        if room >= cap {
            assert!(used_copies <= cap);
        }
        assert!(got == want, "staged replay differs from a direct copy");
    }

    /// Region lengths of the replay's memory: three 64 KiB source regions,
    /// one 64 KiB destination region.
    fn test_lens() -> RegionLens {
        RegionLens {
            src: vec![64 << 10; 3],
            dst: vec![64 << 10],
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn staged_plan_replays_to_direct_copy(runs in arb_runs(), slot in 1u64..5_000, to_host in any::<bool>()) {
            let host = if to_host { HostSide::Destination } else { HostSide::Source };
            replay(&runs, host, slot, None, RAMP_STEPS, usize::MAX >> 1);
        }

        /// Descriptor buffers that fill up mid-copy (replaced by fresh
        /// ones) change nothing in what lands.
        #[test]
        fn staged_plan_with_small_descriptor_buffers_replays_to_direct_copy(
            runs in arb_runs(),
            slot in 1u64..5_000,
            to_host in any::<bool>(),
            room in 1usize..6,
        ) {
            let host = if to_host { HostSide::Destination } else { HostSide::Source };
            replay(&runs, host, slot, None, RAMP_STEPS, room);
        }

        /// A run outside its regions is an error before any chunk holding
        /// it is planned: nothing planned before the error addresses
        /// memory outside the regions.
        #[test]
        fn a_run_out_of_bounds_stops_the_plan_before_its_chunk(
            mut runs in arb_runs(),
            slot in 1u64..5_000,
            to_host in any::<bool>(),
            which in any::<prop::sample::Index>(),
            bad_region in any::<bool>(),
        ) {
            let host = if to_host { HostSide::Destination } else { HostSide::Source };
            let k = which.index(runs.len());
            if bad_region {
                runs[k].src_region = 3;
            } else {
                runs[k].dst_offset = (64 << 10) - runs[k].len + 1;
            }
            // Region 3 exists only in the base table (where an unchecked run
            // would land, between user memory and the slot).
            let src_bases = [0u64, 64 << 10, 128 << 10, 1 << 29];
            let dst_bases = [192 << 10];
            let lens = test_lens();
            const STAGE: u64 = 1 << 30;
            let mut device = vec![CopyRun::default(); 4096];
            let mut pieces = Vec::new();
            let mut c = StagedChunker::new(&runs, &src_bases, &dst_bases, &lens, host, slot);
            let failed = loop {
                    match c.next_chunk(STAGE, &mut device, &mut pieces) {
                        Err(e) => break Some(e),
                        Ok(0) => break None,
                        Ok(n) => {
                            // Every address a launched chunk would touch is
                            // user memory (below 256 KiB) or the slot.
                            for r in &device[..n] {
                                for a in [r.src_offset, r.dst_offset] {
                                    prop_assert!(a + r.len <= 256 << 10 || a >= STAGE);
                                }
                            }
                            for p in &pieces {
                                for a in [p.src, p.dst] {
                                    prop_assert!(a + p.len <= 256 << 10 || a >= STAGE);
                                }
                            }
                        }
                    }
            };
            let out_of_bounds = matches!(failed, Some(CudaError::OutOfBounds { .. }));
            prop_assert!(out_of_bounds, "got {:?}", failed);
        }

        /// A copy whose first chunks one thread planned and whose rest
        /// another continued from the cursor replays to the direct copy.
        #[test]
        fn staged_plan_resumed_elsewhere_replays_to_direct_copy(
            runs in arb_runs(),
            slot in 1u64..5_000,
            to_host in any::<bool>(),
            handoff in 0usize..6,
            ramp in 0u32..6,
        ) {
            let host = if to_host { HostSide::Destination } else { HostSide::Source };
            replay(&runs, host, slot, Some(handoff), ramp, usize::MAX >> 1);
        }
    }

    #[test]
    fn spans_split_at_registration_bounds_on_either_side() {
        let spans = [
            Span {
                src: 0,
                dst: 1000,
                len: 100,
            },
            Span {
                src: 500,
                dst: 5000,
                len: 10,
            },
        ];
        // Bound 50 cuts the first span on the source side, 1070 on the
        // destination side; 505 cuts the second span.
        let got = split_at_bounds(&spans, &[50, 505, 1070]);
        assert_eq!(
            got,
            vec![
                Span {
                    src: 0,
                    dst: 1000,
                    len: 50
                },
                Span {
                    src: 50,
                    dst: 1050,
                    len: 20
                },
                Span {
                    src: 70,
                    dst: 1070,
                    len: 30
                },
                Span {
                    src: 500,
                    dst: 5000,
                    len: 5
                },
                Span {
                    src: 505,
                    dst: 5005,
                    len: 5
                },
            ]
        );
        // A bound at a span's start or end cuts nothing.
        assert_eq!(
            split_at_bounds(&spans[..1], &[0, 100, 1000, 1100]),
            spans[..1].to_vec()
        );
    }

    /// Plans every chunk; returns (device copies, host pieces) per chunk.
    fn chunks(
        runs: &[CopyRun],
        src_bases: &[u64],
        dst_bases: &[u64],
        host: HostSide,
        slot: u64,
    ) -> Vec<(Vec<CopyRun>, Vec<Span>)> {
        let lens = RegionLens {
            src: vec![u64::MAX >> 1; src_bases.len()],
            dst: vec![u64::MAX >> 1; dst_bases.len()],
        };
        let mut c = StagedChunker::new(runs, src_bases, dst_bases, &lens, host, slot);
        let mut out = Vec::new();
        let mut device = vec![CopyRun::default(); runs.len() + 64];
        let mut pieces = Vec::new();
        loop {
            let n = c.next_chunk(1 << 40, &mut device, &mut pieces).unwrap();
            if n == 0 {
                return out;
            }
            out.push((device[..n].to_vec(), pieces.clone()));
        }
    }

    #[test]
    fn scattered_host_bytes_are_sorted_into_one_piece() {
        // Four 1 KiB runs from scattered device places into one contiguous
        // host range, listed backwards: sorted, one DMA piece per slot.
        let runs: Vec<CopyRun> = (0..4u64)
            .map(|i| CopyRun {
                src_region: 0,
                src_offset: (3 - i) * 10_000,
                dst_region: 0,
                dst_offset: (3 - i) * 1024,
                len: 1024,
            })
            .collect();
        let got = chunks(&runs, &[0], &[1 << 20], HostSide::Destination, 32 << 10);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1.len(), 1);
        assert_eq!(got[0].1[0].len, 4096);
        assert_eq!(got[0].0.len(), 4);
    }

    #[test]
    fn blocks_in_plan_order_keep_their_order() {
        // Two blocks of four runs, the second block first on the host: plan
        // order already gives one piece per block, so it is kept.
        let runs: Vec<CopyRun> = (0..8u64)
            .map(|i| CopyRun {
                src_region: 0,
                src_offset: i * 10_000,
                dst_region: 0,
                dst_offset: ((i / 4 + 1) % 2) * 4096 + (i % 4) * 1024,
                len: 1024,
            })
            .collect();
        let got = chunks(&runs, &[0], &[1 << 20], HostSide::Destination, 1 << 20);
        assert_eq!(got.len(), 1);
        let pieces = &got[0].1;
        assert_eq!(pieces.len(), 2);
        assert_eq!(pieces[0].dst, (1 << 20) + 4096);
        assert_eq!(got[0].0[0].src_offset, 0);
    }

    #[test]
    fn runs_continue_across_chunks() {
        let runs = [CopyRun {
            src_region: 0,
            src_offset: 0,
            dst_region: 0,
            dst_offset: 0,
            len: 10_000,
        }];
        // The first chunks ramp up: an eighth of a slot, a quarter, a half.
        let got = chunks(&runs, &[0], &[1 << 20], HostSide::Source, 4096);
        assert_eq!(
            got.iter().map(|c| c.1[0].len).collect::<Vec<_>>(),
            [512, 1024, 2048, 4096, 2320]
        );
        assert_eq!(got[4].0[0].dst_offset, (1 << 20) + 7680);
    }
}
