//! Blocks assembled from the shards that an engine of another parallelism
//! published to an outside store (G4).
//!
//! Tensor parallelism splits each block of a KV cache group across the
//! ranks, each holding the pages of its share of the KV heads. Blocks are
//! shared across parallelisms as *shards*: the bytes one rank of the
//! writing engine holds, published as one object with the checksum of
//! its pages ([`PagedWorker::seal`]). A rank of an engine with another
//! split reads the shards that hold its share of a block into the
//! worker's assembly memory ([`PagedWorker::assembly_memory`]), and the
//! worker ([`PagedWorker::assemble`]):
//!
//! 1. checks every shard against the checksum it was published with (a
//!    shard's checksum covers its pages, one chunk per layer, as the
//!    writer's slot held them);
//! 2. copies the pieces this rank holds into the block's slot, a plan of
//!    [`Piece`]s that must write every byte of the block exactly once;
//! 3. seals the slot with the checksum of what it now holds, which a
//!    verified load checks again.
//!
//! A block whose shards fail their checksums is not written, and must
//! not be loaded.

use std::sync::OnceLock;

use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::checksum::BlockChecksum;

use super::outside::{SUM_BYTES, sum_of, tail_of};
use super::{PageMemory, PagedWorker, invalid, layouts};
use crate::error::Result;
use crate::verify::block_sum;

/// One copy of an assembly: `len` bytes from offset `src` of a block's
/// shards (as they lie in the assembly memory, see [`Shards`]) to offset
/// `dst` of the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Where the bytes start among the block's shards.
    pub src: u64,
    /// Where they go in the block.
    pub dst: u64,
    /// How many bytes.
    pub len: u64,
}

/// How each block's shards lie in the assembly memory: block `k`'s shard
/// `i` starts at `k * bundle + i * (bytes + SUM_BYTES)`, its `bytes`
/// followed by their checksum, where `bundle` is `count * (bytes +
/// SUM_BYTES)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shards {
    /// Shards per block.
    pub count: usize,
    /// Bytes of one shard, without its checksum.
    pub bytes: u64,
}

impl Shards {
    /// Bytes of one shard with its checksum.
    fn stride(&self) -> u64 {
        self.bytes + SUM_BYTES
    }

    /// Bytes of one block's shards.
    pub fn bundle(&self) -> u64 {
        self.count as u64 * self.stride()
    }
}

/// The worker's assembly memory, made on first use.
pub(super) type Assembly = OnceLock<PhysicalLayout>;

impl PagedWorker {
    /// Host memory that an outside store reads shards into: `(address,
    /// bytes)`. The first call makes `bytes` bytes; a later call returns
    /// the same memory and errors if it asks for more.
    pub fn assembly_memory(&self, bytes: u64) -> Result<(u64, u64)> {
        if bytes == 0 {
            return Err(invalid("an assembly memory of 0 bytes"));
        }
        if self.assembly.get().is_none() {
            let made = layouts::slot_region(PageMemory::Host, 1, bytes)?;
            // Another thread may have made it meanwhile; its memory wins.
            let _ = self.assembly.set(made);
        }
        let (addr, size) = self.assembly()?;
        if bytes > size {
            return Err(invalid(format!(
                "assembly memory of {bytes} bytes asked for, {size} made"
            )));
        }
        Ok((addr, size))
    }

    /// `(address, bytes)` of the assembly memory; an error before it is
    /// made.
    fn assembly(&self) -> Result<(u64, u64)> {
        let memory = self
            .assembly
            .get()
            .ok_or_else(|| invalid("no assembly memory"))?;
        let region = &memory.regions()[0];
        let addr = region
            .addr()
            .ok_or_else(|| invalid("assembly memory without a host address"))?;
        Ok((addr, region.len()))
    }

