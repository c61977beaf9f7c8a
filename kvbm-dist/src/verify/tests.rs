//! Verify mode end to end: a leader and in-process workers with real
//! tiers (host G1, system-memory G2, a G3 file), over the lent route (one
//! rank) and the socket (two ranks); bytes are corrupted in G2's memory
//! and in G3's file behind kvbm's back.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use kvbm_layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_pool::Tier;
use kvbm_pool::tier::TierMover;
use kvbm_transfer::memory::{DISK_ALIGNMENT, SystemAllocator};
use kvbm_transfer::{CancelToken, PhysicalLayout, TransferOutcome};
use parking_lot::Mutex;

use super::*;
use crate::leader::tests::{INSTANCE, config, endpoint, secret};
use crate::leader::{Leader, PendingLeader};
use crate::proto::ProbeOp;
use crate::worker::{self, WorkerConfig};

mod kept;

/// G1's shape: chunks of 4 KiB (what G3 needs), blocks of 16 KiB.
fn shape(blocks: usize) -> LayoutConfig {
    LayoutConfig::new(blocks, 2, 2, 16, 128, 2).unwrap()
}

fn g1(blocks: usize) -> PhysicalLayout {
    let l = Layout::new(shape(blocks), LayoutKind::FullyContiguous).unwrap();
    PhysicalLayout::allocate_system(l, &SystemAllocator::new()).unwrap()
}

/// A G1 of [`G1_BLOCKS`] in `memory`, and its probe.
fn g1_in(memory: Memory) -> (PhysicalLayout, Box<dyn crate::worker::probe::BlockProbe>) {
    match memory {
        Memory::Host => (g1(G1_BLOCKS), Box::new(worker::probe::HostProbe)),
        #[cfg(feature = "cuda")]
        Memory::Gpu => {
            let dev = kvbm_transfer::cuda::CudaDevice::open(0).unwrap();
            let l = Layout::new(shape(G1_BLOCKS), LayoutKind::FullyContiguous).unwrap();
            let g1 = worker::device::DeviceG1::allocate(&dev, l).unwrap();
            (g1.physical().clone(), Box::new(g1.probe()))
        }
    }
}

/// G2 for `layout` beside a G1 in `memory`.
fn g2_in(memory: Memory, layout: Layout) -> crate::Result<PhysicalLayout> {
    match memory {
        Memory::Host => Ok(PhysicalLayout::allocate_system(
            layout,
            &SystemAllocator::new(),
        )?),
        #[cfg(feature = "cuda")]
        Memory::Gpu => {
            let dev = kvbm_transfer::cuda::CudaDevice::open(0).unwrap();
            Ok(PhysicalLayout::allocate_pinned(layout, &dev)?)
        }
    }
}

const G1_BLOCKS: usize = 16;
const G2_BLOCKS: u64 = 64;
const G3_BLOCKS: u64 = 32;

/// A leader and its workers, with each worker's G2 and G3 directory.
struct Instance {
    leader: Leader,
    workers: Vec<JoinHandle<crate::Result<()>>>,
    g2: Vec<Arc<Mutex<Option<PhysicalLayout>>>>,
    g3: Vec<std::path::PathBuf>,
    _g3_owned: Vec<tempfile::TempDir>,
    _dir: tempfile::TempDir,
}

/// Where workers keep G3 across restarts: one directory per rank, one per
/// rank for G2 where it is kept too, and the identity.
type Kept<'a> = (
    &'a [std::path::PathBuf],
    Option<&'a [std::path::PathBuf]>,
    &'a str,
);

/// Where the workers' G1 lives.
#[derive(Clone, Copy, PartialEq)]
enum Memory {
    /// System memory (G2 too).
    Host,
    /// GPU 0's memory, with G2 pinned beside it.
    #[cfg(feature = "cuda")]
    Gpu,
}

/// Starts an instance of `world` ranks in this process: one rank lends
/// its executor (the leader copies directly), two talk over the socket.
fn start(world: u32, verify: bool) -> Instance {
    start_on(world, verify, Memory::Host)
}

/// [`start`] with G1 in `memory`.
fn start_on(world: u32, verify: bool, memory: Memory) -> Instance {
    start_in(world, verify, memory, None)
}

