//! Two-hop transfers through bounce buffers: disk → disk, and device ↔ disk
//! with host memory standing in for the device (a memcpy backend that
//! claims the CUDA row of the strategy table).

// kvbm-transfer's test helpers: these tests are kvbm-transfer's, kept here
// because they need this crate's fixtures.
#[path = "../../kvbm-transfer/tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_testkit::gate::{Gate, GatedBackend};
use kvbm_testkit::stand_in::{
    HostAsDevice, gated_stand_in_executor, host_device_layout, pinned_stand_in_pool,
};
use kvbm_transfer::backend::memcpy::MemcpyBackend;
use kvbm_transfer::disk::{DiskBackend, DiskConfig, EngineConfig};
use kvbm_transfer::memory::{DiskAllocator, IoMode};
use kvbm_transfer::{
    BackendKind, BouncePool, Completion, Executor, ExecutorConfig, MemoryKind, PhysicalLayout,
    Strategy, TransferBackend, TransferError, TransferJob,
};

struct Rig {
    exec: Executor,
    system_pool: Arc<BouncePool>,
    pinned_pool: Arc<BouncePool>,
}

/// How long a test waits for something it is owed before it fails.
const WAIT: Duration = Duration::from_secs(10);

fn rig(slot_bytes: u64, slots: usize, per_batch: usize, batch: usize) -> Rig {
    let gates = Gates::default();
    rig_gated(slot_bytes, slots, per_batch, batch, &gates)
}

/// The gates in front of a gated rig's backends: open ones (that only
/// count) unless the test closes them.
struct Gates {
    memcpy: Arc<Gate>,
    disk: Arc<Gate>,
    device: Arc<Gate>,
}

impl Default for Gates {
    fn default() -> Self {
        Gates {
            memcpy: Gate::opened(),
            disk: Gate::opened(),
            device: Gate::opened(),
        }
    }
}

/// [`rig`] with every backend behind its gate of `gates`.
fn rig_gated(slot_bytes: u64, slots: usize, per_batch: usize, batch: usize, gates: &Gates) -> Rig {
    let disk = DiskBackend::new(&DiskConfig {
        engine: EngineConfig {
            queue_depth: 4,
            force_pread: false,
            ..Default::default()
        },
        max_io_bytes: 8192,
    })
    .unwrap();
    let system_pool = BouncePool::system(slots, slot_bytes).unwrap();
    let pinned_pool = pinned_stand_in_pool(slots, slot_bytes).unwrap();
    let exec = Executor::builder()
        .backend(Arc::new(GatedBackend::new(
            MemcpyBackend::new(2).unwrap(),
            gates.memcpy.clone(),
        )))
        .backend(Arc::new(GatedBackend::new(disk, gates.disk.clone())))
        .backend(Arc::new(GatedBackend::new(
            HostAsDevice::new(1).unwrap(),
            gates.device.clone(),
        )))
        .bounce_pool(system_pool.clone())
        .bounce_pool(pinned_pool.clone())
        .config(ExecutorConfig {
            max_blocks_per_batch: batch,
            max_batches_in_flight: 2,
            bounce_slots_per_batch: per_batch,
        })
        .build()
        .unwrap();
    Rig {
        exec,
        system_pool,
        pinned_pool,
    }
}

fn alloc() -> DiskAllocator {
    common::disk_allocator("", IoMode::Auto)
}

fn config(blocks: usize) -> LayoutConfig {
    LayoutConfig::new(blocks, 2, 2, 16, 128, 2).unwrap()
}

