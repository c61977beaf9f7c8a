//! The store's files across crashes: a proptest over the moment a crash
//! stops a sequence of block writes, then units for identities and locks.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

use kvbm_layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::memory::{DISK_ALIGNMENT, IoMode};
use proptest::prelude::*;

use super::*;
use crate::verify::block_sum;

const BLOCKS: usize = 6;

fn layout(blocks: usize) -> Layout {
    let config = LayoutConfig::new(blocks, 2, 2, 16, 128, 2)
        .unwrap()
        .with_alignment(DISK_ALIGNMENT)
        .unwrap();
    Layout::new(config, LayoutKind::FullyContiguous).unwrap()
}

fn open(dir: &Path, identity: &str) -> (KeptStore, PhysicalLayout, Recovery) {
    KeptStore::open(
        dir,
        identity,
        layout(BLOCKS),
        &Medium::Disk(IoMode::Buffered),
    )
    .unwrap()
}

/// The bytes of the block labelled `tag`.
fn bytes_of(tag: u64, len: usize) -> Vec<u8> {
    kvbm_testkit::blocks::pattern(tag, len)
}

fn block_bytes() -> usize {
    layout(BLOCKS).config().block_bytes() as usize
}

/// Writes `data` over block `slot` of the store's data file (a fully
/// contiguous layout: one extent per block).
fn write_block(dir: &Path, g3: &PhysicalLayout, slot: u32, data: &[u8]) {
    let stride = g3.layout().strides().block;
    let f = OpenOptions::new()
        .write(true)
        .open(dir.join("blocks"))
        .unwrap();
    f.write_all_at(data, u64::from(slot) * stride).unwrap();
}

fn label(tag: u64) -> BlockLabel {
    BlockLabel {
        hash: tag,
        parent: (!tag.is_multiple_of(3)).then_some(tag ^ 0x55),
    }
}

/// Where in one block write a crash stops it.
#[derive(Debug, Clone, Copy)]
enum Crash {
    /// Before anything.
    Before,
    /// After the record was emptied, before any byte.
    AfterForget,
    /// With this many of the block's bytes written.
    TornData(usize),
    /// After the bytes, before the record.
    BeforeCommit,
    /// With this many of the record's bytes written.
    TornRecord(usize),
}

fn crash() -> impl Strategy<Value = Crash> {
    prop_oneof![
        Just(Crash::Before),
        Just(Crash::AfterForget),
        (0usize..16384).prop_map(Crash::TornData),
        Just(Crash::BeforeCommit),
        (0usize..=32).prop_map(Crash::TornRecord),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Writes blocks into slots (some slots again), stops at a crash
    /// point, reopens: every block found verifies and holds the bytes
    /// written under its label, and every block committed before the crash
    /// and not overwritten since is found.
    #[test]
    fn a_crash_anywhere_serves_no_wrong_byte_and_loses_no_committed_block(
        writes in proptest::collection::vec((0u32..BLOCKS as u32, 1u64..12), 1..14),
        crash_at in 0usize..14,
        how in crash(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let len = block_bytes();
        let mut committed: HashMap<u32, u64> = HashMap::new();
        {
            let (store, g3, _) = open(dir.path(), "model: m");
            for (i, &(slot, tag)) in writes.iter().enumerate() {
                let data = bytes_of(tag, len);
                let sum_of = |g3: &PhysicalLayout| block_sum(g3, slot as usize).unwrap();
                if i == crash_at.min(writes.len() - 1) {
                    match how {
                        Crash::Before => {}
                        Crash::AfterForget => store.forget(&[slot]).unwrap(),
                        Crash::TornData(n) => {
                            store.forget(&[slot]).unwrap();
                            write_block(dir.path(), &g3, slot, &data[..n.min(len)]);
                        }
                        Crash::BeforeCommit => {
                            store.forget(&[slot]).unwrap();
                            write_block(dir.path(), &g3, slot, &data);
                        }
                        Crash::TornRecord(n) => {
                            store.forget(&[slot]).unwrap();
                            write_block(dir.path(), &g3, slot, &data);
                            store.commit_torn(slot, label(tag), sum_of(&g3), n);
                        }
                    }
                    if !matches!(how, Crash::Before) {
                        committed.remove(&slot);
                    }
                    break;
                }
                store.forget(&[slot]).unwrap();
                committed.remove(&slot);
                write_block(dir.path(), &g3, slot, &data);
                store.commit(&[(slot, label(tag), sum_of(&g3))]).unwrap();
                committed.insert(slot, tag);
            }
        }
        let (_store, g3, recovery) = open(dir.path(), "model: m");
        prop_assert!(recovery.started_fresh.is_none());
        for r in &recovery.blocks {
            let found = block_sum(&g3, r.slot as usize).unwrap();
            prop_assert_eq!(found, r.sum, "slot {} does not verify", r.slot);
            let mut on_disk = vec![0u8; len];
            let f = std::fs::File::open(dir.path().join("blocks")).unwrap();
            f.read_exact_at(&mut on_disk, u64::from(r.slot) * g3.layout().strides().block).unwrap();
            prop_assert!(on_disk == bytes_of(r.label.hash, len), "slot {} holds other bytes", r.slot);
            prop_assert_eq!(r.label, label(r.label.hash));
        }
        for (slot, tag) in &committed {
            prop_assert!(
                recovery.blocks.iter().any(|r| r.slot == *slot && r.label.hash == *tag),
                "slot {} lost its committed block {}", slot, tag
            );
        }
    }
}

#[test]
fn another_identity_or_geometry_reuses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, g3, r) = open(dir.path(), "model: a");
        assert_eq!(r.started_fresh.as_deref(), Some("the directory held no G3"));
        write_block(dir.path(), &g3, 2, &bytes_of(7, block_bytes()));
        store
            .commit(&[(2, label(7), block_sum(&g3, 2).unwrap())])
            .unwrap();
    }
    let (_, _, r) = open(dir.path(), "model: a");
    assert_eq!(r.blocks.len(), 1);
    assert_eq!(r.blocks[0].slot, 2);
    drop(r);
    let (_, _, r) = open(dir.path(), "model: b");
    assert!(r.blocks.is_empty());
    assert_eq!(
        r.started_fresh.as_deref(),
        Some("it was written under another identity")
    );
    // Back to the first identity: the other one emptied the directory.
    let (_, _, r) = open(dir.path(), "model: a");
    assert!(r.blocks.is_empty());
    // Another block count is another geometry.
    let (_, _, r) = KeptStore::open(
        dir.path(),
        "model: a",
        layout(BLOCKS + 1),
        &Medium::Disk(IoMode::Buffered),
    )
    .unwrap();
    assert!(r.started_fresh.is_some());
}

