//! Unit tests of the offload bench: rep sizing, hashes, the G2 check, bad
//! configurations.

use super::*;

#[test]
fn blocks_per_rep_covers_eight_batches_and_the_bytes() {
    assert_eq!(blocks_per_rep(512 << 10, 256, 512 << 20), 2048);
    assert_eq!(blocks_per_rep(2 << 20, 64, 1 << 30), 512);
    assert_eq!(blocks_per_rep(1, 1, 0), 8);
}

#[test]
fn the_g2_check_finds_a_flipped_byte() {
    let model = super::super::MODEL_PRESETS[3];
    let lc = model.layout_config(6, 4).unwrap();
    let g2 = HostTier::allocate(Layout::new(lc, LayoutKind::FullyContiguous).unwrap()).unwrap();
    let view = HostLayoutView::new(g2.physical().clone()).unwrap();
    let pairs: Vec<(usize, u64)> = (0..6).map(|b| (b, hash_of(4, b + 100))).collect();
    for &(b, h) in &pairs {
        // SAFETY: freshly allocated, no transfer anywhere near it.
        unsafe { g2.fill(b, h).unwrap() };
    }
    assert!(check_g2(&view, &pairs).unwrap().is_none());
    // A block that was never written: cleared memory does not pass.
    // SAFETY: as above.
    unsafe { view.zero(2) };
    assert!(matches!(
        check_g2(&view, &pairs[..1]).unwrap(),
        Some(BenchError::Corrupt { .. })
    ));
    for &(b, h) in &pairs {
        // SAFETY: as above.
        unsafe { g2.fill(b, h).unwrap() };
    }
    // One flipped byte in block 4, chunk (layer 1, V).
    let c = g2.physical().layout().chunk(4, 1, 1).unwrap();
    let addr = g2.physical().regions()[c.region].addr().unwrap() + c.offset + 17;
    // SAFETY: inside block 4's chunk of the live region.
    unsafe { *(addr as *mut u8) ^= 0x10 };
    match check_g2(&view, &pairs).unwrap() {
        Some(BenchError::Corrupt {
            block,
            layer,
            outer,
            offset,
            ..
        }) => {
            assert_eq!((block, layer, outer, offset), (pairs[4].1, 1, 1, 17));
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

/// A tiny host-only configuration (the `tiny` model, 4 tokens per block,
/// one idle row of `batch` blocks and `in_flight` batches).
pub(super) fn tiny_host_config(in_flight: usize, batch: usize) -> OffloadConfig {
    OffloadConfig {
        model: super::super::MODEL_PRESETS[3],
        tokens_per_block: vec![4],
        in_flight: vec![in_flight],
        batches: vec![batch],
        batch_bytes: None,
        loads: vec![Load::Idle],
        min_bytes_per_rep: 1 << 20,
        reps: 1,
        reference_bytes: 1 << 20,
        memcpy_threads: 1,
        max_host_bytes: 1 << 30,
        host_g1: true,
        gpu_path: GpuPath::Auto,
        sustain: None,
        timeline: false,
    }
}

#[test]
fn zero_reps_or_batches_are_config_errors() {
    let cfg = tiny_host_config(1, 0);
    assert!(matches!(
        run_offload(&cfg, |_| {}),
        Err(BenchError::Config(_))
    ));
    let tight = OffloadConfig {
        batches: vec![8],
        max_host_bytes: 1,
        ..cfg
    };
    assert!(matches!(
        run_offload(&tight, |_| {}),
        Err(BenchError::Config(_))
    ));
}

#[test]
fn hashes_differ_across_blocks_and_shapes() {
    let mut seen = std::collections::HashSet::new();
    for t in [4, 16] {
        for b in 0..5000 {
            assert!(seen.insert(hash_of(t, b)));
        }
    }
}