#[test]
fn disk_to_disk_through_small_slots_is_byte_exact() {
    for (slot, per_batch, batch) in [(4096, 1, 3), (8192, 2, 16), (12288, 3, 5), (65536, 4, 16)] {
        let r = rig(slot, 3, per_batch, batch);
        let cfg = config(16);
        let host_l = Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap();
        let disk_l = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
        let disk2_l = Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::BlockFirst)).unwrap();
        assert!(matches!(
            r.exec.strategy(MemoryKind::Disk, MemoryKind::Disk).unwrap(),
            Strategy::TwoHop { .. }
        ));
        let (src, back) = (common::host(host_l.clone()), common::host(host_l.clone()));
        common::fill(&src, slot);
        let (a, b) = (
            PhysicalLayout::allocate_disk(disk_l, &alloc()).unwrap(),
            PhysicalLayout::allocate_disk(disk2_l, &alloc()).unwrap(),
        );
        let all: Vec<_> = (0..16).map(|i| (i, i)).collect();
        r.exec.transfer(&src, &a, &all).wait().unwrap();
        let pairs: Vec<_> = (0..16).map(|i| (i, (i * 5 + 3) % 16)).collect();
        r.exec.transfer(&a, &b, &pairs).wait().unwrap();
        assert_eq!(r.system_pool.available(), r.system_pool.capacity());
        common::read_back_and_check(&r.exec, &b, &all, &back, &src, &pairs);
    }
}

#[test]
fn device_to_disk_and_back_through_pinned_bounce() {
    let r = rig(16384, 4, 2, 8);
    let cfg = config(20);
    let dev_l = Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap();
    let disk_l = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let (dev, dev2) = (
        host_device_layout(dev_l.clone(), false).unwrap(),
        host_device_layout(dev_l.clone(), false).unwrap(),
    );
    common::fill(&dev, 11);
    common::fill(&dev2, 12);
    let disk = PhysicalLayout::allocate_disk(disk_l, &alloc()).unwrap();
    assert_eq!(
        r.exec
            .strategy(MemoryKind::Device(0), MemoryKind::Disk)
            .unwrap(),
        Strategy::TwoHop {
            first: BackendKind::Cuda,
            bounce: MemoryKind::Pinned,
            second: BackendKind::Disk
        }
    );
    let pairs: Vec<_> = (0..20).map(|i| (i, 19 - i)).collect();
    r.exec.transfer(&dev, &disk, &pairs).wait().unwrap();
    let back: Vec<_> = (0..20).map(|i| (i, i)).collect();
    let before = common::snapshot(&dev2);
    r.exec.transfer(&disk, &dev2, &back).wait().unwrap();
    assert_eq!(r.pinned_pool.available(), r.pinned_pool.capacity());
    common::assert_copied(
        &dev_l,
        &common::snapshot(&dev),
        &dev_l,
        &before,
        &common::snapshot(&dev2),
        &pairs,
    );
}

