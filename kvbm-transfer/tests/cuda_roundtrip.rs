//! Round trips through every CUDA copy path, checking every chunk.
//!
//! Without a GPU each test prints `skipped: no CUDA device` and passes; with
//! `KVBM_REQUIRE_GPU=1` a missing GPU fails.

mod cuda_common;

use std::sync::Arc;

use cuda_common::{
    Kind, Layout, device_or_skip, packed_device_regions, plan, random_blocks, random_bytes,
};
use kvbm_transfer::cuda::{
    CopierConfig, CopyOptions, CopyPath, CudaCopier, CudaDevice, CudaError, CudaRegion,
    DeviceBuffer, GpuLoad, Location, PinnedMemory, PinnedOptions, Probe, probe,
};

/// Memory for one layout, on the device or pinned on the host.
struct Mem {
    layout: Layout,
    device: Vec<Arc<DeviceBuffer>>,
    host: Vec<Arc<PinnedMemory>>,
    /// Device regions carved out of one allocation (instead of `device`).
    packed: Option<Packed>,
}

/// One device allocation and the regions carved out of it.
type Packed = (Arc<DeviceBuffer>, Vec<Arc<dyn CudaRegion>>);

impl Mem {
    fn new(dev: &CudaDevice, layout: Layout, loc: Location, seed: u64) -> Mem {
        Mem::with_packing(dev, layout, loc, seed, false)
    }

    /// `packed`: device regions are windows of one allocation, so the copy
    /// engines can move a block's runs across layers as one strided copy.
    fn with_packing(
        dev: &CudaDevice,
        layout: Layout,
        loc: Location,
        seed: u64,
        packed: bool,
    ) -> Mem {
        let mut m = Mem {
            layout,
            device: Vec::new(),
            host: Vec::new(),
            packed: None,
        };
        if packed && loc == Location::Device {
            let sizes = layout.region_sizes();
            let (buf, regions) = packed_device_regions(dev, &sizes);
            let mut offset = 0;
            for (i, &size) in sizes.iter().enumerate() {
                buf.write(offset, &random_bytes(size, seed + i as u64))
                    .unwrap();
                offset += size;
            }
            m.packed = Some((buf, regions));
            return m;
        }
        for (i, size) in layout.region_sizes().into_iter().enumerate() {
            let data = random_bytes(size, seed + i as u64);
            match loc {
                Location::Device => {
                    let b = DeviceBuffer::new(dev, size).unwrap();
                    b.write(0, &data).unwrap();
                    m.device.push(Arc::new(b));
                }
                Location::PinnedHost => {
                    let p =
                        PinnedMemory::allocate(dev, size, PinnedOptions::for_device(dev)).unwrap();
                    p.write(0, &data).unwrap();
                    m.host.push(Arc::new(p));
                }
            }
        }
        m
    }

    fn regions(&self) -> Vec<Arc<dyn CudaRegion>> {
        if let Some((_, regions)) = &self.packed {
            return regions.clone();
        }
        let d = self
            .device
            .iter()
            .map(|b| Arc::clone(b) as Arc<dyn CudaRegion>);
        let h = self
            .host
            .iter()
            .map(|b| Arc::clone(b) as Arc<dyn CudaRegion>);
        d.chain(h).collect()
    }

    fn image(&self) -> Vec<Vec<u8>> {
        let sizes = self.layout.region_sizes();
        sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| {
                let mut out = vec![0u8; size];
                if let Some((buf, _)) = &self.packed {
                    buf.read(sizes[..i].iter().sum(), &mut out).unwrap();
                } else if let Some(b) = self.device.get(i) {
                    b.read(0, &mut out).unwrap();
                } else {
                    self.host[i].read(0, &mut out).unwrap();
                }
                out
            })
            .collect()
    }
}

