//! `cuda_bench probe [idle]`: the measurements that decide three changes.
//!
//! 1. The copy-engine path split across several copy streams of one
//!    direction (k = 1, 2, 3, 4, 6; families dealt round-robin or in
//!    contiguous shares; copy streams at low or high priority): idle one
//!    direction and both, 8 and 32 KiB runs, 1-alloc and layer-alloc, and
//!    beside the GEMM against the staged path. Does the engines' cost per
//!    line overlap across streams?
//! 2. The caller enqueuing a staged copy's first chunks (0 = the whole copy
//!    handed to the feeder, as before; 1, 2, 3 chunks; no feeder at all):
//!    one direction and both, same shapes.
//! 3. Where both directions at once lose time at 8 KiB runs: the two
//!    copies' timelines on one clock, and plain DMA in both directions as
//!    512 KiB, 2 MiB and 128 MiB pieces.
//!
//! `idle` runs only part 1 without the GEMM (to repeat it under another
//! `CUDA_DEVICE_MAX_CONNECTIONS` in a second process).

use std::sync::Arc;

use super::*;

fn cfg(f: impl FnOnce(&mut CopierConfig)) -> CopierConfig {
    let mut c = CopierConfig::default();
    f(&mut c);
    c
}

pub(crate) fn run(dev: &CudaDevice) {
    let idle_only = std::env::args().any(|a| a == "idle");
    let arena_len = 2 * GIB;
    let arena = Arc::new(
        PinnedMemory::allocate_in_background(dev, arena_len, GIB, PinnedOptions::for_device(dev))
            .expect("pinned arena"),
    );
    arena.wait_pinned(arena_len).expect("pins");
    let pattern = random_bytes(1 << 20, 3);
    for off in (0..arena_len).step_by(1 << 20) {
        arena.write(off, &pattern).expect("fill");
    }
    let mk = |c: CopierConfig| CudaCopier::new(dev, c).expect("copier");
    let main = mk(CopierConfig::default());
    let refs = references(dev, &main, 5);
    println!(
        "CUDA_DEVICE_MAX_CONNECTIONS={}",
        std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").unwrap_or_else(|_| "unset".into())
    );

    // Part 1: copy streams.
    let mut split: Vec<(String, CudaCopier)> = Vec::new();
    for (k, how) in [
        (1, CopySplit::Interleaved),
        (2, CopySplit::Interleaved),
        (2, CopySplit::Shares),
        (3, CopySplit::Interleaved),
        (4, CopySplit::Interleaved),
        (4, CopySplit::Shares),
        (6, CopySplit::Interleaved),
        (6, CopySplit::Shares),
    ] {
        split.push((
            format!(
                "ce-k{k}-{}",
                if how == CopySplit::Shares {
                    "shares"
                } else {
                    "rr"
                }
            ),
            mk(cfg(|c| {
                c.copy_streams = k;
                c.copy_split = how;
            })),
        ));
    }
    for k in [1, 4] {
        split.push((
            format!("ce-k{k}-rr-hiprio"),
            mk(cfg(|c| {
                c.copy_streams = k;
                c.copy_streams_high_priority = true;
            })),
        ));
    }
    let ce = opts(Some(CopyPath::CopyEngine), GpuLoad::Idle);
    let gemm = if idle_only { None } else { Gemm::new(dev) };
    for (tokens, packed) in [(4usize, true), (16, true), (4, false), (16, false)] {
        let kib = tokens * 2;
        let tag = if packed { "1-alloc" } else { "layer-alloc" };
        let shape = Shape::new(dev, &arena, tokens, packed);
        let on = shape.case(Direction::HostToDevice, 0..256);
        let off = shape.case(Direction::DeviceToHost, 256..512);
        let mut rows: Vec<(&str, &CudaCopier, CopyOptions)> =
            split.iter().map(|(n, c)| (n.as_str(), c, ce)).collect();
        rows.push(("staged (auto)", &main, opts(None, GpuLoad::Idle)));
        for (name, copier, o) in rows {
            let (h, _, _) = gbps(on.bytes, 5, || on.run(copier, o));
            let (d, _, _) = gbps(off.bytes, 5, || off.run(copier, o));
            let (b, blo, bhi) = gbps(on.bytes + off.bytes, 5, || both(copier, &on, &off, o));
            println!(
                "probe streams {kib:>2} KiB {tag:<11} {name:<16} idle H2D {:.3} D2H {:.3} both {:.3} [{:.3}-{:.3}]",
                h / refs.h2d,
                d / refs.d2h,
                b / refs.both,
                blo / refs.both,
                bhi / refs.both
            );
        }
        let Some(g) = gemm.as_ref() else { continue };
        let copy_s = on.bytes as f64 / 40e9;
        let gemm_n = ((6.0 * copy_s / 1.5e-3) as usize).max(60);
        let busy = opts(None, GpuLoad::Busy);
        let mut beside: Vec<(&str, &CudaCopier, CopyOptions)> =
            vec![("staged (auto busy)", &main, busy)];
        for (n, c) in &split {
            let keep = if packed {
                matches!(
                    n.as_str(),
                    "ce-k1-rr" | "ce-k2-rr" | "ce-k4-rr" | "ce-k4-shares" | "ce-k6-rr"
                )
            } else {
                matches!(n.as_str(), "ce-k1-rr" | "ce-k4-rr")
            };
            if keep {
                beside.push((n.as_str(), c, ce));
            }
        }
        for (name, copier, o) in beside {
            let mut line = format!("probe beside GEMM {kib:>2} KiB {tag:<11} {name:<18}");
            for (label, cases) in [
                ("H2D", vec![(&on, o)]),
                ("D2H", vec![(&off, o)]),
                ("both", vec![(&on, o), (&off, o)]),
            ] {
                let (mut losses, mut rates) = (Vec::new(), Vec::new());
                for _ in 0..3 {
                    let alone = g.run(gemm_n);
                    let (t, c, _) = interfere(copier, g, &cases, gemm_n, 1);
                    losses.push((1.0 - t / alone) * 100.0);
                    rates.push(c);
                }
                let reference = match label {
                    "H2D" => refs.h2d,
                    "D2H" => refs.d2h,
                    _ => refs.both,
                };
                let (c, _, _) = median(rates);
                let (l, llo, lhi) = median(losses);
                line += &format!(
                    " | {label} {:.3} loss {l:.1}% [{llo:.1},{lhi:.1}]",
                    c / reference
                );
            }
            println!("{line}");
        }
    }
    if idle_only {
        return;
    }

    // Part 2: the caller's first chunks.
    let ramps: Vec<(String, CudaCopier)> = [0usize, 1, 2, 3]
        .into_iter()
        .map(|n| {
            (
                format!("caller-chunks-{n}"),
                mk(cfg(|c| c.staged_caller_chunks = n)),
            )
        })
        .chain([(
            "no-feeder".to_string(),
            mk(cfg(|c| c.staged_feeder = false)),
        )])
        .collect();
    let st = opts(Some(CopyPath::Staged), GpuLoad::Idle);
    for (tokens, packed) in [(4usize, true), (4, false), (16, true), (16, false)] {
        let kib = tokens * 2;
        let tag = if packed { "1-alloc" } else { "layer-alloc" };
        let shape = Shape::new(dev, &arena, tokens, packed);
        let on = shape.case(Direction::HostToDevice, 0..256);
        let off = shape.case(Direction::DeviceToHost, 256..512);
        // Two passes in alternating order: the machine drifts.
        for pass in 0..2 {
            let order: Vec<usize> = if pass == 0 {
                (0..ramps.len()).collect()
            } else {
                (0..ramps.len()).rev().collect()
            };
            for i in order {
                let (name, copier) = (&ramps[i].0, &ramps[i].1);
                let (h, _, _) = gbps(on.bytes, 7, || on.run(copier, st));
                let (d, _, _) = gbps(off.bytes, 7, || off.run(copier, st));
                let (b, _, _) = gbps(on.bytes + off.bytes, 7, || both(copier, &on, &off, st));
                let (b2, _, _) = gbps(on.bytes + off.bytes, 7, || {
                    std::thread::scope(|s| {
                        s.spawn(|| on.run(copier, st));
                        off.run(copier, st);
                    })
                });
                let t = Instant::now();
                let c = copier.copy(&on.runs, &on.src, &on.dst, st);
                let submit = t.elapsed().as_secs_f64() * 1e6;
                let _ = c.map(|c| c.wait());
                println!(
                    "probe feeder {kib:>2} KiB {tag:<11} pass {pass} {name:<16} H2D {:.3} D2H {:.3} both one thread {:.3} two threads {:.3} (submit {submit:.0} us)",
                    h / refs.h2d,
                    d / refs.d2h,
                    b / refs.both,
                    b2 / refs.both
                );
            }
        }
    }

    // Part 3: both directions at 8 KiB, on one clock.
    let shape = Shape::new(dev, &arena, 4, true);
    let on = shape.case(Direction::HostToDevice, 0..256);
    let off = shape.case(Direction::DeviceToHost, 256..512);
    for n in [2usize, 0] {
        let tl = mk(cfg(|c| {
            c.timeline = true;
            c.staged_caller_chunks = n;
        }));
        for _ in 0..3 {
            both(&tl, &on, &off, st);
        }
        let _ = tl.take_timeline();
        let t = Instant::now();
        both(&tl, &on, &off, st);
        let wall = t.elapsed().as_secs_f64() * 1e6;
        println!(
            "probe timeline both 8 KiB 1-alloc caller-chunks-{n}: copy + wait {wall:.0} us (at the reference rate {:.0} us)\n{}",
            (on.bytes + off.bytes) as f64 / refs.both / 1e3,
            tl.take_timeline().unwrap_or_default()
        );
        let t = Instant::now();
        on.run(&tl, st);
        let wall = t.elapsed().as_secs_f64() * 1e6;
        println!(
            "probe timeline H2D 8 KiB 1-alloc caller-chunks-{n}: copy + wait {wall:.0} us (at the reference rate {:.0} us)\n{}",
            on.bytes as f64 / refs.h2d / 1e3,
            tl.take_timeline().unwrap_or_default()
        );
    }
    dma_pieces(dev, &main, &arena, &refs);
}

