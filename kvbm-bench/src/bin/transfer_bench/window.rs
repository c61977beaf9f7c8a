//! `window-gpu`: page cache → GPU with no CPU copy (the file-window route:
//! the copy engines read page-locked windows of the file's mapping)
//! against the bounce pipeline and the same two hops one after the other,
//! all in the same rounds. Every round builds a fresh route, so each
//! round maps the file and page-locks every window anew: registration,
//! DMA and unregistration are all inside the timed transfer.
//!
//! `KVBM_WINDOWS`: entries `MIB:WORKERS[:BLOCKS][/PATH]` (window size,
//! route worker threads, blocks per executor batch — default 512, the
//! whole file in one batch — and the copier path: `ce`, `staged`,
//! `kernel`, default the copier's choice), optionally `@KEEP_MIB`: keep
//! that much registered between transfers, one route for all rounds, so
//! round 0 is cold and the others find the windows registered. Before the rounds, a probe page-locks one page of
//! the file with and without the read-only flag (do long-term writable
//! pins of file pages get refused?) and times registration alone.

use kvbm_transfer::cuda::CopyPath;
use kvbm_transfer::cuda::file_window::{FileWindowConfig, FileWindowRoute, FileWindowStats};

use super::bounce::{
    BounceParams, GpuTargets, bounce_layouts, buffered_source, check_device, disk_backend,
    gpu_setup, gpu_targets, pinned_memory,
};
use super::*;

struct Entry {
    window: u64,
    workers: usize,
    batch: usize,
    path: Option<CopyPath>,
    /// Bytes kept registered between transfers; such an entry keeps one
    /// route for all rounds (round 0 registers, later rounds reuse).
    keep: u64,
    kept: Option<(Arc<FileWindowRoute>, Executor)>,
    times: Vec<f64>,
    cpu: Vec<f64>,
    stats: Vec<FileWindowStats>,
}

fn entries_from_env() -> Vec<Entry> {
    let spec = std::env::var("KVBM_WINDOWS").unwrap_or_else(|_| "64:2".into());
    spec.split_whitespace()
        .map(|e| {
            let (e, keep) = e.split_once('@').unwrap_or((e, "0"));
            let (nums, path) = e.split_once('/').unwrap_or((e, "auto"));
            let mut it = nums
                .split(':')
                .map(|x| x.parse::<u64>().expect("KVBM_WINDOWS"));
            Entry {
                window: it.next().expect("window MiB") * MIB,
                workers: it.next().unwrap_or(2) as usize,
                batch: it.next().unwrap_or(512) as usize,
                path: match path {
                    "ce" => Some(CopyPath::CopyEngine),
                    "staged" => Some(CopyPath::Staged),
                    "kernel" => Some(CopyPath::Kernel),
                    _ => None,
                },
                keep: keep.parse::<u64>().expect("keep MiB") * MIB,
                kept: None,
                times: Vec::new(),
                cpu: Vec::new(),
                stats: Vec::new(),
            }
        })
        .collect()
}

/// The file system type of `dir` (statfs magic, named where known).
fn fs_type(dir: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: a NUL-terminated path and a statfs the call fills.
    if unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return "unknown".into();
    }
    // SAFETY: statfs succeeded.
    let magic = unsafe { st.assume_init() }.f_type as u64;
    match magic {
        0xEF53 => "ext4".into(),
        0x01021994 => "tmpfs".into(),
        0x794c7630 => "overlayfs".into(),
        0x58465342 => "xfs".into(),
        0x9123683E => "btrfs".into(),
        m => format!("magic {m:#x}"),
    }
}

/// A fresh read-only shared mapping of the first `len` bytes of `f`.
fn map_read_only(f: &std::fs::File, len: usize) -> *mut libc::c_void {
    use std::os::unix::io::AsRawFd;
    // SAFETY: a new mapping at an address of the kernel's choice; the
    // result is checked against MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "mmap of {len} bytes");
    p
}

