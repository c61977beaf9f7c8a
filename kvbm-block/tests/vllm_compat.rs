//! The vllm-sha256 scheme against vectors produced by vLLM 0.33's own code
//! (`kvbm-testkit/scripts/vllm_hash_vectors.py` runs it out of the wheel).

use kvbm_block::hash::{
    CborValue, VllmMmFeature, encode_canonical, vllm_hash_block, vllm_none_hash,
};
use kvbm_block::{PageSize, SequenceDigest, Token, TokenBlockSequence, VllmBlockHash, VllmSha256};
use serde_json::Value;

const VECTORS: &str = include_str!("data/vllm_hash_vectors.json");

fn vectors() -> Value {
    serde_json::from_str(VECTORS).expect("vector file is valid JSON")
}

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
}

fn hash32(s: &str) -> VllmBlockHash {
    VllmBlockHash(unhex(s).try_into().expect("32-byte hash"))
}

/// Decodes the script's typed JSON (`{"t": kind, "v": value}`).
fn value(v: &Value) -> CborValue {
    let body = &v["v"];
    match v["t"].as_str().expect("tag") {
        "none" => CborValue::Null,
        "bool" => CborValue::Bool(body.as_bool().expect("bool")),
        "int" => CborValue::Int(body.as_str().expect("int text").parse().expect("i128")),
        "str" => CborValue::Text(body.as_str().expect("text").to_owned()),
        "bytes" => CborValue::Bytes(unhex(body.as_str().expect("hex"))),
        "array" => CborValue::Array(body.as_array().expect("array").iter().map(value).collect()),
        other => panic!("unknown tag {other}"),
    }
}

fn tokens(v: &Value) -> Vec<Token> {
    v.as_array()
        .expect("token list")
        .iter()
        .map(|t| Token::try_from(t.as_u64().expect("token")).expect("u32 token"))
        .collect()
}

fn seed(v: &Value) -> &str {
    v.as_str().unwrap_or("vllm-none-hash")
}

#[test]
fn canonical_cbor_matches_cbor2() {
    let data = vectors();
    let cases = data["cbor"].as_array().unwrap();
    assert!(cases.len() > 40);
    for case in cases {
        let mut out = Vec::new();
        encode_canonical(&value(&case["value"]), &mut out);
        assert_eq!(out, unhex(case["hex"].as_str().unwrap()), "{case}");
    }
}

#[test]
fn none_hash_matches_vllm_for_every_seed() {
    let data = vectors();
    for case in data["none_hash"].as_array().unwrap() {
        let expected = hash32(case["hash"].as_str().unwrap());
        assert_eq!(vllm_none_hash(seed(&case["seed"])), expected, "{case}");
        let scheme = if case["seed"].is_null() {
            VllmSha256::default()
        } else {
            VllmSha256::with_seed(seed(&case["seed"]))
        };
        assert_eq!(scheme.none_hash(), &expected);
    }
}

#[test]
fn block_hashes_match_vllm_hash_block_tokens() {
    let data = vectors();
    let cases = data["blocks"].as_array().unwrap();
    assert!(cases.len() >= 60);
    for case in cases {
        let none_hash = vllm_none_hash(seed(&case["seed"]));
        assert_eq!(none_hash, hash32(case["none_hash"].as_str().unwrap()));
        let parent = match case["parent"].as_str() {
            Some(h) => hash32(h),
            None => none_hash,
        };
        let extra = value(&case["extra_keys"]);
        let extra = (extra != CborValue::Null).then_some(extra);
        let got = vllm_hash_block(&parent, &tokens(&case["tokens"]), extra.as_ref());
        assert_eq!(got, hash32(case["hash"].as_str().unwrap()), "{case}");
    }
}

#[test]
fn request_hashes_match_vllm_request_block_hasher() {
    let data = vectors();
    let cases = data["sequences"].as_array().unwrap();
    let mut blocks_checked = 0;
    let mut mm_blocks_checked = 0;
    for case in cases {
        let mut scheme = VllmSha256::with_seed(seed(&case["seed"]));
        if let Some(lora) = case["lora"].as_array() {
            scheme = scheme.with_lora(lora[0].as_str().unwrap(), lora[1].as_str().unwrap());
        }
        if let Some(salt) = case["cache_salt"].as_str() {
            scheme = scheme.with_cache_salt(salt);
        }
        let features: Vec<VllmMmFeature> = case["mm"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| VllmMmFeature {
                identifier: m[0].as_str().unwrap().to_owned(),
                offset: m[1].as_u64().unwrap() as usize,
                length: m[2].as_u64().unwrap() as usize,
            })
            .collect();
        scheme = scheme.with_mm_features(&features).unwrap();
        let page = PageSize::new(case["page_size"].as_u64().unwrap() as u32).unwrap();
        let toks = tokens(&case["tokens"]);
        let sequence = TokenBlockSequence::from_tokens(scheme, page, &toks);

        let expected: Vec<VllmBlockHash> = case["hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| hash32(h.as_str().unwrap()))
            .collect();
        let got: Vec<VllmBlockHash> = sequence.blocks().map(|b| *b.digest()).collect();
        assert_eq!(got, expected, "{case}");
        for (block, hash) in sequence.blocks().zip(&expected) {
            assert_eq!(block.sequence_hash(), hash.sequence_hash());
        }
        blocks_checked += expected.len();
        if !features.is_empty() {
            mm_blocks_checked += expected.len();
        }
    }
    assert!(blocks_checked >= 100, "only {blocks_checked} blocks");
    assert!(
        mm_blocks_checked >= 20,
        "only {mm_blocks_checked} multimodal blocks"
    );
}
