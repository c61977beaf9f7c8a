//! A G2 kept across restarts: what a worker stored is found again by the
//! next worker over the same directory, byte for byte, and nothing else
//! is: a slot written over, a reset, bytes changed at rest.

use std::sync::Arc;

use super::tests::{
    Engine, HYBRID, KeptModel, assert_same_pages, engine, page, settled_clean, sorted, zeroed,
};
use super::*;
use crate::kept::tests::memory_dir;

/// A worker over `e`'s pages with `slots` G2 slots kept in `dir` under
/// `identity`, and with `disk`, a kept G3 of as many slots there.
fn host_kept_worker(
    e: &Engine,
    slots: usize,
    dir: &std::path::Path,
    identity: &str,
    disk: Option<&std::path::Path>,
) -> PagedWorker {
    let widest = e.groups.iter().map(PageGroup::block_bytes).max().unwrap();
    let config = PagedConfig {
        groups: e.groups.clone(),
        num_blocks: e.buffers[0][0].len() / e.groups[0].block_stride as usize,
        memory: PageMemory::Host,
        slots,
        slot_bytes: widest,
        disk: disk.map(|d| PagedDisk {
            dir: d.to_path_buf(),
            slots,
            kept: Some(identity.into()),
        }),
        verify: false,
        sum_tail: false,
        tail_salt: 0,
        host_keep: Some(PagedKeep {
            dir: dir.to_path_buf(),
            identity: identity.into(),
        }),
    };
    // SAFETY: the buffers outlive the worker (dropped at the end of each
    // test, after it) and nothing else writes them during a job.
    unsafe { PagedWorker::new(config, Arc::new(())) }.unwrap()
}

/// Stores engine block `i` of group `i % 3` into G2 slot `slot(i)` under
/// key `100 + i` for each of `blocks`.
fn store_keyed(w: &PagedWorker, blocks: &[usize], slot: impl Fn(usize) -> usize, job: u64) {
    let copies = blocks
        .iter()
        .map(|&i| PageCopy::g2(i % 3, i, slot(i)).keyed(100 + i as u64))
        .collect();
    w.store(job, copies, vec![]).unwrap();
    settled_clean(w, job);
}

fn found(w: &PagedWorker) -> Vec<(u32, u64)> {
    sorted(w.kept_host().unwrap().blocks.clone())
}

#[test]
fn a_kept_g2_is_found_again_after_a_restart_byte_for_byte() {
    let blocks = 6;
    let dir = memory_dir();
    let kept = dir.path().join("g2-rank0");
    let e = engine(&HYBRID, blocks);
    {
        let a = host_kept_worker(&e, blocks, &kept, "model a", None);
        assert!(a.kept_host().unwrap().blocks.is_empty());
        assert!(a.kept_host().unwrap().started_fresh.is_some());
        assert!(a.kept().is_none());
        store_keyed(&a, &[0, 1, 2, 4], |i| blocks - 1 - i, 1);
        // A store without a key leaves its slot unrecorded.
        a.store(2, vec![PageCopy::g2(0, 3, 2)], vec![]).unwrap();
        settled_clean(&a, 2);
    }
    // A new worker over other pages (all zero) finds every recorded block
    // in its slot and loads each byte for byte.
    let e2 = zeroed(blocks);
    let b = host_kept_worker(&e2, blocks, &kept, "model a", None);
    assert_eq!(b.kept_host().unwrap().started_fresh, None);
    assert_eq!(b.kept_host().unwrap().dir, kept);
    assert_eq!(found(&b), vec![(1, 104), (3, 102), (4, 101), (5, 100)]);
    let loads: Vec<PageCopy> = [0, 1, 2, 4]
        .iter()
        .map(|&i| PageCopy::g2(i % 3, i, blocks - 1 - i))
        .collect();
    b.load(9, loads.clone()).unwrap();
    settled_clean(&b, 9);
    assert_same_pages(&e2, &e, &loads);
    // A slot nothing was recorded in is never served.
    b.load(10, vec![PageCopy::g2(0, 3, 2)]).unwrap();
    b.wait(&[10]);
    assert_eq!(b.finished()[0].failed.len(), 1);
    // While B holds the directory another engine gets one of its own;
    // another identity reuses nothing.
    let other = host_kept_worker(&e2, blocks, &kept, "model a", None);
    assert_ne!(other.kept_host().unwrap().dir, kept);
    drop((b, other));
    let c = host_kept_worker(&e2, blocks, &kept, "model b", None);
    assert!(c.kept_host().unwrap().blocks.is_empty());
    assert!(c.kept_host().unwrap().started_fresh.is_some());
}