/// [`start_on`], G3 kept in `kept`'s directories when given.
fn start_in(world: u32, verify: bool, memory: Memory, kept: Option<Kept<'_>>) -> Instance {
    let dir = tempfile::tempdir().unwrap();
    let block = shape(1).block_bytes() * u64::from(world);
    let mut c = config(endpoint(&dir), world);
    c.g2_bytes = G2_BLOCKS * block;
    c.g3_bytes = G3_BLOCKS * block;
    c.verify = verify;
    let pending = PendingLeader::bind(c).unwrap();
    let (mut workers, mut g2, mut g3, mut owned) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for rank in 0..world {
        let disk = match kept {
            Some((dirs, ..)) => dirs[rank as usize].clone(),
            None => {
                let d = tempfile::tempdir().unwrap();
                let path = d.path().to_path_buf();
                owned.push(d);
                path
            }
        };
        let (g1, probe) = g1_in(memory);
        let mut wc = WorkerConfig::new(pending.endpoint(), INSTANCE, rank, world, g1, secret());
        wc.leader_timeout = Duration::from_secs(20);
        wc.probe = Some(probe);
        wc.g3_dir = Some(disk.clone());
        wc.kept_identity = kept.map(|(.., identity)| identity.to_string());
        wc.g2_keep_dir = kept.and_then(|(_, g2, _)| Some(g2?[rank as usize].clone()));
        let seen: Arc<Mutex<Option<PhysicalLayout>>> = Arc::default();
        let keep = Arc::clone(&seen);
        wc.g2_allocator = Some(Box::new(move |layout| {
            let l = g2_in(memory, layout)?;
            *keep.lock() = Some(l.clone());
            Ok(l)
        }));
        workers.push(std::thread::spawn(move || worker::run(wc)));
        g2.push(seen);
        g3.push(disk);
    }
    let leader = pending.handshake().unwrap();
    assert_eq!(leader.mover().is_local(), world == 1);
    Instance {
        leader,
        workers,
        g2,
        g3,
        _g3_owned: owned,
        _dir: dir,
    }
}

impl Instance {
    fn copy(&self, src: Tier, dst: Tier, pairs: &[(usize, usize)]) -> TransferOutcome {
        self.leader
            .mover()
            .copy(src, dst, pairs.to_vec(), CancelToken::new())
            .wait()
    }

    fn fill(&self, blocks: &[(u32, u64)]) {
        self.leader.probe(ProbeOp::Fill, blocks.to_vec()).unwrap();
    }

    /// G1 blocks of `blocks` whose pattern is wrong on some rank.
    fn wrong(&self, blocks: &[(u32, u64)]) -> Vec<u32> {
        let mut bad: Vec<u32> = self
            .leader
            .probe(ProbeOp::Check, blocks.to_vec())
            .unwrap()
            .concat();
        bad.sort_unstable();
        bad.dedup();
        bad
    }

    fn mismatches(&self) -> u64 {
        self.leader.status().verify_mismatches
    }

    /// Flips a byte of G2 block `block` on rank 0, in memory.
    fn corrupt_g2(&self, block: usize) {
        let g2 = self.g2[0].lock().clone().unwrap();
        let chunk = g2.layout().chunk(block, 1, 1).unwrap();
        let addr = g2.regions()[chunk.region].addr().unwrap() + chunk.offset + 7;
        // SAFETY: host memory the layout owns (kept alive by `g2`), inside
        // the chunk's region as the layout proved; no copy touches the
        // block now (the test's copies are over).
        unsafe {
            let p = addr as *mut u8;
            p.write_volatile(p.read_volatile() ^ 0x5A);
        }
    }

    /// Flips a byte of G3 block `block` on rank 0, in its file.
    fn corrupt_g3(&self, block: usize) {
        let layout = Layout::new(
            shape(G3_BLOCKS as usize)
                .with_alignment(DISK_ALIGNMENT)
                .unwrap(),
            LayoutKind::FullyContiguous,
        )
        .unwrap();
        let offset = layout.chunk(block, 1, 0).unwrap().offset + 3;
        // A kept G3's data file, or the only file of one that is not kept.
        let kept = self.g3[0].join("blocks");
        let path = if kept.exists() {
            kept
        } else {
            std::fs::read_dir(&self.g3[0])
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|p| p.is_file())
                .unwrap()
        };
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, offset).unwrap();
        byte[0] ^= 0xA5;
        file.write_all_at(&byte, offset).unwrap();
        file.flush().unwrap();
        file.sync_all().unwrap();
    }

    fn copy_labelled(
        &self,
        src: Tier,
        dst: Tier,
        pairs: &[(usize, usize)],
        labels: &[kvbm_pool::tier::BlockLabel],
    ) -> TransferOutcome {
        self.leader
            .mover()
            .copy_labelled(
                src,
                dst,
                pairs.to_vec(),
                labels.to_vec(),
                CancelToken::new(),
            )
            .wait()
    }

    fn stop(self) {
        self.leader.shutdown();
        for w in self.workers {
            w.join().unwrap().unwrap();
        }
    }
}

