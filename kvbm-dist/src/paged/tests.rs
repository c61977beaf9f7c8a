//! Round trips through the slots on host pages, with the groups of a
//! hybrid model: every byte that comes back is the byte that went out,
//! and a slot changed at rest is never served in verify mode.

use std::sync::Arc;

use super::*;

/// Host "engine" tensors: per group, one buffer per layer of
/// `blocks * stride` bytes, filled with a pattern unique to each byte.
pub(super) struct Engine {
    pub(super) buffers: Vec<Vec<Vec<u8>>>,
    pub(super) groups: Vec<PageGroup>,
}

pub(super) fn engine(shapes: &[(usize, u64, u64)], blocks: usize) -> Engine {
    let mut buffers = Vec::new();
    let mut groups = Vec::new();
    for (g, &(layers, page, stride)) in shapes.iter().enumerate() {
        let bufs: Vec<Vec<u8>> = (0..layers)
            .map(|l| {
                (0..blocks as u64 * stride)
                    .map(|i| (i.wrapping_mul(31) ^ (l as u64 * 7) ^ (g as u64 * 101)) as u8)
                    .collect()
            })
            .collect();
        groups.push(PageGroup {
            layers: bufs.iter().map(|b| b.as_ptr() as u64).collect(),
            page_bytes: page,
            block_stride: stride,
        });
        buffers.push(bufs);
    }
    Engine { buffers, groups }
}

pub(super) fn page(e: &Engine, group: usize, layer: usize, block: usize) -> Vec<u8> {
    let g = &e.groups[group];
    let start = block * g.block_stride as usize;
    e.buffers[group][layer][start..start + g.page_bytes as usize].to_vec()
}

fn worker(e: &Engine, blocks: usize, slots: usize, verify: bool) -> PagedWorker {
    worker_over(e, blocks, slots, None, verify, false)
}

/// A worker over `e`'s pages, with `slots` G2 slots and, with `disk`, as
/// many G3 slots in a file under that directory; with `sum_tail`, room
/// for a checksum after each slot's block.
pub(super) fn worker_over(
    e: &Engine,
    blocks: usize,
    slots: usize,
    disk: Option<&std::path::Path>,
    verify: bool,
    sum_tail: bool,
) -> PagedWorker {
    salted_worker(e, blocks, slots, disk, verify, sum_tail, 0)
}

/// [`worker_over`], the checksums after the blocks salted with `salt`.
fn salted_worker(
    e: &Engine,
    blocks: usize,
    slots: usize,
    disk: Option<&std::path::Path>,
    verify: bool,
    sum_tail: bool,
    salt: u64,
) -> PagedWorker {
    let widest = e.groups.iter().map(PageGroup::block_bytes).max().unwrap();
    let config = PagedConfig {
        groups: e.groups.clone(),
        num_blocks: blocks,
        memory: PageMemory::Host,
        slots,
        slot_bytes: widest,
        disk: disk.map(|dir| PagedDisk {
            dir: dir.to_path_buf(),
            slots,
            kept: None,
        }),
        verify,
        sum_tail,
        tail_salt: salt,
        host_keep: None,
    };
    // SAFETY: the buffers outlive the worker (dropped at the end of each
    // test, after it) and nothing else writes them during a job.
    unsafe { PagedWorker::new(config, Arc::new(())) }.unwrap()
}

/// A sliding-window group of 2 layers with padded pages, a full-attention
/// group of 2 layers, and a state group of 1 layer with larger pages.
pub(super) const HYBRID: [(usize, u64, u64); 3] = [(2, 96, 128), (2, 128, 128), (1, 200, 256)];