#[test]
fn cancel_stops_writes_returns_slots_and_reports_landed_blocks() {
    // One batch, two bounce slots of one block each. Hop 1 (the device
    // side of device → disk) waits at a gate: two chunks go through, the
    // next two are held, so the cancel lands with two hops in flight.
    let gates = Gates {
        device: Gate::closed(),
        ..Gates::default()
    };
    let r = rig_gated(16384, 2, 2, 64, &gates);
    let cfg = config(64);
    let dev_l = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let dev = host_device_layout(dev_l.clone(), false).unwrap();
    common::fill(&dev, 5);
    let disk = PhysicalLayout::allocate_disk(dev_l.clone(), &alloc()).unwrap();
    let path = disk.regions()[0]
        .file_location()
        .unwrap()
        .0
        .path()
        .to_path_buf();
    let pairs: Vec<_> = (0..64).map(|i| (i, i)).collect();
    let handle = r.exec.transfer(&dev, &disk, &pairs);
    gates.device.allow(2);
    gates
        .device
        .wait_until(WAIT, |c| c.delivered == 2 && c.held() == 2)
        .expect("two chunks through hop 1 and two more waiting");
    handle.request_cancel();
    // What every backend had seen when the transfer resolved.
    let (tx, rx) = std::sync::mpsc::channel();
    let (device, hop2) = (gates.device.clone(), gates.disk.clone());
    handle.into_completion().on_complete(move |outcome| {
        let _ = tx.send((outcome, device.counts(), hop2.counts()));
    });
    // Let the held chunks through one at a time, each to its end: the
    // transfer may resolve only once none is left.
    while gates.device.counts().held() > 0 {
        gates.device.allow(1);
        gates
            .device
            .wait_until(WAIT, |c| c.delivered == c.passed)
            .expect("a chunk let through ends");
    }
    let (outcome, device_then, disk_then) = rx.recv_timeout(WAIT).expect("the transfer resolves");
    let failure = outcome.expect_err("a cancelled transfer fails");
    assert!(
        matches!(failure.error, TransferError::Cancelled),
        "{failure}"
    );
    assert_eq!(failure.completed.len() + failure.failed.len(), 64);
    assert!(!failure.failed.is_empty(), "{failure}");
    // It resolved with no hop in flight: nothing can reach the destination
    // after it returned.
    assert_eq!(
        device_then.running() + device_then.held(),
        0,
        "{device_then:?}"
    );
    assert_eq!(disk_then.running(), 0, "{disk_then:?}");
    assert_eq!(r.pinned_pool.available(), r.pinned_pool.capacity());
    let after_cancel = std::fs::read(&path).unwrap();
    // Blocks reported as landed really did.
    let back = common::host(dev_l.clone());
    let landed: Vec<_> = failure.completed.iter().map(|&(_, d)| (d, d)).collect();
    r.exec.transfer(&disk, &back, &landed).wait().unwrap();
    common::assert_blocks_match(
        &dev_l,
        &common::snapshot(&dev),
        &dev_l,
        &common::snapshot(&back),
        &failure.completed,
    );
    // Nothing was written since: no write started after the cancel
    // returned (the read-back went through the disk backend as reads).
    assert_eq!(gates.device.counts().arrived, device_then.arrived);
    assert!(
        std::fs::read(&path).unwrap() == after_cancel,
        "destination changed after cancel returned"
    );
}

/// Counts hop-1 submissions (the device side of device → disk).
struct CountingDevice {
    inner: HostAsDevice,
    started: Arc<(parking_lot::Mutex<usize>, parking_lot::Condvar)>,
}

impl TransferBackend for CountingDevice {
    fn name(&self) -> &'static str {
        "counting-device"
    }
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }
    fn supports(&self, s: MemoryKind, d: MemoryKind) -> bool {
        self.inner.supports(s, d)
    }
    fn submit(&self, job: TransferJob) -> Completion {
        *self.started.0.lock() += 1;
        self.started.1.notify_all();
        self.inner.submit(job)
    }
}

/// Holds each hop-2 write back until hop 1 of the next chunk has started
/// (or five seconds pass), and counts how often that happened: a pipeline
/// overlaps them, a serial two-hop never does.
struct GatedDisk {
    inner: Arc<DiskBackend>,
    hop1: Arc<(parking_lot::Mutex<usize>, parking_lot::Condvar)>,
    calls: std::sync::atomic::AtomicUsize,
    chunks: usize,
    overlapped: Arc<std::sync::atomic::AtomicUsize>,
}

impl TransferBackend for GatedDisk {
    fn name(&self) -> &'static str {
        "gated-disk"
    }
    fn kind(&self) -> BackendKind {
        BackendKind::Disk
    }
    fn supports(&self, s: MemoryKind, d: MemoryKind) -> bool {
        self.inner.supports(s, d)
    }
    fn submit(&self, job: TransferJob) -> Completion {
        use std::sync::atomic::Ordering;
        let k = self.calls.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = kvbm_transfer::completion_pair();
        let (hop1, inner, overlapped, chunks) = (
            self.hop1.clone(),
            self.inner.clone(),
            self.overlapped.clone(),
            self.chunks,
        );
        std::thread::spawn(move || {
            if k + 2 <= chunks {
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                let mut started = hop1.0.lock();
                while *started < k + 2 && !hop1.1.wait_until(&mut started, deadline).timed_out() {}
                if *started >= k + 2 {
                    overlapped.fetch_add(1, Ordering::SeqCst);
                }
            }
            inner.submit(job).on_complete(move |r| tx.complete(r));
        });
        rx
    }
}