/// The failure of `out`, asserting which pairs landed and that the error
/// names a checksum mismatch.
fn failed_on_checksum(
    out: TransferOutcome,
    completed: &[(usize, usize)],
    failed: &[(usize, usize)],
) {
    let f = out.expect_err("a corrupted block must fail its copy");
    assert_eq!(f.completed, completed, "{f}");
    assert_eq!(f.failed, failed, "{f}");
    assert!(f.to_string().contains("checksum mismatch"), "{f}");
}

const SEEDS: [(u32, u64); 2] = [(1, 11), (2, 12)];

fn round_trips(world: u32, memory: Memory) {
    let i = start_on(world, true, memory);
    i.fill(&SEEDS);
    // G1 -> G2 -> G1.
    i.copy(Tier::G1, Tier::G2, &[(1, 10), (2, 11)]).unwrap();
    i.copy(Tier::G2, Tier::G1, &[(10, 3), (11, 4)]).unwrap();
    assert!(i.wrong(&[(3, 11), (4, 12)]).is_empty());
    // G2 -> G3 -> G1, G3 -> G2 -> G1, G2 -> G2.
    i.copy(Tier::G2, Tier::G3, &[(10, 5), (11, 6)]).unwrap();
    i.copy(Tier::G3, Tier::G1, &[(5, 7), (6, 8)]).unwrap();
    i.copy(Tier::G3, Tier::G2, &[(5, 20)]).unwrap();
    i.copy(Tier::G2, Tier::G2, &[(20, 21)]).unwrap();
    i.copy(Tier::G2, Tier::G1, &[(21, 9)]).unwrap();
    // G1 -> G3 -> G1 directly.
    i.copy(Tier::G1, Tier::G3, &[(2, 30)]).unwrap();
    i.copy(Tier::G3, Tier::G1, &[(30, 12)]).unwrap();
    assert!(
        i.wrong(&[(7, 11), (8, 12), (9, 11), (12, 12)]).is_empty(),
        "every round trip brings the bytes back"
    );
    // The check tells the patterns apart.
    assert_eq!(i.wrong(&[(7, 12)]), vec![7]);
    assert_eq!(i.mismatches(), 0);
    i.stop();
}

#[test]
fn verified_round_trips_keep_the_bytes_over_the_lent_route() {
    round_trips(1, Memory::Host);
}

#[test]
fn verified_round_trips_keep_the_bytes_over_the_socket() {
    round_trips(2, Memory::Host);
}

fn a_corrupted_g2_block_fails_its_onboard(world: u32, memory: Memory) {
    let i = start_on(world, true, memory);
    i.fill(&SEEDS);
    i.copy(Tier::G1, Tier::G2, &[(1, 10), (2, 11)]).unwrap();
    i.corrupt_g2(10);
    let out = i.copy(Tier::G2, Tier::G1, &[(10, 3), (11, 4)]);
    failed_on_checksum(out, &[(11, 4)], &[(10, 3)]);
    assert!(i.wrong(&[(4, 12)]).is_empty(), "the other block landed");
    assert_eq!(i.mismatches(), 1);
    // Nor does it reach G3; and a slot never written fails as well.
    let out = i.copy(Tier::G2, Tier::G3, &[(10, 5)]);
    failed_on_checksum(out, &[], &[(10, 5)]);
    let out = i.copy(Tier::G2, Tier::G1, &[(40, 6)]);
    failed_on_checksum(out, &[], &[(40, 6)]);
    // Counted on every rank that found it: the empty slot on each.
    let counted = 2 + u64::from(world);
    assert_eq!(i.mismatches(), counted);
    // Overwriting the slot records the new bytes' sum.
    i.copy(Tier::G1, Tier::G2, &[(1, 10)]).unwrap();
    i.copy(Tier::G2, Tier::G1, &[(10, 3)]).unwrap();
    assert!(i.wrong(&[(3, 11)]).is_empty());
    assert_eq!(i.mismatches(), counted);
    i.stop();
}

#[test]
fn a_corrupted_g2_block_fails_its_onboard_over_the_lent_route() {
    a_corrupted_g2_block_fails_its_onboard(1, Memory::Host);
}

#[test]
fn a_corrupted_g2_block_fails_its_onboard_over_the_socket() {
    a_corrupted_g2_block_fails_its_onboard(2, Memory::Host);
}

