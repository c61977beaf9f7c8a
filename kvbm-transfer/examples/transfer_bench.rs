//! Throughput benchmarks of the data path, each against a reference measured
//! in the same run (interleaved, several runs, median and spread).
//!
//! ```text
//! cargo run --release -p kvbm-transfer --example transfer_bench -- [memcpy|disk|bounce|all] [runs] [dir]
//! ```
//!
//! - memcpy: 256 non-consecutive 2 MiB blocks, LayerSeparate → FullyContiguous
//!   (32 KiB runs), vs one `memcpy` of the same bytes.
//! - disk: host → disk and disk → host of 2 MiB blocks through io_uring, vs a
//!   raw sequential O_DIRECT pwrite/pread loop with 2 MiB requests on the
//!   same file; plus process CPU seconds per GiB.
//! - bounce: page-cached file → bounce → host standing in for a device, as a
//!   pipeline vs the same two hops one after the other.
//! - bounce-disk: page-cached file → bounce → O_DIRECT file, the same way.
//! - bounce-gpu (built with `--features cuda`, needs a GPU): page-cached
//!   file → pinned bounce → device memory through the CUDA backend.
//!
//! Bounce settings: `KVBM_SLOT_KIB` or `KVBM_SLOT_MIB` (slot size),
//! `KVBM_SLOTS` (slots per batch), `KVBM_BATCHES` (batches in flight),
//! `KVBM_HOP2_THREADS` (copy threads of the host-as-device hop 2),
//! `KVBM_BOUNCE_BLOCKS` (2 MiB blocks moved, default 256), `KVBM_QD` (disk
//! queue depth, default 8) and `KVBM_PREAD` (pread/pwrite threads instead of
//! io_uring);
//! `KVBM_TRACE=1` traces every pipelined run chunk by chunk and prints
//! where the time went.

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Instant;

use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::bounce::trace::{ChunkTrace, TraceSummary};
use kvbm_transfer::disk::{DiskBackend, DiskConfig, EngineConfig};
use kvbm_transfer::memory::{DiskAllocator, DiskOptions, IoMode, SystemAllocator};
use kvbm_transfer::{
    BackendKind, BouncePool, Completion, Executor, ExecutorConfig, MemoryKind, MemoryRegion,
    PhysicalLayout, TransferBackend, TransferJob,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng, rngs::StdRng};

const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;

fn cpu_seconds() -> f64 {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a full rusage into the pointer we pass.
    let u = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr());
        u.assume_init()
    };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Wall seconds and CPU seconds of `f`.
fn measure(f: impl FnOnce()) -> (f64, f64) {
    let (c0, t0) = (cpu_seconds(), Instant::now());
    f();
    (t0.elapsed().as_secs_f64(), cpu_seconds() - c0)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn spread(v: &[f64]) -> String {
    let (lo, hi) = v
        .iter()
        .fold((f64::MAX, 0f64), |(l, h), &x| (l.min(x), h.max(x)));
    format!("{lo:.2}–{hi:.2}")
}

fn fill(region: &MemoryRegion, seed: u64) {
    // SAFETY: a live system allocation that no transfer touches right now.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(region.addr().unwrap() as *mut u8, region.len() as usize)
    };
    StdRng::seed_from_u64(seed).fill(bytes);
}

fn allocator() -> SystemAllocator {
    let huge = std::env::var_os("KVBM_BENCH_THP").is_some();
    SystemAllocator::new().populate(true).huge_pages(if huge {
        kvbm_transfer::memory::HugePages::Transparent
    } else {
        kvbm_transfer::memory::HugePages::Off
    })
}

fn host(layout: Layout) -> PhysicalLayout {
    let p = PhysicalLayout::allocate_system(layout, &allocator()).unwrap();
    for (i, r) in p.regions().iter().enumerate() {
        fill(r, i as u64);
    }
    p
}