#[test]
fn every_group_round_trips_through_shared_slots() {
    let blocks = 6;
    let mut e = engine(&HYBRID, blocks);
    let w = worker(&e, blocks, 8, true);
    let copies = |pairs: &[(usize, usize, usize)]| {
        pairs
            .iter()
            .map(|&(group, block, slot)| PageCopy::g2(group, block, slot))
            .collect::<Vec<_>>()
    };
    let stored = [(0, 1, 0), (1, 1, 1), (2, 4, 2), (0, 5, 3)];
    let before: Vec<Vec<Vec<u8>>> = stored
        .iter()
        .map(|&(g, b, _)| {
            (0..e.groups[g].layers.len())
                .map(|l| page(&e, g, l, b))
                .collect()
        })
        .collect();
    w.store(1, copies(&stored), vec![]).unwrap();
    w.wait(&[1]);
    let r = w.finished();
    assert_eq!(r.len(), 1);
    assert!(r[0].failed.is_empty() && r[0].error.is_none(), "{r:?}");
    assert_eq!(r[0].bytes, 2 * 96 + 2 * 128 + 200 + 2 * 96);

    // Wipe the engine, then load each slot into another block.
    for group in &mut e.buffers {
        for layer in group.iter_mut() {
            layer.fill(0);
        }
    }
    let loaded = [(0, 2, 0), (1, 0, 1), (2, 3, 2), (0, 4, 3)];
    w.load(2, copies(&loaded)).unwrap();
    w.wait(&[2]);
    let r = w.finished();
    assert!(r[0].failed.is_empty(), "{r:?}");
    for (i, &(g, b, _)) in loaded.iter().enumerate() {
        for (l, want) in before[i].iter().enumerate() {
            assert_eq!(&page(&e, g, l, b), want, "group {g} layer {l} block {b}");
        }
    }
    // Padding between pages is never written.
    assert!(e.buffers[0][0][96..128].iter().all(|&b| b == 0));
}

#[test]
fn a_slot_changed_at_rest_fails_its_load_in_verify_mode() {
    let blocks = 4;
    let e = engine(&HYBRID, blocks);
    let w = worker(&e, blocks, 4, true);
    let c = PageCopy::g2;
    w.store(7, vec![c(0, 0, 0), c(1, 1, 1)], vec![]).unwrap();
    w.wait(&[7]);
    assert!(w.finished()[0].failed.is_empty());
    // Flip a byte of slot 1 at rest.
    let addr = w.shared.region.regions()[0].addr().unwrap() + w.slot_stride();
    // SAFETY: inside the slot region, which no job copies now.
    unsafe { *(addr as *mut u8) ^= 0xff };
    w.load(8, vec![c(0, 2, 0), c(1, 3, 1)]).unwrap();
    w.wait(&[8]);
    let r = w.finished();
    assert_eq!(r[0].failed, vec![c(1, 3, 1)]);
    assert!(r[0].error.as_deref().unwrap().contains("checksum"));
    // The failed load's pages hold zeros, not the damaged bytes; the
    // other copy of the job landed.
    for l in 0..2 {
        assert!(
            page(&e, 1, l, 3).iter().all(|&b| b == 0),
            "layer {l} kept damaged bytes"
        );
        assert_eq!(page(&e, 0, l, 2), page(&e, 0, l, 0));
    }
    // A slot never stored fails too.
    w.load(9, vec![c(0, 2, 3)]).unwrap();
    w.wait(&[9]);
    assert_eq!(w.finished()[0].failed.len(), 1);
}

#[test]
fn bad_jobs_and_shapes_are_refused_with_an_error() {
    let e = engine(&HYBRID, 2);
    let w = worker(&e, 2, 2, false);
    let c = PageCopy::g2;
    assert!(w.store(1, vec![c(3, 0, 0)], vec![]).is_err());
    assert!(w.store(1, vec![c(0, 0, 2)], vec![]).is_err());
    // No G3 to read from or move to.
    assert!(w.load(1, vec![PageCopy::g3(0, 0, 0)]).is_err());
    assert!(
        w.store(1, vec![c(0, 0, 0)], vec![DiskMove::new(1, 0, 0, 1)])
            .is_err()
    );
    // A block beyond the engine's is a failed copy, not a panic.
    w.store(2, vec![c(0, 9, 0)], vec![]).unwrap();
    w.wait(&[2]);
    assert_eq!(w.finished()[0].failed.len(), 1);
    let mut config = PagedConfig {
        groups: e.groups.clone(),
        num_blocks: 2,
        memory: PageMemory::Host,
        slots: 2,
        slot_bytes: 100,
        disk: None,
        verify: false,
        sum_tail: false,
        tail_salt: 0,
        host_keep: None,
    };
    // SAFETY: refused before anything is touched.
    let err = unsafe { PagedWorker::new(config.clone(), Arc::new(())) };
    assert!(err.is_err_and(|e| e.to_string().contains("cannot hold")));
    config.slot_bytes = 1024;
    config.groups[0].block_stride = 10;
    // SAFETY: as above.
    let err = unsafe { PagedWorker::new(config, Arc::new(())) };
    assert!(err.is_err_and(|e| e.to_string().contains("stride")));
}