/// Page-locks pieces of a fresh read-only mapping of `path` with the
/// driver directly: one page with each flag set, then whole windows,
/// timing registration and unregistration.
fn registration_probe(path: &std::path::Path, len: usize) {
    use cudarc::driver::sys;
    let f = std::fs::File::open(path).unwrap();
    let map = || map_read_only(&f, len);
    let name = |rc: sys::CUresult| format!("{rc:?}");
    for (label, flags) in [
        (
            "READ_ONLY|DEVICEMAP",
            sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
        ),
        ("READ_ONLY", sys::CU_MEMHOSTREGISTER_READ_ONLY),
        (
            "DEVICEMAP (writable pin)",
            sys::CU_MEMHOSTREGISTER_DEVICEMAP,
        ),
        ("0 (writable pin)", 0),
    ] {
        let p = map();
        // SAFETY: one page of a live mapping; unregistered before munmap.
        let rc = unsafe { sys::cuMemHostRegister_v2(p, 4096, flags) };
        if rc == sys::cudaError_enum::CUDA_SUCCESS {
            // SAFETY: registered just above.
            unsafe { sys::cuMemHostUnregister(p) };
        }
        println!("  probe: register one page with {label}: {}", name(rc));
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, len) };
    }
    for mib in [8usize, 64, 256] {
        let bytes = (mib << 20).min(len);
        let mut reg = Vec::new();
        let mut unreg = Vec::new();
        for _ in 0..3 {
            let p = map();
            let t0 = Instant::now();
            // SAFETY: as above.
            let rc = unsafe {
                sys::cuMemHostRegister_v2(
                    p,
                    bytes,
                    sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                )
            };
            let t1 = Instant::now();
            if rc != sys::cudaError_enum::CUDA_SUCCESS {
                println!("  probe: register {mib} MiB: {}", name(rc));
                // SAFETY: the mapping made above.
                unsafe { libc::munmap(p, len) };
                break;
            }
            // SAFETY: registered above.
            unsafe { sys::cuMemHostUnregister(p) };
            let t2 = Instant::now();
            // SAFETY: the mapping made above.
            unsafe { libc::munmap(p, len) };
            reg.push((t1 - t0).as_secs_f64());
            unreg.push((t2 - t1).as_secs_f64());
        }
        if !reg.is_empty() {
            println!(
                "  probe: {mib} MiB window, fresh mapping: register {:.2} ms ({:.1} GB/s), unregister {:.2} ms (median of {})",
                median(&mut reg) * 1e3,
                bytes as f64 / median(&mut reg) / 1e9,
                median(&mut unreg) * 1e3,
                reg.len()
            );
        }
    }
}

/// A page-locked range of a file mapping as the copier sees it.
struct Mapped {
    addr: u64,
    len: usize,
}

impl kvbm_transfer::cuda::CudaRegion for Mapped {
    fn device_ptr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> kvbm_transfer::cuda::Location {
        kvbm_transfer::cuda::Location::PinnedHost
    }
}

