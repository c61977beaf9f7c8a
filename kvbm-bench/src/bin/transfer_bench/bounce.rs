//! The two-hop benches: a page-cached file through bounce slots into host
//! memory standing in for a device (`bounce`), an O_DIRECT file
//! (`bounce-disk`) or a GPU (`bounce-gpu`), each pipelined against the same
//! two hops one after the other, with the hop-alone rates and the ideal
//! overlap from the same run.

use kvbm_testkit::stand_in::{HostAsDevice, host_device_layout};

use super::*;

/// Bounce settings from the environment: slot size (`KVBM_SLOT_KIB`, else
/// `KVBM_SLOT_MIB`, default 8 MiB), slots per batch (`KVBM_SLOTS`, 2) and
/// batches in flight (`KVBM_BATCHES`, 2). The pool holds slots × batches.
pub(super) struct BounceParams {
    pub(super) slot: u64,
    pub(super) per_batch: u64,
    pub(super) batches: u64,
}

pub(super) fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

impl BounceParams {
    pub(super) fn from_env() -> Self {
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

    pub(super) fn pool_slots(&self) -> usize {
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
    pub(super) fn builder(
        &self,
        trace: &Option<Arc<ChunkTrace>>,
    ) -> kvbm_transfer::ExecutorBuilder {
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
/// With `KVBM_PIN=split`: the mapped engine's copy threads one per CPU
/// from CPU 0, every other kvbm thread (hop 2, feeders, watchers) on the
/// last four CPUs, so the copies cannot take their CPU time.
fn pin_threads_from_env() {
    let Some(mode) = std::env::var_os("KVBM_PIN") else {
        return;
    };
    let split = mode == "split";
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    let mut next_copy = 0;
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let Ok(tid) = t.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let set_of: Vec<usize> = match comm.trim() {
            c if split && c.starts_with("kvbm-mapped") => {
                next_copy += 1;
                vec![(next_copy - 1) % cpus.saturating_sub(4).max(1)]
            }
            c if split && c.starts_with("kvbm-") => (cpus.saturating_sub(4)..cpus).collect(),
            c if !split && c.starts_with("kvbm-uring-rd") => vec![0],
            c if !split && c.starts_with("kvbm-") => vec![1],
            _ => continue,
        };
        // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and
        // sched_setaffinity only read and write the set we own.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &cpu in &set_of {
                libc::CPU_SET(cpu, &mut set);
            }
            libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
        println!("  pinned {} (tid {tid}) to CPUs {set_of:?}", comm.trim());
    }
}

pub(super) fn loadavg() -> String {
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

/// `runs` rounds of the pipelined transfer `src → dst` (through the
/// executor's bounce slots) against hop 1 for everything (`src → staging`)
/// followed by hop 2 for everything (`staging → dst`), alternating which
/// goes first. With a trace, each pipelined run is traced and summarised.
fn rounds(
    bytes: u64,
    runs: usize,
    trace: Option<&ChunkTrace>,
    exec: &Executor,
    [src, staging, dst]: [&PhysicalLayout; 3],
    pairs: &[(usize, usize)],
) -> Rounds {
    let copy = |a, b| {
        exec.transfer(a, b, pairs).wait().unwrap();
    };
    let piped = || copy(src, dst);
    let hop1 = || copy(src, staging);
    let hop2 = || copy(staging, dst);
    let mut r = Rounds::default();
    let mut last = None;
    for i in 0..runs {
        for first in [i % 2 == 0, i % 2 == 1] {
            if first {
                if let Some(t) = trace {
                    t.clear();
                }
                let (t, c) = measure(piped);
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
                let (t1, c1) = measure(hop1);
                let (t2, c2) = measure(hop2);
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
    let gbs = |t: &[f64]| rates(bytes, t);
    let ideal = ideal_overlap(&r.hop1, &r.hop2);
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

pub(super) fn buffered_source(
    dir: &std::path::Path,
    layout: &Layout,
    exec: &Executor,
) -> (PhysicalLayout, PhysicalLayout) {
    let file =
        PhysicalLayout::allocate_disk(layout.clone(), &disk_allocator(dir, IoMode::Buffered))
            .unwrap();
    let seed = host(layout.clone());
    let pairs: Vec<_> = (0..layout.config().num_blocks()).map(|b| (b, b)).collect();
    exec.transfer(&seed, &file, &pairs).wait().unwrap();
    (file, seed)
}

/// The bounce benches' disk backend: queue depth `KVBM_QD` (default 8),
/// the pread/pwrite threads instead of io_uring with `KVBM_PREAD`, and the
/// buffered-file engine from `KVBM_BUFFERED` (see [`parse_buffered`];
/// default: the library's automatic choice).
pub(super) fn disk_backend() -> DiskBackend {
    let buffered = std::env::var("KVBM_BUFFERED")
        .ok()
        .and_then(|v| parse_buffered(&v))
        .unwrap_or_default();
    disk_backend_with(buffered)
}

fn disk_backend_with(buffered: BufferedIo) -> DiskBackend {
    DiskBackend::new(&DiskConfig {
        engine: EngineConfig {
            queue_depth: env_u64("KVBM_QD", 8) as u32,
            force_pread: std::env::var_os("KVBM_PREAD").is_some(),
            buffered,
        },
        max_io_bytes: 2 * MIB as u32,
    })
    .unwrap()
}

/// `auto`, `direct` (the O_DIRECT engine: io_uring), `pread:N`,
/// `mapped:N` (non-temporal stores) or `mapped-t:N` (ordinary stores).
fn parse_buffered(v: &str) -> Option<BufferedIo> {
    let (kind, n) = v.split_once(':').unwrap_or((v, "0"));
    let threads = n.parse().ok()?;
    Some(match kind {
        "auto" => BufferedIo::Auto,
        "direct" => BufferedIo::SameAsDirect,
        "pread" => BufferedIo::Pread { threads },
        "mapped" => BufferedIo::Mapped {
            threads,
            streaming: true,
        },
        "mapped-t" => BufferedIo::Mapped {
            threads,
            streaming: false,
        },
        _ => return None,
    })
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
pub(super) fn bounce_layouts() -> (Layout, Layout) {
    let blocks = env_u64("KVBM_BOUNCE_BLOCKS", 256) as usize;
    let cfg = LayoutConfig::new(blocks, 32, 2, 16, 1024, 2).unwrap();
    (
        Layout::new(cfg, LayoutKind::FullyContiguous).unwrap(),
        Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap(),
    )
}

/// Page-cached file → bounce → host standing in for the device (both hops
/// CPU copies).
pub(super) fn bench_bounce(runs: usize, dir: &std::path::Path) {
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
        .backend(Arc::new(
            HostAsDevice::new(env_u64("KVBM_HOP2_THREADS", 1) as usize).unwrap(),
        ))
        .bounce_pool(pool.clone())
        .build()
        .unwrap();
    let (file, seed) = buffered_source(dir, &fc, &exec);
    pin_threads_from_env();
    // "Device" destination: host memory labelled Device(0).
    let dev = host_device_layout(dev_l.clone(), true).unwrap();
    let staging = host(fc.clone());
    exec.register(&staging).unwrap();
    let pairs: Vec<_> = (0..fc.config().num_blocks()).map(|b| (b, b)).collect();
    let mut r = rounds(
        bytes,
        runs,
        trace.as_deref(),
        &exec,
        [&file, &staging, &dev],
        &pairs,
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
pub(super) fn bench_bounce_disk(runs: usize, dir: &std::path::Path) {
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
    let dst =
        PhysicalLayout::allocate_disk(fc.clone(), &disk_allocator(dir, IoMode::Direct)).unwrap();
    let staging = host(fc.clone());
    exec.register(&staging).unwrap();
    let pairs: Vec<_> = (0..fc.config().num_blocks()).map(|b| (b, b)).collect();
    let mut r = rounds(
        bytes,
        runs,
        trace.as_deref(),
        &exec,
        [&src, &staging, &dst],
        &pairs,
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

/// One configuration of a sweep: the buffered-file engine (`None`: from
/// the environment) and the bounce settings.
#[cfg(feature = "cuda")]
struct SweepEntry {
    engine: Option<BufferedIo>,
    params: BounceParams,
}

/// `KVBM_SWEEP`: entries separated by spaces, each `ENGINE[@KIBxSLOTS]`
/// (ENGINE as for `KVBM_BUFFERED`; KIB the slot size in KiB and SLOTS the
/// slots per batch, else those of the environment). Unset: one entry from
/// the environment.
#[cfg(feature = "cuda")]
fn sweep_from_env() -> Vec<SweepEntry> {
    let Ok(spec) = std::env::var("KVBM_SWEEP") else {
        return vec![SweepEntry {
            engine: None,
            params: BounceParams::from_env(),
        }];
    };
    spec.split_whitespace()
        .map(|e| {
            let (engine, shape) = e.split_once('@').unwrap_or((e, ""));
            let mut params = BounceParams::from_env();
            if let Some((kib, slots)) = shape.split_once('x') {
                params.slot = kib.parse::<u64>().expect("slot KiB") * 1024;
                params.per_batch = slots.parse().expect("slots per batch");
            }
            SweepEntry {
                engine: Some(parse_buffered(engine).expect("KVBM_SWEEP engine")),
                params,
            }
        })
        .collect()
}

/// The GPU benches' device and copier (completion poll from
/// `KVBM_WAKE_SPIN_US`), or `None` after printing `<name>: skipped: no
/// CUDA device`.
#[cfg(feature = "cuda")]
pub(super) fn gpu_setup(
    name: &str,
) -> Option<(
    kvbm_transfer::cuda::CudaDevice,
    Arc<kvbm_transfer::cuda::CudaCopier>,
)> {
    use kvbm_transfer::cuda::{CopierConfig, CudaCopier, CudaDevice, Probe, probe};
    let Probe::Devices(_) = probe() else {
        println!("{name}: skipped: no CUDA device");
        return None;
    };
    let device = CudaDevice::open(0).unwrap();
    let defaults = CopierConfig::for_device(&device);
    let config = CopierConfig {
        wake_spin_us: env_u64("KVBM_WAKE_SPIN_US", defaults.wake_spin_us),
        ..defaults
    };
    let copier = Arc::new(CudaCopier::new(&device, config).unwrap());
    Some((device, copier))
}

/// The GPU side of a page cache → GPU bench: a pinned staging copy of the
/// file's layout, one device buffer per region of the device layout, and
/// every block paired with itself.
#[cfg(feature = "cuda")]
pub(super) struct GpuTargets {
    pub staging_mem: Arc<kvbm_transfer::cuda::PinnedMemory>,
    pub staging: PhysicalLayout,
    pub buffers: Vec<Arc<kvbm_transfer::cuda::DeviceBuffer>>,
    pub dev: PhysicalLayout,
    pub pairs: Vec<(usize, usize)>,
}

/// [`GpuTargets`] for the file layout `fc` and the device layout `dev_l`.
#[cfg(feature = "cuda")]
pub(super) fn gpu_targets(
    device: &kvbm_transfer::cuda::CudaDevice,
    fc: &Layout,
    dev_l: &Layout,
) -> GpuTargets {
    use kvbm_transfer::cuda::DeviceBuffer;
    let staging_mem = pinned_memory(device, fc.region_size(0).unwrap());
    let staging = PhysicalLayout::new(fc.clone(), vec![staging_mem.region()]).unwrap();
    let buffers: Vec<Arc<DeviceBuffer>> = (0..dev_l.num_regions())
        .map(|r| {
            Arc::new(DeviceBuffer::new(device, dev_l.region_size(r).unwrap() as usize).unwrap())
        })
        .collect();
    let dev =
        PhysicalLayout::new(dev_l.clone(), buffers.iter().map(|b| b.region()).collect()).unwrap();
    let pairs = (0..fc.config().num_blocks()).map(|b| (b, b)).collect();
    GpuTargets {
        staging_mem,
        staging,
        buffers,
        dev,
        pairs,
    }
}

/// `len` bytes of pinned memory on `device`.
#[cfg(feature = "cuda")]
pub(super) fn pinned_memory(
    device: &kvbm_transfer::cuda::CudaDevice,
    len: u64,
) -> Arc<kvbm_transfer::cuda::PinnedMemory> {
    use kvbm_transfer::cuda::{PinnedMemory, PinnedOptions};
    Arc::new(
        PinnedMemory::allocate(device, len as usize, PinnedOptions::for_device(device)).unwrap(),
    )
}

/// Page-cached file → pinned bounce → GPU through the CUDA backend: the
/// G3 → G1 onboard path without GPUDirect Storage. Hop 1 is a CPU copy out
/// of the page cache, hop 2 a DMA on the copy engines. The file, the
/// staging buffer and the device buffers are made once; each entry of the
/// sweep (`KVBM_SWEEP`) gets its own disk backend, bounce pool and
/// executor, and its own check of the device bytes.
#[cfg(feature = "cuda")]
pub(super) fn bench_bounce_gpu(runs: usize, dir: &std::path::Path) {
    use kvbm_transfer::cuda::CudaBackend;
    let Some((device, copier)) = gpu_setup("bounce-gpu") else {
        return;
    };
    let trace = trace_from_env();
    let (fc, dev_l) = bounce_layouts();
    let bytes = fc.total_bytes();
    let pinned = |len: u64| pinned_memory(&device, len);
    let cuda: Arc<dyn kvbm_transfer::TransferBackend> = Arc::new(CudaBackend::new(copier));
    let setup = Executor::builder()
        .backend(Arc::new(disk_backend()))
        .build()
        .unwrap();
    let (file, seed) = buffered_source(dir, &fc, &setup);
    drop(setup);
    let GpuTargets {
        staging_mem: _,
        staging,
        buffers,
        dev,
        pairs,
    } = gpu_targets(&device, &fc, &dev_l);
    let mut summary = Vec::new();
    for entry in sweep_from_env() {
        let p = entry.params;
        let disk = match entry.engine {
            Some(b) => disk_backend_with(b),
            None => disk_backend(),
        };
        let engine = format!("{:?}", entry.engine.unwrap_or_default())
            .replace(" {", "")
            .replace(" }", "")
            .replace("threads: ", "")
            .replace("streaming: ", "nt=");
        let engine = format!("{engine} ({})", disk.buffered_engine_name());
        let pool =
            BouncePool::new(pinned(p.pool_slots() as u64 * p.slot).region(), p.slot).unwrap();
        let exec = p
            .builder(&trace)
            .backend(Arc::new(disk))
            .backend(cuda.clone())
            .bounce_pool(pool.clone())
            .build()
            .unwrap();
        exec.register(&staging).unwrap();
        // Warm-up: maps the file, starts the workers.
        exec.transfer(&file, &dev, &pairs).wait().unwrap();
        pin_threads_from_env();
        let mut r = rounds(
            bytes,
            runs,
            trace.as_deref(),
            &exec,
            [&file, &staging, &dev],
            &pairs,
        );
        // Check a fresh pipelined copy: device chunks against the seed.
        check_device(&seed, &dev_l, &buffers, || {
            exec.transfer(&file, &dev, &pairs).wait().unwrap();
        });
        let line = summary_line(&engine, &p, bytes, &r);
        report_rounds(
            &format!(
                "bounce pipeline (page cache → {engine} → pinned {} → GPU)",
                p.label()
            ),
            bytes,
            &mut r,
            &pool,
        );
        summary.push(line);
    }
    println!(
        "summary (GB/s medians; ratio = median of per-run pipelined/serial; ideal = median (t1+t2)/max(t1,t2)):"
    );
    for l in summary {
        println!("  {l}");
    }
}

/// Zeroes the device buffers, runs `copy`, and checks every chunk of the
/// device layout `dev_l` (on `buffers`) against the same chunk of `seed`.
#[cfg(feature = "cuda")]
pub(super) fn check_device(
    seed: &PhysicalLayout,
    dev_l: &Layout,
    buffers: &[Arc<kvbm_transfer::cuda::DeviceBuffer>],
    copy: impl FnOnce(),
) {
    use kvbm_transfer::cuda::CudaRegion;
    for b in buffers {
        let zeros = vec![0u8; CudaRegion::len(&**b)];
        b.write(0, &zeros).unwrap();
    }
    copy();
    let images: Vec<Vec<u8>> = buffers
        .iter()
        .map(|b| {
            let mut out = vec![0u8; CudaRegion::len(&**b)];
            b.read(0, &mut out).unwrap();
            out
        })
        .collect();
    let cfg = seed.layout().config();
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
                    "device bytes differ from the source: block {blk} layer {l} outer {o}"
                );
            }
        }
    }
}

/// One row of the sweep's summary table.
#[cfg(feature = "cuda")]
fn summary_line(engine: &str, p: &BounceParams, bytes: u64, r: &Rounds) -> String {
    let gbs = |t: &[f64]| rates(bytes, t);
    let ratios: Vec<f64> = r.serial.iter().zip(&r.piped).map(|(s, p)| s / p).collect();
    let ideal = ideal_overlap(&r.hop1, &r.hop2);
    format!(
        "| {engine} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.3} ({}) | {:.2} |",
        p.label(),
        median(&mut gbs(&r.hop1)),
        median(&mut gbs(&r.hop2)),
        median(&mut gbs(&r.piped)),
        median(&mut gbs(&r.serial)),
        median(&mut ratios.clone()),
        spread(&ratios),
        median(&mut ideal.clone()),
    )
}