fn disk_worker(
    e: &Engine,
    blocks: usize,
    slots: usize,
    dir: &std::path::Path,
    verify: bool,
) -> PagedWorker {
    worker_over(e, blocks, slots, Some(dir), verify, false)
}

pub(super) fn settled_clean(w: &PagedWorker, job: u64) -> JobReport {
    w.wait(&[job]);
    let r = w.finished().pop().unwrap();
    assert_eq!(r.job, job);
    assert!(r.failed.is_empty() && r.error.is_none(), "{r:?}");
    r
}

#[test]
fn blocks_moved_to_disk_come_back_byte_for_byte_in_rounds() {
    // More blocks than staging slots, so the load reads G3 in rounds.
    let blocks = STAGING_SLOTS + 7;
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(&HYBRID, blocks);
    let w = disk_worker(&e, blocks, blocks, dir.path(), true);
    assert_eq!(w.slot_stride(), DISK_ALIGNMENT);
    let stored: Vec<PageCopy> = (0..blocks).map(|i| PageCopy::g2(i % 3, i, i)).collect();
    let before: Vec<Vec<Vec<u8>>> = stored
        .iter()
        .map(|c| {
            (0..e.groups[c.group].layers.len())
                .map(|l| page(&e, c.group, l, c.block))
                .collect()
        })
        .collect();
    w.store(1, stored.clone(), vec![]).unwrap();
    settled_clean(&w, 1);
    // Every block moves to G3 slot `blocks - 1 - i`; then G2 and the engine
    // are wiped, so only G3 holds the bytes.
    let moves: Vec<DiskMove> = stored
        .iter()
        .map(|c| DiskMove::new(c.slot, blocks - 1 - c.slot, c.group, c.slot as u64))
        .collect();
    w.store(2, vec![], moves).unwrap();
    settled_clean(&w, 2);
    for slot in 0..blocks {
        layouts::zero_slot(&w.shared.region, slot, w.slot_stride()).unwrap();
    }
    for layer in e.buffers.iter_mut().flatten() {
        layer.fill(0);
    }
    let loads: Vec<PageCopy> = stored
        .iter()
        .enumerate()
        .map(|(i, c)| PageCopy::g3(c.group, blocks - 1 - i, blocks - 1 - i))
        .collect();
    let r = {
        w.load(3, loads.clone()).unwrap();
        settled_clean(&w, 3)
    };
    let want: u64 = stored.iter().map(|c| e.groups[c.group].block_bytes()).sum();
    assert_eq!(r.bytes, want);
    for (i, c) in loads.iter().enumerate() {
        for (l, page_before) in before[i].iter().enumerate() {
            assert_eq!(
                &page(&e, c.group, l, c.block),
                page_before,
                "block {i} layer {l}"
            );
        }
    }
}