#[test]
fn hop_one_of_the_next_chunk_runs_while_hop_two_of_this_one_is_in_flight() {
    let slot = 16384u64;
    let cfg = config(8); // 8 blocks × 16 KiB = 8 chunks of one slot
    let dev_l = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let chunks = (dev_l.total_bytes() / slot) as usize;
    let started = Arc::new((parking_lot::Mutex::new(0), parking_lot::Condvar::new()));
    let overlapped = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let disk = DiskBackend::new(&DiskConfig::default()).unwrap();
    let pool = pinned_stand_in_pool(2, slot).unwrap();
    let exec = Executor::builder()
        .backend(Arc::new(CountingDevice {
            inner: HostAsDevice::new(1).unwrap(),
            started: started.clone(),
        }))
        .backend(Arc::new(GatedDisk {
            inner: Arc::new(disk),
            hop1: started.clone(),
            calls: Default::default(),
            chunks,
            overlapped: overlapped.clone(),
        }))
        .bounce_pool(pool.clone())
        .config(ExecutorConfig {
            max_blocks_per_batch: 8,
            max_batches_in_flight: 1,
            bounce_slots_per_batch: 2,
        })
        .build()
        .unwrap();
    let dev = host_device_layout(dev_l.clone(), false).unwrap();
    common::fill(&dev, 9);
    let d = PhysicalLayout::allocate_disk(dev_l.clone(), &alloc()).unwrap();
    let pairs: Vec<_> = (0..8).map(|i| (i, i)).collect();
    exec.transfer(&dev, &d, &pairs).wait().unwrap();
    assert_eq!(
        overlapped.load(std::sync::atomic::Ordering::SeqCst),
        chunks - 1
    );
    assert_eq!(*started.0.lock(), chunks);
    assert_eq!(pool.available(), 2);
    let back = common::host(dev_l.clone());
    exec.transfer(&d, &back, &pairs).wait().unwrap();
    common::assert_blocks_match(
        &dev_l,
        &common::snapshot(&dev),
        &dev_l,
        &common::snapshot(&back),
        &pairs,
    );
}

