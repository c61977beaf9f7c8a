//! Blocks assembled from shards of another parallelism: a block split
//! over two writers' pages comes back whole in one reader's slot and
//! pages, a reader of half the heads takes its half of one writer's
//! block, and a damaged shard or a bad plan is refused.

use proptest::prelude::*;

use super::tests::{Engine, engine, page, worker_over};
use super::*;

/// A page of `rows` rows, each holding `heads` heads of `inner` bytes (a
/// layer's page in the engine's own order: a rank's page is this with
/// its share of the heads).
#[derive(Clone, Copy)]
struct Geometry {
    rows: u64,
    heads: u64,
    inner: u64,
    layers: usize,
}

impl Geometry {
    fn page(&self, shards: u64) -> u64 {
        self.rows * self.heads / shards * self.inner
    }

    /// Pieces that build a block of `to` shards' share `part` from the
    /// shards of `from` (the whole shards of `from` that hold that share,
    /// in order, as they lie in the assembly memory).
    fn pieces(&self, from: u64, to: u64, part: u64) -> (Vec<Piece>, Vec<u64>, Shards) {
        let (wide, narrow) = (self.heads / from, self.heads / to);
        let first = part * narrow;
        let needed: Vec<u64> = (first / wide..(first + narrow).div_ceil(wide)).collect();
        let shards = Shards {
            count: needed.len(),
            bytes: self.page(from) * self.layers as u64,
        };
        let stride = shards.bytes + SUM_BYTES;
        let mut pieces = Vec::new();
        for layer in 0..self.layers as u64 {
            for row in 0..self.rows {
                for head in first..first + narrow {
                    let (shard, h) = (head / wide, head % wide);
                    let k = needed.iter().position(|&s| s == shard).unwrap() as u64;
                    pieces.push(Piece {
                        src: k * stride + layer * self.page(from) + (row * wide + h) * self.inner,
                        dst: layer * self.page(to) + (row * narrow + head - first) * self.inner,
                        len: self.inner,
                    });
                }
            }
        }
        (pieces, needed, shards)
    }
}

/// The byte a rank of `shards` shards holds at `(layer, row, its head h,
/// byte i)` of block `block`, for its share `part`: a function of the
/// whole block's position alone, so every split agrees.
fn byte(g: &Geometry, shards: u64, part: u64, block: usize, at: u64) -> u8 {
    let page = g.page(shards);
    let (layer, rest) = (at / page, at % page);
    let narrow = g.heads / shards;
    let (row, rest) = (rest / (narrow * g.inner), rest % (narrow * g.inner));
    let head = part * narrow + rest / g.inner;
    let i = rest % g.inner;
    (((layer * 7 + row) * 131 + head * 17 + i) as u8) ^ (block as u8).wrapping_mul(29)
}

/// An engine of one group whose pages are zero.
fn zeroed(g: &Geometry, shards: u64, blocks: usize) -> Engine {
    let page = g.page(shards);
    let mut e = engine(&[(g.layers, page, page)], blocks);
    e.buffers[0].iter_mut().for_each(|layer| layer.fill(0));
    e
}

/// An engine of one group whose pages hold `byte`'s pattern.
fn pages_of(g: &Geometry, shards: u64, part: u64, blocks: usize) -> Engine {
    let page = g.page(shards);
    let mut e = engine(&[(g.layers, page, page)], blocks);
    for (layer, buf) in e.buffers[0].iter_mut().enumerate() {
        for (i, b) in buf.iter_mut().enumerate() {
            let (block, at) = (i / page as usize, i as u64 % page);
            *b = byte(g, shards, part, block, layer as u64 * page + at);
        }
    }
    e
}

/// Stores block `block` of each writer of `from` shards into its slot 0,
/// seals it, assembles the reader's share `part` of `to` shards in the
/// reader's slot `slot` from the shards it needs (copied into its
/// assembly memory, as a store's get would), then loads that slot into
/// the reader's block 0. Returns the reader's engine, what `assemble`
/// said and whether the load was refused.
fn share(g: &Geometry, from: u64, to: u64, part: u64, damage: bool) -> (Engine, bool, bool) {
    let block = 1;
    let (pieces, needed, shards) = g.pieces(from, to, part);
    let reader_pages = zeroed(g, to, 2);
    let reader = worker_over(&reader_pages, 2, 4, None, true, true);
    let (base, _) = reader.assembly_memory(4 * shards.bundle()).unwrap();
    for (k, &w) in needed.iter().enumerate() {
        let pages = pages_of(g, from, w, 2);
        let writer = worker_over(&pages, 2, 2, None, true, true);
        writer
            .store(1, vec![PageCopy::g2(0, block, 0)], vec![])
            .unwrap();
        writer.wait(&[1]);
        assert!(writer.finished()[0].failed.is_empty());
        assert_eq!(writer.seal(0, &[0]).unwrap(), vec![true]);
        let (src, _) = writer.slot_memory().unwrap();
        // SAFETY: the writer's slot 0 (block and sum) and the reader's
        // assembly memory (sized above) are host memory their workers
        // own, which no job copies now.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src as *const u8,
                (base + k as u64 * (shards.bytes + SUM_BYTES)) as *mut u8,
                (shards.bytes + SUM_BYTES) as usize,
            )
        };
    }
    if damage {
        // SAFETY: the first byte of the assembly memory, unused by a job.
        unsafe { *(base as *mut u8) ^= 1 };
    }
    let ok = reader.assemble(0, &[3], shards, &pieces).unwrap()[0];
    reader.load(2, vec![PageCopy::g2(0, 0, 3)]).unwrap();
    reader.wait(&[2]);
    let refused = !reader.finished()[0].failed.is_empty();
    drop(reader);
    (reader_pages, ok, refused)
}