/// Plain DMA of 128 MiB each way as pieces of one size, in shuffled order
/// (so none merge), one direction and both at once.
fn dma_pieces(dev: &CudaDevice, copier: &CudaCopier, arena: &Arc<PinnedMemory>, refs: &Refs) {
    let len = 128usize << 20;
    let dev_buf: Arc<dyn CudaRegion> =
        Arc::new(DeviceBuffer::new(dev, 2 * len).expect("device buffer"));
    let host: Arc<dyn CudaRegion> = window(arena, 0, 2 * len);
    let ce = opts(Some(CopyPath::CopyEngine), GpuLoad::Idle);
    for piece in [512usize << 10, 2 << 20, len] {
        let n = len / piece;
        let order = random_blocks(n, n, 5);
        let runs = |src_off: usize, dst_off: usize| -> Vec<CopyRun> {
            order
                .iter()
                .enumerate()
                .map(|(i, &j)| CopyRun {
                    src_region: 0,
                    src_offset: (src_off + j * piece) as u64,
                    dst_region: 0,
                    dst_offset: (dst_off + ((i * 7 + 3) % n) * piece) as u64,
                    len: piece as u64,
                })
                .collect()
        };
        let h2d = Case {
            runs: runs(0, 0),
            src: vec![host.clone()],
            dst: vec![dev_buf.clone()],
            bytes: len as u64,
        };
        let d2h = Case {
            runs: runs(len, len),
            src: vec![dev_buf.clone()],
            dst: vec![host.clone()],
            bytes: len as u64,
        };
        let (h, _, _) = gbps(h2d.bytes, 7, || h2d.run(copier, ce));
        let (d, _, _) = gbps(d2h.bytes, 7, || d2h.run(copier, ce));
        let (b, lo, hi) = gbps(2 * len as u64, 7, || both(copier, &h2d, &d2h, ce));
        println!(
            "probe dma pieces {:>6} KiB x {n:>3}: H2D {:.3} D2H {:.3} both {:.3} [{:.3}-{:.3}]",
            piece >> 10,
            h / refs.h2d,
            d / refs.d2h,
            b / refs.both,
            lo / refs.both,
            hi / refs.both
        );
    }
}