#[test]
fn a_damaged_record_is_rejected_and_its_slot_is_free() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, g3, _) = open(dir.path(), "m");
        for slot in [0u32, 1] {
            write_block(
                dir.path(),
                &g3,
                slot,
                &bytes_of(9 + u64::from(slot), block_bytes()),
            );
            store
                .commit(&[(
                    slot,
                    label(9 + u64::from(slot)),
                    block_sum(&g3, slot as usize).unwrap(),
                )])
                .unwrap();
        }
    }
    let f = OpenOptions::new()
        .write(true)
        .open(dir.path().join("slots"))
        .unwrap();
    f.write_all_at(&[0xff], HEADER_BYTES + RECORD_BYTES + 3)
        .unwrap();
    let (_, _, r) = open(dir.path(), "m");
    assert_eq!(r.rejected, 1);
    assert_eq!(r.blocks.len(), 1);
    assert_eq!(r.blocks[0].slot, 0);
}

#[test]
fn a_crash_while_creating_starts_afresh() {
    let dir = tempfile::tempdir().unwrap();
    drop(open(dir.path(), "m"));
    std::fs::remove_file(dir.path().join("identity")).unwrap();
    let (_, _, r) = open(dir.path(), "m");
    assert!(r.started_fresh.is_some());
}

#[test]
fn two_engines_never_open_one_directory() {
    let dir = tempfile::tempdir().unwrap();
    let first = open(dir.path(), "m");
    let second = KeptStore::open(
        dir.path(),
        "m",
        layout(BLOCKS),
        &Medium::Disk(IoMode::Buffered),
    );
    let err = second.unwrap_err().to_string();
    assert!(err.contains("in use by another engine"), "{err}");
    assert!(!is_unused_store(dir.path()));
    drop(first);
    assert!(is_unused_store(dir.path()));
}

#[test]
fn records_encode_and_decode() {
    for (slot, l, sum) in [
        (
            0u32,
            BlockLabel {
                hash: 0,
                parent: None,
            },
            0u64,
        ),
        (
            5,
            BlockLabel {
                hash: u64::MAX,
                parent: Some(0),
            },
            1,
        ),
        (
            u32::MAX,
            BlockLabel {
                hash: 3,
                parent: Some(u64::MAX),
            },
            u64::MAX,
        ),
    ] {
        let r = encode(slot, l, sum);
        assert_eq!(decode(slot, &r), Ok(Some((l, sum))));
        assert_eq!(
            decode(slot.wrapping_add(1), &r),
            Err(()),
            "a record moved to another slot"
        );
    }
    assert_eq!(decode(1, &[0u8; 32]), Ok(None));
}

#[test]
fn engines_of_one_identity_keep_a_directory_each() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rank0");
    let (a, _, _) =
        KeptStore::open_free(&path, "m", layout(BLOCKS), &Medium::Disk(IoMode::Buffered)).unwrap();
    let (b, _, _) =
        KeptStore::open_free(&path, "m", layout(BLOCKS), &Medium::Disk(IoMode::Buffered)).unwrap();
    assert_eq!(a.dir(), path);
    assert_eq!(b.dir(), dir.path().join("rank0.2"));
    drop(a);
    // A restarted engine takes the first that is free.
    let (c, _, _) =
        KeptStore::open_free(&path, "m", layout(BLOCKS), &Medium::Disk(IoMode::Buffered)).unwrap();
    assert_eq!(c.dir(), path);
}

