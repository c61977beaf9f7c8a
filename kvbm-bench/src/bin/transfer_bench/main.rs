//! Throughput benchmarks of the data path, each against a reference measured
//! in the same run (interleaved, several runs, median and spread).
//!
//! ```text
//! cargo run --release -p kvbm-bench --features diagnostics --bin transfer_bench -- [memcpy|disk|bounce|all] [runs] [dir]
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
//!   file → pinned bounce → device memory through the CUDA backend; with
//!   `KVBM_SWEEP` several buffered-file engines and slot shapes in one run.
//! - window-gpu (not in `all`; `--features cuda`, needs a GPU): page-cached
//!   file → GPU with no CPU copy (the copy engines read page-locked windows
//!   of the file's mapping), against the bounce pipeline and the serial
//!   hops; `KVBM_WINDOWS` lists window size, workers and batch blocks.
//! - membw (not in `all`): DRAM bandwidth for 1–16 threads reading and
//!   copying (temporal, non-temporal, `rep movsb` stores), alone and, with
//!   a GPU, beside a pinned → device DMA loop.
//!
//! Bounce settings: `KVBM_SLOT_KIB` or `KVBM_SLOT_MIB` (slot size),
//! `KVBM_SLOTS` (slots per batch), `KVBM_BATCHES` (batches in flight),
//! `KVBM_HOP2_THREADS` (copy threads of the host-as-device hop 2),
//! `KVBM_BOUNCE_BLOCKS` (2 MiB blocks moved, default 256), `KVBM_QD` (disk
//! queue depth, default 8), `KVBM_PREAD` (pread/pwrite threads instead of
//! io_uring for O_DIRECT files) and `KVBM_BUFFERED` (`auto`, `direct`,
//! `pread:N`, `mapped:N`, `mapped-t:N`: the engine for buffered files);
//! `KVBM_TRACE=1` traces every pipelined run chunk by chunk and prints
//! where the time went. Diagnosis only: `KVBM_WAKE_SPIN_US` (the CUDA
//! completion poll of `bounce-gpu` and `window-gpu`), `KVBM_PIN=split`
//! (`bounce-gpu`: copy threads one per CPU from CPU 0, the other kvbm
//! threads on the last four CPUs).

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Instant;

use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::bounce::trace::{ChunkTrace, TraceSummary};
use kvbm_transfer::disk::{BufferedIo, DiskBackend, DiskConfig, EngineConfig};
use kvbm_transfer::memory::{DiskAllocator, DiskOptions, IoMode, SystemAllocator};
use kvbm_transfer::{
    BouncePool, Executor, ExecutorConfig, MemoryKind, MemoryRegion, PhysicalLayout,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng, rngs::StdRng};

mod bounce;
mod membw;
#[cfg(feature = "cuda")]
mod window;

#[cfg(feature = "cuda")]
use bounce::bench_bounce_gpu;
use bounce::{bench_bounce, bench_bounce_disk, loadavg};

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

/// GB/s of `bytes` moved in each of `times` (seconds).
fn rates(bytes: u64, times: &[f64]) -> Vec<f64> {
    times.iter().map(|&t| bytes as f64 / t / 1e9).collect()
}