fn a_corrupted_g3_block_fails_its_onboard(world: u32, memory: Memory) {
    let i = start_on(world, true, memory);
    i.fill(&SEEDS);
    i.copy(Tier::G1, Tier::G2, &[(1, 10), (2, 11)]).unwrap();
    i.copy(Tier::G2, Tier::G3, &[(10, 5), (11, 6)]).unwrap();
    i.corrupt_g3(5);
    let out = i.copy(Tier::G3, Tier::G1, &[(5, 3), (6, 4)]);
    failed_on_checksum(out, &[(6, 4)], &[(5, 3)]);
    assert!(i.wrong(&[(4, 12)]).is_empty(), "the other block landed");
    assert_eq!(i.mismatches(), 1);
    // Into G2 as well; the G2 slot it went to is not trusted afterwards.
    let out = i.copy(Tier::G3, Tier::G2, &[(5, 20), (6, 21)]);
    failed_on_checksum(out, &[(6, 21)], &[(5, 20)]);
    let out = i.copy(Tier::G2, Tier::G1, &[(20, 7), (21, 8)]);
    failed_on_checksum(out, &[(21, 8)], &[(20, 7)]);
    assert!(i.wrong(&[(8, 12)]).is_empty());
    assert_eq!(i.mismatches(), 3);
    i.stop();
}

#[test]
fn a_corrupted_g3_block_fails_its_onboard_over_the_lent_route() {
    a_corrupted_g3_block_fails_its_onboard(1, Memory::Host);
}

#[test]
fn a_corrupted_g3_block_fails_its_onboard_over_the_socket() {
    a_corrupted_g3_block_fails_its_onboard(2, Memory::Host);
}

/// GPU 0, or a skip line (a failure with `KVBM_REQUIRE_GPU=1`).
#[cfg(feature = "cuda")]
fn gpu_or_skip() -> bool {
    let found = worker::device::device_at(0).is_some();
    if !found {
        assert!(
            std::env::var("KVBM_REQUIRE_GPU").as_deref() != Ok("1"),
            "KVBM_REQUIRE_GPU=1 but no CUDA device"
        );
        println!("skipped: no CUDA device");
    }
    found
}

/// With G1 on a GPU its side of each copy is summed there: round trips,
/// and corrupted G2 and G3 blocks refused on the way into GPU memory, over
/// both routes.
#[cfg(feature = "cuda")]
#[test]
fn blocks_bound_for_gpu_memory_are_checked_on_the_gpu() {
    if !gpu_or_skip() {
        return;
    }
    for world in [1, 2] {
        round_trips(world, Memory::Gpu);
        a_corrupted_g2_block_fails_its_onboard(world, Memory::Gpu);
        a_corrupted_g3_block_fails_its_onboard(world, Memory::Gpu);
    }
}

/// Verify mode is opt-in: without it nothing is summed and corrupted
/// bytes are served.
fn without_verify_corruption_goes_unnoticed(world: u32) {
    let i = start(world, false);
    i.fill(&SEEDS);
    i.copy(Tier::G1, Tier::G2, &[(1, 10), (2, 11)]).unwrap();
    i.copy(Tier::G2, Tier::G3, &[(11, 6)]).unwrap();
    i.corrupt_g2(10);
    i.corrupt_g3(6);
    i.copy(Tier::G2, Tier::G1, &[(10, 3)]).unwrap();
    i.copy(Tier::G3, Tier::G1, &[(6, 4)]).unwrap();
    // A slot never written is not refused either.
    i.copy(Tier::G2, Tier::G1, &[(40, 5)]).unwrap();
    assert_eq!(i.wrong(&[(3, 11), (4, 12)]), vec![3, 4]);
    assert_eq!(i.mismatches(), 0);
    i.stop();
}

#[test]
fn without_verify_corruption_goes_unnoticed_over_the_lent_route() {
    without_verify_corruption_goes_unnoticed(1);
}

#[test]
fn without_verify_corruption_goes_unnoticed_over_the_socket() {
    without_verify_corruption_goes_unnoticed(2);
}

