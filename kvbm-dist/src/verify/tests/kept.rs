//! Tiers kept across restarts over the leader and its workers: G3 and G2
//! found again by a restarted instance, what a reset leaves of them, and
//! a model of the records under stores, resets and restarts.

use super::*;

fn label(hash: u64, parent: Option<u64>) -> kvbm_pool::tier::BlockLabel {
    (
        kvbm_block::SequenceHash(hash),
        parent.map(kvbm_block::SequenceHash),
    )
}

/// A G3 directory per rank of `world`: the directories, removed when
/// dropped, and their paths.
fn kept_dirs(world: u32) -> (Vec<tempfile::TempDir>, Vec<std::path::PathBuf>) {
    let dirs: Vec<tempfile::TempDir> = (0..world).map(|_| tempfile::tempdir().unwrap()).collect();
    let paths = dirs.iter().map(|d| d.path().to_path_buf()).collect();
    (dirs, paths)
}

/// `(slot, hash)` of every block the instance's kept G3 held at start.
fn kept_g3_of(i: &Instance) -> Vec<(u32, u64)> {
    slot_hashes(i.leader.kept_g3())
}

/// `(slot, hash)` of every kept block of `found`.
fn slot_hashes(found: &[(u32, crate::proto::BlockLabel)]) -> Vec<(u32, u64)> {
    found.iter().map(|(s, l)| (*s, l.hash)).collect()
}

/// Writes labelled blocks into a kept G3, stops, starts again on the same
/// directories: the blocks are found on every rank and load back intact;
/// a byte changed on disk while the engine was down is caught on load; a
/// G3 kept under another identity gives nothing back.
fn kept_g3_outlives_the_instance(world: u32, memory: Memory) {
    let (_dirs, paths) = kept_dirs(world);
    let kept = Some((&paths[..], None, "model: tiny"));
    let i = start_in(world, false, memory, kept);
    assert!(i.leader.kept_g3().is_empty());
    i.fill(&SEEDS);
    i.copy(Tier::G1, Tier::G2, &[(1, 10), (2, 11)]).unwrap();
    let labels = [label(100, None), label(101, Some(100))];
    i.copy_labelled(Tier::G2, Tier::G3, &[(10, 3), (11, 5)], &labels)
        .unwrap();
    // Written without a label: not kept.
    i.copy(Tier::G2, Tier::G3, &[(10, 7)]).unwrap();
    i.stop();

    let i = start_in(world, false, memory, kept);
    assert_eq!(kept_g3_of(&i), vec![(3, 100), (5, 101)]);
    assert_eq!(i.leader.kept_g3()[1].1.parent, Some(100));
    // Every rank said how long opening (and reading back) its G3 took.
    let open = i.leader.g3_open_times();
    assert_eq!(open.len(), world as usize);
    assert!(open.iter().all(|d| !d.is_zero()), "{open:?}");
    let engine = kvbm_pool::TierEngine::builder_with_mover(i.leader.mover(), 16)
        .build()
        .unwrap();
    assert_eq!(i.leader.restore_kept(&engine).g3, 2);
    let g3 = engine.pool(Tier::G3).unwrap();
    assert!(
        g3.contains(kvbm_block::SequenceHash(100)) && g3.contains(kvbm_block::SequenceHash(101))
    );
    drop(engine);
    i.copy(Tier::G3, Tier::G1, &[(3, 8), (5, 9)]).unwrap();
    assert!(
        i.wrong(&[(8, 11), (9, 12)]).is_empty(),
        "kept blocks load back intact"
    );
    i.stop();

    let i = start_in(world, false, memory, kept);
    i.corrupt_g3(5);
    let out = i.copy(Tier::G3, Tier::G1, &[(3, 8), (5, 9)]);
    failed_on_checksum(out, &[(3, 8)], &[(5, 9)]);
    assert!(i.mismatches() >= 1);
    i.stop();

    let other = Some((&paths[..], None, "model: other"));
    let i = start_in(world, false, memory, other);
    assert!(
        i.leader.kept_g3().is_empty(),
        "another identity reuses nothing"
    );
    i.stop();
}

#[test]
fn a_kept_g3_outlives_the_instance_over_the_lent_route() {
    kept_g3_outlives_the_instance(1, Memory::Host);
}

