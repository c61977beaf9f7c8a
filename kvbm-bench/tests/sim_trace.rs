//! Mooncake reader errors and the synthetic workload's guarantees.

use std::io::Cursor;

use kvbm_bench::sim::{LruSim, replay};
use kvbm_testkit::trace::{
    ChainError, ChainValidator, LineError, MOONCAKE_BLOCK_TOKENS, MooncakeReader, Request,
    SyntheticConfig, TraceError, TraceFacts, generate_synthetic,
};

mod sim_support;

fn read(text: &str) -> Vec<Result<Request, TraceError>> {
    MooncakeReader::new(Cursor::new(text.to_owned()), "t.jsonl").collect()
}

#[test]
fn reads_requests_and_skips_blank_lines() {
    let out = read(
        "{\"timestamp\": 5, \"input_length\": 1025, \"output_length\": 7, \"hash_ids\": [1, 2, 3]}\n\n\
         {\"timestamp\": 9, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [1], \"extra\": true}\n",
    );
    let reqs: Vec<Request> = out.into_iter().map(Result::unwrap).collect();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].hash_ids, vec![1, 2, 3]);
    assert_eq!(reqs[0].timestamp_ms, 5);
    assert!(reqs[0].last_block_partial(MOONCAKE_BLOCK_TOKENS));
    assert!(!reqs[1].last_block_partial(MOONCAKE_BLOCK_TOKENS));
    assert_eq!(reqs[0].full_blocks(MOONCAKE_BLOCK_TOKENS), 2);
    assert_eq!(reqs[1].full_blocks(MOONCAKE_BLOCK_TOKENS), 1);
}

#[test]
fn malformed_line_names_file_line_and_problem() {
    let out = read(
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n\
         {\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1}\n\
         {\"timestamp\": 2, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n",
    );
    assert_eq!(out.len(), 2, "the reader stops at the first bad line");
    let err = out[1].as_ref().unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("t.jsonl:2: "), "{msg}");
    assert!(msg.contains("hash_ids"), "{msg}");
    assert!(matches!(
        err,
        TraceError::Line {
            line: 2,
            error: LineError::Json(_),
            ..
        }
    ));
}

#[test]
fn block_count_mismatch_is_rejected() {
    let out = read(
        "{\"timestamp\": 0, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [4]}\n",
    );
    let err = out[0].as_ref().unwrap_err();
    assert!(matches!(
        err,
        TraceError::Line {
            line: 1,
            error: LineError::BlockCount {
                expected: 2,
                found: 1,
                ..
            },
            ..
        }
    ));
    assert!(err.to_string().contains("needs 2 blocks"), "{err}");
}

/// The error of the first bad line of `text`, as the reader words it.
fn first_error(text: &str) -> TraceError {
    read(text)
        .into_iter()
        .find_map(Result::err)
        .expect("the trace is rejected")
}

fn line(ts: u64, input: u64, ids: &str) -> String {
    format!(
        "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": 1, \"hash_ids\": [{ids}]}}\n"
    )
}

#[test]
fn an_empty_trace_is_an_error() {
    for text in ["", "\n\n  \n"] {
        let e = first_error(text);
        assert!(matches!(e, TraceError::Empty { .. }), "{e}");
        assert!(e.to_string().starts_with("t.jsonl: no requests"), "{e}");
    }
}