#[test]
fn dropping_the_executor_mid_transfer_lets_the_transfer_finish() {
    // A worker joining itself panics on its own thread, which the handles
    // would not show: count panics anywhere in the process instead.
    static PANICS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        previous(info);
    }));
    for round in 0..4 {
        // One open gate in front of all three backends: it counts their
        // drops.
        let gate = Gate::opened();
        let gates = Gates {
            memcpy: gate.clone(),
            disk: gate.clone(),
            device: gate.clone(),
        };
        let r = rig_gated(8192, 2, 2, 3, &gates);
        let cfg = config(24);
        let l = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
        let (dev, host) = (
            host_device_layout(l.clone(), false).unwrap(),
            common::host(l.clone()),
        );
        common::fill(&dev, round);
        common::fill(&host, round + 100);
        let d = PhysicalLayout::allocate_disk(l.clone(), &alloc()).unwrap();
        let pairs: Vec<_> = (0..24).map(|i| (i, i)).collect();
        // Two-hop (device -> disk) and direct (host -> host) at once; the
        // last handles to the backends and pools then die on their own
        // worker threads.
        let a = r.exec.transfer(&dev, &d, &pairs);
        let b = r.exec.transfer(&host, &dev, &pairs[..12]);
        drop((r, gates));
        a.wait().unwrap();
        b.wait().unwrap();
        // Every backend is dropped in the end, on whichever thread held
        // its last handle (and with it its worker threads, but the one
        // that dropped it, which then only returns).
        gate.wait_until(WAIT, |c| c.dropped == 3)
            .expect("every backend is dropped once its transfers ended");
    }
    assert_eq!(PANICS.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[test]
fn cancelling_a_transfer_queued_behind_another_does_not_wait_for_it() {
    // The device's copies wait at a gate until the test opens it.
    let gate = Gate::closed();
    let exec = gated_stand_in_executor(&gate, 2, 1).unwrap();
    let l = Layout::new(config(8), LayoutKind::FullyContiguous).unwrap();
    let (a_src, b_src, dst) = (
        host_device_layout(l.clone(), false).unwrap(),
        host_device_layout(l.clone(), false).unwrap(),
        host_device_layout(l.clone(), false).unwrap(),
    );
    let dst2 = host_device_layout(l, false).unwrap();
    let pairs: Vec<_> = (0..8).map(|i| (i, i)).collect();
    // A holds the only in-flight permit until the gate opens; B queues.
    let a = exec.transfer(&a_src, &dst, &pairs);
    let b = exec.transfer(&b_src, &dst2, &pairs);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(b.cancel()).unwrap());
    let b_outcome = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("cancel waited for another transfer");
    let f = b_outcome.unwrap_err();
    assert!(matches!(f.error, TransferError::Cancelled));
    assert!(f.completed.is_empty());
    assert_eq!(f.failed.len(), 8);
    // A was held at the gate all along; let it finish normally.
    assert!(gate.counts().held() > 0);
    gate.open();
    assert_eq!(a.wait().unwrap().blocks, 8);
}