#[test]
fn a_kept_g3_outlives_the_instance_over_the_socket() {
    kept_g3_outlives_the_instance(2, Memory::Host);
}

/// After a reset ([`DistMover::stop_keeping`](crate::leader::DistMover::stop_keeping))
/// a kept G3 records nothing more and forgets what it recorded: a
/// restarted instance finds neither the blocks written before it nor one
/// written after it, nor one written over after it; the instance itself
/// goes on reading them.
fn a_kept_g3_records_nothing_after_a_reset(world: u32) {
    let (_dirs, paths) = kept_dirs(world);
    let kept = Some((&paths[..], None, "model: tiny"));
    let i = start_in(world, false, Memory::Host, kept);
    i.fill(&SEEDS);
    i.copy(Tier::G1, Tier::G2, &[(1, 10), (2, 11)]).unwrap();
    let labels = [label(100, None), label(101, Some(100))];
    i.copy_labelled(Tier::G2, Tier::G3, &[(10, 3), (11, 5)], &labels)
        .unwrap();
    i.leader.mover().stop_keeping();
    i.copy_labelled(Tier::G2, Tier::G3, &[(10, 7), (11, 5)], &labels)
        .unwrap();
    i.copy(Tier::G3, Tier::G2, &[(3, 20), (7, 21)]).unwrap();
    i.stop();
    let i = start_in(world, false, Memory::Host, kept);
    assert_eq!(kept_g3_of(&i), Vec::<(u32, u64)>::new());
    i.stop();
}

#[test]
fn a_kept_g3_records_nothing_after_a_reset_over_the_lent_route() {
    a_kept_g3_records_nothing_after_a_reset(1);
}

#[test]
fn a_kept_g3_records_nothing_after_a_reset_over_the_socket() {
    a_kept_g3_records_nothing_after_a_reset(2);
}

/// A step of [`kept_g3_follows_stores_resets_and_restarts`].
#[derive(Debug, Clone)]
enum KeptStep {
    /// A labelled copy from G2 block `0` or `1` into G3 slot `g3`.
    Keep { g2: usize, g3: usize },
    /// The same without a label.
    Plain { g2: usize, g3: usize },
    /// The engine's cache reset.
    Reset,
    /// The instance stopped and started again on the same directories.
    Restart,
}

fn kept_step() -> impl proptest::strategy::Strategy<Value = KeptStep> {
    use proptest::prelude::*;
    let slots = || (0usize..2, 0usize..6);
    prop_oneof![
        4 => slots().prop_map(|(g2, g3)| KeptStep::Keep { g2, g3 }),
        1 => slots().prop_map(|(g2, g3)| KeptStep::Plain { g2, g3 }),
        1 => Just(KeptStep::Reset),
        2 => Just(KeptStep::Restart),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 12, ..Default::default() })]

    /// A kept G3 against a model of its records: a labelled copy names
    /// its block in its slot until another copy writes the slot, a reset
    /// forgets every record and keeps nothing written after it, and every
    /// restart finds exactly the model's blocks, over the lent route and
    /// over the socket.
    #[test]
    fn kept_g3_follows_stores_resets_and_restarts(
        world in 1u32..=2,
        steps in proptest::collection::vec(kept_step(), 1..10),
    ) {
        let (_dirs, paths) = kept_dirs(world);
        let kept = Some((&paths[..], None, "model: tiny"));
        let begin = || {
            let i = start_in(world, false, Memory::Host, kept);
            i.fill(&SEEDS);
            i.copy(Tier::G1, Tier::G2, &[(1, 0), (2, 1)]).unwrap();
            i
        };
        let mut model = std::collections::BTreeMap::new();
        let (mut keeping, mut next_hash) = (true, 100u64);
        let mut i = begin();
        for step in steps.into_iter().chain([KeptStep::Restart]) {
            match step {
                KeptStep::Keep { g2, g3 } => {
                    next_hash += 1;
                    i.copy_labelled(Tier::G2, Tier::G3, &[(g2, g3)], &[label(next_hash, None)])
                        .unwrap();
                    if keeping {
                        model.insert(g3 as u32, next_hash);
                    } else {
                        model.remove(&(g3 as u32));
                    }
                }
                KeptStep::Plain { g2, g3 } => {
                    i.copy(Tier::G2, Tier::G3, &[(g2, g3)]).unwrap();
                    model.remove(&(g3 as u32));
                }
                KeptStep::Reset => {
                    i.leader.mover().stop_keeping();
                    keeping = false;
                    model.clear();
                }
                KeptStep::Restart => {
                    i.stop();
                    i = begin();
                    let want: Vec<(u32, u64)> = model.iter().map(|(&s, &h)| (s, h)).collect();
                    proptest::prop_assert_eq!(kept_g3_of(&i), want);
                    keeping = true;
                }
            }
        }
        i.stop();
    }
}