#[cfg(feature = "fault-injection")]
#[test]
fn a_disk_slot_changed_at_rest_fails_its_load_in_verify_mode() {
    let blocks = 4;
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&HYBRID, blocks);
    let w = disk_worker(&e, blocks, 4, dir.path(), true);
    w.store(
        1,
        vec![PageCopy::g2(0, 0, 0), PageCopy::g2(1, 1, 1)],
        vec![],
    )
    .unwrap();
    settled_clean(&w, 1);
    // Slots 0 and 1 move to G3 while a new store takes slot 0.
    let moves = vec![DiskMove::new(0, 3, 0, 10), DiskMove::new(1, 2, 1, 11)];
    w.store(2, vec![PageCopy::g2(2, 2, 0)], moves).unwrap();
    settled_clean(&w, 2);
    w.corrupt_disk_slot(2).unwrap();
    w.load(3, vec![PageCopy::g3(0, 2, 3), PageCopy::g3(1, 3, 2)])
        .unwrap();
    w.wait(&[3]);
    let r = w.finished().pop().unwrap();
    assert_eq!(r.failed, vec![PageCopy::g3(1, 3, 2)]);
    assert!(
        r.error
            .as_deref()
            .unwrap()
            .contains("G3 slot 2 failed its checksum")
    );
    for l in 0..2 {
        assert_eq!(
            page(&e, 0, l, 2),
            page(&e, 0, l, 0),
            "the good block landed"
        );
        assert!(
            page(&e, 1, l, 3).iter().all(|&b| b == 0),
            "layer {l} kept damaged bytes"
        );
    }
    // The store that took slot 0 landed after the move read it.
    w.load(4, vec![PageCopy::g2(2, 1, 0)]).unwrap();
    settled_clean(&w, 4);
    assert_eq!(page(&e, 2, 0, 1), page(&e, 2, 0, 2));
}

#[test]
fn bad_moves_are_refused_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&HYBRID, 2);
    let w = disk_worker(&e, 2, 2, dir.path(), false);
    let mv = |from, to, group| vec![DiskMove::new(from, to, group, 7)];
    assert!(w.store(1, vec![], mv(2, 0, 0)).is_err());
    assert!(w.store(1, vec![], mv(0, 2, 0)).is_err());
    assert!(
        w.store(1, vec![], mv(0, 0, 3)).is_err(),
        "a group beyond the worker's"
    );
    assert!(w.load(1, vec![PageCopy::g3(0, 0, 2)]).is_err());
    // A G3 slot is never a store's destination.
    assert!(w.store(1, vec![PageCopy::g3(0, 0, 0)], vec![]).is_err());
    // The refused job id is free again.
    w.store(1, vec![PageCopy::g2(0, 0, 0)], mv(1, 1, 0))
        .unwrap();
    settled_clean(&w, 1);
}

/// Copies the first `len` bytes of slot `from` of `a` into slot `to` of
/// `b`, as an outside store moving a block between two engines' slots.
fn carry(a: &PagedWorker, from: usize, b: &PagedWorker, to: usize, len: u64) {
    let (src, _) = a.slot_memory().unwrap();
    let (dst, _) = b.slot_memory().unwrap();
    // SAFETY: both slots lie inside their workers' slot regions (host
    // memory the workers own) and no job copies them now.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (src + from as u64 * a.slot_stride()) as *const u8,
            (dst + to as u64 * b.slot_stride()) as *mut u8,
            len as usize,
        )
    };
}

