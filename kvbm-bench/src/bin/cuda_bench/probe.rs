//! `cuda_bench probe`: the rows that decide how a staged copy starts.
//!
//! - Staged copies through the feeder (the caller enqueues the first
//!   chunks when the ring has nothing queued): one direction, both from
//!   one thread (plans lent and shared) and from two, 8 and 32 KiB runs,
//!   1-alloc and layer-alloc, two passes.
//! - Timelines of one staged copy and of an onboard and an offload at once
//!   (8 KiB runs, plans lent and shared), on one clock: where the fixed
//!   cost goes.
//! - Four onboards queued at once: when each one's completion resolves.
//!
//! (Earlier versions also compared how many first chunks the caller
//! enqueues, the ramp, no feeder at all, and followed onboards waited for
//! in the driver; those alternatives are gone, their figures are in
//! docs/benchmarks.md. A first version also measured the copy-engine path split across 1–6
//! copy streams, with stream priorities and `CUDA_DEVICE_MAX_CONNECTIONS`,
//! and plain DMA as pieces of 512 KiB, 2 MiB and 128 MiB; the figures are
//! in docs/benchmarks.md, the split is gone.)

use super::*;

pub(crate) fn run(dev: &CudaDevice) {
    let arena = filled_arena(dev, 2 * GIB);
    if std::env::args().any(|a| a == "queued") {
        queued_onboards(dev, &arena);
        return;
    }
    let mk = |c: CopierConfig| CudaCopier::new(dev, c).expect("copier");
    let main = mk(CopierConfig::for_device(dev));
    let refs = references(dev, &main, 5);

    // The staged start.
    let ramps: Vec<(String, CudaCopier)> =
        vec![("default".to_string(), mk(CopierConfig::for_device(dev)))];
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
                let (bs, _, _) = gbps(on.bytes + off.bytes, 7, || {
                    both_as(copier, &on, &off, st, true)
                });
                let (b2, _, _) = gbps(on.bytes + off.bytes, 7, || {
                    std::thread::scope(|s| {
                        s.spawn(|| on.run(copier, st));
                        off.run(copier, st);
                    })
                });
                let submit = on.submit_us(copier, st, false);
                println!(
                    "probe feeder {kib:>2} KiB {tag:<11} pass {pass} {name:<16} H2D {:.3} D2H {:.3} both one thread lent {:.3} shared {:.3} two threads {:.3} (submit {submit:.0} us)",
                    h / refs.h2d,
                    d / refs.d2h,
                    b / refs.both,
                    bs / refs.both,
                    b2 / refs.both
                );
            }
        }
    }

    // Both directions at 8 KiB, on one clock; one direction likewise.
    let shape = Shape::new(dev, &arena, 4, true);
    let on = shape.case(Direction::HostToDevice, 0..256);
    let off = shape.case(Direction::DeviceToHost, 256..512);
    {
        let tl = mk(cfg(dev, |c| c.timeline = true));
        for shared in [false, true] {
            for _ in 0..3 {
                both_as(&tl, &on, &off, st, shared);
            }
            let _ = tl.take_timeline();
            let t = Instant::now();
            both_as(&tl, &on, &off, st, shared);
            let wall = t.elapsed().as_secs_f64() * 1e6;
            println!(
                "probe timeline both 8 KiB 1-alloc plans {}: copy + wait {wall:.0} us (at the reference rate {:.0} us)\n{}",
                if shared { "shared" } else { "lent" },
                (on.bytes + off.bytes) as f64 / refs.both / 1e3,
                tl.take_timeline().unwrap_or_default()
            );
        }
        let t = Instant::now();
        on.run(&tl, st);
        let wall = t.elapsed().as_secs_f64() * 1e6;
        println!(
            "probe timeline H2D 8 KiB 1-alloc: copy + wait {wall:.0} us (at the reference rate {:.0} us)\n{}",
            on.bytes as f64 / refs.h2d / 1e3,
            tl.take_timeline().unwrap_or_default()
        );
    }

    queued_onboards(dev, &arena);
}

/// Four onboards of 32 MiB (8 KiB runs) queued at once: when each one's
/// completion resolves. `cuda_bench probe queued` runs only this.
pub(crate) fn queued_onboards(dev: &CudaDevice, arena: &Arc<PinnedMemory>) {
    let mk = |c: CopierConfig| CudaCopier::new(dev, c).expect("copier");
    let shape = Shape::new(dev, arena, 4, true);
    let st = opts(Some(CopyPath::Staged), GpuLoad::Idle);
    let polled = mk(CopierConfig::for_device(dev));
    let quarters: Vec<Case> = (0..4)
        .map(|q| shape.case(Direction::HostToDevice, q * 64..(q + 1) * 64))
        .collect();
    for pass in 0..2 {
        for (name, copier) in [("polled", &polled)] {
            let mut at: Vec<Vec<f64>> = vec![Vec::new(); quarters.len()];
            for rep in 0..8 {
                let t0 = Instant::now();
                // Each completion reports (which, when, how) on one channel.
                let (tx, rx) = std::sync::mpsc::channel();
                for (i, q) in quarters.iter().enumerate() {
                    let tx = tx.clone();
                    q.submit(copier, st, true)
                        .expect("onboard")
                        .on_complete(move |r| {
                            let _ = tx.send((i, t0.elapsed().as_secs_f64() * 1e6, r));
                        });
                }
                for _ in 0..quarters.len() {
                    let (i, us, r) = rx.recv().expect("completion");
                    r.expect("onboard failed");
                    if rep > 0 {
                        at[i].push(us);
                    }
                }
            }
            let medians: Vec<String> = at
                .into_iter()
                .map(|v| format!("{:.0}", median(v).0))
                .collect();
            println!(
                "probe queued onboards pass {pass} {name:<7} resolved at (us, medians of 7): {}",
                medians.join(" / ")
            );
        }
    }
}
