//! Cost of naming blocks: ns per complete block for each hash scheme, at
//! page sizes 16 and 512, beside a reference measured in the same run
//! (`dynamo-tokens` for dynamo-xxh3; a bare SHA-256 of the same CBOR bytes
//! for vllm-sha256, the floor any implementation of that scheme pays).
//!
//! Run: `cargo bench -p kvbm-block --bench hash`

use criterion::{BenchmarkId, Criterion, Throughput, criterion_main};
use kvbm_block::hash::{CborValue, encode_canonical, vllm_none_hash};
use kvbm_block::{
    DynamoXxh3, PageSize, SequenceHash, SequenceHasher, Token, TokenBlockSequence, VllmSha256,
};
use sha2::{Digest, Sha256};
use std::hint::black_box;
use std::time::Duration;

const PAGES: [u32; 2] = [16, 512];

/// Tokens spread like a real vocabulary (ids up to ~150k).
fn tokens(n: usize) -> Vec<Token> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 150_000) as Token
        })
        .collect()
}

fn one_block(c: &mut Criterion) {
    let mut group = c.benchmark_group("hash_block");
    group.throughput(Throughput::Elements(1));
    for page in PAGES {
        let block = tokens(page as usize);

        let xxh3 = DynamoXxh3::new(b"lora:sql|salt:tenant-7");
        let parent = SequenceHash(0x1234_5678_9abc_def0);
        group.bench_function(BenchmarkId::new("kvbm-dynamo-xxh3", page), |b| {
            b.iter(|| xxh3.hash_block(1, Some(black_box(&parent)), black_box(&block)))
        });
        let salt = xxh3.salt_hash();
        group.bench_function(BenchmarkId::new("ref-dynamo-tokens", page), |b| {
            b.iter(|| {
                let bh = dynamo_tokens::compute_block_hash_for_tokens(black_box(&block), salt);
                dynamo_tokens::compute_next_sequence_hash(black_box(parent.0), bh)
            })
        });

        let vllm = VllmSha256::default();
        let vparent = vllm_none_hash("parent");
        group.bench_function(BenchmarkId::new("kvbm-vllm-sha256", page), |b| {
            b.iter(|| vllm.hash_block(1, Some(black_box(&vparent)), black_box(&block)))
        });
        let mut encoded = Vec::new();
        let value = CborValue::Array(vec![
            CborValue::Bytes(vparent.0.to_vec()),
            CborValue::Array(block.iter().map(|&t| CborValue::Int(t.into())).collect()),
            CborValue::Null,
        ]);
        encode_canonical(&value, &mut encoded);
        group.bench_function(BenchmarkId::new("ref-sha256-of-cbor-bytes", page), |b| {
            b.iter(|| Sha256::digest(black_box(&encoded)))
        });
    }
    group.finish();
}

/// A whole 8192-token prompt through a sequence, reported per block.
fn prompt(c: &mut Criterion) {
    let mut group = c.benchmark_group("sequence_from_tokens_8192");
    let prompt = tokens(8192);
    for page in PAGES {
        let page_size = PageSize::new(page).unwrap_or_else(|e| panic!("{e}"));
        group.throughput(Throughput::Elements(u64::from(8192 / page)));
        group.bench_function(BenchmarkId::new("kvbm-dynamo-xxh3", page), |b| {
            b.iter(|| {
                TokenBlockSequence::from_tokens(
                    DynamoXxh3::default(),
                    page_size,
                    black_box(&prompt),
                )
            })
        });
        group.bench_function(BenchmarkId::new("ref-dynamo-tokens", page), |b| {
            b.iter(|| {
                dynamo_tokens::TokenBlockSequence::new(
                    black_box(prompt.as_slice()).into(),
                    page,
                    None,
                )
            })
        });
        group.bench_function(BenchmarkId::new("kvbm-vllm-sha256", page), |b| {
            b.iter(|| {
                TokenBlockSequence::from_tokens(
                    VllmSha256::default(),
                    page_size,
                    black_box(&prompt),
                )
            })
        });
    }
    group.finish();
}

fn config() -> Criterion {
    // Short runs: the machine is shared with other builds; repeat the whole
    // bench for spread instead.
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}

/// The macro-generated group function carries no doc comment.
#[allow(missing_docs)]
mod groups {
    use super::{config, one_block, prompt};
    criterion::criterion_group! {
        name = benches;
        config = config();
        targets = one_block, prompt
    }
}
criterion_main!(groups::benches);