// The chunk trace: kvbm-transfer's feature `diagnostics`, which this
// crate's tests turn on.
#[test]
fn chunk_trace_sees_every_chunk_in_order_and_no_more_slots_than_allowed() {
    use kvbm_transfer::bounce::trace::{ChunkTrace, TraceEvent, TraceSummary};
    use std::collections::HashMap;
    let (slot, per_batch, batch) = (8192u64, 3usize, 5usize);
    let trace = Arc::new(ChunkTrace::new(1 << 12));
    let disk = DiskBackend::new(&DiskConfig::default()).unwrap();
    let pool = pinned_stand_in_pool(6, slot).unwrap();
    let exec = Executor::builder()
        .backend(Arc::new(HostAsDevice::new(1).unwrap()))
        .backend(Arc::new(disk))
        .bounce_pool(pool.clone())
        .chunk_trace(trace.clone())
        .config(ExecutorConfig {
            max_blocks_per_batch: batch,
            max_batches_in_flight: 2,
            bounce_slots_per_batch: per_batch,
        })
        .build()
        .unwrap();
    let l = Layout::new(config(16), LayoutKind::FullyContiguous).unwrap();
    let dev = host_device_layout(l.clone(), false).unwrap();
    common::fill(&dev, 21);
    let d = PhysicalLayout::allocate_disk(l.clone(), &alloc()).unwrap();
    let pairs: Vec<_> = (0..16).map(|i| (i, 15 - i)).collect();
    exec.transfer(&dev, &d, &pairs).wait().unwrap();
    let records = trace.records();
    assert_eq!(trace.dropped(), 0);
    // 16 blocks of 8 KiB in batches of 5: chunks of one 8 KiB slot each.
    let chunks = (l.total_bytes() / slot) as usize;
    let starts: Vec<u32> = records
        .iter()
        .filter(|r| r.event == TraceEvent::PipelineStart)
        .map(|r| r.chunk)
        .collect();
    assert_eq!(starts.len(), 16usize.div_ceil(batch));
    assert_eq!(starts.iter().sum::<u32>() as usize, chunks);
    // Per chunk: each event once, in order, on one slot.
    type Events = Vec<(TraceEvent, u64, u16)>;
    let mut seen: HashMap<(u32, u32), Events> = HashMap::new();
    for r in records
        .iter()
        .filter(|r| r.event != TraceEvent::PipelineStart)
    {
        seen.entry((r.pipeline, r.chunk))
            .or_default()
            .push((r.event, r.t_ns, r.slot));
    }
    assert_eq!(seen.len(), chunks);
    let order = [
        TraceEvent::SlotAsked,
        TraceEvent::SlotGranted,
        TraceEvent::Hop1Start,
        TraceEvent::Hop1End,
        TraceEvent::Hop2Start,
        TraceEvent::Hop2End,
    ];
    for ev in seen.values() {
        let kinds: Vec<TraceEvent> = ev.iter().map(|e| e.0).collect();
        assert_eq!(kinds, order, "{ev:?}");
        assert!(ev.windows(2).all(|w| w[0].1 <= w[1].1));
        assert!(ev[1..].iter().all(|e| e.2 == ev[1].2), "one slot per chunk");
    }
    // Hop 2 starts in chunk order within each pipeline.
    let mut last_hop2: HashMap<u32, u32> = HashMap::new();
    for r in records.iter().filter(|r| r.event == TraceEvent::Hop2Start) {
        if let Some(prev) = last_hop2.insert(r.pipeline, r.chunk) {
            assert!(prev < r.chunk);
        }
    }
    // Never more than `per_batch` slots per pipeline, nor more than the pool.
    let (mut held, mut total, mut peak) = (HashMap::<u32, usize>::new(), 0usize, 0usize);
    for r in &records {
        match r.event {
            TraceEvent::SlotGranted => {
                let h = held.entry(r.pipeline).or_default();
                *h += 1;
                assert!(*h <= per_batch);
                total += 1;
                peak = peak.max(total);
            }
            TraceEvent::Hop2End => {
                *held.get_mut(&r.pipeline).unwrap() -= 1;
                total -= 1;
            }
            _ => {}
        }
    }
    assert!(peak <= pool.capacity());
    let s = TraceSummary::from_records(&records);
    assert_eq!(s.chunks, chunks);
    let shares = s.both + s.hop1_only + s.hop2_only_slot_bound + s.hop2_only_tail + s.idle;
    assert!((shares - 1.0).abs() < 1e-6, "{s}");
    // The trace changes nothing about the bytes.
    let back = common::host(l.clone());
    let landed: Vec<_> = (0..16).map(|i| (i, i)).collect();
    common::read_back_and_check(&exec, &d, &landed, &back, &dev, &pairs);
}

#[test]
fn buffered_disk_to_disk_is_byte_exact() {
    // Many small requests, both hops on buffered files. Where the process
    // has 4 or more CPUs they run on the mapped engine's copy threads and
    // complete out of order; on fewer, inline on the io_uring ring thread.
    let r = rig(16384, 4, 2, 7);
    let buffered = common::disk_allocator("buffered-two-hop", IoMode::Buffered);
    let cfg = config(48);
    let host_l = Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap();
    let disk_l = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let (a, b) = (
        PhysicalLayout::allocate_disk(disk_l.clone(), &buffered).unwrap(),
        PhysicalLayout::allocate_disk(disk_l, &buffered).unwrap(),
    );
    assert!(
        a.regions()[0]
            .file_location()
            .is_some_and(|(f, _)| !f.is_direct())
    );
    let (src, back) = (common::host(host_l.clone()), common::host(host_l.clone()));
    common::fill(&src, 77);
    let all: Vec<_> = (0..48).map(|i| (i, i)).collect();
    r.exec.transfer(&src, &a, &all).wait().unwrap();
    let pairs: Vec<_> = (0..48).map(|i| (i, (i * 7 + 5) % 48)).collect();
    r.exec.transfer(&a, &b, &pairs).wait().unwrap();
    assert_eq!(r.system_pool.available(), r.system_pool.capacity());
    common::read_back_and_check(&r.exec, &b, &all, &back, &src, &pairs);
}
