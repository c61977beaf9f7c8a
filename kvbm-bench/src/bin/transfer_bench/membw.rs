//! Memory-bandwidth probe: how many bytes per second this machine's DRAM
//! gives to 1–16 threads reading, copying with ordinary (temporal) stores,
//! copying with non-temporal stores, and copying with `rep movsb` (what the
//! kernel's `copy_to_user` uses for a buffered `pread`) — and, with a GPU,
//! the same while the copy engines read pinned host memory (a bounce
//! pipeline's hop 2) at full speed beside them.
//!
//! DRAM traffic per byte moved: read 1; temporal copy 3 (read the source,
//! read the destination line for ownership, write it back); non-temporal
//! copy 2. A bounce pipeline's hop 1 is a copy and its hop 2 a DMA read of
//! the slot: if the ceiling is DRAM bandwidth, the copy rate falls while
//! the DMA runs by about the DMA's bytes, and non-temporal stores lift it.

use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::*;

#[derive(Clone, Copy, Debug)]
enum Kernel {
    Read,
    CopyTemporal,
    CopyNonTemporal,
    RepMovsb,
}

impl Kernel {
    fn name(self) -> &'static str {
        match self {
            Kernel::Read => "read",
            Kernel::CopyTemporal => "copy, temporal stores",
            Kernel::CopyNonTemporal => "copy, non-temporal stores",
            Kernel::RepMovsb => "copy, rep movsb",
        }
    }

    /// DRAM bytes per payload byte.
    fn traffic(self) -> f64 {
        match self {
            Kernel::Read => 1.0,
            Kernel::CopyTemporal | Kernel::RepMovsb => 3.0,
            Kernel::CopyNonTemporal => 2.0,
        }
    }

    /// Runs the kernel over `len` bytes (a multiple of 64, 64-aligned).
    ///
    /// # Safety
    /// `src` readable and `dst` writable for `len` bytes, not overlapping.
    #[cfg(target_arch = "x86_64")]
    unsafe fn run(self, src: *const u8, dst: *mut u8, len: usize) -> u64 {
        use std::arch::x86_64::*;
        let mut off = 0;
        // SAFETY: every access is at `off < len`, 64 bytes at a time inside
        // both ranges, 16-byte aligned as the aligned loads and stream
        // stores require (both buffers are page-aligned).
        unsafe {
            match self {
                Kernel::Read => {
                    let (mut a, mut b) = (_mm_setzero_si128(), _mm_setzero_si128());
                    while off < len {
                        let s = src.add(off).cast::<__m128i>();
                        a = _mm_xor_si128(a, _mm_load_si128(s));
                        b = _mm_xor_si128(b, _mm_load_si128(s.add(1)));
                        a = _mm_xor_si128(a, _mm_load_si128(s.add(2)));
                        b = _mm_xor_si128(b, _mm_load_si128(s.add(3)));
                        off += 64;
                    }
                    _mm_cvtsi128_si64(_mm_xor_si128(a, b)) as u64
                }
                Kernel::CopyTemporal | Kernel::CopyNonTemporal => {
                    let nt = matches!(self, Kernel::CopyNonTemporal);
                    while off < len {
                        let s = src.add(off).cast::<__m128i>();
                        let d = dst.add(off).cast::<__m128i>();
                        let v = [
                            _mm_load_si128(s),
                            _mm_load_si128(s.add(1)),
                            _mm_load_si128(s.add(2)),
                            _mm_load_si128(s.add(3)),
                        ];
                        for (i, x) in v.into_iter().enumerate() {
                            if nt {
                                _mm_stream_si128(d.add(i), x);
                            } else {
                                _mm_store_si128(d.add(i), x);
                            }
                        }
                        off += 64;
                    }
                    _mm_sfence();
                    0
                }
                Kernel::RepMovsb => {
                    std::arch::asm!(
                        "rep movsb",
                        inout("rcx") len => _,
                        inout("rsi") src => _,
                        inout("rdi") dst => _,
                        options(nostack, preserves_flags)
                    );
                    0
                }
            }
        }
    }
}

