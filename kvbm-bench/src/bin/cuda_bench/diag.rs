//! `cuda_bench diag`: where the staged path's time goes.
//!
//! A staged copy's timeline (host instants and GPU events per chunk), the
//! staged path against the kernel and copy engines one way and both ways
//! (one submitting thread and two), with and without polling at the end of
//! a copy, and a gather on the copy engines against the kernel (does a D2D
//! copy share the engine an offload's DMA needs?). The main bench measures
//! the paths beside the GEMM.

use std::sync::Arc;
use std::time::Instant;

use super::*;

pub(crate) fn run(dev: &CudaDevice) {
    let arena = filled_arena(dev, 2 * GIB);
    let mk = |c: CopierConfig| CudaCopier::new(dev, c).expect("copier");
    let main = mk(CopierConfig::for_device(dev));
    let refs = references(dev, &main, 5);
    let timeline = mk(cfg(dev, |c| c.timeline = true));
    let nospin = mk(cfg(dev, |c| c.wake_spin_us = 0));
    let st = |l| opts(Some(CopyPath::Staged), l);
    let idle = GpuLoad::Idle;

    for (tokens, packed) in [(16usize, true), (4, true)] {
        let kib = tokens * 2;
        let tag = if packed { "1-alloc" } else { "layer-alloc" };
        let shape = Shape::new(dev, &arena, tokens, packed);
        let on = shape.case(Direction::HostToDevice, 0..256);
        let off = shape.case(Direction::DeviceToHost, 256..512);
        println!(
            "=== {kib} KiB runs, {tag}, {} runs, {} MiB per copy",
            on.runs.len(),
            on.bytes >> 20
        );
        // One direction.
        let variants: Vec<(&str, &CudaCopier, CopyOptions)> = vec![
            ("staged", &main, st(idle)),
            ("staged-nospin", &nospin, st(idle)),
            ("kernel", &main, opts(Some(CopyPath::Kernel), idle)),
            ("kernel-nospin", &nospin, opts(Some(CopyPath::Kernel), idle)),
            ("copy-engine", &main, opts(Some(CopyPath::CopyEngine), idle)),
            ("auto-idle", &main, opts(None, idle)),
        ];
        for (case, label, reference) in [(&on, "H2D", refs.h2d), (&off, "D2H", refs.d2h)] {
            for &(name, copier, o) in &variants {
                let (m, lo, hi) = gbps(case.bytes, 7, || case.run(copier, o));
                let submit = case.submit_us(copier, o, false);
                println!(
                    "{kib:>3} KiB {tag} {label} {name:<16} {m:6.1} GB/s [{lo:.1}-{hi:.1}] ratio {:.3} submit {submit:.0} us",
                    m / reference
                );
            }
            // The timeline of one staged copy (warm).
            case.run(&timeline, st(idle));
            let _ = timeline.take_timeline();
            let t = Instant::now();
            case.run(&timeline, st(idle));
            let wall = t.elapsed().as_secs_f64() * 1e6;
            println!(
                "{kib:>3} KiB {tag} {label} staged timeline (copy + wait {wall:.0} us; at the reference rate {:.0} us):\n{}",
                case.bytes as f64 / reference / 1e3,
                timeline.take_timeline().unwrap_or_default()
            );
        }
        // Both directions.
        let bi: Vec<(&str, &CudaCopier, CopyOptions, CopyOptions)> = vec![
            ("staged", &main, st(idle), st(idle)),
            ("staged-nospin", &nospin, st(idle), st(idle)),
            (
                "kernel",
                &main,
                opts(Some(CopyPath::Kernel), idle),
                opts(Some(CopyPath::Kernel), idle),
            ),
            (
                "copy-engine",
                &main,
                opts(Some(CopyPath::CopyEngine), idle),
                opts(Some(CopyPath::CopyEngine), idle),
            ),
            ("auto-idle", &main, opts(None, idle), opts(None, idle)),
        ];
        for (name, copier, a, b) in bi {
            let (m, lo, hi) = gbps(on.bytes + off.bytes, 7, || {
                let r = copier.copy(&on.runs, &on.src, &on.dst, a).and_then(|c1| {
                    let c2 = copier.copy(&off.runs, &off.src, &off.dst, b)?;
                    c1.wait()?;
                    c2.wait()
                });
                if let Err(e) = r {
                    println!("FAILED both: {e}");
                }
            });
            let (m2, lo2, hi2) = gbps(on.bytes + off.bytes, 7, || {
                std::thread::scope(|s| {
                    s.spawn(|| on.run(copier, a));
                    off.run(copier, b);
                })
            });
            println!(
                "{kib:>3} KiB {tag} both {name:<24} one thread {m:6.1} GB/s [{lo:.1}-{hi:.1}] ratio {:.3}; two threads {m2:6.1} [{lo2:.1}-{hi2:.1}] ratio {:.3}",
                m / refs.both,
                m2 / refs.both
            );
        }
        if tokens == 16 && packed {
            gather_on_copy_engines(dev, &main, &shape, &off, &arena);
        }
    }
}