/// What registration does to a DMA running beside it, and the DMA rate
/// from page cache that stays registered (no per-transfer registration):
/// (a) pinned staging → device alone; (b) the whole file registered once,
/// then copied to the device with the copier's choice and with the copy
/// engines forced; (c) the staging DMA in a loop while this thread
/// registers and unregisters 64 MiB windows of a fresh mapping.
fn interference_probe(
    copier: &kvbm_transfer::cuda::CudaCopier,
    path: &std::path::Path,
    file_base: u64,
    staging: Arc<dyn kvbm_transfer::cuda::CudaRegion>,
    dst: Vec<Arc<dyn kvbm_transfer::cuda::CudaRegion>>,
    runs: Vec<kvbm_layout::CopyRun>,
    bytes: u64,
) {
    use cudarc::driver::sys;
    use kvbm_transfer::cuda::{CopyOptions, CudaRegion};
    use std::os::unix::io::AsRawFd;
    let copy =
        |src: &Arc<dyn CudaRegion>, path: Option<CopyPath>, runs: &[kvbm_layout::CopyRun]| {
            let t = Instant::now();
            copier
                .copy(
                    runs,
                    std::slice::from_ref(src),
                    &dst,
                    CopyOptions {
                        path,
                        ..Default::default()
                    },
                )
                .unwrap()
                .wait()
                .unwrap();
            t.elapsed().as_secs_f64()
        };
    let rate = |t: f64| bytes as f64 / t / 1e9;
    let mut alone: Vec<f64> = (0..3).map(|_| copy(&staging, None, &runs)).collect();
    let mut alone_ce: Vec<f64> = (0..3)
        .map(|_| copy(&staging, Some(CopyPath::CopyEngine), &runs))
        .collect();
    println!(
        "  interference: pinned staging → device alone {:.1} GB/s (copier's choice), {:.1} (copy engines)",
        rate(median(&mut alone)),
        rate(median(&mut alone_ce))
    );
    let f = std::fs::File::open(path).unwrap();
    let len = (file_base + bytes) as usize;
    let p = map_read_only(&f, len);
    let t0 = Instant::now();
    // SAFETY: the whole live mapping; unregistered before munmap.
    let rc = unsafe {
        sys::cuMemHostRegister_v2(
            p,
            len,
            sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
        )
    };
    let reg_t = t0.elapsed().as_secs_f64();
    if rc == sys::cudaError_enum::CUDA_SUCCESS {
        let src: Arc<dyn CudaRegion> = Arc::new(Mapped {
            addr: p as u64,
            len,
        });
        let file_runs: Vec<kvbm_layout::CopyRun> = runs
            .iter()
            .map(|r| kvbm_layout::CopyRun {
                src_offset: r.src_offset + file_base,
                ..*r
            })
            .collect();
        let mut warm: Vec<f64> = (0..3).map(|_| copy(&src, None, &file_runs)).collect();
        let mut warm_ce: Vec<f64> = (0..3)
            .map(|_| copy(&src, Some(CopyPath::CopyEngine), &file_runs))
            .collect();
        let t1 = Instant::now();
        // SAFETY: registered above; no copy in flight.
        unsafe { sys::cuMemHostUnregister(p) };
        println!(
            "  warm page cache (whole file registered once: {:.1} ms, unregister {:.1} ms) → device: {:.1} GB/s (copier's choice), {:.1} (copy engines)",
            reg_t * 1e3,
            t1.elapsed().as_secs_f64() * 1e3,
            rate(median(&mut warm)),
            rate(median(&mut warm_ce))
        );
    } else {
        println!("  warm page cache: registering the whole file: {rc:?}");
    }
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(p, len) };
    // (c) registration beside the DMA loop.
    for path_choice in [None, Some(CopyPath::CopyEngine)] {
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (dma, regs) = std::thread::scope(|s| {
            let h = s.spawn(|| {
                copier.device().bind().unwrap();
                let mut v = Vec::new();
                for _ in 0..8 {
                    v.push(copy(&staging, path_choice, &runs));
                }
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                v
            });
            copier.device().bind().unwrap();
            let w = 64usize << 20;
            let mut regs = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // SAFETY: as above, a fresh mapping per round.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        w,
                        libc::PROT_READ,
                        libc::MAP_SHARED,
                        f.as_raw_fd(),
                        file_base as i64,
                    )
                };
                assert_ne!(p, libc::MAP_FAILED);
                let t = Instant::now();
                // SAFETY: the live mapping; unregistered before munmap.
                let rc = unsafe {
                    sys::cuMemHostRegister_v2(
                        p,
                        w,
                        sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                    )
                };
                if rc == sys::cudaError_enum::CUDA_SUCCESS {
                    // SAFETY: registered just above.
                    unsafe { sys::cuMemHostUnregister(p) };
                }
                regs.push(t.elapsed().as_secs_f64());
                // SAFETY: the mapping made above.
                unsafe { libc::munmap(p, w) };
            }
            (h.join().unwrap(), regs)
        });
        let (mut dma, mut regs) = (dma, regs);
        println!(
            "  interference ({}): staging DMA {:.1} GB/s while this thread registered+unregistered {} × 64 MiB windows ({:.2} ms each, {:.1} GB/s)",
            if path_choice.is_some() {
                "copy engines"
            } else {
                "copier's choice"
            },
            rate(median(&mut dma)),
            regs.len(),
            median(&mut regs) * 1e3,
            (64u64 << 20) as f64 / median(&mut regs) / 1e9,
        );
    }
}

