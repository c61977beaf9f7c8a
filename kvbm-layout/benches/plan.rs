//! Copy-planning cost per block, for the shapes an offload actually plans.
//!
//! Block shape: 32 layers, K and V, 16 tokens of 8 heads x 128 bf16 values
//! (64 chunks of 32 KiB, 2 MiB per block). Planning must cost far less than
//! the copy it plans. Each case runs twice: `plan_copy` measures wall time
//! (criterion's default), `plan_copy_cpu` measures the planning thread's CPU
//! time, which stays meaningful when the machine is shared with builds.
//! Throughput lines read as ns per block. `reference/memcpy_one_block`
//! copies one block's bytes with memcpy, to put the planning cost next to the
//! copy it plans.

#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::hint::black_box;

use cpu_time::ThreadTime;
use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind, plan_copy};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::index::sample;

const BLOCKS: usize = 16_384;
const PAIRS: usize = 4096;

/// CPU time of the calling thread, in nanoseconds.
struct ThreadCpu;

/// Formats nanoseconds, and throughput as nanoseconds per element (block).
struct PerBlock;

impl ValueFormatter for PerBlock {
    fn scale_values(&self, _typical: f64, _values: &mut [f64]) -> &'static str {
        "ns"
    }

    fn scale_throughputs(
        &self,
        _typical: f64,
        throughput: &Throughput,
        values: &mut [f64],
    ) -> &'static str {
        let n = match *throughput {
            Throughput::Elements(n) | Throughput::Bytes(n) | Throughput::BytesDecimal(n) => n,
            Throughput::Bits(n) => n,
        };
        for v in values {
            *v /= n.max(1) as f64;
        }
        "ns/block"
    }

    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ns"
    }
}

impl Measurement for ThreadCpu {
    type Intermediate = ThreadTime;
    type Value = f64;

    fn start(&self) -> ThreadTime {
        ThreadTime::now()
    }
    fn end(&self, start: ThreadTime) -> f64 {
        start.elapsed().as_nanos() as f64
    }
    fn add(&self, a: &f64, b: &f64) -> f64 {
        a + b
    }
    fn zero(&self) -> f64 {
        0.0
    }
    fn to_f64(&self, value: &f64) -> f64 {
        *value
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &PerBlock
    }
}

fn layout(kind: LayoutKind) -> Layout {
    let config = LayoutConfig::new(BLOCKS, 32, 2, 16, 8 * 128, 2).expect("valid bench config");
    Layout::new(config, kind).expect("valid bench layout")
}

/// `n` pairs of distinct random source and distinct random destination
/// blocks, in random order.
fn random_pairs(n: usize, seed: u64) -> Vec<(usize, usize)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let src = sample(&mut rng, BLOCKS, n);
    let dst = sample(&mut rng, BLOCKS, n);
    src.iter().zip(dst.iter()).collect()
}

/// One benchmark: name, source layout, destination layout, block pairs.
type Case<'a> = (&'a str, &'a Layout, &'a Layout, &'a [(usize, usize)]);

fn run_cases<M: Measurement>(c: &mut Criterion<M>, group_name: &str) {
    let fc = layout(LayoutKind::FullyContiguous);
    let block_first = layout(LayoutKind::LayerSeparate(BlockOrder::BlockFirst));
    let outer_first = layout(LayoutKind::LayerSeparate(BlockOrder::OuterFirst));
    let random = random_pairs(PAIRS, 7);
    let mut random_sorted = random.clone();
    random_sorted.sort_unstable_by_key(|&(_, d)| d);
    let consecutive: Vec<(usize, usize)> = (0..PAIRS).map(|i| (100 + i, 2000 + i)).collect();

    let cases: [Case<'_>; 6] = [
        ("ls_block_first_to_fc/random", &block_first, &fc, &random),
        (
            "ls_block_first_to_fc/random_dst_sorted",
            &block_first,
            &fc,
            &random_sorted,
        ),
        ("ls_outer_first_to_fc/random", &outer_first, &fc, &random),
        ("fc_to_ls_outer_first/random", &fc, &outer_first, &random),
        ("fc_to_fc/consecutive", &fc, &fc, &consecutive),
        (
            "ls_block_first_to_fc/one_block",
            &block_first,
            &fc,
            &random[..1],
        ),
    ];
    let mut group = c.benchmark_group(group_name);
    for (name, src, dst, pairs) in cases {
        group.throughput(Throughput::Elements(pairs.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &pairs, |b, pairs| {
            b.iter(|| plan_copy(black_box(src), black_box(dst), black_box(pairs)))
        });
    }
    // The reference: copying one block's bytes (counted from the layout)
    // host to host with memcpy, the cheapest copy a plan can lead to here.
    let block_bytes = fc.config().block_bytes() as usize;
    let from = vec![0x5au8; block_bytes];
    let mut to = vec![0u8; block_bytes];
    group.throughput(Throughput::Elements(1));
    group.bench_function("reference/memcpy_one_block", |b| {
        b.iter(|| to.copy_from_slice(black_box(&from)))
    });
    group.finish();
}

fn wall(c: &mut Criterion<WallTime>) {
    run_cases(c, "plan_copy");
}

fn cpu(c: &mut Criterion<ThreadCpu>) {
    run_cases(c, "plan_copy_cpu");
}

criterion_group!(
    name = wall_time;
    config = Criterion::default();
    targets = wall
);
criterion_group!(
    name = cpu_time;
    config = Criterion::default().with_measurement(ThreadCpu);
    targets = cpu
);
criterion_main!(wall_time, cpu_time);