/// Gathers the offload's runs into a dense device buffer on the copy
/// engines (strided D2D descriptors) and on the kernel, alone and while a
/// dense device → host DMA runs: does a D2D copy share the engine the
/// offload's DMA needs?
fn gather_on_copy_engines(
    dev: &CudaDevice,
    copier: &CudaCopier,
    shape: &Shape,
    off: &Case,
    arena: &Arc<PinnedMemory>,
) {
    let dense = Arc::new(DeviceBuffer::new(dev, off.bytes as usize).expect("dense"));
    let dense2 = Arc::new(DeviceBuffer::new(dev, off.bytes as usize).expect("dense2"));
    let mut at = 0u64;
    let runs: Vec<CopyRun> = off
        .runs
        .iter()
        .map(|r| {
            let g = CopyRun {
                dst_region: 0,
                dst_offset: at,
                ..*r
            };
            at += r.len;
            g
        })
        .collect();
    let gather = Case::new(runs, shape.dev_regions.clone(), vec![dense.clone()]);
    let host_len = off.bytes as usize;
    let dma = Case::new(
        one_run(off.bytes),
        vec![dense2.clone()],
        vec![window(arena, GIB, host_len)],
    );
    let ce = opts(Some(CopyPath::CopyEngine), GpuLoad::Idle);
    let k = opts(Some(CopyPath::Kernel), GpuLoad::Idle);
    let kb = opts(Some(CopyPath::Kernel), GpuLoad::Busy);
    for (name, o) in [
        ("copy engines", ce),
        ("kernel idle grid", k),
        ("kernel 8 CTAs", kb),
    ] {
        let (m, lo, hi) = gbps(gather.bytes, 7, || gather.run(copier, o));
        println!("gather D2D 32 KiB runs on {name:<16} {m:7.1} GB/s [{lo:.1}-{hi:.1}]");
    }
    let (m, lo, hi) = gbps(dma.bytes, 7, || dma.run(copier, ce));
    println!("dense D2H DMA alone {m:6.1} GB/s [{lo:.1}-{hi:.1}]");
    for (name, o) in [("copy engines", ce), ("kernel idle grid", k)] {
        let t = Instant::now();
        let n = 5;
        for _ in 0..n {
            let r = copier
                .copy(&dma.runs, &dma.src, &dma.dst, ce)
                .and_then(|c1| {
                    let c2 = copier.copy(&gather.runs, &gather.src, &gather.dst, o)?;
                    c1.wait()?;
                    c2.wait()
                });
            if let Err(e) = r {
                println!("FAILED dma + gather: {e}");
            }
        }
        let s = t.elapsed().as_secs_f64() / n as f64;
        println!(
            "dense D2H DMA (copy engines) + gather on {name}: {:.0} us per pair (DMA alone at its rate {:.0} us)",
            s * 1e6,
            dma.bytes as f64 / m / 1e3
        );
    }
}

/// `cuda_bench gemm-timeline`: timelines of busy staged copies beside the
/// bf16 GEMM loop (8 KiB runs, one allocation; four copies, two in
/// flight, one direction at a time), to see where they wait for the GEMM.
pub(crate) fn beside_gemm(dev: &CudaDevice) {
    let Some(gemm) = Gemm::new(dev.ordinal()) else {
        println!("no cuBLAS: no GEMM to run beside");
        return;
    };
    let arena = filled_arena(dev, 2 * GIB);
    let shape = Shape::new(dev, &arena, 4, true);
    let on = shape.case(Direction::HostToDevice, 0..256);
    let off = shape.case(Direction::DeviceToHost, 256..512);
    {
        let copier = CudaCopier::new(dev, cfg(dev, |c| c.timeline = true)).expect("copier");
        let busy = opts(None, GpuLoad::Busy);
        for (case, label) in [(&on, "H2D"), (&off, "D2H")] {
            case.run(&copier, busy);
            let _ = copier.take_timeline();
            let wall = std::thread::scope(|s| {
                let copies = s.spawn(|| {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    let t = Instant::now();
                    let mut queue = std::collections::VecDeque::new();
                    for _ in 0..4 {
                        if queue.len() == 2 {
                            let c: Completion = queue.pop_front().expect("two queued");
                            let _ = c.wait();
                        }
                        queue.push_back(case.submit(&copier, busy, false).expect("copy"));
                    }
                    for c in queue {
                        let _ = c.wait();
                    }
                    t.elapsed().as_secs_f64() * 1e6
                });
                gemm.run(60);
                copies.join().expect("copy thread")
            });
            println!(
                "8 KiB 1-alloc {label} beside GEMM: 4 copies, 2 in flight, {wall:.0} us ({:.1} GB/s)\n{}",
                4.0 * case.bytes as f64 / wall / 1e3,
                copier.take_timeline().unwrap_or_default()
            );
        }
    }
}