/// The table alone: sums follow overwrites and failed copies.
#[test]
fn sums_are_replaced_on_overwrite_and_cleared_on_failure() {
    let l = Layout::new(shape(4), LayoutKind::FullyContiguous).unwrap();
    let g1 = End {
        tier: Tier::G1,
        layout: g1(4),
    };
    let g2 = End {
        tier: Tier::G2,
        layout: PhysicalLayout::allocate_system(l, &SystemAllocator::new()).unwrap(),
    };
    let sums = Checksums::new(&g1.layout, crate::verify::Tracked::ALL);
    let ok = || Ok(kvbm_transfer::TransferReport::default());
    let (out, n) = sums.settle(&g1, &g2, &[(0, 1)], ok());
    assert!(out.is_ok() && n == 0);
    let first = sums.get(Tier::G2, 1).unwrap();
    assert_eq!(Some(first), block_sum(&g2.layout, 1).ok());
    // Other bytes in the slot: a new sum.
    let chunk = g2.layout.layout().chunk(1, 0, 0).unwrap();
    let addr = g2.layout.regions()[0].addr().unwrap() + chunk.offset;
    // SAFETY: host memory owned by `g2.layout`, inside block 1's first
    // chunk; nothing else touches it.
    unsafe { (addr as *mut u8).write_volatile(0xEE) };
    let (out, _) = sums.settle(&g1, &g2, &[(0, 1)], ok());
    assert!(out.is_ok());
    assert_ne!(sums.get(Tier::G2, 1), Some(first));
    // A copy into the slot that failed: no sum.
    let failed = Err(Box::new(kvbm_transfer::TransferFailure {
        error: kvbm_transfer::TransferError::Cancelled,
        completed: Vec::new(),
        failed: vec![(0, 1)],
        culprit: None,
    }));
    let (out, n) = sums.settle(&g1, &g2, &[(0, 1)], failed);
    assert!(out.is_err() && n == 0);
    assert_eq!(sums.get(Tier::G2, 1), None);
    // Reading it now is a mismatch, not a pass.
    let (out, n) = sums.settle(&g2, &g1, &[(1, 0)], ok());
    assert_eq!(n, 1);
    assert!(out.unwrap_err().to_string().contains("checksum mismatch"));
    assert_eq!(sums.mismatches(), 1);
}

/// A read out of G3 into host memory cut into one-block pieces: each piece
/// is checked as it lands, and one damaged block fails alone.
#[test]
fn reads_checked_piece_by_piece_fail_only_the_damaged_block() {
    let dir = tempfile::tempdir().unwrap();
    let g1 = End {
        tier: Tier::G1,
        layout: g1(8),
    };
    let layout = Layout::new(
        shape(8).with_alignment(DISK_ALIGNMENT).unwrap(),
        LayoutKind::FullyContiguous,
    )
    .unwrap();
    let alloc = kvbm_transfer::memory::DiskAllocator::new(dir.path(), Default::default()).unwrap();
    let g3 = End {
        tier: Tier::G3,
        layout: PhysicalLayout::allocate_disk(layout, &alloc).unwrap(),
    };
    let executor = crate::worker::default_executor(&g1.layout).unwrap();
    executor.register(&g3.layout).unwrap();
    let sums = Arc::new(Checksums::new(&g1.layout, crate::verify::Tracked::ALL));
    // Distinct bytes in G1 blocks 0..4, written to G3 and summed there.
    for b in 0..4usize {
        let chunk = g1.layout.layout().chunk(b, 0, 0).unwrap();
        let addr = g1.layout.regions()[chunk.region].addr().unwrap() + chunk.offset;
        // SAFETY: host memory owned by `g1.layout`, inside block b's first
        // chunk; no copy runs.
        unsafe { (addr as *mut u8).write_volatile(b as u8 + 1) };
    }
    let to_g3: Vec<(usize, usize)> = (0..4).map(|b| (b, b)).collect();
    let landed = executor
        .transfer_with(&g1.layout, &g3.layout, &to_g3, CancelToken::new())
        .wait();
    let (out, _) = sums.settle(&g1, &g3, &to_g3, landed);
    out.unwrap();
    // Damage G3 block 2 on disk.
    let offset = g3.layout.layout().chunk(2, 1, 0).unwrap().offset + 5;
    let file = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_file())
        .unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    f.write_all_at(&[0x77], offset).unwrap();
    let back: Vec<(usize, usize)> = (0..4).map(|b| (b, b + 4)).collect();
    assert_eq!(pieces::piece_blocks(&g3, &g1, 1), 1);
    let (tx, rx) = std::sync::mpsc::channel();
    pieces::copy_in_pieces(
        &sums,
        &executor,
        g3.clone(),
        g1.clone(),
        back,
        1,
        CancelToken::new(),
        move |out, m| tx.send((out, m)).unwrap(),
    );
    let (out, mismatches) = rx.recv_timeout(Duration::from_secs(20)).unwrap();
    let f = out.unwrap_err();
    assert_eq!(mismatches, 1);
    assert_eq!(f.failed, vec![(2, 6)]);
    let mut completed = f.completed.clone();
    completed.sort_unstable();
    assert_eq!(completed, vec![(0, 4), (1, 5), (3, 7)]);
}