#[test]
fn contradicting_chains_name_both_lines() {
    // The same id at every position.
    let e = first_error(&(line(0, 1024, "7, 1") + &line(1, 1024, "3, 7")));
    assert!(
        matches!(
            e,
            TraceError::Line {
                line: 2,
                error: LineError::Chain(ChainError::Position {
                    id: 7,
                    position: 1,
                    first_line: 1,
                    first_position: 0
                }),
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().starts_with("t.jsonl:2: hash id 7"), "{e}");
    // One position, two parents (a shifted chain).
    let e = first_error(&(line(0, 1536, "0, 1, 2") + "\n" + &line(0, 1536, "0, 5, 2")));
    assert!(
        matches!(
            e,
            TraceError::Line {
                line: 3,
                error: LineError::Chain(ChainError::Parent {
                    id: 2,
                    parent: 5,
                    first_parent: 1,
                    ..
                }),
                ..
            }
        ),
        "{e}"
    );
    // Within one line.
    let e = first_error(&line(0, 1536, "4, 4, 4"));
    assert!(e.to_string().contains("t.jsonl:1: hash id 4"), "{e}");
    // Time runs forward.
    let e = first_error(&(line(9, 512, "0") + &line(8, 512, "0")));
    assert!(e.to_string().contains("arrival order"), "{e}");
}

#[test]
fn impossible_numbers_name_their_field() {
    for (text, want) in [
        (
            line(0, 1024, "0, -1"),
            "t.jsonl:1: hash_ids[1] is -1, not a non-negative integer",
        ),
        (line(0, 1024, "0, 1.5"), "hash_ids[1] is 1.5"),
        (line(0, 0, ""), "input_length is 0"),
        (line(0, 4294967296, "0"), "input_length is 4294967296"),
        (
            "{\"timestamp\": -3, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}"
                .into(),
            "timestamp is -3",
        ),
        (
            line(0, 100, "0, 1"),
            "needs 1 blocks of 512 tokens, hash_ids has 2",
        ),
    ] {
        let e = first_error(&text).to_string();
        assert!(e.contains(want), "{text}: {e}");
    }
    // A wrong type keeps serde's words, without its in-line position.
    let e = first_error("{\"timestamp\": 0, \"input_length\": \"x\"}").to_string();
    assert!(e.contains("(column") && !e.contains("at line"), "{e}");
}

#[test]
fn published_traces_and_the_synthetic_workload_are_consistent() {
    for name in ["conversation", "synthetic"] {
        if let Some((requests, _)) = sim_support::load(name) {
            assert!(!requests.is_empty(), "{name}");
        }
    }
    let mut v = ChainValidator::new();
    for (i, r) in generate_synthetic(&SyntheticConfig::default())
        .iter()
        .enumerate()
    {
        v.check(i + 1, r).unwrap();
    }
}

#[test]
fn missing_file_is_an_io_error_naming_it() {
    let err = MooncakeReader::open("/nonexistent/trace.jsonl").unwrap_err();
    assert!(matches!(err, TraceError::Io { .. }));
    assert!(err.to_string().contains("/nonexistent/trace.jsonl"));
}

#[test]
fn synthetic_is_deterministic_and_seed_sensitive() {
    let cfg = SyntheticConfig::default();
    let a = generate_synthetic(&cfg);
    assert_eq!(a, generate_synthetic(&cfg));
    let b = generate_synthetic(&SyntheticConfig {
        seed: cfg.seed + 1,
        ..cfg.clone()
    });
    assert_ne!(a, b);
}

#[test]
fn synthetic_requests_are_well_formed_and_sorted() {
    let cfg = SyntheticConfig::default();
    let reqs = generate_synthetic(&cfg);
    assert!(reqs.len() > 1_000, "{}", reqs.len());
    for w in reqs.windows(2) {
        assert!(w[0].timestamp_ms <= w[1].timestamp_ms);
    }
    for r in &reqs {
        assert_eq!(
            r.hash_ids.len(),
            Request::blocks_for(r.input_length, cfg.block_tokens)
        );
    }
}

#[test]
fn synthetic_turns_extend_earlier_prompts() {
    // Every request after the first turn of its conversation starts with
    // all full blocks of an earlier request: look for the longest earlier
    // prompt sharing the first non-system block.
    let cfg = SyntheticConfig::default();
    let reqs = generate_synthetic(&cfg);
    let sys = cfg.system_prompt_blocks as usize;
    let mut by_first_user_block = std::collections::HashMap::new();
    let mut followups = 0;
    for r in &reqs {
        let full = r.input_length as usize / cfg.block_tokens as usize;
        let Some(&key) = r.hash_ids.get(sys) else {
            continue;
        };
        if full <= sys {
            continue;
        }
        if let Some(prev) = by_first_user_block.get(&key) {
            let prev: &Request = prev;
            let prev_full = prev.input_length as usize / cfg.block_tokens as usize;
            assert_eq!(&r.hash_ids[..prev_full], &prev.hash_ids[..prev_full]);
            followups += 1;
        }
        by_first_user_block.insert(key, r.clone());
    }
    assert!(followups > 200, "{followups}");
}

#[test]
fn synthetic_default_has_reuse_that_lru_can_find() {
    let reqs = generate_synthetic(&SyntheticConfig::default());
    let facts = TraceFacts::of(&reqs);
    assert!(facts.unique_blocks < facts.block_references);
    let infinite = replay(
        &reqs,
        MOONCAKE_BLOCK_TOKENS,
        &mut LruSim::new(facts.unique_blocks),
    );
    let small = replay(
        &reqs,
        MOONCAKE_BLOCK_TOKENS,
        &mut LruSim::new(facts.unique_blocks / 50),
    );
    assert!(
        infinite.hit_rate_pct() > 30.0,
        "{}",
        infinite.hit_rate_pct()
    );
    assert!(small.hit_rate_pct() < infinite.hit_rate_pct());
}

#[test]
fn synthetic_default_facts() {
    let reqs = generate_synthetic(&SyntheticConfig::default());
    let facts = TraceFacts::of(&reqs);
    let infinite = replay(
        &reqs,
        MOONCAKE_BLOCK_TOKENS,
        &mut LruSim::new(facts.unique_blocks),
    );
    println!(
        "synthetic default: {} requests, {} block references, {} unique, infinite-cache hit {:.2}%, span {} s",
        facts.requests,
        facts.block_references,
        facts.unique_blocks,
        infinite.hit_rate_pct(),
        reqs.last().map_or(0, |r| r.timestamp_ms / 1000),
    );
    // Pinned so that a change to the generator is a visible decision.
    assert_eq!(
        (facts.requests, facts.block_references, facts.unique_blocks),
        PINNED_DEFAULT_FACTS
    );
}

const PINNED_DEFAULT_FACTS: (usize, usize, usize) = (1_604, 19_694, 6_058);