    /// Assembles the blocks of `group` in `slots` from their shards in the
    /// assembly memory (block `k` of `slots` from the `k`-th bundle, laid
    /// out as `shards` says), copying `pieces` from each; see the module
    /// docs. Per slot whether it was assembled. In verify mode (or with G2
    /// kept) the sums of assembled slots are recorded and those of the
    /// others cleared. Errors, before anything is written, for pieces that
    /// do not write every byte of the block once or read outside a shard's
    /// bytes, for shards whose bytes are not whole layers, and for more
    /// bundles than the assembly memory holds. The caller keeps the slots
    /// off every job, and the assembly memory unwritten, meanwhile.
    pub fn assemble(
        &self,
        group: usize,
        slots: &[usize],
        shards: Shards,
        pieces: &[Piece],
    ) -> Result<Vec<bool>> {
        let tails = self.tails(group, slots)?;
        let block = self.block_bytes(group)?;
        let g2 = &self.shared.g2[group];
        let layers = g2.layout().config().num_layers() as u64;
        if shards.count == 0 || shards.bytes == 0 || !shards.bytes.is_multiple_of(layers) {
            return Err(invalid(format!(
                "{} shards of {} bytes for a group of {layers} layers",
                shards.count, shards.bytes
            )));
        }
        check_pieces(pieces, shards, block)?;
        let (base, size) = self.assembly()?;
        if slots.len() as u64 * shards.bundle() > size {
            return Err(invalid(format!(
                "{} bundles of {} bytes beyond the assembly memory's {size}",
                slots.len(),
                shards.bundle()
            )));
        }
        let (slot_base, _) = self.slot_memory()?;
        let mut good = Vec::with_capacity(slots.len());
        for (k, (&slot, tail)) in slots.iter().zip(tails).enumerate() {
            let bundle = base + k as u64 * shards.bundle();
            if !(0..shards.count).all(|i| shard_matches(bundle, i, shards, layers, self.tail_salt))
            {
                good.push(None);
                continue;
            }
            let dst = slot_base + slot as u64 * self.stride;
            for p in pieces {
                // SAFETY: `check_pieces` proved each piece reads inside one
                // shard of the bundle, which lies in the assembly memory
                // (checked against its size above), and writes inside the
                // block of the slot, which lies in the slot region (`tails`
                // checked the slot); the two memories are distinct
                // allocations the worker owns, and the caller keeps both
                // untouched meanwhile.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (bundle + p.src) as *const u8,
                        (dst + p.dst) as *mut u8,
                        p.len as usize,
                    );
                }
            }
            let sum = block_sum(g2, slot).map_err(invalid)?;
            // SAFETY: as in `seal`: the SUM_BYTES after the group's block
            // inside the slot, which no job copies meanwhile.
            unsafe { (tail as *mut [u8; 8]).write_unaligned(tail_of(sum, self.tail_salt)) };
            good.push(Some(sum));
        }
        if let Some(sums) = &self.shared.sums {
            let mut sums = sums.lock();
            for (&slot, sum) in slots.iter().zip(&good) {
                sums[slot] = *sum;
            }
        }
        Ok(good.iter().map(Option::is_some).collect())
    }
}

/// Whether shard `i` of the bundle at `bundle` matches the checksum after
/// it, salted with `salt`: its bytes as `layers` chunks, as the writer's
/// slot held them.
fn shard_matches(bundle: u64, i: usize, shards: Shards, layers: u64, salt: u64) -> bool {
    let start = bundle + i as u64 * shards.stride();
    // SAFETY: the shard and its checksum lie inside the bundle, which
    // `assemble` checked lies in the assembly memory; only read.
    let bytes = unsafe { std::slice::from_raw_parts(start as *const u8, shards.stride() as usize) };
    let (data, sum) = bytes.split_at(shards.bytes as usize);
    let mut h = BlockChecksum::new();
    for chunk in data.chunks_exact((shards.bytes / layers) as usize) {
        h.update(chunk);
    }
    <[u8; 8]>::try_from(sum).is_ok_and(|sum| sum_of(sum, salt) == h.digest())
}

/// Errors unless `pieces` read inside single shards' bytes and write
/// each of the `block` bytes of a block exactly once.
fn check_pieces(pieces: &[Piece], shards: Shards, block: u64) -> Result<()> {
    let mut by_dst: Vec<&Piece> = pieces.iter().collect();
    by_dst.sort_unstable_by_key(|p| p.dst);
    let mut next = 0u64;
    for p in by_dst {
        let shard = p.src / shards.stride();
        let at = p.src % shards.stride();
        if p.len == 0 || shard >= shards.count as u64 || at + p.len > shards.bytes {
            return Err(invalid(format!(
                "a piece of {} bytes from {} outside the shards' bytes",
                p.len, p.src
            )));
        }
        if p.dst != next {
            return Err(invalid(format!(
                "pieces that {} block bytes {next}..{}",
                if p.dst < next {
                    "overlap at"
                } else {
                    "leave out"
                },
                p.dst.max(next)
            )));
        }
        next = p.dst + p.len;
    }
    if next != block {
        return Err(invalid(format!(
            "pieces that write {next} of the block's {block} bytes"
        )));
    }
    Ok(())
}
