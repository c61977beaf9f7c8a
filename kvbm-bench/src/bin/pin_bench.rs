//! How fast pinned host memory becomes usable: the pinned-allocation
//! figures of `docs/benchmarks.md` (first 1 GiB usable, all 16 GiB
//! pinned), with the time split between first-touching pages and
//! `cuMemHostRegister`.
//!
//! `pin_bench [all|fresh] [GIB]` (default `all 16`). The first allocations of a process run on
//! memory the machine has never touched (on a VM, the host backs guest
//! pages lazily, so that is the slow case); they are held while the next
//! configuration allocates, so each of the "fresh" rows gets fresh memory.
//! Then everything is freed and the same configurations run again on
//! memory the guest has touched before ("warm"). `fresh` compares the
//! configurations on untouched memory only: every allocation is held, and
//! the configurations alternate for three rounds (as many as fit in three
//! quarters of the free memory).
//! `kept` compares, three rounds each, an anonymous allocation pinned with
//! the defaults against a G2 kept across restarts: a file in `/dev/shm`
//! created and reserved, then mapped and pinned in place (an engine's
//! first start), and mapped and pinned again once the mapping is gone (a
//! restarted engine re-attaching).
//! Without a GPU it prints `skipped: no CUDA device`.

use std::time::Instant;

use kvbm_transfer::cuda::{self, CudaDevice, PinnedMemory, PinnedOptions};
use kvbm_transfer::memory::SystemBuffer;

const GIB: usize = 1 << 30;

fn meminfo(key: &str) -> String {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with(key))
                .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_else(|| "?".into())
}

fn one(dev: &CudaDevice, label: &str, len: usize, opts: PinnedOptions) -> PinnedMemory {
    let t = Instant::now();
    let mem = PinnedMemory::allocate_in_background(dev, len, GIB, opts).expect("pinned memory");
    let first = t.elapsed().as_secs_f64();
    mem.wait_pinned(len).expect("pins");
    let all = t.elapsed().as_secs_f64();
    let st = mem.stats();
    println!(
        "{label:<34} first 1 GiB {first:.3} s, all {} GiB {all:.3} s ({:.1} GB/s); touch {:.3} s, register {:.3} s in {} chunks; AnonHugePages {}",
        len / GIB,
        len as f64 / all / 1e9,
        st.touch_s,
        st.register_s,
        st.chunks,
        meminfo("AnonHugePages")
    );
    mem
}

/// Free memory now, in bytes (0 if unknown).
fn mem_free_bytes() -> usize {
    meminfo("MemFree")
        .split_whitespace()
        .next()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// A named configuration.
fn cfg(
    label: &str,
    base: &PinnedOptions,
    f: impl FnOnce(&mut PinnedOptions),
) -> (String, PinnedOptions) {
    let mut o = base.clone();
    f(&mut o);
    (label.to_string(), o)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "all".into());
    let gib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(16);
    if !matches!(cuda::probe(), cuda::Probe::Devices(_)) {
        println!("skipped: no CUDA device");
        return;
    }
    let dev = CudaDevice::open(0).expect("device 0");
    println!(
        "THP: {}; MemFree {}",
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default()
            .trim(),
        meminfo("MemFree")
    );
    let base = PinnedOptions::for_device(&dev);
    let len = gib * GIB;
    if mode == "kept" {
        kept(&dev, &base, len);
        return;
    }
    if mode == "fresh" {
        // Every allocation is held, so each one gets memory this machine
        // never touched; the configurations alternate, round after round.
        let configs = [
            cfg("256 MiB chunks (default)", &base, |_| {}),
            cfg("128 MiB chunks", &base, |o| o.chunk_bytes = 128 << 20),
            cfg("1 GiB chunks", &base, |o| o.chunk_bytes = GIB),
        ];
        let budget = mem_free_bytes() * 3 / 4;
        let mut held = Vec::new();
        let mut used = 0;
        'rounds: for round in 0..3 {
            for (label, opts) in &configs {
                if used + len > budget {
                    break 'rounds;
                }
                held.push(one(
                    &dev,
                    &format!("fresh {round}, {label}"),
                    len,
                    opts.clone(),
                ));
                used += len;
            }
        }
        return;
    }
    let configs = [
        cfg("256 MiB chunks (default)", &base, |_| {}),
        cfg("1 GiB chunks", &base, |o| o.chunk_bytes = GIB),
        cfg("64 MiB chunks", &base, |o| o.chunk_bytes = 64 << 20),
        cfg("no huge pages", &base, |o| o.huge_pages = false),
    ];
    // Fresh memory: hold each allocation while the next runs (as many as fit
    // in half of what is free).
    let fit = (mem_free_bytes() / 2 / len).max(1);
    let mut held = Vec::new();
    for (label, opts) in configs.iter().take(fit.min(3)) {
        held.push(one(&dev, &format!("fresh, {label}"), len, opts.clone()));
    }
    drop(held);
    for round in 0..2 {
        for (label, opts) in &configs {
            drop(one(
                &dev,
                &format!("warm {round}, {label}"),
                len,
                opts.clone(),
            ));
        }
    }
}

/// Seconds to map `file`'s first `len` bytes shared and pin them in place.
fn pin_file(dev: &CudaDevice, file: &std::fs::File, len: usize, opts: &PinnedOptions) -> f64 {
    let t = Instant::now();
    let buffer = SystemBuffer::map_shared(file, len as u64).expect("shared mapping");
    let pinned = PinnedMemory::register(dev, buffer, opts.clone()).expect("pinned in place");
    let s = t.elapsed().as_secs_f64();
    drop(pinned);
    s
}

fn kept(dev: &CudaDevice, opts: &PinnedOptions, len: usize) {
    let path =
        std::path::Path::new("/dev/shm").join(format!("kvbm-pin-bench-{}", std::process::id()));
    for round in 0..3 {
        let t = Instant::now();
        let anon = PinnedMemory::allocate(dev, len, opts.clone()).expect("pinned memory");
        let anon_s = t.elapsed().as_secs_f64();
        drop(anon);
        let t = Instant::now();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("file in /dev/shm");
        // SAFETY: the descriptor is `file`'s, open for writing.
        let rc = unsafe {
            libc::posix_fallocate(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
                len as libc::off_t,
            )
        };
        assert_eq!(rc, 0, "posix_fallocate: {rc}");
        let reserve_s = t.elapsed().as_secs_f64();
        let first_s = reserve_s + pin_file(dev, &file, len, opts);
        let again_s = pin_file(dev, &file, len, opts);
        println!(
            "round {round}: {} GiB anonymous, pinned {anon_s:.3} s; kept in /dev/shm: first start {first_s:.3} s (reserve {reserve_s:.3} s, {:.2}x), re-attach {again_s:.3} s ({:.2}x)",
            len / GIB,
            first_s / anon_s,
            again_s / anon_s
        );
        let _ = std::fs::remove_file(&path);
    }
}