/// Wall seconds for `threads` threads to run `kernel` over `bytes`, each
/// on its own contiguous share, released together: from the first start to
/// the last end, as each thread stamps them.
#[cfg(target_arch = "x86_64")]
fn timed(kernel: Kernel, threads: usize, src: u64, dst: u64, bytes: usize) -> f64 {
    let share = (bytes / threads) & !4095;
    let barrier = Barrier::new(threads);
    let sink = AtomicU64::new(0);
    let stamps = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let (barrier, sink) = (&barrier, &sink);
                s.spawn(move || {
                    barrier.wait();
                    let t0 = Instant::now();
                    // SAFETY: shares of two live, distinct allocations of
                    // `bytes` bytes each.
                    let v = unsafe {
                        kernel.run(
                            (src as usize + i * share) as *const u8,
                            (dst as usize + i * share) as *mut u8,
                            share,
                        )
                    };
                    sink.fetch_xor(v, Ordering::Relaxed);
                    (t0, Instant::now())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    let start = stamps.iter().map(|s| s.0).min().unwrap();
    let end = stamps.iter().map(|s| s.1).max().unwrap();
    (end - start).as_secs_f64() * bytes as f64 / (share * threads) as f64
}

/// A background load on the memory system, and what it moved.
pub(super) trait Background: Sync {
    /// Runs until `stop`; returns bytes moved.
    fn run(&self, stop: &AtomicBool) -> u64;
    /// A short name.
    fn name(&self) -> &'static str;
}

/// Runs every kernel at 1–16 threads, `runs` times each (median), alone and,
/// if given, beside `background`.
#[cfg(target_arch = "x86_64")]
pub(super) fn probe(runs: usize, background: Option<&dyn Background>) {
    let bytes = (env_mib("KVBM_MEMBW_MIB", 1024) * MIB) as usize;
    let a = allocator().allocate(bytes as u64).unwrap();
    let b = allocator().allocate(bytes as u64).unwrap();
    fill(&a.region(), 7);
    fill(&b.region(), 8);
    println!(
        "memory-bandwidth probe: {} MiB per pass, {} CPUs, load {}",
        bytes as u64 / MIB,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        loadavg()
    );
    let kernels = [
        Kernel::Read,
        Kernel::CopyTemporal,
        Kernel::CopyNonTemporal,
        Kernel::RepMovsb,
    ];
    let mut sides: Vec<Option<&dyn Background>> = vec![None];
    if background.is_some() {
        sides.push(background);
    }
    for side in sides {
        for k in kernels {
            for threads in [1, 2, 4, 8, 16] {
                let stop = AtomicBool::new(false);
                let (mut times, mut moved, mut bg_secs) = (Vec::new(), 0u64, 0f64);
                std::thread::scope(|s| {
                    let bg = side.map(|g| {
                        let stop = &stop;
                        s.spawn(move || {
                            let t0 = Instant::now();
                            let n = g.run(stop);
                            (n, t0.elapsed().as_secs_f64())
                        })
                    });
                    for _ in 0..runs {
                        times.push(timed(k, threads, a.addr(), b.addr(), bytes));
                    }
                    stop.store(true, Ordering::Relaxed);
                    if let Some(h) = bg {
                        (moved, bg_secs) = h.join().unwrap();
                    }
                });
                let gbs = rates(bytes as u64, &times);
                let m = median(&mut gbs.clone());
                let beside = match side {
                    Some(g) => format!(
                        "; beside {} at {:.1} GB/s",
                        g.name(),
                        moved as f64 / bg_secs.max(1e-9) / 1e9
                    ),
                    None => String::new(),
                };
                println!(
                    "  membw {:<26} {:>2} threads: {:>6.1} GB/s (runs {}), ≈ {:>6.1} GB/s of DRAM traffic{}",
                    k.name(),
                    threads,
                    m,
                    spread(&gbs),
                    m * k.traffic(),
                    beside
                );
            }
        }
    }
}

fn env_mib(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// Pinned host → device copies in a loop through the CUDA backend: the
/// DMA read side of a bounce pipeline's hop 2.
#[cfg(feature = "cuda")]
pub(super) struct DmaLoop {
    exec: Executor,
    src: PhysicalLayout,
    dst: PhysicalLayout,
    pairs: Vec<(usize, usize)>,
    bytes: u64,
}

#[cfg(feature = "cuda")]
impl DmaLoop {
    /// 256 MiB of pinned memory and as much device memory, on device 0.
    pub(super) fn new() -> Option<Self> {
        use kvbm_transfer::cuda::{
            CopierConfig, CudaBackend, CudaCopier, CudaDevice, DeviceBuffer, PinnedMemory,
            PinnedOptions, Probe, probe,
        };
        let Probe::Devices(_) = probe() else {
            return None;
        };
        let device = CudaDevice::open(0).ok()?;
        let cfg = LayoutConfig::new(128, 32, 2, 16, 1024, 2).unwrap();
        let layout = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
        let bytes = layout.total_bytes();
        let pinned = Arc::new(
            PinnedMemory::allocate(&device, bytes as usize, PinnedOptions::for_device(&device))
                .ok()?,
        );
        let dev = Arc::new(DeviceBuffer::new(&device, bytes as usize).ok()?);
        let copier = Arc::new(CudaCopier::new(&device, CopierConfig::for_device(&device)).ok()?);
        let exec = Executor::builder()
            .backend(Arc::new(CudaBackend::new(copier)))
            .build()
            .ok()?;
        let src = PhysicalLayout::new(layout.clone(), vec![pinned.region()]).ok()?;
        let dst = PhysicalLayout::new(layout, vec![dev.region()]).ok()?;
        Some(DmaLoop {
            exec,
            src,
            dst,
            pairs: (0..128).map(|b| (b, b)).collect(),
            bytes,
        })
    }
}

#[cfg(feature = "cuda")]
impl Background for DmaLoop {
    fn run(&self, stop: &AtomicBool) -> u64 {
        let mut moved = 0;
        while !stop.load(Ordering::Relaxed) {
            self.exec
                .transfer(&self.src, &self.dst, &self.pairs)
                .wait()
                .unwrap();
            moved += self.bytes;
        }
        moved
    }

    fn name(&self) -> &'static str {
        "pinned → GPU DMA"
    }
}
