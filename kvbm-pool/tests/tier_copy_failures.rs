//! Copy failures are counted by path and OS error, apart from the policy's
//! skips, and nothing whose copy failed is registered or found by a match.
//!
//! Two ways to fill G3's disk mid-run: fault injection under the disk
//! backend (G3 writes fail with `ENOSPC` after a few succeed; runs
//! everywhere), and a real ext2 file system of a few MiB holding a sparse
//! G3 file (the kernel's own `ENOSPC`; skipped where a loop device cannot
//! be mounted).

mod tier_support;

use std::os::unix::fs::FileExt;

use kvbm_block::SequenceHash;
use kvbm_layout::{Layout, LayoutKind};
use kvbm_pool::Tier;
use kvbm_pool::metrics::{FailureCause, Path, TierStats};
use kvbm_pool::tier::{G1Lookup, OnboardTarget, TierEngine, TierLayouts};
use kvbm_testkit::fault::{Fault, FaultRule};
use kvbm_testkit::small_fs::SmallFs;
use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::disk::IoDir;
use kvbm_transfer::memory::{DiskFile, IoMode, MemoryRegion};
use tier_support::*;

const ENOSPC: FailureCause = FailureCause::Errno(libc::ENOSPC);

fn chains() -> Vec<Vec<SequenceHash>> {
    (1..=4).map(|seed| chain(seed, 8)).collect()
}

/// The checks every run makes: G2 → G3 failures are counted by cause,
/// never as skips; a block is in G3 exactly when its copy landed; matches
/// find only those, and their bytes are right.
fn check_failures_are_counted_and_never_hits(
    engine: &TierEngine,
    chains: &[Vec<SequenceHash>],
    control: &TierStats,
) -> TierStats {
    let stats = engine.stats();
    let failed = stats.failed_on(Path::G2ToG3);
    assert!(failed > 0, "no G2 -> G3 copy failed: {stats:?}");
    assert_eq!(
        stats.failed_for(Path::G2ToG3, ENOSPC),
        failed,
        "failures not all ENOSPC: {:?}",
        stats.copy_failures
    );
    assert_eq!(stats.offload_copy_failures(), failed);
    assert_eq!(stats.onboard_copy_failures(), 0);
    // The policy skipped exactly what it skips without failures.
    assert_eq!(stats.skipped, control.skipped, "failures leaked into skips");
    // Every block offered to G3 either landed (registered) or failed.
    assert_eq!(
        stats.blocks_on(Path::G2ToG3) + failed,
        control.blocks_on(Path::G2ToG3)
    );
    let g3 = engine.pool(Tier::G3).unwrap();
    let in_g3 = chains.iter().flatten().filter(|h| g3.contains(**h)).count() as u64;
    assert_eq!(in_g3, stats.blocks_on(Path::G2ToG3));

    // Matches report only registered blocks, and those carry their bytes.
    let before = engine.stats().hits[2];
    let mut found = 0;
    for (i, c) in chains.iter().enumerate() {
        let id = format!("r{i}");
        let tokens = c.len() * BLOCK_TOKENS + 1;
        let m = engine
            .match_request(&*id, c, tokens, G1Lookup::Pool)
            .unwrap();
        let expect = c.iter().take_while(|h| g3.contains(**h)).count();
        assert_eq!(m.g3_blocks, expect, "chain {i}");
        found += m.g3_blocks as u64;
        if m.external_blocks() > 0 {
            let done = engine
                .onboard(&*id, OnboardTarget::Pool)
                .unwrap()
                .wait()
                .unwrap();
            verify(engine, &done.blocks.into_blocks());
        }
        assert!(engine.release(&*id));
    }
    assert_eq!(engine.stats().hits[2] - before, found);
    stats
}

/// The same workload without faults: what the policy skips and offers.
fn control_stats() -> TierStats {
    let dir = tempdir();
    let engine = write_through_engine(dir.path(), faulty_executor_with(None));
    push_to_g3(&engine, &chains(), 4);
    let stats = engine.stats();
    assert_eq!(stats.copy_failures, Vec::new());
    // Every chain block went on to G3; the fillers stayed in G2.
    assert_eq!(stats.blocks_on(Path::G2ToG3), 32);
    stats
}