#[test]
fn a_block_published_by_one_engine_is_checked_and_served_by_another() {
    let blocks = 4;
    let a_pages = engine(&HYBRID, blocks);
    let a = worker_over(&a_pages, blocks, 4, None, true, true);
    assert!(a.slot_stride() >= 200 + SUM_BYTES && a.slot_stride().is_multiple_of(256));
    let c = PageCopy::g2;
    a.store(1, vec![c(2, 1, 0), c(0, 3, 1)], vec![]).unwrap();
    a.wait(&[1]);
    assert!(a.finished()[0].failed.is_empty());
    assert_eq!(a.seal(2, &[0]).unwrap(), vec![true]);
    assert_eq!(a.seal(0, &[1]).unwrap(), vec![true]);

    // Another engine, its pages zero, receives both blocks with their
    // sums into its slots 3 and 2; one byte of the second is changed on
    // the way.
    let mut b_pages = engine(&HYBRID, blocks);
    for group in &mut b_pages.buffers {
        for layer in group.iter_mut() {
            layer.fill(0);
        }
    }
    let b = worker_over(&b_pages, blocks, 4, None, true, true);
    carry(&a, 0, &b, 3, b.block_bytes(2).unwrap() + SUM_BYTES);
    carry(&a, 1, &b, 2, b.block_bytes(0).unwrap() + SUM_BYTES);
    assert_eq!(b.adopt(2, &[3]).unwrap(), vec![true]);
    let (dst, _) = b.slot_memory().unwrap();
    // SAFETY: inside B's slot 2, which no job copies now.
    unsafe { *((dst + 2 * b.slot_stride() + 5) as *mut u8) ^= 1 };
    assert_eq!(b.adopt(0, &[2]).unwrap(), vec![false]);
    // A block that arrived without its sum fails too.
    carry(&a, 1, &b, 1, b.block_bytes(0).unwrap());
    assert_eq!(b.adopt(0, &[1]).unwrap(), vec![false]);

    // The checked block loads byte for byte; the damaged one is refused
    // by verify mode's own check too.
    b.load(2, vec![c(2, 0, 3), c(0, 2, 2)]).unwrap();
    b.wait(&[2]);
    let r = b.finished();
    assert_eq!(r[0].failed, vec![c(0, 2, 2)]);
    assert_eq!(page(&b_pages, 2, 0, 0), page(&a_pages, 2, 0, 1));
    assert!(page(&b_pages, 0, 0, 2).iter().all(|&x| x == 0));

    // A slot changed at rest is not published in verify mode.
    let (src, _) = a.slot_memory().unwrap();
    // SAFETY: inside A's slot 1, which no job copies now.
    unsafe { *((src + a.slot_stride()) as *mut u8) ^= 1 };
    assert_eq!(a.seal(0, &[1]).unwrap(), vec![false]);

    // Slots and groups out of range, and a worker without room for the
    // sums, are errors, not panics.
    assert!(b.seal(3, &[0]).is_err());
    assert!(b.seal(0, &[4]).is_err());
    assert!(b.adopt(0, &[9]).is_err());
    let to_disk = [DiskMove::new(0, 0, 0, 1)];
    assert!(b.move_to_disk(&to_disk).is_err(), "a move without G3");
    let plain = worker(&b_pages, blocks, 4, true);
    assert!(
        plain
            .seal(0, &[0])
            .is_err_and(|e| e.to_string().contains("sum_tail"))
    );
    assert!(plain.adopt(0, &[0]).is_err());
}

/// A block published by an engine that lays its bytes out otherwise (its
/// sums salted otherwise) fails the check of the engine that receives it,
/// whatever its bytes, while one of the same salt passes.
#[test]
fn a_block_published_under_another_salt_is_refused() {
    let blocks = 4;
    let pages = engine(&HYBRID, blocks);
    let a = salted_worker(&pages, blocks, 4, None, false, true, 0x5a17);
    a.store(1, vec![PageCopy::g2(0, 3, 1)], vec![]).unwrap();
    a.wait(&[1]);
    assert!(a.finished()[0].failed.is_empty());
    assert_eq!(a.seal(0, &[1]).unwrap(), vec![true]);
    let len = a.block_bytes(0).unwrap() + SUM_BYTES;
    for (salt, verdict) in [(0x5a17, true), (0x5a18, false), (0, false)] {
        let b = salted_worker(&pages, blocks, 4, None, true, true, salt);
        carry(&a, 1, &b, 2, len);
        assert_eq!(b.adopt(0, &[2]).unwrap(), vec![verdict], "salt {salt:#x}");
    }
}

/// A worker over `e`'s pages with `slots` G2 slots and as many G3 slots
/// kept in `dir` under `identity`.
fn kept_worker(e: &Engine, slots: usize, dir: &std::path::Path, identity: &str) -> PagedWorker {
    kept_worker_over(e, slots, dir, identity, false)
}

/// [`kept_worker`], in verify mode where `verify`.
fn kept_worker_over(
    e: &Engine,
    slots: usize,
    dir: &std::path::Path,
    identity: &str,
    verify: bool,
) -> PagedWorker {
    let widest = e.groups.iter().map(PageGroup::block_bytes).max().unwrap();
    let config = PagedConfig {
        groups: e.groups.clone(),
        num_blocks: e.buffers[0][0].len() / e.groups[0].block_stride as usize,
        memory: PageMemory::Host,
        slots,
        slot_bytes: widest,
        disk: Some(PagedDisk {
            dir: dir.to_path_buf(),
            slots,
            kept: Some(identity.into()),
        }),
        verify,
        sum_tail: false,
        tail_salt: 0,
        host_keep: None,
    };
    // SAFETY: as in `worker_over`.
    unsafe { PagedWorker::new(config, Arc::new(())) }.unwrap()
}