fn report(
    name: &str,
    bytes: u64,
    subject: &mut [f64],
    reference: &mut [f64],
    ref_name: &str,
) -> f64 {
    let gbs = |t: f64| bytes as f64 / t / 1e9;
    let s: Vec<f64> = subject.iter().map(|&t| gbs(t)).collect();
    let r: Vec<f64> = reference.iter().map(|&t| gbs(t)).collect();
    let ratios: Vec<f64> = subject
        .iter()
        .zip(reference.iter())
        .map(|(s, r)| r / s)
        .collect();
    let (ms, mr) = (gbs(median(subject)), gbs(median(reference)));
    let mut rr = ratios.clone();
    let ratio = median(&mut rr);
    println!(
        "{name}: {ms:.2} GB/s (runs {}) | {ref_name}: {mr:.2} GB/s (runs {}) | ratio median {ratio:.3} (per-run {})",
        spread(&s),
        spread(&r),
        spread(&ratios)
    );
    ratio
}

fn bench_memcpy(runs: usize) {
    // 32 layers × K,V × 32 KiB chunks = 2 MiB blocks.
    let src_cfg = LayoutConfig::new(512, 32, 2, 16, 1024, 2).unwrap();
    let dst_cfg = src_cfg.with_num_blocks(256).unwrap();
    let src =
        host(Layout::new(src_cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap());
    let dst = host(Layout::new(dst_cfg, LayoutKind::FullyContiguous).unwrap());
    let mut blocks: Vec<usize> = (0..512).collect();
    blocks.shuffle(&mut StdRng::seed_from_u64(42));
    let pairs: Vec<(usize, usize)> = blocks[..256]
        .iter()
        .enumerate()
        .map(|(d, &s)| (s, d))
        .collect();
    let bytes = 256 * dst_cfg.block_bytes();
    let plan = kvbm_layout::plan_copy(src.layout(), dst.layout(), &pairs).unwrap();
    println!(
        "memcpy plan: {} runs, {} MiB",
        plan.len(),
        plan.total_bytes() / MIB
    );
    let threads = std::env::var("KVBM_MEMCPY_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let exec = Executor::builder()
        .backend(Arc::new(MemcpyBackend::new(threads).unwrap()))
        .build()
        .unwrap();
    let a = allocator().allocate(bytes).unwrap();
    let b = allocator().allocate(bytes).unwrap();
    fill(&a.region(), 1);
    fill(&b.region(), 2);
    let (mut subject, mut reference) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        subject.push(
            measure(|| {
                assert_eq!(
                    exec.transfer(&src, &dst, &pairs).wait().unwrap().bytes,
                    bytes
                )
            })
            .0,
        );
        // SAFETY: two distinct live allocations of `bytes` bytes each.
        reference.push(
            measure(|| unsafe {
                std::ptr::copy_nonoverlapping(
                    a.addr() as *const u8,
                    b.addr() as *mut u8,
                    bytes as usize,
                )
            })
            .0,
        );
    }
    let ratio = report(
        &format!("memcpy plan (256 × 2 MiB, 32 KiB runs, {threads} threads)"),
        bytes,
        &mut subject,
        &mut reference,
        "one memcpy",
    );
    println!(
        "memcpy target ≥ 0.9: {}",
        if ratio >= 0.9 { "met" } else { "MISSED" }
    );
}

fn raw_direct(path: &std::path::Path, buf: &MemoryRegion, bytes: u64, write: bool) {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap();
    // SAFETY: a live system allocation of at least `bytes` bytes that no
    // transfer touches during the reference run.
    let mem =
        unsafe { std::slice::from_raw_parts_mut(buf.addr().unwrap() as *mut u8, bytes as usize) };
    for (i, chunk) in mem.chunks_mut(2 * MIB as usize).enumerate() {
        let off = i as u64 * 2 * MIB;
        if write {
            f.write_all_at(chunk, off).unwrap();
        } else {
            f.read_exact_at(chunk, off).unwrap();
        }
    }
}

fn bench_disk(runs: usize, dir: &std::path::Path) {
    let blocks = 512; // 1 GiB of 2 MiB blocks
    let cfg = LayoutConfig::new(blocks, 32, 2, 16, 1024, 2).unwrap();
    let layout = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let src = host(layout.clone());
    let back = host(layout.clone());
    let disk_cfg = DiskConfig {
        engine: EngineConfig {
            queue_depth: std::env::var("KVBM_QD")
                .ok()
                .and_then(|q| q.parse().ok())
                .unwrap_or(8),
            force_pread: std::env::var_os("KVBM_PREAD").is_some(),
        },
        max_io_bytes: 2 * MIB as u32,
    };
    let backend = DiskBackend::new(&disk_cfg).unwrap();
    let (engine, qd) = (backend.engine_name(), disk_cfg.engine.queue_depth);
    let exec = Executor::builder()
        .backend(Arc::new(backend))
        .build()
        .unwrap();
    exec.register(&src).unwrap();
    exec.register(&back).unwrap();
    let alloc = DiskAllocator::new(
        dir,
        DiskOptions {
            io_mode: IoMode::Direct,
            ..Default::default()
        },
    )
    .unwrap();
    let disk = PhysicalLayout::allocate_disk(layout.clone(), &alloc).unwrap();
    let path = disk.regions()[0]
        .file_location()
        .unwrap()
        .0
        .path()
        .to_path_buf();
    let bytes = layout.total_bytes();
    let pairs: Vec<_> = (0..blocks).map(|b| (b, b)).collect();
    let (mut w, mut wr, mut r, mut rr, mut wcpu, mut rcpu, mut wrcpu, mut rrcpu) = (
        vec![],
        vec![],
        vec![],
        vec![],
        vec![],
        vec![],
        vec![],
        vec![],
    );
    let gib = bytes as f64 / GIB;
    for i in 0..runs {
        // Alternate which of subject and reference goes first, so neither
        // always inherits the other's write-back or cache state.
        for first in [i % 2 == 0, i % 2 == 1] {
            if first {
                let (t, c) = measure(|| {
                    exec.transfer(&src, &disk, &pairs).wait().unwrap();
                });
                w.push(t);
                wcpu.push(c / gib);
            } else {
                let (t, c) = measure(|| raw_direct(&path, &back.regions()[0], bytes, true));
                wr.push(t);
                wrcpu.push(c / gib);
            }
        }
        for first in [i % 2 == 0, i % 2 == 1] {
            if first {
                let (t, c) = measure(|| {
                    exec.transfer(&disk, &back, &pairs).wait().unwrap();
                });
                r.push(t);
                rcpu.push(c / gib);
            } else {
                let (t, c) = measure(|| raw_direct(&path, &back.regions()[0], bytes, false));
                rr.push(t);
                rrcpu.push(c / gib);
            }
        }
    }
    // Verify the last round trip: disk holds `back`'s bytes from the raw
    // write... so redo a clean write/read and compare.
    exec.transfer(&src, &disk, &pairs).wait().unwrap();
    exec.transfer(&disk, &back, &pairs).wait().unwrap();
    // SAFETY: both live, no transfer running.
    let same = unsafe {
        std::slice::from_raw_parts(
            src.regions()[0].addr().unwrap() as *const u8,
            bytes as usize,
        ) == std::slice::from_raw_parts(
            back.regions()[0].addr().unwrap() as *const u8,
            bytes as usize,
        )
    };
    assert!(same, "disk round trip corrupted data");
    let wratio = report(
        &format!("host→disk {engine} (2 MiB, QD {qd})"),
        bytes,
        &mut w,
        &mut wr,
        "raw O_DIRECT pwrite 2 MiB",
    );
    let rratio = report(
        &format!("disk→host {engine} (2 MiB, QD {qd})"),
        bytes,
        &mut r,
        &mut rr,
        "raw O_DIRECT pread 2 MiB",
    );
    let (wc, rc) = (median(&mut wcpu), median(&mut rcpu));
    println!(
        "CPU s/GiB: write {wc:.3} (runs {}), read {rc:.3} (runs {}); raw loop write {:.3}, read {:.3}",
        spread(&wcpu),
        spread(&rcpu),
        median(&mut wrcpu),
        median(&mut rrcpu)
    );
    println!(
        "disk targets: write ratio {} read ratio {} CPU {}",
        if wratio >= 0.9 { "met" } else { "MISSED" },
        if rratio >= 0.9 { "met" } else { "MISSED" },
        if wc <= 0.1 && rc <= 0.1 {
            "met"
        } else {
            "MISSED"
        }
    );
}

/// Host memory labelled as device memory, moved by memcpy: stands in for
/// the CUDA backend on a CPU machine.
struct HostAsDevice(MemcpyBackend);

impl TransferBackend for HostAsDevice {
    fn name(&self) -> &'static str {
        "host-as-device"
    }
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }
    fn supports(&self, _: MemoryKind, _: MemoryKind) -> bool {
        true
    }
    fn submit(&self, job: TransferJob) -> Completion {
        let relabel = |rs: &[MemoryRegion]| -> Arc<[MemoryRegion]> {
            rs.iter()
                // SAFETY: the "device" regions are system allocations kept
                // alive by the owner the new region carries.
                .map(|r| unsafe {
                    MemoryRegion::from_raw(
                        r.addr().unwrap(),
                        r.len(),
                        MemoryKind::Pinned,
                        r.owner().cloned(),
                    )
                })
                .collect()
        };
        self.0.submit(TransferJob::new(
            relabel(&job.src),
            relabel(&job.dst),
            job.runs.clone(),
            job.cancel.clone(),
        ))
    }
}