fn assert_share(g: &Geometry, e: &Engine, shards: u64, part: u64) {
    for layer in 0..g.layers {
        let want: Vec<u8> = (0..g.page(shards))
            .map(|i| byte(g, shards, part, 1, layer as u64 * g.page(shards) + i))
            .collect();
        assert_eq!(page(e, 0, layer, 0), want, "layer {layer}");
    }
}

const GEOMETRY: Geometry = Geometry {
    rows: 4,
    heads: 4,
    inner: 16,
    layers: 2,
};

#[test]
fn a_block_split_over_two_writers_is_assembled_whole() {
    let (e, ok, refused) = share(&GEOMETRY, 2, 1, 0, false);
    assert!(ok && !refused);
    assert_share(&GEOMETRY, &e, 1, 0);
}

#[test]
fn a_reader_of_fewer_heads_takes_its_share_of_a_whole_block() {
    for part in 0..4 {
        let (e, ok, refused) = share(&GEOMETRY, 1, 4, part, false);
        assert!(ok && !refused, "share {part}");
        assert_share(&GEOMETRY, &e, 4, part);
    }
}

#[test]
fn a_damaged_shard_is_refused_and_its_slot_never_served() {
    let (e, ok, refused) = share(&GEOMETRY, 2, 1, 0, true);
    assert!(!ok);
    // Verify mode's load refuses the slot (its sum was cleared): the
    // pages stay zero.
    assert!(refused);
    assert!(page(&e, 0, 0, 0).iter().all(|&b| b == 0));
}

#[test]
fn plans_that_miss_or_repeat_bytes_or_read_outside_a_shard_are_errors() {
    let g = GEOMETRY;
    let (pieces, _, shards) = g.pieces(2, 1, 0);
    let e = zeroed(&g, 1, 2);
    let w = worker_over(&e, 2, 4, None, true, true);
    assert!(
        w.assemble(0, &[0], shards, &pieces).is_err(),
        "no assembly memory yet"
    );
    w.assembly_memory(shards.bundle()).unwrap();
    assert!(
        w.assembly_memory(2 * shards.bundle()).is_err(),
        "more than was made"
    );
    let mut missing = pieces.clone();
    missing.pop();
    let mut twice = pieces.clone();
    twice.push(pieces[3]);
    let mut outside = pieces.clone();
    outside[0].src = shards.bytes - 4;
    for bad in [missing, twice, outside, vec![]] {
        assert!(w.assemble(0, &[0], shards, &bad).is_err());
    }
    let uneven = Shards {
        bytes: shards.bytes - 1,
        ..shards
    };
    assert!(
        w.assemble(0, &[0], uneven, &pieces).is_err(),
        "shards not whole layers"
    );
    assert!(
        w.assemble(0, &[0, 1], shards, &pieces).is_err(),
        "two bundles in room for one"
    );
    assert!(
        w.assemble(0, &[9], shards, &pieces).is_err(),
        "a slot beyond G2"
    );
    // Shards that never arrived (the memory is zero) fail their sums.
    assert_eq!(w.assemble(0, &[0], shards, &pieces).unwrap(), vec![false]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any split of the heads into writers and readers: every reader's
    /// share is assembled byte for byte.
    #[test]
    fn every_split_assembles_every_share(
        rows in 1u64..4,
        heads_log in 0u32..3,
        from_log in 0u32..3,
        to_log in 0u32..3,
        inner in prop::sample::select(vec![8u64, 24, 64]),
        layers in 1usize..3,
    ) {
        let heads = 1 << heads_log;
        let (from, to) = (1 << from_log.min(heads_log), 1 << to_log.min(heads_log));
        let g = Geometry { rows, heads, inner, layers };
        for part in 0..to {
            let (e, ok, refused) = share(&g, from, to, part, false);
            prop_assert!(ok && !refused);
            assert_share(&g, &e, to, part);
        }
    }
}
