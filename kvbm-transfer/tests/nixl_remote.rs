//! Two kvbm instances, as two processes, pulling each other's G2 blocks
//! through NIXL over UCX on loopback TCP; forged peer descriptions refused
//! before any read.
//!
//! The test re-runs its own binary twice with a role in the environment;
//! the two children exchange their exported descriptions through files in
//! a shared directory (standing in for kvbm-dist's leaders), each pulls
//! from the other, verifies every byte, and keeps its memory registered
//! until the other is done.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::memory::SystemAllocator;
use kvbm_transfer::nixl::runtime_or_skip as nixl_or_skip;
use kvbm_transfer::nixl::{NixlRemote, PeerRegion, RemoteConfig, RemoteError, RemotePeer};

const ROLE: &str = "KVBM_NIXL_TEST_ROLE";
const DIR: &str = "KVBM_NIXL_TEST_DIR";
const TEST: &str = "two_instances_pull_each_others_g2_blocks";
/// Blocks `0..SERVED` are read by the peer; pulls land in `SERVED..`.
const SERVED: usize = 16;
const BLOCKS: usize = 32;
const WAIT: Duration = Duration::from_secs(90);

fn config() -> LayoutConfig {
    // 2 KiB chunks, 8 KiB blocks.
    LayoutConfig::new(BLOCKS, 2, 2, 16, 64, 2).unwrap()
}

fn layout(role: &str) -> Layout {
    let kind = if role == "a" {
        LayoutKind::LayerSeparate(BlockOrder::OuterFirst)
    } else {
        LayoutKind::FullyContiguous
    };
    Layout::new(config(), kind).unwrap()
}

/// The byte at `i` of chunk `(block, layer, outer)` of instance `role`:
/// a hash, so every chunk differs and none is zero-filled.
fn pattern(role: &str, block: usize, layer: usize, outer: usize, i: usize) -> u8 {
    let mut z = (role.as_bytes()[0] as u64) << 56
        ^ (block as u64) << 40
        ^ (layer as u64) << 32
        ^ (outer as u64) << 28
        ^ i as u64;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as u8
}

#[allow(clippy::mut_from_ref)]
fn chunk_bytes(p: &PhysicalLayout, block: usize, layer: usize, outer: usize) -> &mut [u8] {
    let c = p.layout().chunk(block, layer, outer).unwrap();
    let base = p.regions()[c.region].addr().unwrap();
    // SAFETY: the chunk lies inside a live system region of `p`; the test
    // touches it only while no transfer into it runs.
    unsafe { std::slice::from_raw_parts_mut((base + c.offset) as *mut u8, c.len as usize) }
}

fn for_chunks(mut f: impl FnMut(usize, usize)) {
    for layer in 0..config().num_layers() {
        for outer in 0..config().outer_dim() {
            f(layer, outer);
        }
    }
}