/// Bounce settings from the environment: slot size (`KVBM_SLOT_KIB`, else
/// `KVBM_SLOT_MIB`, default 8 MiB), slots per batch (`KVBM_SLOTS`, 2) and
/// batches in flight (`KVBM_BATCHES`, 2). The pool holds slots × batches.
struct BounceParams {
    slot: u64,
    per_batch: u64,
    batches: u64,
}

fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

impl BounceParams {
    fn from_env() -> Self {
        let slot = match std::env::var("KVBM_SLOT_KIB")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        {
            Some(kib) => kib * 1024,
            None => env_u64("KVBM_SLOT_MIB", 8) * MIB,
        };
        BounceParams {
            slot,
            per_batch: env_u64("KVBM_SLOTS", 2),
            batches: env_u64("KVBM_BATCHES", 2),
        }
    }

    fn pool_slots(&self) -> usize {
        (self.per_batch * self.batches) as usize
    }

    fn config(&self) -> ExecutorConfig {
        ExecutorConfig {
            max_blocks_per_batch: 64,
            max_batches_in_flight: self.batches as usize,
            bounce_slots_per_batch: self.per_batch as usize,
        }
    }

    fn label(&self) -> String {
        let slot = if self.slot >= MIB {
            format!("{} MiB", self.slot / MIB)
        } else {
            format!("{} KiB", self.slot / 1024)
        };
        format!("{slot} slots ×{} ×{} batches", self.per_batch, self.batches)
    }