/// What `dst` must hold after copying `pairs` from `src`: its old bytes with
/// every copied chunk replaced.
fn expected(
    src: &Mem,
    src_img: &[Vec<u8>],
    dst: &Mem,
    dst_img: &[Vec<u8>],
    pairs: &[(usize, usize)],
) -> Vec<Vec<u8>> {
    let mut want = dst_img.to_vec();
    let (s, d) = (src.layout, dst.layout);
    for &(sb, db) in pairs {
        for l in 0..s.layers {
            for o in 0..s.outer {
                let (sr, so) = s.at(sb, l, o);
                let (dr, dof) = d.at(db, l, o);
                let chunk = &src_img[sr as usize][so as usize..][..s.run_bytes];
                want[dr as usize][dof as usize..][..s.run_bytes].copy_from_slice(chunk);
            }
        }
    }
    want
}

/// Copies `pairs` with the plan lent (`copy`) or, for paths named
/// `…-shared`, shared (`copy_shared`), and checks every byte of `dst`.
fn check_copy(
    copier: &CudaCopier,
    src: &Mem,
    dst: &Mem,
    pairs: &[(usize, usize)],
    (pname, opts): (&str, CopyOptions),
    what: &str,
) {
    let src_img = src.image();
    let dst_img = dst.image();
    let runs = plan(&src.layout, &dst.layout, pairs);
    let started = if pname.ends_with("-shared") {
        copier.copy_shared(runs.into(), &src.regions(), &dst.regions(), opts)
    } else {
        copier.copy(&runs, &src.regions(), &dst.regions(), opts)
    };
    started
        .unwrap()
        .wait()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let want = expected(src, &src_img, dst, &dst_img, pairs);
    let got = dst.image();
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        if g != w {
            let first = g.iter().zip(w).position(|(a, b)| a != b).unwrap_or(0);
            panic!("{what}: region {r} differs first at byte {first}");
        }
    }
}

fn paths() -> Vec<(&'static str, CopyOptions)> {
    let o = |path, load| CopyOptions { path, load };
    vec![
        ("copy-engine", o(Some(CopyPath::CopyEngine), GpuLoad::Idle)),
        ("kernel-idle", o(Some(CopyPath::Kernel), GpuLoad::Idle)),
        ("kernel-busy", o(Some(CopyPath::Kernel), GpuLoad::Busy)),
        ("staged", o(Some(CopyPath::Staged), GpuLoad::Idle)),
        ("staged-shared", o(Some(CopyPath::Staged), GpuLoad::Idle)),
        // Busy: one kernel per half ring of chunks.
        ("staged-busy", o(Some(CopyPath::Staged), GpuLoad::Busy)),
        (
            "staged-busy-shared",
            o(Some(CopyPath::Staged), GpuLoad::Busy),
        ),
        ("auto-idle", o(None, GpuLoad::Idle)),
        ("auto-idle-shared", o(None, GpuLoad::Idle)),
        ("auto-busy", o(None, GpuLoad::Busy)),
    ]
}

/// A copier whose staging slots are small and not a multiple of the run
/// size, so rings wrap many times and runs split across slots, with one
/// lane per direction and a short busy poll.
fn tight_copier(dev: &CudaDevice) -> CudaCopier {
    CudaCopier::new(
        dev,
        CopierConfig {
            staging_slot_bytes: 12 * 1024 + 4096,
            staging_slots: 3,
            lanes_per_direction: 1,
            wake_spin_us: 300,
            ..CopierConfig::for_device(dev)
        },
    )
    .unwrap()
}

fn layout(kind: Kind, blocks: usize, run_bytes: usize) -> Layout {
    Layout {
        kind,
        blocks,
        layers: 4,
        outer: 2,
        run_bytes,
    }
}

/// host → device → host for one pair of layout kinds, every path, 1 and
/// 1024 blocks.
fn roundtrip(dev_kind: Kind, host_kind: Kind, run_bytes: usize) {
    roundtrip_with(dev_kind, host_kind, run_bytes, false);
}

