//! GPU benchmark of the CUDA backend (run on the H200 machine).
//!
//! Shape: 32 layers, K and V, 8 KV heads × 128, bf16; device LayerSeparate
//! (outer-first, as vLLM) ↔ pinned FullyContiguous; 256 random
//! non-consecutive blocks out of 512. Run sizes 8, 32 and 256 KiB (4, 16 and
//! 128 tokens per block). The device layers are carved out of one
//! allocation (every path is measured so); a second pass gives each layer
//! its own allocation (copy engines and auto only), where a block's runs
//! form one strided family per layer instead of one per block. Every figure is also printed as a ratio to one
//! large pinned copy measured in the same run. Byte counts come from the
//! plan (the sum of its runs), never from hand arithmetic.
//!
//! `cargo run --release -p kvbm-bench --features cuda,gemm --bin cuda_bench
//! [-- quick | gemm | focus | diag | gemm-timeline | probe | lone]`; `focus` runs only the
//! rows that judge how copies start and end (8 and 32 KiB runs: one
//! direction, both directions, beside the GEMM one copy at a time);
//! `probe` (see `probe.rs`) the measurements behind the staged
//! path's start; `lone` (see `lone.rs`) one block alone through each path
//! that can take it; `gemm-timeline` the timelines of busy staged copies beside
//! the GEMM (`diag.rs`). `-sh` rows hand the plan over shared
//! (`copy_shared`) instead of lending it. `KVBM_SHAPES` keeps some run
//! sizes and placements in any mode (`"32:1-alloc 8:layer-alloc"`; 256 KiB
//! shapes make the GEMM and focus modes pin 16 GiB), `KVBM_GEMM_X`
//! stretches the GEMM window.

// Shared with kvbm-transfer's CUDA tests.
#[path = "../../../../kvbm-transfer/tests/cuda_common/mod.rs"]
mod cuda_common;
mod diag;
mod gemm;
mod lone;
mod probe;

use gemm::interfere;
use kvbm_testkit::gemm::Gemm;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cuda_common::{
    Kind, Layout, device_or_skip, packed_device_regions, plan, random_blocks, random_bytes,
};
use kvbm_transfer::cuda::{
    Completion, CopierConfig, CopyOptions, CopyPath, CopyRun, CudaCopier, CudaDevice, CudaError,
    CudaRegion, DeviceBuffer, Direction, GpuLoad, Location, PinnedMemory, PinnedOptions,
};

const GIB: usize = 1 << 30;

/// The copier configuration for `dev` changed by `f`.
fn cfg(dev: &CudaDevice, f: impl FnOnce(&mut CopierConfig)) -> CopierConfig {
    let mut c = CopierConfig::for_device(dev);
    f(&mut c);
    c
}

/// `len` bytes of pinned memory, all pinned, filled with non-zero bytes.
fn filled_arena(dev: &CudaDevice, len: usize) -> Arc<PinnedMemory> {
    let arena = Arc::new(
        PinnedMemory::allocate_in_background(dev, len, GIB, PinnedOptions::for_device(dev))
            .expect("pinned arena"),
    );
    arena.wait_pinned(len).expect("pins");
    let pattern = random_bytes(1 << 20, 3);
    for off in (0..len).step_by(1 << 20) {
        arena.write(off, &pattern).expect("fill");
    }
    arena
}

/// A window of the pinned arena, as its own region.
struct Window {
    mem: Arc<PinnedMemory>,
    offset: usize,
    len: usize,
}