/// Per round, the best a perfect two-hop overlap could do against the hops
/// one after the other: (t1 + t2) / max(t1, t2).
fn ideal_overlap(hop1: &[f64], hop2: &[f64]) -> Vec<f64> {
    hop1.iter()
        .zip(hop2)
        .map(|(a, b)| (a + b) / a.max(*b))
        .collect()
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

/// Files in `dir` opened with `io_mode`.
fn disk_allocator(dir: &std::path::Path, io_mode: IoMode) -> DiskAllocator {
    let options = DiskOptions {
        io_mode,
        ..Default::default()
    };
    DiskAllocator::new(dir, options).unwrap()
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

/// The disk engine's settings: queue depth from `KVBM_QD` (8 without it),
/// `pread` forced by `KVBM_PREAD`, 2 MiB I/Os.
fn disk_config() -> DiskConfig {
    DiskConfig {
        engine: EngineConfig {
            queue_depth: std::env::var("KVBM_QD")
                .ok()
                .and_then(|q| q.parse().ok())
                .unwrap_or(8),
            force_pread: std::env::var_os("KVBM_PREAD").is_some(),
            ..Default::default()
        },
        max_io_bytes: 2 * MIB as u32,
    }
}

/// The disk bench's memory and file: 1 GiB of 2 MiB blocks in host
/// memory (`src`, and `back` to read into) and in an `O_DIRECT` file, and
/// the executor that moves them. The file drops first, the host memory
/// after the executor it is registered with.
struct DiskRig {
    disk: PhysicalLayout,
    exec: Executor,
    back: PhysicalLayout,
    src: PhysicalLayout,
    /// The file's path, for the raw reference.
    path: std::path::PathBuf,
    /// Bytes of all blocks.
    bytes: u64,
    /// Every block to the same block.
    pairs: Vec<(usize, usize)>,
    /// The disk engine's name and queue depth.
    engine: &'static str,
    qd: u32,
}

impl DiskRig {
    /// Allocates the memory and a file in `dir`.
    fn new(dir: &std::path::Path) -> DiskRig {
        let blocks = 512; // 1 GiB of 2 MiB blocks
        let cfg = LayoutConfig::new(blocks, 32, 2, 16, 1024, 2).unwrap();
        let layout = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
        let src = host(layout.clone());
        let back = host(layout.clone());
        let disk_cfg = disk_config();
        let backend = DiskBackend::new(&disk_cfg).unwrap();
        let (engine, qd) = (backend.engine_name(), disk_cfg.engine.queue_depth);
        let exec = Executor::builder()
            .backend(Arc::new(backend))
            .build()
            .unwrap();
        exec.register(&src).unwrap();
        exec.register(&back).unwrap();
        let disk =
            PhysicalLayout::allocate_disk(layout.clone(), &disk_allocator(dir, IoMode::Direct))
                .unwrap();
        let path = disk.regions()[0]
            .file_location()
            .unwrap()
            .0
            .path()
            .to_path_buf();
        DiskRig {
            disk,
            exec,
            back,
            src,
            path,
            bytes: layout.total_bytes(),
            pairs: (0..blocks).map(|b| (b, b)).collect(),
            engine,
            qd,
        }
    }

    /// Host to file through the executor (`write`), or file to host.
    fn transfer(&self, write: bool) {
        if write {
            self.exec.transfer(&self.src, &self.disk, &self.pairs)
        } else {
            self.exec.transfer(&self.disk, &self.back, &self.pairs)
        }
        .wait()
        .unwrap();
    }

    /// Writes or reads the whole file with raw `O_DIRECT` I/O.
    fn raw(&self, write: bool) {
        raw_direct(&self.path, &self.back.regions()[0], self.bytes, write);
    }

    /// Writes the file and reads it back, then checks that `back` holds
    /// `src`'s bytes.
    fn verify_round_trip(&self) {
        self.transfer(true);
        self.transfer(false);
        let bytes = self.bytes as usize;
        // SAFETY: both live, no transfer running.
        let same = unsafe {
            std::slice::from_raw_parts(self.src.regions()[0].addr().unwrap() as *const u8, bytes)
                == std::slice::from_raw_parts(
                    self.back.regions()[0].addr().unwrap() as *const u8,
                    bytes,
                )
        };
        assert!(same, "disk round trip corrupted data");
    }
}

/// Seconds and CPU-seconds per GiB of each run: the executor's writes and
/// reads, and the raw reference's.
#[derive(Default)]
struct DiskTimes {
    w: Vec<f64>,
    wr: Vec<f64>,
    r: Vec<f64>,
    rr: Vec<f64>,
    wcpu: Vec<f64>,
    rcpu: Vec<f64>,
    wrcpu: Vec<f64>,
    rrcpu: Vec<f64>,
}

impl DiskTimes {
    /// `runs` rounds of writes then reads, executor and raw reference in
    /// alternating order.
    fn measure(rig: &DiskRig, runs: usize) -> DiskTimes {
        let mut d = DiskTimes::default();
        let gib = rig.bytes as f64 / GIB;
        for i in 0..runs {
            // Alternate which of subject and reference goes first, so neither
            // always inherits the other's write-back or cache state.
            for first in [i % 2 == 0, i % 2 == 1] {
                if first {
                    let (t, c) = measure(|| rig.transfer(true));
                    d.w.push(t);
                    d.wcpu.push(c / gib);
                } else {
                    let (t, c) = measure(|| rig.raw(true));
                    d.wr.push(t);
                    d.wrcpu.push(c / gib);
                }
            }
            for first in [i % 2 == 0, i % 2 == 1] {
                if first {
                    let (t, c) = measure(|| rig.transfer(false));
                    d.r.push(t);
                    d.rcpu.push(c / gib);
                } else {
                    let (t, c) = measure(|| rig.raw(false));
                    d.rr.push(t);
                    d.rrcpu.push(c / gib);
                }
            }
        }
        d
    }

    /// Prints the rates against the raw reference, the CPU cost, and
    /// whether the disk targets were met.
    fn print(&mut self, rig: &DiskRig) {
        let (engine, qd, bytes) = (rig.engine, rig.qd, rig.bytes);
        let wratio = report(
            &format!("host→disk {engine} (2 MiB, QD {qd})"),
            bytes,
            &mut self.w,
            &mut self.wr,
            "raw O_DIRECT pwrite 2 MiB",
        );
        let rratio = report(
            &format!("disk→host {engine} (2 MiB, QD {qd})"),
            bytes,
            &mut self.r,
            &mut self.rr,
            "raw O_DIRECT pread 2 MiB",
        );
        let (wc, rc) = (median(&mut self.wcpu), median(&mut self.rcpu));
        println!(
            "CPU s/GiB: write {wc:.3} (runs {}), read {rc:.3} (runs {}); raw loop write {:.3}, read {:.3}",
            spread(&self.wcpu),
            spread(&self.rcpu),
            median(&mut self.wrcpu),
            median(&mut self.rrcpu)
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
}

/// The disk rows: the backend's writes and reads against raw `O_DIRECT`
/// ones of the same file, `runs` times, then one round trip checked.
fn bench_disk(runs: usize, dir: &std::path::Path) {
    let rig = DiskRig::new(dir);
    let mut times = DiskTimes::measure(&rig, runs);
    // Verify the last round trip: disk holds `back`'s bytes from the raw
    // write... so redo a clean write/read and compare.
    rig.verify_round_trip();
    times.print(&rig);
}

/// Runs the benches the first argument names (`all` by default) with the
/// repetitions of the second, over files in the directory of the third.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let what = args.get(1).map_or("all", String::as_str);
    let runs = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(5);
    let dir = args.get(3).map_or_else(
        || std::env::temp_dir().join("kvbm-transfer-bench"),
        std::path::PathBuf::from,
    );
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
    if what == "membw" {
        #[cfg(feature = "cuda")]
        let dma = membw::DmaLoop::new();
        #[cfg(feature = "cuda")]
        let bg = dma.as_ref().map(|d| d as &dyn membw::Background);
        #[cfg(not(feature = "cuda"))]
        let bg = None;
        #[cfg(target_arch = "x86_64")]
        membw::probe(runs, bg);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = bg;
    }
    if what == "window-gpu" {
        #[cfg(feature = "cuda")]
        window::bench_window_gpu(runs, &dir);
        #[cfg(not(feature = "cuda"))]
        println!("window-gpu: skipped: built without the `cuda` feature");
    }
    if matches!(what, "bounce-gpu" | "all") {
        #[cfg(feature = "cuda")]
        bench_bounce_gpu(runs, &dir);
        #[cfg(not(feature = "cuda"))]
        println!("bounce-gpu: skipped: built without the `cuda` feature");
    }
}
