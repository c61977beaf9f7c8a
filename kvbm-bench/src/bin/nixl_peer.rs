//! Two kvbm instances (here: two agents of one process) exchanging peer
//! descriptions as bytes and pulling G2 blocks over UCX, then the CPU an
//! idle pair costs (NIXL's progress threads) and what a pull costs.
//!
//! ```text
//! LD_LIBRARY_PATH=target/nixl-runtime/.nixl_cu13.mesonpy.libs \
//! UCX_TLS=tcp UCX_NET_DEVICES=lo UCX_MODULES=^ib \
//!   cargo run --release -p kvbm-bench --features nixl --bin nixl_peer
//! ```

use std::time::{Duration, Instant};

use kvbm_layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::memory::SystemAllocator;
use kvbm_transfer::nixl::{NixlRemote, RemoteConfig};

fn cpu_seconds() -> f64 {
    // SAFETY: `getrusage` fills the zeroed local; no other requirement.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Err(e) = kvbm_transfer::nixl::runtime() {
        println!("skipped: {e}");
        return Ok(());
    }
    // 256 blocks of 32 layers x K/V x 16 tokens x 1024 bf16 = 2 MiB blocks.
    let cfg = LayoutConfig::new(256, 32, 2, 16, 1024, 2)?;
    let g2 = |seed: u8| -> Result<PhysicalLayout, Box<dyn std::error::Error>> {
        let p = PhysicalLayout::allocate_system(
            Layout::new(cfg, LayoutKind::FullyContiguous)?,
            &SystemAllocator::new().populate(true),
        )?;
        let r = &p.regions()[0];
        // SAFETY: a fresh system region of this length, not in any transfer.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                r.addr().unwrap_or_default() as *mut u8,
                r.len() as usize,
            )
        };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31) ^ seed;
        }
        Ok(p)
    };
    let a = NixlRemote::new("example-a", g2(0x5a)?, RemoteConfig::default())?;
    let b = NixlRemote::new("example-b", g2(0xa5)?, RemoteConfig::default())?;
    // The bytes a leader would carry from a to b.
    let description = a.export()?;
    println!("peer description: {} bytes", description.len());
    let peer = b.import(&description)?;

    let (c0, t0) = (cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(2));
    println!(
        "idle pair of agents: {:.1}% of one core",
        (cpu_seconds() - c0) / t0.elapsed().as_secs_f64() * 100.0
    );

    let pairs: Vec<(usize, usize)> = (0..256).map(|i| ((i * 97) % 256, i)).collect();
    for _ in 0..3 {
        let (c0, t0) = (cpu_seconds(), Instant::now());
        let report = b.pull(&peer, &pairs)?.wait()?;
        let secs = t0.elapsed().as_secs_f64();
        let gib = report.bytes as f64 / (1u64 << 30) as f64;
        println!(
            "pulled {} blocks, {:.2} GB/s, {:.2} CPU-s/GiB",
            report.blocks,
            report.bytes as f64 / secs / 1e9,
            (cpu_seconds() - c0) / gib
        );
    }
    // Every pulled byte is the peer's.
    let (ra, rb) = (&a.local().regions()[0], &b.local().regions()[0]);
    let block = cfg.block_bytes() as usize;
    // SAFETY: both regions are live and no transfer runs any more.
    let (sa, sb) = unsafe {
        (
            std::slice::from_raw_parts(
                ra.addr().unwrap_or_default() as *const u8,
                ra.len() as usize,
            ),
            std::slice::from_raw_parts(
                rb.addr().unwrap_or_default() as *const u8,
                rb.len() as usize,
            ),
        )
    };
    for &(r, l) in &pairs {
        if sa[r * block..(r + 1) * block] != sb[l * block..(l + 1) * block] {
            return Err(format!("block {r} -> {l} differs").into());
        }
    }
    println!("every byte verified");
    Ok(())
}