impl CudaRegion for Window {
    fn device_ptr(&self) -> u64 {
        self.mem.device_ptr() + self.offset as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> Location {
        Location::PinnedHost
    }
}

fn window(mem: &Arc<PinnedMemory>, offset: usize, len: usize) -> Arc<dyn CudaRegion> {
    Arc::new(Window {
        mem: Arc::clone(mem),
        offset,
        len,
    })
}

/// One contiguous run of `len` bytes, from the start of the first source
/// region to the start of the first destination region.
fn one_run(len: u64) -> Vec<CopyRun> {
    vec![CopyRun {
        src_region: 0,
        src_offset: 0,
        dst_region: 0,
        dst_offset: 0,
        len,
    }]
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Times `reps` runs of `f` (after one warm-up); returns GB/s (median, min, max).
fn gbps(bytes: u64, reps: usize, mut f: impl FnMut()) -> (f64, f64, f64) {
    f();
    let v = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            bytes as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    median(v)
}

struct Case {
    runs: Vec<CopyRun>,
    /// The same plan, shared (for `copy_shared`).
    shared: Arc<[CopyRun]>,
    src: Vec<Arc<dyn CudaRegion>>,
    dst: Vec<Arc<dyn CudaRegion>>,
    bytes: u64,
}

impl Case {
    fn new(
        runs: Vec<CopyRun>,
        src: Vec<Arc<dyn CudaRegion>>,
        dst: Vec<Arc<dyn CudaRegion>>,
    ) -> Case {
        Case {
            shared: runs.as_slice().into(),
            bytes: runs.iter().map(|r| r.len).sum(),
            runs,
            src,
            dst,
        }
    }

    /// Starts the copy with the plan lent (`copy`) or shared
    /// (`copy_shared`, variants named `…-sh`).
    fn submit(
        &self,
        copier: &CudaCopier,
        opts: CopyOptions,
        shared: bool,
    ) -> Result<Completion, CudaError> {
        if shared {
            copier.copy_shared(Arc::clone(&self.shared), &self.src, &self.dst, opts)
        } else {
            copier.copy(&self.runs, &self.src, &self.dst, opts)
        }
    }

    /// Microseconds the `copy` call itself takes (the copy is then waited
    /// for).
    fn submit_us(&self, copier: &CudaCopier, opts: CopyOptions, shared: bool) -> f64 {
        let t = Instant::now();
        let c = self.submit(copier, opts, shared);
        let us = t.elapsed().as_secs_f64() * 1e6;
        let _ = c.map(|c| c.wait());
        us
    }

    fn try_run_as(
        &self,
        copier: &CudaCopier,
        opts: CopyOptions,
        shared: bool,
    ) -> Result<(), CudaError> {
        self.submit(copier, opts, shared)?.wait()
    }

    fn run(&self, copier: &CudaCopier, opts: CopyOptions) {
        self.run_as(copier, opts, false)
    }

    fn run_as(&self, copier: &CudaCopier, opts: CopyOptions, shared: bool) {
        if let Err(e) = self.try_run_as(copier, opts, shared) {
            println!("FAILED copy ({opts:?}): {e}");
        }
    }
}

fn opts(path: Option<CopyPath>, load: GpuLoad) -> CopyOptions {
    CopyOptions { path, load }
}

/// The copiers compared: the default one and one per alternative setting.
struct Copiers {
    main: CudaCopier,
    /// Watchers that always sleep in the driver (no polling at the end).
    nospin: CudaCopier,
}

impl Copiers {
    fn new(dev: &CudaDevice) -> Copiers {
        let mk = |c: CopierConfig| CudaCopier::new(dev, c).expect("copier");
        Copiers {
            main: mk(CopierConfig::for_device(dev)),
            nospin: mk(cfg(dev, |c| c.wake_spin_us = 0)),
        }
    }

    fn variants(&self, all: bool) -> Vec<(&'static str, &CudaCopier, CopyOptions)> {
        let (ce, k, st) = (
            Some(CopyPath::CopyEngine),
            Some(CopyPath::Kernel),
            Some(CopyPath::Staged),
        );
        let (i, b) = (GpuLoad::Idle, GpuLoad::Busy);
        let v = vec![
            ("copy-engine", &self.main, opts(ce, i)),
            ("kernel-idle", &self.main, opts(k, i)),
            ("kernel-busy", &self.main, opts(k, b)),
            ("staged", &self.main, opts(st, i)),
            ("staged-nospin", &self.nospin, opts(st, i)),
            ("kernel-nospin", &self.nospin, opts(k, i)),
            ("auto-idle", &self.main, opts(None, i)),
            ("auto-idle-sh", &self.main, opts(None, i)),
            ("staged-sh", &self.main, opts(st, i)),
            ("staged-busy", &self.main, opts(st, b)),
            ("auto-busy", &self.main, opts(None, b)),
        ];
        v.into_iter()
            .filter(|x| {
                all || matches!(
                    x.0,
                    "copy-engine" | "kernel-idle" | "auto-idle" | "auto-idle-sh" | "auto-busy"
                )
            })
            .collect()
    }
}

/// The bench shape at one run size: device LayerSeparate ↔ pinned
/// FullyContiguous over a pool of 512 blocks.
struct Shape {
    dev_regions: Vec<Arc<dyn CudaRegion>>,
    host_regions: Vec<Arc<dyn CudaRegion>>,
    dl: Layout,
    hl: Layout,
    dev_ids: Vec<usize>,
    host_ids: Vec<usize>,
    _one_alloc: Option<Arc<DeviceBuffer>>,
}

const POOL: usize = 512;

impl Shape {
    /// `packed`: the device layers carved out of one allocation.
    fn new(dev: &CudaDevice, arena: &Arc<PinnedMemory>, tokens: usize, packed: bool) -> Shape {
        let run_bytes = tokens * 8 * 128 * 2;
        let dl = Layout {
            kind: Kind::LayerSeparate,
            blocks: POOL,
            layers: 32,
            outer: 2,
            run_bytes,
        };
        let hl = Layout {
            kind: Kind::FullyContiguous,
            ..dl
        };
        let (one_alloc, dev_regions) = if packed {
            let (buf, regions) = packed_device_regions(dev, &dl.region_sizes());
            (Some(buf), regions)
        } else {
            let regions = dl
                .region_sizes()
                .into_iter()
                .map(|s| {
                    Arc::new(DeviceBuffer::new(dev, s).expect("device layer"))
                        as Arc<dyn CudaRegion>
                })
                .collect();
            (None, regions)
        };
        Shape {
            dev_regions,
            host_regions: vec![window(arena, 0, hl.region_sizes()[0])],
            dl,
            hl,
            dev_ids: random_blocks(POOL, POOL, 11),
            host_ids: random_blocks(POOL, POOL, 12),
            _one_alloc: one_alloc,
        }
    }

    /// The copy of blocks `range` (of the shuffled id lists) in direction `d`.
    fn case(&self, d: Direction, range: std::ops::Range<usize>) -> Case {
        let p: Vec<(usize, usize)> = range.map(|i| (self.host_ids[i], self.dev_ids[i])).collect();
        let (runs, src, dst) = match d {
            Direction::HostToDevice => (
                plan(&self.hl, &self.dl, &p),
                self.host_regions.clone(),
                self.dev_regions.clone(),
            ),
            _ => {
                let rev: Vec<_> = p.iter().map(|&(h, g)| (g, h)).collect();
                (
                    plan(&self.dl, &self.hl, &rev),
                    self.dev_regions.clone(),
                    self.host_regions.clone(),
                )
            }
        };
        Case::new(runs, src, dst)
    }
}

/// The same-run reference: one large pinned copy per direction and both
/// at once (GB/s, medians).
struct Refs {
    h2d: f64,
    d2h: f64,
    both: f64,
}

/// Submits `a` and `b` from one thread, then waits for both.
fn both(copier: &CudaCopier, a: &Case, b: &Case, o: CopyOptions) {
    both_as(copier, a, b, o, false)
}

/// [`both`] with the plans lent or shared (see [`Case::submit`]).
fn both_as(copier: &CudaCopier, a: &Case, b: &Case, o: CopyOptions, shared: bool) {
    let r = a.submit(copier, o, shared).and_then(|c1| {
        let c2 = b.submit(copier, o, shared)?;
        c1.wait()?;
        c2.wait()
    });
    if let Err(e) = r {
        println!("FAILED both directions ({o:?}): {e}");
    }
}

fn references(dev: &CudaDevice, copier: &CudaCopier, reps: usize) -> Refs {
    let dev = dev.clone();
    let big = Arc::new(DeviceBuffer::new(&dev, 2 * GIB).expect("device"));
    let one = |src_off: u64, dst_off: u64| CopyRun {
        src_region: 0,
        src_offset: src_off,
        dst_region: 0,
        dst_offset: dst_off,
        len: GIB as u64,
    };
    let dev_r: Vec<Arc<dyn CudaRegion>> = vec![big.clone()];
    // One registration, so the reference really is one copy per direction.
    let ref_host = Arc::new(
        PinnedMemory::allocate(
            &dev,
            2 * GIB,
            PinnedOptions {
                chunk_bytes: 2 * GIB,
                ..PinnedOptions::for_device(&dev)
            },
        )
        .expect("reference pinned"),
    );
    ref_host.write(0, &random_bytes(1 << 20, 4)).expect("fill");
    let host_r: Vec<Arc<dyn CudaRegion>> = vec![window(&ref_host, 0, 2 * GIB)];
    let ce = opts(Some(CopyPath::CopyEngine), GpuLoad::Idle);
    let h2d_ref = Case::new(vec![one(0, 0)], host_r.clone(), dev_r.clone());
    let d2h_ref = Case::new(
        vec![one(GIB as u64, GIB as u64)],
        dev_r.clone(),
        host_r.clone(),
    );
    let (ref_h2d, lo, hi) = gbps(GIB as u64, reps, || h2d_ref.run(copier, ce));
    println!("reference single 1 GiB copy H2D {ref_h2d:.1} GB/s [{lo:.1}-{hi:.1}]");
    let (ref_d2h, lo, hi) = gbps(GIB as u64, reps, || d2h_ref.run(copier, ce));
    println!("reference single 1 GiB copy D2H {ref_d2h:.1} GB/s [{lo:.1}-{hi:.1}]");
    let (ref_bi, lo, hi) = gbps(2 * GIB as u64, reps, || {
        both(copier, &h2d_ref, &d2h_ref, ce)
    });
    println!(
        "reference single 1 GiB copy both directions {ref_bi:.1} GB/s total [{lo:.1}-{hi:.1}]"
    );
    drop((h2d_ref, d2h_ref, dev_r, host_r, big, ref_host));

    Refs {
        h2d: ref_h2d,
        d2h: ref_d2h,
        both: ref_bi,
    }
}

/// `rows`, then (when `twice`) the same rows in reverse order: the machine
/// drifts, and a row measured first in a shape can catch a transient.
fn in_two_passes<T: Clone>(rows: Vec<T>, twice: bool) -> Vec<T> {
    let mut out = rows.clone();
    if twice {
        out.extend(rows.into_iter().rev());
    }
    out
}

fn main() {
    let Some(dev) = device_or_skip() else { return };
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(400));
        println!("bench watchdog: still running after 400 s, exiting");
        std::process::exit(3);
    });
    if std::env::args().any(|a| a == "diag") {
        diag::run(&dev);
        return;
    }
    if std::env::args().any(|a| a == "gemm-timeline") {
        diag::beside_gemm(&dev);
        return;
    }
    if std::env::args().any(|a| a == "probe") {
        probe::run(&dev);
        return;
    }
    if std::env::args().any(|a| a == "lone") {
        lone::run(&dev);
        return;
    }
    let started = Instant::now();
    let quick = std::env::args().any(|a| a == "quick");
    // `gemm`: only the reference and the copies beside a GEMM loop.
    let gemm_only = std::env::args().any(|a| a == "gemm");
    let focus = std::env::args().any(|a| a == "focus");
    // Variants of the `focus` rows: the changed paths and the old ones.
    let in_focus = |name: &str| {
        !focus
            || matches!(
                name,
                "staged" | "staged-sh" | "auto-idle" | "auto-idle-sh" | "auto-busy"
            )
    };
    let reps = if quick { 3 } else { 5 };
    let engines = dev
        .context()
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)
        .unwrap_or(-1);
    println!(
        "device: {} ({} SMs, NUMA node {:?}, batch copy {}, 3D batch copy {}, max pitch {}, async engines {engines})",
        dev.name(),
        dev.sm_count(),
        dev.numa_node(),
        dev.has_batch_copy(),
        dev.has_batch_copy_3d(),
        dev.max_pitch()
    );

    // `KVBM_SHAPES="32:1-alloc 8:layer-alloc"` keeps only those run sizes
    // (KiB) and placements, in any mode.
    let only = std::env::var("KVBM_SHAPES").ok();
    // 256 KiB runs need 8 GiB of host blocks.
    let big_runs = only.as_ref().is_some_and(|o| o.contains("256:"));
    // --- Pinned allocation: 16 GiB, first 1 GiB usable at once. ---
    let arena_len = if (gemm_only || focus) && !big_runs {
        2 * GIB
    } else {
        16 * GIB
    };
    let mut firsts = Vec::new();
    let mut alls = Vec::new();
    let mut arena = None;
    for _ in 0..1 {
        drop(arena.take());
        let t = Instant::now();
        let mem = PinnedMemory::allocate_in_background(
            &dev,
            arena_len,
            GIB,
            PinnedOptions::for_device(&dev),
        )
        .expect("pinned arena");
        firsts.push(t.elapsed().as_secs_f64());
        mem.wait_pinned(arena_len).expect("pins");
        alls.push(t.elapsed().as_secs_f64());
        arena = Some(mem);
    }
    println!(
        "pinned 16 GiB per run (first 1 GiB usable / all pinned, s): {:?} / {:?}",
        firsts, alls
    );
    let (f, fmin, fmax) = median(firsts);
    let (a, amin, amax) = median(alls);
    println!(
        "pinned 16 GiB: first 1 GiB usable {f:.3} s [{fmin:.3}-{fmax:.3}], all pinned {a:.3} s [{amin:.3}-{amax:.3}]"
    );
    let arena = Arc::new(arena.expect("allocated"));
    {
        // Non-zero contents for the host side.
        let pattern = random_bytes(1 << 20, 3);
        for off in (0..arena_len / 2).step_by(1 << 20) {
            arena.write(off, &pattern).expect("fill");
        }
    }
    let copiers = Copiers::new(&dev);
    let copier = &copiers.main;

    let Refs {
        h2d: ref_h2d,
        d2h: ref_d2h,
        both: ref_bi,
    } = references(&dev, copier, reps);

    let gemm = Gemm::new(dev.ordinal());
    let gemm_alone = gemm.as_ref().map(|g| {
        g.run(10);
        median((0..3).map(|_| g.run(40)).collect()).0
    });
    if let Some(t) = gemm_alone {
        println!("GEMM bf16 8192^3 alone: {t:.0} TFLOP/s");
    }

    let shapes: &[usize] = if (gemm_only || focus) && !big_runs {
        &[16, 4]
    } else {
        &[16, 4, 128]
    };
    for (tokens, packed) in shapes.iter().flat_map(|&t| [(t, true), (t, false)]) {
        let tag = if packed { "1-alloc" } else { "layer-alloc" };
        let key = format!("{}:{tag}", (tokens * 8 * 128 * 2) >> 10);
        if only
            .as_ref()
            .is_some_and(|o| !o.split_whitespace().any(|k| k == key))
        {
            continue;
        }
        println!(
            "--- {} KiB runs, device layers in {} ({:.1} s) ---",
            (tokens * 8 * 128 * 2) >> 10,
            if packed {
                "one allocation"
            } else {
                "one allocation each"
            },
            started.elapsed().as_secs_f64()
        );
        let run_bytes = tokens * 8 * 128 * 2;
        let shape = Shape::new(&dev, &arena, tokens, packed);
        let mk = |d: Direction, range: std::ops::Range<usize>| shape.case(d, range);
        let kib = run_bytes >> 10;
        let directions: &[Direction] = if gemm_only {
            &[]
        } else {
            &[Direction::HostToDevice, Direction::DeviceToHost]
        };
        for &d in directions {
            let case = mk(d, 0..256);
            let reps = if tokens > 16 { 3 } else { reps };
            let reference = if d == Direction::HostToDevice {
                ref_h2d
            } else {
                ref_d2h
            };
            let mut best = 0f64;
            let mut auto = Vec::new();
            for (name, copier, o) in in_two_passes(
                copiers
                    .variants(packed)
                    .into_iter()
                    .filter(|v| in_focus(v.0) && !(focus && v.0.starts_with("auto-busy")))
                    .collect(),
                focus,
            ) {
                let sh = name.ends_with("-sh");
                if let Err(e) = case.try_run_as(copier, o, sh) {
                    println!("{kib:>3} KiB {tag} runs {d:?} {name}: FAILED {e}");
                    continue;
                }
                let (m, lo, hi) = gbps(case.bytes, reps, || case.run_as(copier, o, sh));
                let submit = case.submit_us(copier, o, sh);
                println!(
                    "{kib:>3} KiB {tag} runs {d:?} 256 blocks ({} runs, {} MiB) {name:<12} {m:6.1} GB/s [{lo:.1}-{hi:.1}] ratio {:.3} (submit call {submit:.0} us)",
                    case.runs.len(),
                    case.bytes >> 20,
                    m / reference
                );
                if name.starts_with("auto") {
                    auto.push((name, m));
                } else {
                    best = best.max(m);
                }
            }
            for (name, m) in auto.into_iter().filter(|_| best > 0.0) {
                println!(
                    "{kib:>3} KiB {tag} runs {d:?} {name} / best path = {:.3}",
                    m / best
                );
            }
            // Latency of one 2 MiB block (at 32 KiB runs) per path.
            if tokens == 16 {
                let single = mk(d, 300..301);
                for (name, copier, o) in copiers
                    .variants(packed)
                    .into_iter()
                    .filter(|v| !focus || matches!(v.0, "kernel-idle" | "auto-idle"))
                {
                    single.run(copier, o);
                    let mut lat: Vec<f64> = (0..100)
                        .map(|_| {
                            let t = Instant::now();
                            single.run(copier, o);
                            t.elapsed().as_secs_f64() * 1e6
                        })
                        .collect();
                    lat.sort_by(|a, b| a.total_cmp(b));
                    println!(
                        "single 2 MiB block {d:?} {name:<12} p50 {:.1} us p99 {:.1} us",
                        lat[50], lat[98]
                    );
                }
            }
        }
        // Offload and onboard at once (disjoint blocks).
        let on = mk(Direction::HostToDevice, 0..256);
        let off = mk(Direction::DeviceToHost, 256..512);
        let reps = if tokens > 16 { 3 } else { reps };
        let mut best_bi = 0f64;
        for (name, copier, o) in in_two_passes(
            copiers
                .variants(packed)
                .into_iter()
                .filter(|v| !gemm_only && in_focus(v.0) && !(focus && v.0.starts_with("auto-busy")))
                .collect(),
            focus,
        ) {
            let sh = name.ends_with("-sh");
            let (m, lo, hi) = gbps(on.bytes + off.bytes, reps, || {
                both_as(copier, &on, &off, o, sh)
            });
            // The same submitted from two threads, as an engine's offload
            // and onboard tasks would.
            let (m2, lo2, hi2) = gbps(on.bytes + off.bytes, reps, || {
                std::thread::scope(|s| {
                    s.spawn(|| on.run_as(copier, o, sh));
                    off.run_as(copier, o, sh);
                })
            });
            println!(
                "{kib:>3} KiB {tag} runs both directions {name:<12} two threads {m2:6.1} GB/s total [{lo2:.1}-{hi2:.1}] ratio {:.3}",
                m2 / ref_bi
            );
            if name.starts_with("auto") {
                if best_bi > 0.0 {
                    println!(
                        "{kib:>3} KiB {tag} runs both directions {name} / best path = {:.3}",
                        m / best_bi
                    );
                }
            } else {
                best_bi = best_bi.max(m);
            }
            println!(
                "{kib:>3} KiB {tag} runs both directions {name:<12} {m:6.1} GB/s total [{lo:.1}-{hi:.1}] ratio {:.3}",
                m / ref_bi
            );
        }
        // One direction on the kernel, the other on the copy engines,
        // submitted from one thread in that order.
        if !gemm_only && !focus {
            let ko = opts(Some(CopyPath::Kernel), GpuLoad::Idle);
            let co = opts(Some(CopyPath::CopyEngine), GpuLoad::Idle);
            for (cname, c) in [("", &copiers.main)] {
                for (label, first, fo, second, so) in [
                    ("onboard kernel, offload copy engines", &on, ko, &off, co),
                    ("offload kernel, onboard copy engines", &off, ko, &on, co),
                    ("onboard copy engines, offload kernel", &on, co, &off, ko),
                ] {
                    let (m, lo, hi) = gbps(on.bytes + off.bytes, reps, || {
                        let r = c
                            .copy(&first.runs, &first.src, &first.dst, fo)
                            .and_then(|c1| {
                                let c2 = c.copy(&second.runs, &second.src, &second.dst, so)?;
                                c1.wait()?;
                                c2.wait()
                            });
                        if let Err(e) = r {
                            println!("FAILED mixed: {e}");
                        }
                    });
                    println!(
                        "{kib:>3} KiB {tag} runs both directions mixed{cname} ({label}) {m:6.1} GB/s total [{lo:.1}-{hi:.1}] ratio {:.3}",
                        m / ref_bi
                    );
                }
            }
        }
        // Beside a GEMM loop.
        if let (Some(g), Some(_), true) = (gemm.as_ref(), gemm_alone, tokens <= 16 || big_runs) {
            // Long enough for several copies to fit inside the GEMM window
            // (one GEMM is about 1.5 ms; copies assumed no faster than 40 GB/s).
            let copy_s = on.bytes as f64 / 40e9;
            // `KVBM_GEMM_X=k` makes the window k times longer (the in-flight
            // rows' bounds then close in on each other).
            let stretch: usize = std::env::var("KVBM_GEMM_X")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1);
            let gemm_n = ((6.0 * copy_s / 1.5e-3) as usize).max(60) * stretch.max(1);
            // Kernels on an idle-sized grid starve the GEMM (measured: -86%
            // throughput) and, run from two threads, block it entirely, so
            // only the SM-sparing variants run beside it.
            let mut rows = Vec::new();
            for v in copiers.variants(packed) {
                let keep = if focus {
                    matches!(v.0, "auto-busy")
                } else {
                    matches!(v.0, "copy-engine" | "staged" | "staged-busy" | "auto-busy")
                };
                if keep {
                    rows.push((v, 1));
                }
                // An engine's offload queue keeps several copies in flight.
                if !focus && matches!(v.0, "staged-busy" | "auto-busy") {
                    rows.push((v, 2));
                    rows.push((v, 4));
                }
            }
            for ((name, copier, o), in_flight) in rows {
                for (label, cases) in [
                    ("H2D", vec![(&on, o)]),
                    ("D2H", vec![(&off, o)]),
                    ("both", vec![(&on, o), (&off, o)]),
                ] {
                    // Alternate alone / beside three times; GEMM clocks drift,
                    // so each loss is against the run just before it.
                    let mut losses = Vec::new();
                    let mut rates = Vec::new();
                    let mut steadies = Vec::new();
                    for _ in 0..3 {
                        let alone = g.run(gemm_n);
                        let lanes = copier.config().lanes_per_direction;
                        let (t, c, st) = interfere(copier, g, &cases, gemm_n, in_flight, lanes);
                        losses.push((1.0 - t / alone) * 100.0);
                        rates.push(c);
                        steadies.push(st);
                    }
                    let reference = match label {
                        "H2D" => ref_h2d,
                        "D2H" => ref_d2h,
                        _ => ref_bi,
                    };
                    // In-flight rows: completion to completion (see
                    // `interfere`); the one-at-a-time rows keep the earlier
                    // measure, and print the other beside it.
                    let (other, c, clo, chi) = if in_flight == 1 {
                        let (c, lo, hi) = median(rates);
                        (median(steadies).0, c, lo, hi)
                    } else {
                        let (c, lo, hi) = median(steadies);
                        (median(rates).0, c, lo, hi)
                    };
                    let (l, llo, lhi) = median(losses);
                    println!(
                        "{kib:>3} KiB {tag} runs {label:<4} beside GEMM {name:<12} {} copy {c:6.1} GB/s [{clo:.1}-{chi:.1}] ratio {:.3}; GEMM loss {l:.1}% [{llo:.1}-{lhi:.1}] (3 alternations); {} {:.3}",
                        if in_flight == 1 {
                            "one at a time".to_string()
                        } else {
                            format!("{in_flight} in flight, completion to completion,")
                        },
                        c / reference,
                        if in_flight == 1 {
                            "completion to completion"
                        } else {
                            "from submission (errs low)"
                        },
                        other / reference
                    );
                }
            }
            println!("GEMM alone again: {:.0} TFLOP/s", g.run(40));
        }
    }
}