/// An engine of `blocks` blocks whose pages are all zero.
pub(super) fn zeroed(blocks: usize) -> Engine {
    let mut e = engine(&HYBRID, blocks);
    for layer in e.buffers.iter_mut().flatten() {
        layer.fill(0);
    }
    e
}

/// Stores engine block `i` of group `i % 3` into G2 slot `i` for each of
/// `blocks`, then moves each to G3 slot `to(i)` under key `100 + i`.
fn store_and_move(w: &PagedWorker, blocks: &[usize], to: impl Fn(usize) -> usize, job: u64) {
    let stored: Vec<PageCopy> = blocks.iter().map(|&i| PageCopy::g2(i % 3, i, i)).collect();
    w.store(job, stored, vec![]).unwrap();
    settled_clean(w, job);
    let moves = blocks
        .iter()
        .map(|&i| DiskMove::new(i, to(i), i % 3, 100 + i as u64))
        .collect();
    w.store(job + 1, vec![], moves).unwrap();
    settled_clean(w, job + 1);
}

/// Every page the copies name holds the same bytes in `a` as in `b`.
pub(super) fn assert_same_pages(a: &Engine, b: &Engine, copies: &[PageCopy]) {
    for c in copies {
        for l in 0..a.groups[c.group].layers.len() {
            assert_eq!(
                page(a, c.group, l, c.block),
                page(b, c.group, l, c.block),
                "group {} block {} layer {l}",
                c.group,
                c.block
            );
        }
    }
}

/// What a kept tier's records must name in the model tests: each slot's
/// last block written under a key, unless its record was emptied since or
/// the worker stopped keeping after it opened.
#[derive(Default)]
pub(super) struct KeptModel {
    slots: std::collections::BTreeMap<u32, u64>,
    stopped: bool,
}

impl KeptModel {
    /// `slot` was written: named `key` while the worker keeps, else by
    /// nothing.
    pub(super) fn wrote(&mut self, slot: usize, key: Option<u64>) {
        match key.filter(|_| !self.stopped) {
            Some(key) => self.slots.insert(slot as u32, key),
            None => self.slots.remove(&(slot as u32)),
        };
    }

    /// `slot`'s record was emptied.
    pub(super) fn forgot(&mut self, slot: usize) {
        self.slots.remove(&(slot as u32));
    }

    /// The worker stopped keeping: every record emptied, none written.
    pub(super) fn stop(&mut self) {
        self.slots.clear();
        self.stopped = true;
    }

    /// A restart: `w`, opened over engine `to`, found exactly the model's
    /// blocks (`found`, as `(slot, key)`, key `100 + block`), and each loads
    /// from its slot (of G3 with `disk`; a block in two slots from one) byte
    /// for byte as `from` holds it (job `job`). The worker opened next
    /// keeps again.
    pub(super) fn check_reopened(
        &mut self,
        w: &PagedWorker,
        found: Vec<(u32, u64)>,
        disk: bool,
        job: u64,
        to: &Engine,
        from: &Engine,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        self.stopped = false;
        let want: Vec<(u32, u64)> = self.slots.iter().map(|(&s, &k)| (s, k)).collect();
        proptest::prop_assert_eq!(sorted(found), want);
        let mut seen = std::collections::HashSet::new();
        let loads: Vec<PageCopy> = self
            .slots
            .iter()
            .map(|(&slot, &key)| {
                let b = (key - 100) as usize;
                let copy = if disk { PageCopy::g3 } else { PageCopy::g2 };
                copy(b % 3, b, slot as usize)
            })
            .filter(|c| seen.insert(c.block))
            .collect();
        w.load(job, loads.clone()).unwrap();
        settled_clean(w, job);
        for c in &loads {
            proptest::prop_assert_eq!(
                page(to, c.group, 0, c.block),
                page(from, c.group, 0, c.block)
            );
        }
        Ok(())
    }
}

