//! Heap bytes per registered block: a pool of 1,000,000 blocks, every one
//! registered (cached, inactive), counted by a global allocator that tracks
//! live heap bytes. Also reports the peak after match/release churn, when
//! the eviction queue carries stale entries up to its compaction threshold.
//!
//! `cargo run --release -p kvbm-pool --example pool_memory`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use kvbm_block::SequenceHash;
use kvbm_pool::{BlockPool, EvictionKind, PoolConfig, Tier};

/// The system allocator, counting live and peak bytes.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator, which
// upholds GlobalAlloc's contract; the counters have no effect on memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
        PEAK.fetch_max(live, Relaxed);
        // SAFETY: the caller's layout contract is passed through as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        // SAFETY: `ptr` was allocated by `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let live = LIVE.fetch_add(new_size, Relaxed) + new_size;
        LIVE.fetch_sub(layout.size(), Relaxed);
        PEAK.fetch_max(live, Relaxed);
        // SAFETY: `ptr` was allocated by `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const BLOCKS: usize = 1_000_000;
const SEQ: usize = 128;

fn hash(i: usize) -> SequenceHash {
    SequenceHash((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn measure(label: &str, eviction: EvictionKind) {
    let base = LIVE.load(Relaxed);
    let pool =
        BlockPool::new(PoolConfig::new(BLOCKS, 16, Tier::G2).eviction(eviction)).expect("pool");
    let empty = LIVE.load(Relaxed) - base;
    let mut next = 0usize;
    while next < BLOCKS {
        let n = SEQ.min(BLOCKS - next);
        let blocks = pool.allocate(n).expect("allocate");
        let mut parent = None;
        let complete = blocks
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                let h = hash(next + i);
                let c = b.complete(h, parent).expect("complete");
                parent = Some(h);
                c
            })
            .collect();
        drop(pool.register(complete).expect("register"));
        next += n;
    }
    let counts = pool.counts();
    assert_eq!(counts.inactive, BLOCKS);
    let registered = LIVE.load(Relaxed) - base;

    PEAK.store(LIVE.load(Relaxed), Relaxed);
    let hashes: Vec<SequenceHash> = (0..BLOCKS).map(hash).collect();
    let hashes_bytes = LIVE.load(Relaxed) - base - registered;
    for round in 0..3 * BLOCKS / SEQ {
        let start = (round * 7919 % (BLOCKS / SEQ)) * SEQ;
        drop(pool.match_prefix(&hashes[start..start + SEQ]));
    }
    let churn_peak = PEAK.load(Relaxed) - base - hashes_bytes;
    println!(
        "{label}: empty pool {:.1} B/block, {BLOCKS} registered {:.1} B/block, \
         peak after match/release churn {:.1} B/block",
        empty as f64 / BLOCKS as f64,
        registered as f64 / BLOCKS as f64,
        churn_peak as f64 / BLOCKS as f64,
    );
    drop(hashes);
    drop(pool);
}

fn main() {
    measure("lru", EvictionKind::Lru);
    measure("leaf-first", EvictionKind::LeafFirst);
    measure("tinylfu", EvictionKind::Frequency { sample: 4 });
}