#[test]
fn injected_enospc_is_a_counted_failure_not_a_skip_or_a_hit() {
    #[cfg(feature = "prometheus")]
    let prometheus = kvbm_pool::metrics::install_prometheus().unwrap();
    let control = control_stats();
    let dir = tempdir();
    // G3 fills up after its first few writes.
    let rule = FaultRule::always(Fault::Errno(libc::ENOSPC))
        .on_dir(IoDir::Write)
        .after(6);
    let engine = write_through_engine(dir.path(), faulty_executor(rule));
    let chains = chains();
    push_to_g3(&engine, &chains, 4);
    let stats = check_failures_are_counted_and_never_hits(&engine, &chains, &control);
    assert!(stats.blocks_on(Path::G2ToG3) > 0, "nothing landed first");
    assert_eq!(ENOSPC.label(), "ENOSPC");

    #[cfg(feature = "prometheus")]
    {
        let text = prometheus.render();
        let line = text
            .lines()
            .find(|l| {
                l.starts_with("kvbm_copy_failures_total{")
                    && l.contains("path=\"g2_g3\"")
                    && l.contains("errno=\"ENOSPC\"")
            })
            .unwrap_or_else(|| panic!("no copy-failure counter in:\n{text}"));
        let n: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(n >= stats.failed_on(Path::G2ToG3) as f64, "{line}");
        assert!(
            !text.contains("copy_failed"),
            "a failure reason among skips"
        );
    }
}

#[test]
fn onboard_read_errors_are_counted_on_their_path() {
    let dir = tempdir();
    let rule = FaultRule::always(Fault::Errno(libc::EIO))
        .on_dir(IoDir::Read)
        .times(1);
    let engine = write_through_engine(dir.path(), faulty_executor(rule));
    let a = chain(7, 4);
    push_to_g3(&engine, std::slice::from_ref(&a), 4);
    let m = engine
        .match_request("a", &a, 4 * BLOCK_TOKENS + 1, G1Lookup::Pool)
        .unwrap();
    assert_eq!(m.g3_blocks, 4);
    assert!(
        engine
            .onboard("a", OnboardTarget::Pool)
            .unwrap()
            .wait()
            .is_err()
    );
    let stats = engine.stats();
    assert_eq!(
        stats.failed_for(Path::G3ToG1, FailureCause::Errno(libc::EIO)),
        4
    );
    assert_eq!(stats.onboard_copy_failures(), 4);
    assert_eq!(stats.offload_copy_failures(), 0);
    assert_eq!(stats.onboard_failures, 1);
    assert_eq!(stats.blocks_on(Path::G3ToG1), 0);
}

/// A G3 of `blocks` blocks on a sparse file at `path` (its space is not
/// reserved: the situation reservation exists to prevent).
fn sparse_g3(path: &std::path::Path, blocks: usize) -> PhysicalLayout {
    let layout = Layout::new(layout_config(blocks), LayoutKind::FullyContiguous).unwrap();
    let len = layout.region_size(0).unwrap();
    std::fs::File::create(path).unwrap().set_len(len).unwrap();
    let file = DiskFile::open(path, IoMode::Auto).unwrap();
    let region = MemoryRegion::file(file, 0, len).unwrap();
    PhysicalLayout::new(layout, vec![region]).unwrap()
}

/// Fills the file system at `dir` but for about `room` bytes.
fn fill_but(dir: &std::path::Path, room: u64) {
    let path = dir.join("filler");
    let f = std::fs::File::create(&path).unwrap();
    let chunk = vec![0xA5u8; 64 << 10];
    let mut len = 0u64;
    while f.write_all_at(&chunk, len).is_ok() {
        len += chunk.len() as u64;
    }
    f.sync_all().unwrap();
    f.set_len(len.saturating_sub(room)).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn a_sparse_g3_on_a_full_ext2_fails_with_the_kernels_enospc() {
    let fs = match SmallFs::ext2(4 << 20) {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("skipping: {why}");
            return;
        }
    };
    let control = control_stats();
    // Room for a handful of 8 KiB blocks (and ext2's indirect blocks).
    fill_but(fs.path(), 48 << 10);
    let layouts = TierLayouts {
        g1: host(64),
        g2: Some(host(4)),
        g3: Some(sparse_g3(&fs.path().join("g3.blocks"), 64)),
    };
    let engine = write_through(over(layouts, executor())).build().unwrap();
    let chains = chains();
    push_to_g3(&engine, &chains, 4);
    check_failures_are_counted_and_never_hits(&engine, &chains, &control);
    drop(engine);
}