/// Buffered file → GPU: the file-window route against the bounce pipeline
/// and the serial hops.
pub(super) fn bench_window_gpu(runs: usize, dir: &std::path::Path) {
    use kvbm_transfer::TransferBackend;
    use kvbm_transfer::cuda::CudaBackend;
    let Some((device, copier)) = gpu_setup("window-gpu") else {
        return;
    };
    let (fc, dev_l) = bounce_layouts();
    let bytes = fc.total_bytes();
    println!(
        "window-gpu: {} MiB from {} ({}), load {}",
        bytes / MIB,
        dir.display(),
        fs_type(dir),
        loadavg()
    );
    let pinned = |len: u64| pinned_memory(&device, len);
    let cuda: Arc<dyn TransferBackend> = Arc::new(CudaBackend::new(copier.clone()));
    let disk: Arc<dyn TransferBackend> = Arc::new(disk_backend());
    let setup = Executor::builder().backend(disk.clone()).build().unwrap();
    let (file, seed) = buffered_source(dir, &fc, &setup);
    drop(setup);
    let path = file.regions()[0]
        .file_location()
        .unwrap()
        .0
        .path()
        .to_path_buf();
    device.bind().unwrap();
    registration_probe(&path, bytes as usize);

    let GpuTargets {
        staging_mem,
        staging,
        buffers,
        dev,
        pairs,
    } = gpu_targets(&device, &fc, &dev_l);

    if std::env::var_os("KVBM_PROBE").is_some() {
        let runs = kvbm_layout::plan_copy(&fc, &dev_l, &pairs)
            .unwrap()
            .into_runs();
        let base = file.regions()[0].file_location().unwrap().1;
        interference_probe(
            &copier,
            &path,
            base,
            staging_mem.clone(),
            buffers
                .iter()
                .map(|b| b.clone() as Arc<dyn kvbm_transfer::cuda::CudaRegion>)
                .collect(),
            runs,
            bytes,
        );
    }
    let p = BounceParams::from_env();
    let pool = BouncePool::new(pinned(p.pool_slots() as u64 * p.slot).region(), p.slot).unwrap();
    let bounce = p
        .builder(&None)
        .backend(disk.clone())
        .backend(cuda.clone())
        .bounce_pool(pool.clone())
        .build()
        .unwrap();
    bounce.register(&staging).unwrap();
    let route_exec = |e: &Entry| {
        let route = Arc::new(
            FileWindowRoute::new(
                copier.clone(),
                FileWindowConfig {
                    window_bytes: e.window,
                    workers: e.workers,
                    path: e.path,
                    keep_registered_bytes: e.keep,
                    ..FileWindowConfig::default()
                },
            )
            .unwrap(),
        );
        let exec = Executor::builder()
            .config(ExecutorConfig {
                max_blocks_per_batch: e.batch,
                max_batches_in_flight: p.batches as usize,
                bounce_slots_per_batch: p.per_batch as usize,
            })
            .backend(disk.clone())
            .backend(cuda.clone())
            .bounce_pool(pool.clone())
            .file_route(route.clone())
            .build()
            .unwrap();
        (route, exec)
    };
    let mut entries = entries_from_env();
    // Warm-up: the bounce pipeline and one route transfer.
    bounce.transfer(&file, &dev, &pairs).wait().unwrap();
    if let Some(e) = entries.first() {
        let (route, exec) = route_exec(e);
        let file0 = file.regions()[0].file_location().unwrap().0.clone();
        if let Some(why) = route.registration_refusal(&file0) {
            println!("  route declined: {why}");
        }
        exec.transfer(&file, &dev, &pairs).wait().unwrap();
    }
    let (mut t1s, mut t2s, mut piped, mut cpu_piped) = (vec![], vec![], vec![], vec![]);
    for i in 0..runs {
        let (t1, _) = measure(|| {
            bounce.transfer(&file, &staging, &pairs).wait().unwrap();
        });
        let (t2, _) = measure(|| {
            bounce.transfer(&staging, &dev, &pairs).wait().unwrap();
        });
        t1s.push(t1);
        t2s.push(t2);
        let (t, c) = measure(|| {
            bounce.transfer(&file, &dev, &pairs).wait().unwrap();
        });
        piped.push(t);
        cpu_piped.push(c);
        let n = entries.len();
        for k in 0..n {
            let e = &mut entries[if i % 2 == 0 { k } else { n - 1 - k }];
            let (route, exec) = match &e.kept {
                Some(kept) => kept.clone(),
                None => route_exec(e),
            };
            if e.keep > 0 {
                e.kept = Some((route.clone(), exec.clone()));
            }
            let (t, c) = measure(|| {
                exec.transfer(&file, &dev, &pairs).wait().unwrap();
            });
            e.times.push(t);
            e.cpu.push(c);
            e.stats.push(route.stats());
        }
    }
    let gbs = |t: &[f64]| rates(bytes, t);
    let serial: Vec<f64> = t1s.iter().zip(&t2s).map(|(a, b)| a + b).collect();
    let ideal = ideal_overlap(&t1s, &t2s);
    let bounce_ratio: Vec<f64> = serial.iter().zip(&piped).map(|(s, p)| s / p).collect();
    println!(
        "  hop 1 alone {:.1} GB/s ({}), hop 2 alone {:.1} ({}), serial {:.1} ({}); bounce pipeline {:.1} GB/s ({}), ratio {:.2} ({}), ideal {:.2}; CPU s {:.3}",
        median(&mut gbs(&t1s)),
        spread(&gbs(&t1s)),
        median(&mut gbs(&t2s)),
        spread(&gbs(&t2s)),
        median(&mut gbs(&serial)),
        spread(&gbs(&serial)),
        median(&mut gbs(&piped)),
        spread(&gbs(&piped)),
        median(&mut bounce_ratio.clone()),
        spread(&bounce_ratio),
        median(&mut ideal.clone()),
        median(&mut cpu_piped),
    );
    println!(
        "  | window | workers | batch | route GB/s (spread) | ÷ serial (spread) | ÷ bounce pipeline (spread) | per window: register / DMA / unregister ms | register GB/s per worker | CPU s |"
    );
    for e in &mut entries {
        let r_serial: Vec<f64> = serial.iter().zip(&e.times).map(|(s, t)| s / t).collect();
        let r_bounce: Vec<f64> = piped.iter().zip(&e.times).map(|(s, t)| s / t).collect();
        let s = e.stats.last().copied().unwrap_or_default();
        let w = s.windows.max(1) as f64;
        println!(
            "  | {} MiB{} | {} | {} | {:.1} ({}) | {:.2} ({}) | {:.2} ({}) | {:.2} / {:.2} / {:.2} | {:.1} | {:.3} |",
            e.window / MIB,
            match e.path {
                Some(p) => format!(" {p:?}"),
                None => String::new(),
            },
            e.workers,
            e.batch,
            median(&mut gbs(&e.times)),
            spread(&gbs(&e.times)),
            median(&mut r_serial.clone()),
            spread(&r_serial),
            median(&mut r_bounce.clone()),
            spread(&r_bounce),
            s.register_ns as f64 / w / 1e6,
            s.dma_ns as f64 / w / 1e6,
            s.unregister_ns as f64 / w / 1e6,
            s.registered_bytes as f64 / s.register_ns.max(1) as f64,
            median(&mut e.cpu),
        );
        if s.windows == 0 {
            println!("  (the route declined: every transfer above took the bounce pipeline)");
        }
        if e.keep > 0 && e.times.len() > 1 {
            let mut warm = gbs(&e.times[1..]);
            println!(
                "    kept {} MiB registered: round 0 (cold) {:.1} GB/s, later rounds {:.1} GB/s ({}), {} window hits",
                e.keep / MIB,
                gbs(&e.times[..1])[0],
                median(&mut warm),
                spread(&warm),
                s.kept_hits
            );
        }
    }
    // Check every entry's route once more, byte for byte.
    for e in &entries {
        let (_route, exec) = match &e.kept {
            Some(kept) => kept.clone(),
            None => route_exec(e),
        };
        check_device(&seed, &dev_l, &buffers, || {
            exec.transfer(&file, &dev, &pairs).wait().unwrap();
        });
    }
    assert_eq!(pool.available(), pool.capacity(), "bounce slots leaked");
    println!("  device bytes checked against the source for every entry");
}