pub(super) fn sorted(mut blocks: Vec<(u32, u64)>) -> Vec<(u32, u64)> {
    blocks.sort_unstable();
    blocks
}

#[test]
fn a_kept_g3_is_found_again_after_a_restart_byte_for_byte() {
    let blocks = 6;
    let dir = tempfile::tempdir().unwrap();
    let kept = dir.path().join("rank0");
    let e = engine(&HYBRID, blocks);
    {
        let a = kept_worker(&e, blocks, &kept, "model a");
        assert!(a.kept().unwrap().blocks.is_empty());
        assert!(a.kept().unwrap().started_fresh.is_some());
        store_and_move(&a, &[0, 1, 2, 4], |i| blocks - 1 - i, 1);
    }
    // What the store's own reader finds: four blocks, each matching the
    // sum in its record.
    let seen = crate::kept::inspect(&kept, true).unwrap();
    assert_eq!((seen.blocks, seen.bad_records), (4, 0));
    assert!(seen.verified && seen.bad_blocks.is_empty(), "{seen:?}");
    // A new worker over other pages (all zero) finds every block where it
    // was moved, and loads each byte for byte, unverified: a kept G3
    // checks every read.
    let e2 = zeroed(blocks);
    let b = kept_worker(&e2, blocks, &kept, "model a");
    let found = b.kept().unwrap().clone();
    assert_eq!(found.started_fresh, None);
    assert_eq!(found.dir, kept);
    assert_eq!(
        sorted(found.blocks),
        vec![(1, 104), (3, 102), (4, 101), (5, 100)]
    );
    let loads: Vec<PageCopy> = [0, 1, 2, 4]
        .iter()
        .map(|&i| PageCopy::g3(i % 3, i, blocks - 1 - i))
        .collect();
    b.load(9, loads.clone()).unwrap();
    settled_clean(&b, 9);
    assert_same_pages(&e2, &e, &loads);
    // While B holds the directory another engine of the same identity
    // gets a directory of its own.
    let other = kept_worker(&e2, blocks, &kept, "model a");
    assert_ne!(other.kept().unwrap().dir, kept);
    assert!(other.kept().unwrap().blocks.is_empty());
    drop((b, other));
    // Another identity reuses nothing.
    let c = kept_worker(&e2, blocks, &kept, "model b");
    let found = c.kept().unwrap();
    assert!(
        found.blocks.is_empty() && found.started_fresh.is_some(),
        "{found:?}"
    );
}

#[test]
fn a_moved_over_or_reset_slot_is_not_found_again() {
    let blocks = 6;
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&HYBRID, blocks);
    {
        let a = kept_worker(&e, blocks, dir.path(), "m");
        store_and_move(&a, &[0, 1], |i| i, 1);
        // A move into slot 0 names its new block.
        store_and_move(&a, &[3], |_| 0, 3);
    }
    {
        let b = kept_worker(&zeroed(blocks), blocks, dir.path(), "m");
        assert_eq!(
            sorted(b.kept().unwrap().blocks.clone()),
            vec![(0, 103), (1, 101)]
        );
        // The cache is reset: what was moved before is forgotten, and
        // what is moved after is not kept either.
        b.stop_keeping().unwrap();
        store_and_move(&b, &[2], |_| 4, 5);
    }
    let c = kept_worker(&zeroed(blocks), blocks, dir.path(), "m");
    assert!(c.kept().unwrap().blocks.is_empty());
    // Without a kept G3 there is nothing to stop.
    let plain = worker(&e, blocks, 2, false);
    plain.stop_keeping().unwrap();
    assert!(plain.kept().is_none());
}