fn wait_for(path: &Path) -> Vec<u8> {
    let start = Instant::now();
    loop {
        if let Ok(bytes) = std::fs::read(path) {
            return bytes;
        }
        assert!(
            start.elapsed() < WAIT,
            "timed out waiting for {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn publish(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn forged_descriptions_are_refused(me: &NixlRemote, real: &RemotePeer) {
    let name = real.agent_name();
    let md = real.nixl_metadata().to_vec();
    let regions = real.regions().to_vec();
    // An extent past the registered region: NIXL's registration check.
    let mut longer = regions.clone();
    longer[0].len += 4096;
    let forged = RemotePeer::new(name, md.clone(), real.layout(), longer).unwrap();
    assert!(matches!(
        me.connect(&forged),
        Err(RemoteError::NotRegistered { region: 0, .. })
    ));
    // A region moved below the registered one.
    let mut moved = regions.clone();
    let last = moved.len() - 1;
    moved[last].addr -= 4096;
    let forged = RemotePeer::new(name, md.clone(), real.layout(), moved).unwrap();
    assert!(matches!(
        me.connect(&forged),
        Err(RemoteError::NotRegistered { .. })
    ));
    // More blocks than were registered, with regions grown to match.
    let bigger = Layout::new(
        config().with_num_blocks(BLOCKS * 4).unwrap(),
        real.layout().kind(),
    )
    .unwrap();
    let grown: Vec<PeerRegion> = regions
        .iter()
        .enumerate()
        .map(|(i, r)| PeerRegion {
            len: bigger.region_size(i).unwrap(),
            ..*r
        })
        .collect();
    let forged = RemotePeer::new(name, md.clone(), &bigger, grown).unwrap();
    assert!(matches!(
        me.connect(&forged),
        Err(RemoteError::NotRegistered { .. })
    ));
    // Another block shape.
    let other = LayoutConfig::new(BLOCKS, 2, 2, 16, 128, 2).unwrap();
    let other = Layout::new(other, LayoutKind::FullyContiguous).unwrap();
    let sized: Vec<PeerRegion> = regions
        .iter()
        .take(1)
        .map(|r| PeerRegion {
            len: other.region_size(0).unwrap(),
            ..*r
        })
        .collect();
    let forged = RemotePeer::new(name, md, &other, sized).unwrap();
    assert!(matches!(
        me.connect(&forged),
        Err(RemoteError::ShapeMismatch(_))
    ));
}

fn child(role: &str, dir: &Path) {
    let peer_role = if role == "a" { "b" } else { "a" };
    let g2 = PhysicalLayout::allocate_system(layout(role), &SystemAllocator::new()).unwrap();
    for b in 0..BLOCKS {
        for_chunks(|layer, outer| {
            for (i, byte) in chunk_bytes(&g2, b, layer, outer).iter_mut().enumerate() {
                *byte = pattern(role, b, layer, outer, i);
            }
        });
    }
    let me = NixlRemote::new(
        &format!("kvbm-test-{role}"),
        g2.clone(),
        RemoteConfig { batch_blocks: 5 },
    )
    .unwrap();
    publish(&dir.join(format!("{role}.peer")), &me.export().unwrap());
    let bytes = wait_for(&dir.join(format!("{peer_role}.peer")));
    let real = RemotePeer::import(&bytes).unwrap();
    forged_descriptions_are_refused(&me, &real);
    let peer = me.import(&bytes).unwrap();
    // Connected twice: the same description is the same peer; a forged
    // one is refused without disturbing the live connection.
    assert_eq!(me.import(&bytes).unwrap().peer(), &real);
    let mut longer = real.regions().to_vec();
    longer[0].len += 4096;
    let forged = RemotePeer::new(
        real.agent_name(),
        real.nixl_metadata().to_vec(),
        real.layout(),
        longer,
    )
    .unwrap();
    assert!(matches!(
        me.connect(&forged),
        Err(RemoteError::Malformed(_))
    ));

    // Refused before any read: ids out of range, a destination twice.
    let untouched = chunk_bytes(&g2, SERVED, 0, 0).to_vec();
    assert!(matches!(
        me.pull(&peer, &[(1, SERVED), (BLOCKS, SERVED + 1)]),
        Err(RemoteError::BlockOutOfRange {
            side: "remote",
            block: BLOCKS,
            ..
        })
    ));
    assert!(matches!(
        me.pull(&peer, &[(1, BLOCKS + 3)]),
        Err(RemoteError::BlockOutOfRange { side: "local", .. })
    ));
    assert!(matches!(
        me.pull(&peer, &[(1, SERVED), (2, SERVED)]),
        Err(RemoteError::DuplicateDestination(_))
    ));
    assert_eq!(chunk_bytes(&g2, SERVED, 0, 0), &untouched[..]);

    // Non-consecutive remote blocks into non-consecutive local blocks.
    let pairs: Vec<(usize, usize)> = (0..SERVED)
        .map(|i| {
            (
                (i * 7 + 3) % SERVED,
                SERVED + (i * 5 + 1) % (BLOCKS - SERVED),
            )
        })
        .collect();
    let report = me.pull(&peer, &pairs).unwrap().wait().unwrap();
    assert_eq!(report.blocks, pairs.len());
    assert_eq!(report.bytes, pairs.len() as u64 * config().block_bytes());
    let mut checked = 0u64;
    for &(r, l) in &pairs {
        for_chunks(|layer, outer| {
            for (i, &byte) in chunk_bytes(&g2, l, layer, outer).iter().enumerate() {
                assert_eq!(
                    byte,
                    pattern(peer_role, r, layer, outer, i),
                    "block {r} -> {l} byte {i}"
                );
                checked += 1;
            }
        });
    }
    // Our own served blocks are untouched by the peer's reads.
    for b in 0..SERVED {
        for_chunks(|layer, outer| {
            for (i, &byte) in chunk_bytes(&g2, b, layer, outer).iter().enumerate() {
                assert_eq!(byte, pattern(role, b, layer, outer, i));
            }
        });
    }
    me.disconnect(&peer).unwrap();
    assert!(matches!(
        me.pull(&peer, &pairs),
        Err(RemoteError::UnknownPeer(_))
    ));
    println!(
        "role {role}: verified {checked} bytes of {} blocks",
        pairs.len()
    );
    publish(&dir.join(format!("{role}.done")), b"done");
    // Keep our memory registered until the peer has read it.
    wait_for(&dir.join(format!("{peer_role}.done")));
}

fn spawn(role: &str, dir: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(DIR, dir)
        .env("KVBM_REQUIRE_NIXL", "1")
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", "lo")
        .env("UCX_MODULES", "^ib")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn two_instances_pull_each_others_g2_blocks() {
    if let (Ok(role), Some(dir)) = (std::env::var(ROLE), std::env::var_os(DIR)) {
        return child(&role, &PathBuf::from(dir));
    }
    if !nixl_or_skip(TEST) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let children = [spawn("a", dir.path()), spawn("b", dir.path())];
    let start = Instant::now();
    let mut outputs = Vec::new();
    for mut c in children {
        // A hung child is killed rather than hanging the suite.
        while c.try_wait().unwrap().is_none() {
            if start.elapsed() > WAIT + Duration::from_secs(30) {
                let _ = c.kill();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        outputs.push(c.wait_with_output().unwrap());
    }
    for (role, out) in ["a", "b"].iter().zip(&outputs) {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("role {role}: verified")),
            "instance {role} failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        if let Some(at) = stdout.find("role ") {
            println!("{}", stdout[at..].lines().next().unwrap_or_default());
        }
    }
}

#[test]
fn real_descriptions_survive_mutation_without_panics() {
    if !nixl_or_skip("real_descriptions_survive_mutation_without_panics") {
        return;
    }
    // A real export (with NIXL's own metadata), truncated and mutated.
    let g2 = PhysicalLayout::allocate_system(layout("a"), &SystemAllocator::new()).unwrap();
    let me = NixlRemote::new("kvbm-fuzz", g2, RemoteConfig::default()).unwrap();
    let bytes = me.export().unwrap();
    assert_eq!(RemotePeer::import(&bytes).unwrap(), me.describe().unwrap());
    for cut in (0..bytes.len()).step_by(7) {
        assert!(RemotePeer::import(&bytes[..cut]).is_err());
    }
    let mut state = 0x1234_5678_u64;
    for _ in 0..2000 {
        let mut v = bytes.clone();
        for _ in 0..4 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let i = (state >> 33) as usize % v.len();
            v[i] ^= (state >> 20) as u8 | 1;
        }
        if let Ok(p) = RemotePeer::import(&v) {
            // Still well-formed; a mutation in the opaque metadata survives
            // import, and connecting to ourselves is refused.
            assert!(me.connect(&p).is_err());
        }
    }
}