#[test]
fn a_slot_written_over_unrecorded_or_reset_is_not_found_again() {
    let blocks = 6;
    // G2 in memory (io_uring takes no buffer mapped from a disk file),
    // G3 on disk.
    let (dir, disk) = (memory_dir(), tempfile::tempdir().unwrap());
    let (g2, g3) = (dir.path().join("g2"), disk.path().join("g3"));
    let e = engine(&HYBRID, blocks);
    {
        let a = host_kept_worker(&e, blocks, &g2, "m", Some(&g3));
        store_keyed(&a, &[0, 1, 2], |i| i, 1);
        // Slot 1 holds another block now, slot 2 a block that came from
        // outside (unrecorded before it was written).
        store_keyed(&a, &[4], |_| 1, 2);
        a.unrecord(&[2]).unwrap();
        assert!(a.unrecord(&[blocks]).is_err());
    }
    let b = host_kept_worker(&e, blocks, &g2, "m", Some(&g3));
    assert_eq!(found(&b), vec![(0, 100), (1, 104)]);
    // A reset empties the records of both kept tiers, after the jobs
    // before it (the block stored just before is forgotten too), and
    // stops them: what is stored or moved after is not recorded.
    store_keyed(&b, &[5], |_| 3, 3);
    let moves = vec![DiskMove::new(0, 4, 0, 100)];
    b.store(4, vec![], moves).unwrap();
    settled_clean(&b, 4);
    b.stop_keeping().unwrap();
    store_keyed(&b, &[3], |_| 5, 5);
    let moves = vec![DiskMove::new(5, 1, 0, 103)];
    b.store(6, vec![], moves).unwrap();
    settled_clean(&b, 6);
    drop(b);
    let c = host_kept_worker(&e, blocks, &g2, "m", Some(&g3));
    assert!(found(&c).is_empty());
    assert!(c.kept().unwrap().blocks.is_empty());
}

#[test]
fn a_kept_g2_slot_changed_at_rest_is_refused() {
    let blocks = 4;
    let dir = memory_dir();
    let kept = dir.path().join("g2");
    let e = engine(&HYBRID, blocks);
    {
        let a = host_kept_worker(&e, blocks, &kept, "m", None);
        store_keyed(&a, &[0, 1], |i| i, 1);
    }
    let e2 = zeroed(blocks);
    let b = host_kept_worker(&e2, blocks, &kept, "m", None);
    assert_eq!(found(&b), vec![(0, 100), (1, 101)]);
    // Flip a byte of slot 1 at rest: not verify mode, but a kept G2
    // checks every load.
    let addr = b.shared.region.regions()[0].addr().unwrap() + b.slot_stride();
    // SAFETY: inside the slot region, which no job copies now.
    unsafe { *(addr as *mut u8) ^= 0xff };
    b.load(2, vec![PageCopy::g2(0, 0, 0), PageCopy::g2(1, 1, 1)])
        .unwrap();
    b.wait(&[2]);
    let r = b.finished();
    assert_eq!(r[0].failed, vec![PageCopy::g2(1, 1, 1)]);
    for l in 0..2 {
        assert_eq!(page(&e2, 0, l, 0), page(&e, 0, l, 0));
        assert!(page(&e2, 1, l, 1).iter().all(|&x| x == 0));
    }
}

/// One step of the kept G2's model test.
#[derive(Debug, Clone)]
enum HostStep {
    /// Engine block `block` stored into slot `slot` under its key, or
    /// without one.
    Store {
        block: usize,
        slot: usize,
        keyed: bool,
    },
    /// Something outside the worker is about to write `slot` (a G4 fetch).
    Unrecord { slot: usize },
    /// The cache reset: the worker keeps nothing more.
    Stop,
    /// The worker dropped and opened again.
    Restart,
}

fn host_step(blocks: usize) -> impl proptest::strategy::Strategy<Value = HostStep> {
    use proptest::prelude::*;
    prop_oneof![
        6 => (0..blocks, 0..blocks, proptest::bool::weighted(0.85))
            .prop_map(|(block, slot, keyed)| HostStep::Store { block, slot, keyed }),
        1 => (0..blocks).prop_map(|slot| HostStep::Unrecord { slot }),
        1 => Just(HostStep::Stop),
        2 => Just(HostStep::Restart),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// After any run of stores (keyed or not), slots given to the outside,
    /// resets and restarts, a reopened kept G2 names exactly the last
    /// block stored into each slot where it was stored under a key,
    /// before the worker's reset (if any), and not given to the outside
    /// since; each of them loads byte for byte.
    #[test]
    fn a_reopened_kept_g2_names_the_last_keyed_block_stored_in_each_slot(
        steps in proptest::collection::vec(host_step(5), 1..20)
    ) {
        let blocks = 5;
        let dir = memory_dir();
        let kept = dir.path().join("g2");
        let e = engine(&HYBRID, blocks);
        let mut model = KeptModel::default();
        let mut w = Some(host_kept_worker(&e, blocks, &kept, "m", None));
        let mut job = 1;
        for step in steps.into_iter().chain([HostStep::Restart]) {
            let worker = w.as_ref().unwrap();
            match step {
                HostStep::Store { block, slot, keyed } => {
                    let copy = PageCopy::g2(block % 3, block, slot);
                    let copy = if keyed { copy.keyed(100 + block as u64) } else { copy };
                    worker.store(job, vec![copy], vec![]).unwrap();
                    settled_clean(worker, job);
                    job += 1;
                    model.wrote(slot, keyed.then_some(100 + block as u64));
                }
                HostStep::Unrecord { slot } => {
                    worker.unrecord(&[slot]).unwrap();
                    model.forgot(slot);
                }
                HostStep::Stop => {
                    worker.stop_keeping().unwrap();
                    model.stop();
                }
                HostStep::Restart => {
                    drop(w.take());
                    let e2 = zeroed(blocks);
                    let r = host_kept_worker(&e2, blocks, &kept, "m", None);
                    model.check_reopened(&r, found(&r), false, job, &e2, &e)?;
                    job += 1;
                    drop(r);
                    w = Some(host_kept_worker(&e, blocks, &kept, "m", None));
                }
            }
        }
    }
}