#[cfg(feature = "fault-injection")]
#[test]
fn a_kept_block_changed_at_rest_is_refused_and_forgotten() {
    let blocks = 4;
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&HYBRID, blocks);
    {
        let a = kept_worker(&e, blocks, dir.path(), "m");
        store_and_move(&a, &[0, 1], |i| i + 2, 1);
    }
    let e2 = zeroed(blocks);
    {
        let b = kept_worker(&e2, blocks, dir.path(), "m");
        b.corrupt_disk_slot(3).unwrap();
        b.load(1, vec![PageCopy::g3(0, 0, 2), PageCopy::g3(1, 1, 3)])
            .unwrap();
        b.wait(&[1]);
        let r = b.finished().pop().unwrap();
        assert_eq!(r.failed, vec![PageCopy::g3(1, 1, 3)]);
        assert_eq!(page(&e2, 0, 0, 0), page(&e, 0, 0, 0));
        assert!(page(&e2, 1, 0, 1).iter().all(|&x| x == 0));
    }
    let c = kept_worker(&e2, blocks, dir.path(), "m");
    assert_eq!(c.kept().unwrap().blocks, vec![(2, 100)]);
}

/// A step of the kept G3's model-based test.
#[derive(Debug, Clone)]
enum KeptStep {
    /// Engine block `block` stored and moved to G3 slot `to`.
    Move { block: usize, to: usize },
    /// The cache reset: the worker keeps nothing more.
    Stop,
    /// The worker dropped and opened again.
    Restart,
}

fn kept_step(blocks: usize) -> impl proptest::strategy::Strategy<Value = KeptStep> {
    use proptest::prelude::*;
    prop_oneof![
        6 => (0..blocks, 0..blocks).prop_map(|(block, to)| KeptStep::Move { block, to }),
        1 => Just(KeptStep::Stop),
        2 => Just(KeptStep::Restart),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// After any run of moves, resets and restarts, a reopened kept G3
    /// names exactly the last block moved into each slot, where it was
    /// moved before the worker's reset (if any), and each loads byte for
    /// byte.
    #[test]
    fn a_reopened_kept_g3_names_the_last_block_moved_into_each_slot(
        steps in proptest::collection::vec(kept_step(5), 1..16)
    ) {
        let blocks = 5;
        let dir = tempfile::tempdir().unwrap();
        let e = engine(&HYBRID, blocks);
        let mut model = KeptModel::default();
        let mut w = Some(kept_worker(&e, blocks, dir.path(), "m"));
        let mut job = 1;
        for step in steps.into_iter().chain([KeptStep::Restart]) {
            match step {
                KeptStep::Move { block, to } => {
                    store_and_move(w.as_ref().unwrap(), &[block], |_| to, job);
                    job += 2;
                    model.wrote(to, Some(100 + block as u64));
                }
                KeptStep::Stop => {
                    w.as_ref().unwrap().stop_keeping().unwrap();
                    model.stop();
                }
                KeptStep::Restart => {
                    drop(w.take());
                    let e2 = zeroed(blocks);
                    let r = kept_worker(&e2, blocks, dir.path(), "m");
                    let found = r.kept().unwrap().blocks.clone();
                    model.check_reopened(&r, found, true, job, &e2, &e)?;
                    job += 1;
                    drop(r);
                    w = Some(kept_worker(&e, blocks, dir.path(), "m"));
                }
            }
        }
    }
}

#[cfg(feature = "fault-injection")]
#[test]
fn in_verify_mode_a_block_changed_in_g2_is_not_kept() {
    let blocks = 4;
    let dir = tempfile::tempdir().unwrap();
    let e = engine(&HYBRID, blocks);
    {
        let a = kept_worker_over(&e, blocks, dir.path(), "m", true);
        let stored = vec![PageCopy::g2(0, 0, 0), PageCopy::g2(1, 1, 1)];
        a.store(1, stored, vec![]).unwrap();
        settled_clean(&a, 1);
        a.corrupt_slot(1).unwrap();
        let moves = vec![DiskMove::new(0, 2, 0, 100), DiskMove::new(1, 3, 1, 101)];
        a.store(2, vec![], moves).unwrap();
        settled_clean(&a, 2);
        // Its load from G3 fails as it would have from G2.
        a.load(3, vec![PageCopy::g3(1, 2, 3)]).unwrap();
        a.wait(&[3]);
        assert_eq!(a.finished()[0].failed, vec![PageCopy::g3(1, 2, 3)]);
    }
    let b = kept_worker(&zeroed(blocks), blocks, dir.path(), "m");
    assert_eq!(b.kept().unwrap().blocks, vec![(2, 100)]);
}