fn roundtrip_with(dev_kind: Kind, host_kind: Kind, run_bytes: usize, packed: bool) {
    let Some(dev) = device_or_skip() else { return };
    let copiers = [
        (
            "default",
            CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap(),
        ),
        ("tight", tight_copier(&dev)),
    ];
    for n in [1usize, 1024] {
        let pool = 2 * n + 1;
        for (cname, copier) in &copiers {
            for (i, (pname, opts)) in paths().into_iter().enumerate() {
                let seed = (n * 100 + i) as u64;
                let host = Mem::new(
                    &dev,
                    layout(host_kind, pool, run_bytes),
                    Location::PinnedHost,
                    seed,
                );
                let gpu = Mem::with_packing(
                    &dev,
                    layout(dev_kind, pool, run_bytes),
                    Location::Device,
                    seed + 10,
                    packed,
                );
                let back = Mem::new(
                    &dev,
                    layout(host_kind, pool, run_bytes),
                    Location::PinnedHost,
                    seed + 20,
                );
                let a = random_blocks(n, pool, seed + 1);
                let b = random_blocks(n, pool, seed + 2);
                let c = random_blocks(n, pool, seed + 3);
                let h2d: Vec<_> = a.iter().copied().zip(b.iter().copied()).collect();
                let d2h: Vec<_> = b.iter().copied().zip(c.iter().copied()).collect();
                let what = format!(
                    "{cname}/{pname} {n} blocks {host_kind:?}->{dev_kind:?} run {run_bytes} packed {packed}"
                );
                let path = (pname, opts);
                check_copy(copier, &host, &gpu, &h2d, path, &format!("H2D {what}"));
                check_copy(copier, &gpu, &back, &d2h, path, &format!("D2H {what}"));
                // Round trip: block a[i] of `host` is now block c[i] of `back`.
                let (hi, bi) = (host.image(), back.image());
                for (&x, &z) in a.iter().zip(&c) {
                    for l in 0..4 {
                        for o in 0..2 {
                            let (r1, o1) = host.layout.at(x, l, o);
                            let (r2, o2) = back.layout.at(z, l, o);
                            assert_eq!(
                                hi[r1 as usize][o1 as usize..][..run_bytes],
                                bi[r2 as usize][o2 as usize..][..run_bytes],
                                "round trip {what}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn device_layer_separate_host_fully_contiguous() {
    roundtrip(Kind::LayerSeparate, Kind::FullyContiguous, 4096);
}

#[test]
fn device_fully_contiguous_host_layer_separate() {
    roundtrip(Kind::FullyContiguous, Kind::LayerSeparate, 4096);
}

#[test]
fn device_layers_in_one_allocation() {
    // Every layer's K and V of a block sit at one pitch: the copy engines
    // move a whole block as one strided copy (3D batch with the default
    // copier, one cuMemcpy2DAsync each with the tight one).
    roundtrip_with(Kind::LayerSeparate, Kind::FullyContiguous, 4096, true);
    roundtrip_with(Kind::LayerSeparate, Kind::FullyContiguous, 999, true);
}

#[test]
fn runs_not_a_multiple_of_16_bytes() {
    // 999-byte runs: every run starts at an odd offset on some side, so the
    // kernel's narrow-vector and byte fallbacks are exercised.
    roundtrip(Kind::LayerSeparate, Kind::FullyContiguous, 999);
}

#[test]
fn device_to_device_both_orders() {
    let Some(dev) = device_or_skip() else { return };
    let copier = CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap();
    for (sk, dk) in [
        (Kind::LayerSeparate, Kind::FullyContiguous),
        (Kind::FullyContiguous, Kind::LayerSeparate),
    ] {
        for n in [1usize, 1024] {
            let pool = 2 * n + 1;
            for path in paths() {
                let pname = path.0;
                let src = Mem::new(&dev, layout(sk, pool, 4096), Location::Device, 7);
                let dst = Mem::new(&dev, layout(dk, pool, 4096), Location::Device, 8);
                let pairs: Vec<_> = random_blocks(n, pool, 1)
                    .into_iter()
                    .zip(random_blocks(n, pool, 2))
                    .collect();
                check_copy(
                    &copier,
                    &src,
                    &dst,
                    &pairs,
                    path,
                    &format!("D2D {pname} {n} {sk:?}->{dk:?}"),
                );
            }
        }
    }
}

#[test]
fn offload_and_onboard_overlap_and_both_land() {
    let Some(dev) = device_or_skip() else { return };
    let copier = CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap();
    let n = 256;
    let pool = 2 * n;
    let host = Mem::new(
        &dev,
        layout(Kind::FullyContiguous, pool, 32 << 10),
        Location::PinnedHost,
        1,
    );
    let gpu = Mem::new(
        &dev,
        layout(Kind::LayerSeparate, pool, 32 << 10),
        Location::Device,
        2,
    );
    let ids = random_blocks(pool, pool, 3);
    // Onboard blocks ids[..n] while offloading ids[n..]: disjoint blocks.
    let on: Vec<_> = ids[..n].iter().map(|&b| (b, b)).collect();
    let off: Vec<_> = ids[n..].iter().map(|&b| (b, b)).collect();
    let (hi, gi) = (host.image(), gpu.image());
    let c1 = copier
        .copy(
            &plan(&host.layout, &gpu.layout, &on),
            &host.regions(),
            &gpu.regions(),
            CopyOptions::default(),
        )
        .unwrap();
    let c2 = copier
        .copy(
            &plan(&gpu.layout, &host.layout, &off),
            &gpu.regions(),
            &host.regions(),
            CopyOptions::default(),
        )
        .unwrap();
    futures::executor::block_on(async {
        c1.await.unwrap();
        c2.await.unwrap();
    });
    assert!(gpu.image() == expected(&host, &hi, &gpu, &gi, &on));
    assert!(host.image() == expected(&gpu, &gi, &host, &hi, &off));
}

/// Staged copies submitted from one thread without waiting go through the
/// ring's feeder in order: two onboards into the same device blocks leave
/// the second one's bytes, two offloads into the same host blocks likewise,
/// through a ring that wraps many times and through the default one, with
/// the caller enqueuing the first chunks and the feeder taking whole
/// copies (behind queued ones).
#[test]
fn queued_staged_copies_keep_their_order() {
    let Some(dev) = device_or_skip() else { return };
    let copiers = [
        (
            "default",
            CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap(),
        ),
        ("tight", tight_copier(&dev)),
        (
            // Eight 256 KiB slots: a busy copy's groups of four slots wrap
            // the ring several times per copy.
            "small ring",
            CudaCopier::new(
                &dev,
                CopierConfig {
                    staging_slot_bytes: 256 << 10,
                    ..CopierConfig::for_device(&dev)
                },
            )
            .unwrap(),
        ),
    ];
    let n = 48;
    let pool = 3 * n;
    let loads = [GpuLoad::Idle, GpuLoad::Busy];
    for ((name, copier), load) in copiers.iter().flat_map(|c| loads.map(|l| (c, l))) {
        let staged = CopyOptions {
            path: Some(CopyPath::Staged),
            load,
        };
        let name = format!("{name} {load:?}");
        let host = Mem::new(
            &dev,
            layout(Kind::FullyContiguous, pool, 8 << 10),
            Location::PinnedHost,
            1,
        );
        let gpu = Mem::new(
            &dev,
            layout(Kind::LayerSeparate, pool, 8 << 10),
            Location::Device,
            2,
        );
        let ids = random_blocks(pool, pool, 7);
        let (first, second, target) = (&ids[..n], &ids[n..2 * n], &ids[2 * n..]);
        let onto = |from: &[usize], to: &[usize]| -> Vec<(usize, usize)> {
            from.iter().copied().zip(to.iter().copied()).collect()
        };
        let (hi, gi) = (host.image(), gpu.image());
        let mut pending = Vec::new();
        // Onboards: first → target, then second → target.
        for pairs in [onto(first, target), onto(second, target)] {
            let runs = plan(&host.layout, &gpu.layout, &pairs);
            pending.push(
                copier
                    .copy(&runs, &host.regions(), &gpu.regions(), staged)
                    .unwrap(),
            );
        }
        // Offloads of device blocks the onboards do not touch: first →
        // target, then second → target.
        for pairs in [onto(first, target), onto(second, target)] {
            let runs = plan(&gpu.layout, &host.layout, &pairs);
            pending.push(
                copier
                    .copy(&runs, &gpu.regions(), &host.regions(), staged)
                    .unwrap(),
            );
        }
        for c in pending {
            c.wait().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let want_gpu = expected(&host, &hi, &gpu, &gi, &onto(second, target));
        let want_host = expected(&gpu, &gi, &host, &hi, &onto(second, target));
        assert!(gpu.image() == want_gpu, "{name}: onboards out of order");
        assert!(host.image() == want_host, "{name}: offloads out of order");
    }
}

#[test]
fn copies_cross_registration_chunks() {
    // Pinned memory registered in 2 MiB chunks; one run spans four chunks on
    // the host side. DMA paths must split it, the kernel reads straight on.
    let Some(dev) = device_or_skip() else { return };
    let copier = CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap();
    let len = 8 << 20;
    let opts = PinnedOptions {
        chunk_bytes: 2 << 20,
        ..PinnedOptions::for_device(&dev)
    };
    for (pname, o) in paths() {
        let a = Arc::new(PinnedMemory::allocate(&dev, len, opts.clone()).unwrap());
        let b = Arc::new(PinnedMemory::allocate(&dev, len, opts.clone()).unwrap());
        let g = Arc::new(DeviceBuffer::new(&dev, len).unwrap());
        let data = random_bytes(len, 77);
        a.write(0, &data).unwrap();
        b.write(0, &random_bytes(len, 78)).unwrap();
        let run = kvbm_transfer::cuda::CopyRun {
            src_region: 0,
            src_offset: 50,
            dst_region: 0,
            dst_offset: 50,
            len: len as u64 - 100,
        };
        let regs = |r: &Arc<PinnedMemory>| vec![Arc::clone(r) as Arc<dyn CudaRegion>];
        let greg = vec![Arc::clone(&g) as Arc<dyn CudaRegion>];
        copier
            .copy(&[run], &regs(&a), &greg, o)
            .unwrap()
            .wait()
            .unwrap();
        copier
            .copy(&[run], &greg, &regs(&b), o)
            .unwrap()
            .wait()
            .unwrap();
        let mut out = vec![0u8; len];
        b.read(0, &mut out).unwrap();
        assert!(
            out[50..len - 50] == data[50..len - 50],
            "{pname}: bytes differ"
        );
    }
}

#[test]
fn bad_plans_are_errors_not_panics() {
    let Some(dev) = device_or_skip() else { return };
    let copier = CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap();
    let gpu: Arc<dyn CudaRegion> = Arc::new(DeviceBuffer::new(&dev, 4096).unwrap());
    let host: Arc<dyn CudaRegion> =
        Arc::new(PinnedMemory::allocate(&dev, 4096, PinnedOptions::for_device(&dev)).unwrap());
    let run = |src_region, dst_offset, len| kvbm_transfer::cuda::CopyRun {
        src_region,
        src_offset: 0,
        dst_region: 0,
        dst_offset,
        len,
    };
    let copy = |r, s: &Arc<dyn CudaRegion>, d: &Arc<dyn CudaRegion>| {
        copier.copy(
            &[r],
            std::slice::from_ref(s),
            std::slice::from_ref(d),
            CopyOptions::default(),
        )
    };
    assert!(matches!(
        copy(run(0, 1, 4096), &gpu, &host),
        Err(CudaError::OutOfBounds {
            side: "destination",
            region_len: Some(4096),
            ..
        })
    ));
    assert!(matches!(
        copy(run(1, 0, 16), &gpu, &host),
        Err(CudaError::OutOfBounds {
            side: "source",
            region_len: None,
            ..
        })
    ));
    assert!(matches!(
        copy(run(0, u64::MAX, 16), &gpu, &host),
        Err(CudaError::OutOfBounds { .. })
    ));
    assert!(matches!(
        copy(run(0, 0, 16), &host, &host),
        Err(CudaError::InvalidCopy(_))
    ));
    // A zero-length plan completes at once.
    assert!(copy(run(0, 0, 0), &gpu, &host).unwrap().is_done());
}

/// A staged copy whose last run crosses the end of its destination fails
/// with `OutOfBounds` (at the call for a lent plan; at the call or on the
/// completion for a shared one, whose runs are checked as chunks are
/// planned) and writes nothing past the region: the bytes after it, in the
/// same allocation, are unchanged.
#[test]
fn staged_runs_out_of_bounds_fail_and_write_nothing_outside() {
    let Some(dev) = device_or_skip() else { return };
    const RUN: usize = 64 << 10;
    const RUNS: usize = 160; // 10 MiB: staged, several chunks.
    let len = RUN * RUNS;
    let guard_len = 1 << 20;
    let host: Arc<dyn CudaRegion> = {
        let p = PinnedMemory::allocate(&dev, len, PinnedOptions::for_device(&dev)).unwrap();
        p.write(0, &random_bytes(len, 41)).unwrap();
        Arc::new(p)
    };
    let (buf, windows) = packed_device_regions(&dev, &[len, guard_len]);
    let guard = random_bytes(guard_len, 42);
    buf.write(len, &guard).unwrap();
    let order = random_blocks(RUNS, RUNS, 43);
    let mut runs: Vec<_> = order
        .iter()
        .enumerate()
        .map(|(i, &j)| kvbm_transfer::cuda::CopyRun {
            src_region: 0,
            src_offset: (i * RUN) as u64,
            dst_region: 0,
            dst_offset: (j * RUN) as u64,
            len: RUN as u64,
        })
        .collect();
    // The last run reaches half a run past the destination's end.
    runs.last_mut().unwrap().dst_offset = (len - RUN / 2) as u64;
    let copiers = [
        (
            "default",
            CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap(),
        ),
        ("tight", tight_copier(&dev)),
    ];
    let src = [host];
    let dst = [Arc::clone(&windows[0])];
    for (cname, copier) in &copiers {
        for (pname, opts) in paths()
            .into_iter()
            .filter(|(n, _)| n.starts_with("staged") || n.starts_with("auto-idle"))
        {
            let what = format!("{cname}/{pname}");
            let result = if pname.ends_with("-shared") {
                copier
                    .copy_shared(runs.clone().into(), &src, &dst, opts)
                    .and_then(|c| c.wait())
            } else {
                let started = copier.copy(&runs, &src, &dst, opts);
                assert!(started.is_err(), "{what}: a lent plan fails at the call");
                started.map(|_| ())
            };
            assert!(
                matches!(
                    result,
                    Err(CudaError::OutOfBounds {
                        side: "destination",
                        ..
                    })
                ),
                "{what}: {result:?}"
            );
            let mut after = vec![0u8; guard_len];
            buf.read(len, &mut after).unwrap();
            assert!(after == guard, "{what}: bytes past the region changed");
        }
    }
}

#[test]
fn probe_agrees_with_opening_a_device() {
    // On a machine without CUDA, probe reports no driver or no device and
    // opening device 0 fails with the same typed error; with one, it
    // reports the device count, the first and last devices open, and the
    // next ordinal is a typed error. Either way nothing panics.
    let p = probe();
    assert_eq!(probe(), p, "probing twice gives the same answer");
    match p {
        Probe::Devices(n) => {
            assert!(n >= 1, "{p:?}");
            for ordinal in [0, n - 1] {
                let dev = CudaDevice::open(ordinal).expect("a probed device opens");
                assert_eq!(dev.ordinal(), ordinal);
            }
            let past = CudaDevice::open(n).err();
            assert!(
                matches!(past, Some(CudaError::NoDevice { ordinal, count }) if ordinal == n && count == n),
                "opening device {n} of {n}: {past:?}"
            );
        }
        Probe::NoDriver | Probe::NoDevice => {
            assert!(
                std::env::var("KVBM_REQUIRE_GPU").as_deref() != Ok("1"),
                "KVBM_REQUIRE_GPU=1 but no CUDA device ({p:?})"
            );
            let err = CudaDevice::open(0).err();
            let agrees = match p {
                Probe::NoDriver => matches!(err, Some(CudaError::NoDriver)),
                _ => matches!(
                    err,
                    Some(CudaError::NoDevice {
                        ordinal: 0,
                        count: 0
                    })
                ),
            };
            assert!(agrees, "probe says {p:?}, opening device 0 says {err:?}");
        }
    }
}