/// The same with G1 on a GPU: the blocks bound for G3 are summed there as
/// they leave, and the kept blocks read back are summed there as they land.
#[cfg(feature = "cuda")]
#[test]
fn a_kept_g3_outlives_the_instance_with_g1_on_the_gpu() {
    if !gpu_or_skip() {
        return;
    }
    for world in [1, 2] {
        kept_g3_outlives_the_instance(world, Memory::Gpu);
    }
}

/// G2 kept too: blocks offloaded into G2 with labels come back after a
/// restart in their slots on every rank, registered in the new engine's
/// G2 and intact; an unlabelled write is not kept; a byte changed in the
/// memory file while the engine was down is caught on load.
fn kept_g2_outlives_the_instance(world: u32, memory: Memory) {
    let (_g3_dirs, g3) = kept_dirs(world);
    let g2_dirs: Vec<tempfile::TempDir> = (0..world)
        .map(|_| crate::kept::tests::memory_dir())
        .collect();
    let g2: Vec<std::path::PathBuf> = g2_dirs.iter().map(|d| d.path().join("g2")).collect();
    let kept = Some((&g3[..], Some(&g2[..]), "model: tiny"));
    let i = start_in(world, false, memory, kept);
    assert!(i.leader.kept_g2().is_empty());
    i.fill(&SEEDS);
    let labels = [label(100, None), label(101, Some(100))];
    i.copy_labelled(Tier::G1, Tier::G2, &[(1, 10), (2, 11)], &labels)
        .unwrap();
    i.copy(Tier::G1, Tier::G2, &[(1, 12)]).unwrap();
    i.stop();

    let i = start_in(world, false, memory, kept);
    assert_eq!(slot_hashes(i.leader.kept_g2()), vec![(10, 100), (11, 101)]);
    let engine = kvbm_pool::TierEngine::builder_with_mover(i.leader.mover(), 16)
        .build()
        .unwrap();
    let restored = i.leader.restore_kept(&engine);
    assert_eq!((restored.g2, restored.g3), (2, 0));
    assert!(
        engine
            .pool(Tier::G2)
            .unwrap()
            .contains(kvbm_block::SequenceHash(101))
    );
    drop(engine);
    i.copy(Tier::G2, Tier::G1, &[(10, 8), (11, 9)]).unwrap();
    assert!(
        i.wrong(&[(8, 11), (9, 12)]).is_empty(),
        "kept G2 blocks load back intact"
    );
    i.stop();

    // Damage slot 11 in every rank's memory file while no engine runs.
    let stride = shape(1).block_bytes();
    for dir in &g2 {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join("blocks"))
            .unwrap();
        let at = 11 * stride + 7;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x5A], at).unwrap();
    }
    let i = start_in(world, false, memory, kept);
    let out = i.copy(Tier::G2, Tier::G1, &[(10, 8), (11, 9)]);
    failed_on_checksum(out, &[(10, 8)], &[(11, 9)]);
    i.stop();
}

#[test]
fn a_kept_g2_outlives_the_instance() {
    for world in [1, 2] {
        kept_g2_outlives_the_instance(world, Memory::Host);
    }
}

/// The same with G1 on a GPU: the kept G2 is pinned in place.
#[cfg(feature = "cuda")]
#[test]
fn a_kept_g2_outlives_the_instance_with_g1_on_the_gpu() {
    if !gpu_or_skip() {
        return;
    }
    for world in [1, 2] {
        kept_g2_outlives_the_instance(world, Memory::Gpu);
    }
}
