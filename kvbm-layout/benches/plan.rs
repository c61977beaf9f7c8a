//! Copy-planning cost per block, for the shapes an offload actually plans.
//!
//! Block shape: 32 layers, K and V, 16 tokens of 8 heads x 128 bf16 values
//! (64 chunks of 32 KiB, 2 MiB per block). Planning must cost far less than
//! the copy it plans; the figures are read as ns per block (criterion's
//! throughput in elements = blocks).

#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind, plan_copy};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::index::sample;

const BLOCKS: usize = 16_384;
const PAIRS: usize = 4096;

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

fn bench_plans(c: &mut Criterion) {
    let fc = layout(LayoutKind::FullyContiguous);
    let block_first = layout(LayoutKind::LayerSeparate(BlockOrder::BlockFirst));
    let outer_first = layout(LayoutKind::LayerSeparate(BlockOrder::OuterFirst));
    let random = random_pairs(PAIRS, 7);
    let mut random_sorted = random.clone();
    random_sorted.sort_unstable_by_key(|&(_, d)| d);
    let consecutive: Vec<(usize, usize)> = (0..PAIRS).map(|i| (100 + i, 2000 + i)).collect();

    let mut group = c.benchmark_group("plan_copy");
    let cases: [Case<'_>; 6] = [
        ("ls_block_first_to_fc/random", &block_first, &fc, &random),
        (
            "ls_block_first_to_fc/random_dst_sorted",
            &block_first,
            &fc,
            &random_sorted,
        ),
        ("ls_outer_first_to_fc/random", &outer_first, &fc, &random),
        ("fc_to_ls_block_first/random", &fc, &block_first, &random),
        ("fc_to_fc/consecutive", &fc, &fc, &consecutive),
        (
            "ls_block_first_to_fc/one_block",
            &block_first,
            &fc,
            &random[..1],
        ),
    ];
    for (name, src, dst, pairs) in cases {
        group.throughput(Throughput::Elements(pairs.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &pairs, |b, pairs| {
            b.iter(|| plan_copy(black_box(src), black_box(dst), black_box(pairs)))
        });
    }
    group.finish();
}

criterion_group!(
    name = benches;
    config = Criterion::default();
    targets = bench_plans
);
criterion_main!(benches);