    /// An executor builder with the settings, and the chunk trace when
    /// `KVBM_TRACE` is set.
    fn builder(&self, trace: &Option<Arc<ChunkTrace>>) -> kvbm_transfer::ExecutorBuilder {
        let b = Executor::builder().config(self.config());
        match trace {
            Some(t) => b.chunk_trace(t.clone()),
            None => b,
        }
    }
}

fn trace_from_env() -> Option<Arc<ChunkTrace>> {
    std::env::var_os("KVBM_TRACE").map(|_| Arc::new(ChunkTrace::new(1 << 18)))
}

/// With `KVBM_PIN=1`: pins this process's hop threads, found by name, to
/// separate CPUs (the io_uring read ring on CPU 0, everything else of
/// kvbm's on CPU 1) — a diagnosis of thread placement, not a setting.
fn pin_threads_from_env() {
    if std::env::var_os("KVBM_PIN").is_none() {
        return;
    }
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let Ok(tid) = t.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cpu = match comm.trim() {
            c if c.starts_with("kvbm-uring-rd") => 0,
            c if c.starts_with("kvbm-") => 1,
            _ => continue,
        };
        // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and
        // sched_setaffinity only read and write the set we own.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
        println!("  pinned {} (tid {tid}) to CPU {cpu}", comm.trim());
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Pipelined and serial timings of one bounce case.
#[derive(Default)]
struct Rounds {
    piped: Vec<f64>,
    serial: Vec<f64>,
    hop1: Vec<f64>,
    hop2: Vec<f64>,
    cpu_piped: Vec<f64>,
    cpu_serial: Vec<f64>,
}

/// `runs` rounds of the pipelined transfer against hop 1 for everything
/// followed by hop 2 for everything, alternating which goes first. With a
/// trace, each pipelined run is traced and summarised.
fn rounds(
    bytes: u64,
    runs: usize,
    trace: Option<&ChunkTrace>,
    mut piped: impl FnMut(),
    mut hop1: impl FnMut(),
    mut hop2: impl FnMut(),
) -> Rounds {
    let mut r = Rounds::default();
    let mut last = None;
    for i in 0..runs {
        for first in [i % 2 == 0, i % 2 == 1] {
            if first {
                if let Some(t) = trace {
                    t.clear();
                }
                let (t, c) = measure(&mut piped);
                r.piped.push(t);
                r.cpu_piped.push(c);
                if let Some(t) = trace {
                    let s = TraceSummary::from_records(&t.records());
                    let line = s.to_string();
                    let rate = |ns: u64| bytes as f64 / ns.max(1) as f64;
                    println!(
                        "  trace run {i}: {}; while busy hop 1 moved {:.2} GB/s, hop 2 {:.2} GB/s",
                        line.lines().next().unwrap_or(""),
                        rate(s.hop1_busy_ns),
                        rate(s.hop2_busy_ns)
                    );
                    last = Some(line);
                }
            } else {
                let (t1, c1) = measure(&mut hop1);
                let (t2, c2) = measure(&mut hop2);
                r.serial.push(t1 + t2);
                r.cpu_serial.push(c1 + c2);
                r.hop1.push(t1);
                r.hop2.push(t2);
            }
        }
    }
    if let Some(s) = last {
        for l in s.lines().skip(1) {
            println!("  trace (last run): {l}");
        }
    }
    r
}

/// Prints hop-alone rates, the ideal overlap and the ratio; returns it.
fn report_rounds(label: &str, bytes: u64, r: &mut Rounds, pool: &BouncePool) -> f64 {
    assert_eq!(pool.available(), pool.capacity(), "bounce slots leaked");
    let gbs = |t: &[f64]| -> Vec<f64> { t.iter().map(|&t| bytes as f64 / t / 1e9).collect() };
    let ideal: Vec<f64> = r
        .hop1
        .iter()
        .zip(&r.hop2)
        .map(|(a, b)| (a + b) / a.max(*b))
        .collect();
    println!(
        "  load {}; hop 1 alone {:.2} GB/s (runs {}), hop 2 alone {:.2} GB/s (runs {}); ideal overlap (t1+t2)/max(t1,t2) median {:.2} (runs {}); CPU s: pipelined {:.3}, serial {:.3}",
        loadavg(),
        median(&mut gbs(&r.hop1)),
        spread(&gbs(&r.hop1)),
        median(&mut gbs(&r.hop2)),
        spread(&gbs(&r.hop2)),
        median(&mut ideal.clone()),
        spread(&ideal),
        median(&mut r.cpu_piped),
        median(&mut r.cpu_serial),
    );
    let ratio = report(
        label,
        bytes,
        &mut r.piped,
        &mut r.serial,
        "same hops one after the other",
    );
    println!(
        "  {label}: target ≥ 1.6 {}; {:.0}% of the ideal overlap",
        if ratio >= 1.6 { "met" } else { "MISSED" },
        100.0 * (ratio - 1.0) / (median(&mut ideal.clone()) - 1.0).max(1e-9)
    );
    ratio
}

fn buffered_source(
    dir: &std::path::Path,
    layout: &Layout,
    exec: &Executor,
) -> (PhysicalLayout, PhysicalLayout) {
    let alloc = DiskAllocator::new(
        dir,
        DiskOptions {
            io_mode: IoMode::Buffered,
            ..Default::default()
        },
    )
    .unwrap();
    let file = PhysicalLayout::allocate_disk(layout.clone(), &alloc).unwrap();
    let seed = host(layout.clone());
    let pairs: Vec<_> = (0..layout.config().num_blocks()).map(|b| (b, b)).collect();
    exec.transfer(&seed, &file, &pairs).wait().unwrap();
    (file, seed)
}

/// The bounce benches' disk backend: queue depth `KVBM_QD` (default 8),
/// the pread/pwrite threads instead of io_uring with `KVBM_PREAD`.
fn disk_backend() -> DiskBackend {
    DiskBackend::new(&DiskConfig {
        engine: EngineConfig {
            queue_depth: env_u64("KVBM_QD", 8) as u32,
            force_pread: std::env::var_os("KVBM_PREAD").is_some(),
        },
        max_io_bytes: 2 * MIB as u32,
    })
    .unwrap()
}

/// Whether every chunk of `a` equals the same chunk of `b` (host layouts).
fn same_chunks(a: &PhysicalLayout, b: &PhysicalLayout) -> bool {
    let cfg = a.layout().config();
    let bytes = |p: &PhysicalLayout, blk, l, o| {
        let c = p.layout().chunk(blk, l, o).unwrap();
        let base = p.regions()[c.region].addr().unwrap() + c.offset;
        // SAFETY: a live host region, not written while we compare.
        unsafe { std::slice::from_raw_parts(base as *const u8, c.len as usize) }
    };
    (0..cfg.num_blocks()).all(|blk| {
        (0..cfg.num_layers())
            .all(|l| (0..cfg.outer_dim()).all(|o| bytes(a, blk, l, o) == bytes(b, blk, l, o)))
    })
}

/// The case every bounce bench moves: `KVBM_BOUNCE_BLOCKS` (256, i.e.
/// 512 MiB) blocks of 2 MiB.
fn bounce_layouts() -> (Layout, Layout) {
    let blocks = env_u64("KVBM_BOUNCE_BLOCKS", 256) as usize;
    let cfg = LayoutConfig::new(blocks, 32, 2, 16, 1024, 2).unwrap();
    (
        Layout::new(cfg, LayoutKind::FullyContiguous).unwrap(),
        Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap(),
    )
}

/// Page-cached file → bounce → host standing in for the device (both hops
/// CPU copies).
fn bench_bounce(runs: usize, dir: &std::path::Path) {
    let p = BounceParams::from_env();
    let trace = trace_from_env();
    let (fc, dev_l) = bounce_layouts();
    let bytes = fc.total_bytes();
    let pinned_buf = allocator()
        .allocate(p.pool_slots() as u64 * p.slot)
        .unwrap();
    // SAFETY: a live system allocation owned by the region.
    let pinned = unsafe {
        MemoryRegion::from_raw(
            pinned_buf.addr(),
            pinned_buf.len(),
            MemoryKind::Pinned,
            Some(pinned_buf),
        )
    };
    let pool = BouncePool::new(pinned, p.slot).unwrap();
    let exec = p
        .builder(&trace)
        .backend(Arc::new(disk_backend()))
        .backend(Arc::new(MemcpyBackend::new(1).unwrap()))
        .backend(Arc::new(HostAsDevice(
            MemcpyBackend::new(env_u64("KVBM_HOP2_THREADS", 1) as usize).unwrap(),
        )))
        .bounce_pool(pool.clone())
        .build()
        .unwrap();
    let (file, seed) = buffered_source(dir, &fc, &exec);
    pin_threads_from_env();
    // "Device" destination: host memory labelled Device(0).
    let dev_regions = (0..dev_l.num_regions())
        .map(|r| {
            let b = SystemAllocator::new()
                .populate(true)
                .allocate(dev_l.region_size(r).unwrap())
                .unwrap();
            // SAFETY: a live system allocation owned by the region.
            unsafe { MemoryRegion::from_raw(b.addr(), b.len(), MemoryKind::Device(0), Some(b)) }
        })
        .collect();
    let dev = PhysicalLayout::new(dev_l.clone(), dev_regions).unwrap();
    let staging = host(fc.clone());
    exec.register(&staging).unwrap();
    let pairs: Vec<_> = (0..fc.config().num_blocks()).map(|b| (b, b)).collect();
    let mut r = rounds(
        bytes,
        runs,
        trace.as_deref(),
        || {
            exec.transfer(&file, &dev, &pairs).wait().unwrap();
        },
        || {
            exec.transfer(&file, &staging, &pairs).wait().unwrap();
        },
        || {
            exec.transfer(&staging, &dev, &pairs).wait().unwrap();
        },
    );
    // The serial run was the last to write `dev` in odd-length runs: redo
    // a pipelined copy and check it.
    let wipe = host(dev_l.clone());
    exec.transfer(&wipe, &dev, &pairs).wait().unwrap();
    exec.transfer(&file, &dev, &pairs).wait().unwrap();
    assert!(same_chunks(&seed, &dev), "bounce pipeline corrupted data");
    report_rounds(
        &format!(
            "bounce pipeline (page cache → {} → host-as-device)",
            p.label()
        ),
        bytes,
        &mut r,
        &pool,
    );
}

/// Page-cached file → system bounce → O_DIRECT file (the disk → disk row):
/// hop 1 is CPU work (a page-cache copy), hop 2 is device work, so the
/// pipeline can overlap them even when this process gets little CPU.
fn bench_bounce_disk(runs: usize, dir: &std::path::Path) {
    let p = BounceParams::from_env();
    let trace = trace_from_env();
    let (fc, _) = bounce_layouts();
    let bytes = fc.total_bytes();
    let pool = BouncePool::system(p.pool_slots(), p.slot).unwrap();
    let exec = p
        .builder(&trace)
        .backend(Arc::new(disk_backend()))
        .bounce_pool(pool.clone())
        .build()
        .unwrap();
    let (src, seed) = buffered_source(dir, &fc, &exec);
    pin_threads_from_env();
    let direct = DiskAllocator::new(
        dir,
        DiskOptions {
            io_mode: IoMode::Direct,
            ..Default::default()
        },
    )
    .unwrap();
    let dst = PhysicalLayout::allocate_disk(fc.clone(), &direct).unwrap();
    let staging = host(fc.clone());
    exec.register(&staging).unwrap();
    let pairs: Vec<_> = (0..fc.config().num_blocks()).map(|b| (b, b)).collect();
    let mut r = rounds(
        bytes,
        runs,
        trace.as_deref(),
        || {
            exec.transfer(&src, &dst, &pairs).wait().unwrap();
        },
        || {
            exec.transfer(&src, &staging, &pairs).wait().unwrap();
        },
        || {
            exec.transfer(&staging, &dst, &pairs).wait().unwrap();
        },
    );
    // Check a fresh pipelined copy byte for byte.
    exec.transfer(&host(fc.clone()), &dst, &pairs)
        .wait()
        .unwrap();
    exec.transfer(&src, &dst, &pairs).wait().unwrap();
    let back = host(fc.clone());
    exec.transfer(&dst, &back, &pairs).wait().unwrap();
    assert!(
        same_chunks(&seed, &back),
        "disk to disk copy corrupted data"
    );
    report_rounds(
        &format!(
            "bounce pipeline (page cache → {} → O_DIRECT file)",
            p.label()
        ),
        bytes,
        &mut r,
        &pool,
    );
}

/// Page-cached file → pinned bounce → GPU through the CUDA backend: the
/// G3 → G1 onboard path without GPUDirect Storage. Hop 1 is a CPU copy out
/// of the page cache, hop 2 a DMA on the copy engines.
#[cfg(feature = "cuda")]
fn bench_bounce_gpu(runs: usize, dir: &std::path::Path) {
    use kvbm_transfer::cuda::{
        CopierConfig, CudaBackend, CudaCopier, CudaDevice, CudaRegion, DeviceBuffer, PinnedMemory,
        PinnedOptions, Probe, probe,
    };
    let Probe::Devices(_) = probe() else {
        println!("bounce-gpu: skipped: no CUDA device");
        return;
    };
    let device = CudaDevice::open(0).unwrap();
    let p = BounceParams::from_env();
    let trace = trace_from_env();
    let (fc, dev_l) = bounce_layouts();
    let bytes = fc.total_bytes();
    let pinned = |len: u64| {
        Arc::new(
            PinnedMemory::allocate(&device, len as usize, PinnedOptions::for_device(&device))
                .unwrap(),
        )
    };
    let pool = BouncePool::new(pinned(p.pool_slots() as u64 * p.slot).region(), p.slot).unwrap();
    let copier = Arc::new(CudaCopier::new(&device, CopierConfig::default()).unwrap());
    let exec = p
        .builder(&trace)
        .backend(Arc::new(disk_backend()))
        .backend(Arc::new(CudaBackend::new(copier)))
        .bounce_pool(pool.clone())
        .build()
        .unwrap();
    let (file, seed) = buffered_source(dir, &fc, &exec);
    let staging_mem = pinned(fc.region_size(0).unwrap());
    let staging = PhysicalLayout::new(fc.clone(), vec![staging_mem.region()]).unwrap();
    exec.register(&staging).unwrap();
    let buffers: Vec<Arc<DeviceBuffer>> = (0..dev_l.num_regions())
        .map(|r| {
            Arc::new(DeviceBuffer::new(&device, dev_l.region_size(r).unwrap() as usize).unwrap())
        })
        .collect();
    let dev =
        PhysicalLayout::new(dev_l.clone(), buffers.iter().map(|b| b.region()).collect()).unwrap();
    let pairs: Vec<_> = (0..fc.config().num_blocks()).map(|b| (b, b)).collect();
    let mut r = rounds(
        bytes,
        runs,
        trace.as_deref(),
        || {
            exec.transfer(&file, &dev, &pairs).wait().unwrap();
        },
        || {
            exec.transfer(&file, &staging, &pairs).wait().unwrap();
        },
        || {
            exec.transfer(&staging, &dev, &pairs).wait().unwrap();
        },
    );
    // Check a fresh pipelined copy: device chunks against the seed.
    for b in &buffers {
        let zeros = vec![0u8; CudaRegion::len(&**b)];
        b.write(0, &zeros).unwrap();
    }
    exec.transfer(&file, &dev, &pairs).wait().unwrap();
    let images: Vec<Vec<u8>> = buffers
        .iter()
        .map(|b| {
            let mut out = vec![0u8; CudaRegion::len(&**b)];
            b.read(0, &mut out).unwrap();
            out
        })
        .collect();
    let cfg = fc.config();
    for blk in 0..cfg.num_blocks() {
        for l in 0..cfg.num_layers() {
            for o in 0..cfg.outer_dim() {
                let s = seed.layout().chunk(blk, l, o).unwrap();
                let d = dev_l.chunk(blk, l, o).unwrap();
                let base = seed.regions()[s.region].addr().unwrap() + s.offset;
                // SAFETY: a live host region that nothing writes now.
                let want = unsafe { std::slice::from_raw_parts(base as *const u8, s.len as usize) };
                let got = &images[d.region][d.offset as usize..][..d.len as usize];
                assert!(
                    want == got,
                    "GPU bounce corrupted block {blk} layer {l} outer {o}"
                );
            }
        }
    }
    report_rounds(
        &format!("bounce pipeline (page cache → pinned {} → GPU)", p.label()),
        bytes,
        &mut r,
        &pool,
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let what = args.get(1).map_or("all", String::as_str);
    let runs = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(5);
    let dir = std::path::PathBuf::from(args.get(3).map_or("/work/tmp-bench", String::as_str));
    std::fs::create_dir_all(&dir).unwrap();
    println!("load average at start: {}", loadavg());
    if matches!(what, "memcpy" | "all") {
        bench_memcpy(runs);
    }
    if matches!(what, "disk" | "all") {
        bench_disk(runs, &dir);
    }
    if matches!(what, "bounce" | "all") {
        bench_bounce(runs, &dir);
    }
    if matches!(what, "bounce-disk" | "all") {
        bench_bounce_disk(runs, &dir);
    }
    if matches!(what, "bounce-gpu" | "all") {
        #[cfg(feature = "cuda")]
        bench_bounce_gpu(runs, &dir);
        #[cfg(not(feature = "cuda"))]
        println!("bounce-gpu: skipped: built without the `cuda` feature");
    }
}
