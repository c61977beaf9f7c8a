//! Unit tests of the replay's accounting and configuration checks.

use super::refs::split;
use super::*;

fn request(input_length: u32, blocks: usize) -> Request {
    Request {
        timestamp_ms: 0,
        input_length,
        output_length: 1,
        hash_ids: (0..blocks as u64).collect(),
    }
}

#[test]
fn tokens_avoided_counts_whole_and_partial_blocks_by_tier() {
    // 1 200 tokens in 512-token blocks: 512 + 512 + 176.
    let r = request(1200, 3);
    assert_eq!(tokens_avoided(&r, 512, &[]), [0, 0, 0]);
    assert_eq!(tokens_avoided(&r, 512, &[Tier::G1]), [512, 0, 0]);
    assert_eq!(
        tokens_avoided(&r, 512, &[Tier::G1, Tier::G2]),
        [512, 512, 0]
    );
    // The whole prompt hit: the last token is still computed.
    assert_eq!(
        tokens_avoided(&r, 512, &[Tier::G1, Tier::G2, Tier::G3]),
        [512, 512, 175]
    );
    let exact = request(1024, 2);
    assert_eq!(
        tokens_avoided(&exact, 512, &[Tier::G3, Tier::G3]),
        [0, 0, 1023]
    );
}

#[test]
fn split_keeps_the_total_and_the_proportions() {
    assert_eq!(split(100, [0.02, 0.06, 0.12]), [10, 30, 60]);
    assert_eq!(split(7, [1.0, 1.0, 1.0]), [2, 2, 3]);
    assert_eq!(split(5, [0.0, 0.0, 0.0]), [0, 0, 0]);
    for total in 0..50 {
        assert_eq!(split(total, [0.3, 0.2, 0.5]).iter().sum::<usize>(), total);
    }
}

/// A one-process replay of `requests` in 512-token blocks with tiers of
/// `fractions`, no workers, no restarts.
fn config(requests: Vec<Request>, fractions: [f64; 3]) -> ReplayConfig {
    ReplayConfig {
        workload: "test".into(),
        requests,
        block_tokens: 512,
        model: super::super::MODEL_PRESETS[3],
        scale: 64,
        fractions,
        prefill_tokens_per_s: 1.0,
        memcpy_threads: 1,
        disk_dir: std::env::temp_dir(),
        max_host_bytes: 1 << 30,
        policy: TierPolicy::WriteThrough,
        offload_mode: OffloadMode::default(),
        host_g1: true,
        sweep: Vec::new(),
        workers: 0,
        worker_exe: None,
        offload_in_flight: None,
        g1_free_reserve: None,
        g3_faults: G3Faults::default(),
        g3_staging_bytes: 0,
        decline_slow_loads: false,
        restarts: Restarts::default(),
    }
}

#[test]
fn bad_configuration_is_an_error_not_a_panic() {
    let cfg = config(vec![request(1024, 2)], [0.5, f64::NAN, 0.5]);
    assert!(matches!(
        run_replay(&cfg, |_, _| {}),
        Err(BenchError::Config(_))
    ));
    let tight = ReplayConfig {
        fractions: [1.0, 1.0, 0.0],
        max_host_bytes: 1,
        ..cfg
    };
    let e = run_replay(&tight, |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("--scale"), "{e}");
}

#[test]
fn restarts_need_workers_and_room_in_the_trace() {
    let cfg = ReplayConfig {
        restarts: Restarts {
            count: 1,
            seed: None,
            keep_g2: false,
        },
        ..config(vec![request(1024, 2), request(1024, 2)], [0.5, 0.5, 0.5])
    };
    let e = run_replay(&cfg, |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("--restarts") && e.contains("--workers"), "{e}");
    let crowded = ReplayConfig {
        workers: 2,
        restarts: Restarts {
            count: 2,
            seed: Some(1),
            keep_g2: false,
        },
        ..cfg
    };
    let e = run_replay(&crowded, |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("at most 1"), "{e}");
}