#[test]
fn inspection_lists_blocks_and_finds_damaged_ones() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (store, g3, _) = open(dir.path(), "model: m");
        for slot in [1u32, 4] {
            let tag = 20 + u64::from(slot);
            write_block(dir.path(), &g3, slot, &bytes_of(tag, block_bytes()));
            store
                .commit(&[(slot, label(tag), block_sum(&g3, slot as usize).unwrap())])
                .unwrap();
        }
        let seen = inspect(dir.path(), true).unwrap();
        assert!(
            seen.in_use && !seen.verified,
            "an open store is listed, not read"
        );
        assert_eq!(seen.blocks, 2);
    }
    let clean = inspect(dir.path(), true).unwrap();
    assert!(clean.identity.starts_with("model: m\n"));
    assert_eq!(
        (clean.slots, clean.blocks, clean.bad_records),
        (BLOCKS as u32, 2, 0)
    );
    assert_eq!(clean.block_bytes, 2 * block_bytes() as u64);
    assert!(clean.verified && clean.bad_blocks.is_empty());
    assert!(clean.disk_bytes >= clean.block_bytes);
    let f = OpenOptions::new()
        .write(true)
        .open(dir.path().join("blocks"))
        .unwrap();
    let stride = layout(BLOCKS).strides().block;
    f.write_all_at(&[0x42], 4 * stride + 9).unwrap();
    let damaged = inspect(dir.path(), true).unwrap();
    assert_eq!(damaged.bad_blocks, vec![4]);
}

/// A directory in memory where the host has one (`/dev/shm`), as a kept G2
/// lives in; a temporary directory elsewhere.
pub(crate) fn memory_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm).unwrap()
    } else {
        tempfile::tempdir().unwrap()
    }
}

/// A G2 layout: the G3 shape without the disk alignment.
fn host_layout(blocks: usize) -> Layout {
    let config = LayoutConfig::new(blocks, 2, 2, 16, 128, 2).unwrap();
    Layout::new(config, LayoutKind::FullyContiguous).unwrap()
}

/// Writes `data` over block `slot` of a host tier, as a copy into it does.
fn write_host_block(g2: &PhysicalLayout, slot: u32, data: &[u8]) {
    let stride = g2.layout().strides().block;
    let base = g2.regions()[0].addr().unwrap() + u64::from(slot) * stride;
    assert!(data.len() as u64 <= stride);
    // SAFETY: the block lies inside the mapping the layout was built over
    // (its region is at least the layout's size), which `g2` keeps mapped;
    // nothing else touches it during the test.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base as *mut u8, data.len()) };
}

#[test]
fn a_kept_g2_keeps_committed_blocks_in_memory_files_and_drops_torn_ones() {
    let dir = memory_dir();
    let medium = Medium::Memory { pin: None };
    let open_g2 =
        |identity: &str| KeptStore::open(dir.path(), identity, host_layout(BLOCKS), &medium);
    let len = host_layout(BLOCKS).config().block_bytes() as usize;
    {
        let (store, g2, r) = open_g2("model: m").unwrap();
        assert_eq!(r.started_fresh.as_deref(), Some("the directory held no G2"));
        assert_eq!(g2.kind(), kvbm_transfer::MemoryKind::System);
        store.forget(&[3]).unwrap();
        write_host_block(&g2, 3, &bytes_of(11, len));
        store
            .commit(&[(3, label(11), block_sum(&g2, 3).unwrap())])
            .unwrap();
        // Killed in the middle of writing slot 4: emptied, never filled.
        store.forget(&[4]).unwrap();
        write_host_block(&g2, 4, &bytes_of(12, len / 2));
    }
    let (_store, g2, r) = open_g2("model: m").unwrap();
    assert!(r.started_fresh.is_none(), "{:?}", r.started_fresh);
    let found: Vec<(u32, u64)> = r.blocks.iter().map(|b| (b.slot, b.label.hash)).collect();
    assert_eq!(found, vec![(3, 11)]);
    assert_eq!(r.blocks[0].sum, block_sum(&g2, 3).unwrap());
    let stride = g2.layout().strides().block;
    let at = g2.regions()[0].addr().unwrap() + 3 * stride;
    // SAFETY: block 3 of the mapping `g2` keeps alive; nothing writes it.
    let kept = unsafe { std::slice::from_raw_parts(at as *const u8, len) };
    assert!(
        kept == bytes_of(11, len).as_slice(),
        "the kept bytes changed"
    );
    // A second engine of the same identity gets an error, not the memory.
    assert!(matches!(open_g2("model: m"), Err(DistError::KeptInUse(_))));
    drop((_store, g2));
    // Another identity reuses nothing.
    let (_, _, r) = open_g2("model: other").unwrap();
    assert!(r.blocks.is_empty());
    assert_eq!(
        r.started_fresh.as_deref(),
        Some("it was written under another identity")
    );
}
