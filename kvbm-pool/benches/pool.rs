//! Block pool hot paths: register cycle, prefix match (inactive, active,
#![allow(missing_docs)] // criterion_group! generates undocumented functions.
//! absent), eviction churn, two threads matching at once.
//!
//! Blocks are 16 tokens; sequence hashes are precomputed or made by one
//! multiply, so hashing is excluded from timing.
//!
//! `KVBM_BENCH_CLOCK=cpu` times the single-thread benches with the
//! thread's CPU time instead of wall time: on a shared, overloaded machine
//! wall time also counts the time other processes held the core.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use cpu_time::ThreadTime;
use criterion::{Bencher, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvbm_block::SequenceHash;
use kvbm_pool::{BlockPool, EvictionKind, ImmutableBlocks, PoolConfig, Tier};

const BLOCK: usize = 16;

/// Times `iters` runs of `work` with the chosen clock.
fn run(b: &mut Bencher<'_>, mut work: impl FnMut()) {
    let cpu = std::env::var("KVBM_BENCH_CLOCK").is_ok_and(|v| v == "cpu");
    b.iter_custom(|iters| {
        let (wall, thread) = (Instant::now(), ThreadTime::now());
        for _ in 0..iters {
            work();
        }
        if cpu {
            thread.elapsed()
        } else {
            wall.elapsed()
        }
    });
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Allocates, completes and registers one sequence of `hashes` (chained).
fn register_sequence(pool: &BlockPool, hashes: &[SequenceHash]) -> ImmutableBlocks {
    let blocks = pool.allocate(hashes.len()).expect("allocate");
    let mut parent = None;
    let complete = blocks
        .into_iter()
        .zip(hashes)
        .map(|(b, &h)| {
            let c = b.complete(h, parent).expect("complete");
            parent = Some(h);
            c
        })
        .collect();
    pool.register(complete).expect("register")
}

fn sequences(count: usize, len: usize, salt: u64) -> Vec<Vec<SequenceHash>> {
    (0..count)
        .map(|s| {
            (0..len)
                .map(|i| SequenceHash(mix((salt << 48) ^ ((s * len + i) as u64))))
                .collect()
        })
        .collect()
}

fn lru_pool(capacity: usize) -> BlockPool {
    BlockPool::new(PoolConfig::new(capacity, BLOCK, Tier::G2)).expect("pool")
}

fn bench_register_cycle(c: &mut Criterion) {
    let mut g = c.benchmark_group("register_cycle");
    const SEQ: usize = 128;
    g.throughput(Throughput::Elements(SEQ as u64));
    for (label, kind) in [
        ("lru", EvictionKind::Lru),
        ("leaf_first", EvictionKind::LeafFirst),
    ] {
        let pool =
            BlockPool::new(PoolConfig::new(65_536, BLOCK, Tier::G2).eviction(kind)).expect("pool");
        let mut counter = 0u64;
        let mut hashes = vec![SequenceHash(0); SEQ];
        g.bench_function(BenchmarkId::new(label, SEQ), |b| {
            run(b, || {
                for h in hashes.iter_mut() {
                    counter += 1;
                    *h = SequenceHash(counter.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                }
                drop(black_box(register_sequence(&pool, &hashes)));
            })
        });
    }
    g.finish();
}

fn bench_match(c: &mut Criterion) {
    let mut g = c.benchmark_group("match_inactive");
    for len in [8usize, 128, 1024] {
        let pool = lru_pool(65_536);
        let seqs = sequences(65_536 / len, len, 1);
        for s in &seqs {
            drop(register_sequence(&pool, s));
        }
        g.throughput(Throughput::Elements(len as u64));
        let mut next = 0usize;
        g.bench_function(BenchmarkId::from_parameter(len), |b| {
            run(b, || {
                next = (next + 7) % seqs.len();
                let hit = pool.match_prefix(&seqs[next]);
                debug_assert_eq!(hit.len(), len);
                drop(black_box(hit));
            })
        });
    }
    g.finish();

    // The same with every block at a random id (blocks allocated one at a
    // time across requests): the consecutive-id guess never hits.
    let mut g = c.benchmark_group("match_inactive_scattered");
    {
        use rand::seq::SliceRandom;
        let len = 128;
        let pool = lru_pool(65_536);
        let seqs = sequences(65_536 / len, len, 6);
        let mut blocks = pool.allocate(65_536).expect("allocate");
        blocks.shuffle(&mut rand::rng());
        for s in &seqs {
            let mut parent = None;
            let complete = blocks
                .drain(..len)
                .zip(s)
                .map(|(b, &h)| {
                    let c = b.complete(h, parent).expect("complete");
                    parent = Some(h);
                    c
                })
                .collect();
            drop(pool.register(complete).expect("register"));
        }
        g.throughput(Throughput::Elements(len as u64));
        let mut next = 0usize;
        g.bench_function(BenchmarkId::from_parameter(len), |b| {
            run(b, || {
                next = (next + 7) % seqs.len();
                drop(black_box(pool.match_prefix(&seqs[next])));
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("match_active");
    let len = 128;
    let pool = lru_pool(65_536);
    let seqs = sequences(65_536 / len, len, 2);
    let held: Vec<_> = seqs.iter().map(|s| register_sequence(&pool, s)).collect();
    g.throughput(Throughput::Elements(len as u64));
    let mut next = 0usize;
    g.bench_function(BenchmarkId::from_parameter(len), |b| {
        run(b, || {
            next = (next + 7) % seqs.len();
            drop(black_box(pool.match_prefix(&seqs[next])));
        })
    });
    drop(held);
    g.finish();

    let mut g = c.benchmark_group("match_absent");
    let absent = sequences(1024, 128, 3);
    let mut next = 0usize;
    g.bench_function("first_hash_absent", |b| {
        run(b, || {
            next = (next + 1) % absent.len();
            drop(black_box(pool.match_prefix(&absent[next])));
        })
    });
    // The same absent prefix every time: its table slot stays in cache.
    g.bench_function("first_hash_absent_hot", |b| {
        run(b, || {
            drop(black_box(pool.match_prefix(black_box(&absent[0]))))
        })
    });
    g.finish();
}

fn bench_churn(c: &mut Criterion) {
    let mut g = c.benchmark_group("eviction_churn");
    const SEQ: usize = 64;
    g.throughput(Throughput::Elements(SEQ as u64));
    for (label, kind) in [
        ("lru", EvictionKind::Lru),
        ("leaf_first", EvictionKind::LeafFirst),
        ("tinylfu", EvictionKind::Frequency { sample: 4 }),
    ] {
        let pool =
            BlockPool::new(PoolConfig::new(16_384, BLOCK, Tier::G2).eviction(kind)).expect("pool");
        for s in sequences(16_384 / SEQ, SEQ, 4) {
            drop(register_sequence(&pool, &s));
        }
        let mut counter = 1u64 << 40;
        let mut hashes = vec![SequenceHash(0); SEQ];
        g.bench_function(BenchmarkId::new(label, SEQ), |b| {
            run(b, || {
                for h in hashes.iter_mut() {
                    counter += 1;
                    *h = SequenceHash(counter.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                }
                drop(black_box(register_sequence(&pool, &hashes)));
            })
        });
    }
    g.finish();
}

/// Runs `iters` match+drop cycles on each of `threads` threads (disjoint
/// prefixes) and returns the time per cycle of the aggregate: wall time
/// divided by the thread count, or with `KVBM_BENCH_CLOCK=cpu` the longest
/// thread CPU time divided by the thread count — what the wall time would
/// be with a core per thread (it counts cache-line bouncing and spinning,
/// not time parked on a lock; the match path parks only behind a writer).
fn threaded_matches(
    pool: &BlockPool,
    seqs: &[Vec<SequenceHash>],
    threads: usize,
    iters: u64,
) -> Duration {
    let cpu = std::env::var("KVBM_BENCH_CLOCK").is_ok_and(|v| v == "cpu");
    let barrier = Barrier::new(threads + 1);
    // Every thread, also a lone one, cycles over the same number of
    // prefixes, so the working set per thread is the same in both runs.
    let per = seqs.len() / 2;
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let mine = &seqs[t * per..(t + 1) * per];
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    let clock = ThreadTime::now();
                    let mut next = 0usize;
                    for _ in 0..iters {
                        next = (next + 7) % mine.len();
                        drop(black_box(pool.match_prefix(&mine[next])));
                    }
                    let spent = clock.elapsed();
                    barrier.wait();
                    spent
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        barrier.wait();
        let wall = start.elapsed();
        let busiest = workers
            .into_iter()
            .map(|w| w.join().expect("worker"))
            .max()
            .unwrap_or_default();
        (if cpu { busiest } else { wall }) / threads as u32
    })
}

fn bench_threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("match_threads");
    for len in [128usize, 8] {
        let pool = lru_pool(65_536);
        let seqs = sequences(65_536 / len, len, 5);
        for s in &seqs {
            drop(register_sequence(&pool, s));
        }
        g.throughput(Throughput::Elements(len as u64));
        for threads in [1usize, 2] {
            g.bench_function(BenchmarkId::new(format!("L{len}"), threads), |b| {
                b.iter_custom(|iters| threaded_matches(&pool, &seqs, threads, iters))
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench_register_cycle, bench_match, bench_churn, bench_threads
}
criterion_main!(benches);
