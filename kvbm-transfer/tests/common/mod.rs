//! Helpers shared by the integration tests: host layouts filled with
//! random bytes, snapshots, and byte-exact checks of a copy.
#![allow(dead_code)]

use std::ops::Range;

use kvbm_layout::Layout;
use kvbm_transfer::memory::{DiskAllocator, DiskOptions, IoMode, SystemAllocator};
use kvbm_transfer::{Executor, MemoryRegion, PhysicalLayout};
use rand::{Rng, SeedableRng, rngs::StdRng};

pub fn host(layout: Layout) -> PhysicalLayout {
    PhysicalLayout::allocate_system(layout, &SystemAllocator::new()).unwrap()
}

#[allow(clippy::mut_from_ref)]
fn bytes_mut(r: &MemoryRegion) -> &mut [u8] {
    let addr = r.addr().expect("host region");
    // SAFETY: test regions are system allocations kept alive by `r`; the
    // tests only touch them while no transfer runs.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, r.len() as usize) }
}

pub fn fill(p: &PhysicalLayout, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    for r in p.regions().iter() {
        rng.fill(bytes_mut(r));
    }
}

pub fn snapshot(p: &PhysicalLayout) -> Vec<Vec<u8>> {
    p.regions().iter().map(|r| bytes_mut(r).to_vec()).collect()
}

fn chunk_range(layout: &Layout, block: usize, layer: usize, outer: usize) -> (usize, Range<usize>) {
    let c = layout.chunk(block, layer, outer).unwrap();
    (c.region, c.offset as usize..(c.offset + c.len) as usize)
}

/// Checks that every chunk of every pair arrived byte for byte and that no
/// other destination byte changed.
pub fn assert_copied(
    src: &Layout,
    src_snap: &[Vec<u8>],
    dst: &Layout,
    dst_before: &[Vec<u8>],
    dst_after: &[Vec<u8>],
    pairs: &[(usize, usize)],
) {
    let cfg = src.config();
    let mut expected = dst_before.to_vec();
    for &(s, d) in pairs {
        for layer in 0..cfg.num_layers() {
            for outer in 0..cfg.outer_dim() {
                let (sr, srange) = chunk_range(src, s, layer, outer);
                let (dr, drange) = chunk_range(dst, d, layer, outer);
                expected[dr][drange].copy_from_slice(&src_snap[sr][srange]);
            }
        }
    }
    for (r, (want, got)) in expected.iter().zip(dst_after).enumerate() {
        if want != got {
            let at = want.iter().zip(got).position(|(a, b)| a != b).unwrap();
            panic!("destination region {r} differs first at byte {at}");
        }
    }
}

/// Checks only that the chunks of `pairs` match the source.
pub fn assert_blocks_match(
    src: &Layout,
    src_snap: &[Vec<u8>],
    dst: &Layout,
    dst_snap: &[Vec<u8>],
    pairs: &[(usize, usize)],
) {
    let cfg = src.config();
    for &(s, d) in pairs {
        for layer in 0..cfg.num_layers() {
            for outer in 0..cfg.outer_dim() {
                let (sr, srange) = chunk_range(src, s, layer, outer);
                let (dr, drange) = chunk_range(dst, d, layer, outer);
                assert!(
                    src_snap[sr][srange] == dst_snap[dr][drange],
                    "block {s} -> {d} (layer {layer}, outer {outer}) differs"
                );
            }
        }
    }
}

pub fn bench_dir() -> std::path::PathBuf {
    let dir = std::env::var_os("KVBM_TEST_DIR")
        .map(Into::into)
        .unwrap_or_else(|| std::env::temp_dir().join("kvbm-transfer-tests"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A disk allocator opening files with `io_mode` in `bench_dir()/sub`
/// (`sub` empty: `bench_dir()` itself).
pub fn disk_allocator(sub: &str, io_mode: IoMode) -> DiskAllocator {
    let options = DiskOptions {
        io_mode,
        ..Default::default()
    };
    DiskAllocator::new(bench_dir().join(sub), options).unwrap()
}

/// Reads `read` from `from` into the host layout `back`, then checks that
/// `back` holds `src`'s blocks where `pairs` (src block → back block) put
/// them and is unchanged everywhere else.
pub fn read_back_and_check(
    exec: &Executor,
    from: &PhysicalLayout,
    read: &[(usize, usize)],
    back: &PhysicalLayout,
    src: &PhysicalLayout,
    pairs: &[(usize, usize)],
) {
    let before = snapshot(back);
    exec.transfer(from, back, read).wait().unwrap();
    assert_copied(
        src.layout(),
        &snapshot(src),
        back.layout(),
        &before,
        &snapshot(back),
        pairs,
    );
}
