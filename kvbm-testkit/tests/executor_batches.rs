//! How the executor runs a transfer's batches: the batches in flight are
//! bounded per direction, so an onboard never queues behind an offload's
//! batches while batches of one direction still wait their turn; and the
//! caller's thread starts only a transfer's first batch, the executor's
//! planning thread the rest.

// kvbm-transfer's test helpers: these tests are kvbm-transfer's, kept here
// because they need this crate's fixtures.
#[path = "../../kvbm-transfer/tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use kvbm_layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_testkit::gate::Gate;
use kvbm_testkit::stand_in::{HostAsDevice, gated_stand_in_executor, host_device_layout};
use kvbm_transfer::{
    BackendKind, Completion, Executor, ExecutorConfig, MemoryKind, TransferBackend, TransferJob,
};
use parking_lot::Mutex;

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn an_onboard_does_not_queue_behind_an_offloads_batches() {
    let gate = Gate::closed();
    let exec = gated_stand_in_executor(&gate, 1, 1).unwrap();
    let cfg = LayoutConfig::new(8, 2, 2, 16, 128, 2).unwrap();
    let layout = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let device = host_device_layout(layout.clone(), true).unwrap();
    let host = common::host(layout.clone());
    common::fill(&device, 1);
    common::fill(&host, 2);
    let (device_then, host_then) = (common::snapshot(&device), common::snapshot(&host));

    // Four blocks offloaded one batch at a time: the first is held at the
    // gate, the other three wait for the one permit of their direction.
    let offload_pairs = [(0, 0), (1, 1), (2, 2), (3, 3)];
    let offload = exec.transfer(&device, &host, &offload_pairs);
    gate.wait_until(WAIT, |c| c.arrived == 1)
        .expect("the offload's first batch reaches the backend");
    // A second offload queues behind the first.
    let second = exec.transfer(&device, &host, &[(6, 6)]);
    // An onboard the other way has a permit of its own.
    let onboard_pairs = [(4, 4), (5, 5)];
    let onboard = exec.transfer(&host, &device, &onboard_pairs);
    gate.wait_until(WAIT, |c| c.arrived == 2)
        .expect("the onboard's batch reaches the backend while the offload's wait");
    assert_eq!(
        gate.counts().arrived,
        2,
        "one batch in flight per direction: the offloads' other batches wait"
    );

    gate.open();
    assert_eq!(onboard.wait().unwrap().blocks, 2);
    assert_eq!(offload.wait().unwrap().blocks, 4);
    assert_eq!(second.wait().unwrap().blocks, 1);
    let (device_now, host_now) = (common::snapshot(&device), common::snapshot(&host));
    let mut offloaded = offload_pairs.to_vec();
    offloaded.push((6, 6));
    common::assert_blocks_match(&layout, &device_then, &layout, &host_now, &offloaded);
    common::assert_blocks_match(&layout, &host_then, &layout, &device_now, &onboard_pairs);
}

/// Notes the thread of every submission, then copies.
struct ThreadNoting {
    inner: HostAsDevice,
    threads: Arc<Mutex<Vec<std::thread::ThreadId>>>,
}

impl TransferBackend for ThreadNoting {
    fn name(&self) -> &'static str {
        "thread-noting"
    }
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }
    fn supports(&self, s: MemoryKind, d: MemoryKind) -> bool {
        self.inner.supports(s, d)
    }
    fn submit(&self, job: TransferJob) -> Completion {
        self.threads.lock().push(std::thread::current().id());
        self.inner.submit(job)
    }
}

#[test]
fn the_caller_starts_the_first_batch_and_the_planning_thread_the_rest() {
    let threads = Arc::new(Mutex::new(Vec::new()));
    let exec = Executor::builder()
        .backend(Arc::new(ThreadNoting {
            inner: HostAsDevice::new(1).unwrap(),
            threads: threads.clone(),
        }))
        .config(ExecutorConfig {
            max_blocks_per_batch: 2,
            max_batches_in_flight: 8,
            bounce_slots_per_batch: 1,
        })
        .build()
        .unwrap();
    let cfg = LayoutConfig::new(16, 2, 2, 16, 128, 2).unwrap();
    let layout = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let device = host_device_layout(layout.clone(), true).unwrap();
    let host = common::host(layout.clone());
    common::fill(&device, 3);
    let device_then = common::snapshot(&device);
    for round in 0..3 {
        threads.lock().clear();
        // Seven blocks in batches of two: four batches.
        let pairs: Vec<(usize, usize)> = (0..7).map(|b| (b + round, 15 - b - round)).collect();
        assert_eq!(
            exec.transfer(&device, &host, &pairs).wait().unwrap().blocks,
            7
        );
        common::assert_blocks_match(
            &layout,
            &device_then,
            &layout,
            &common::snapshot(&host),
            &pairs,
        );
        let seen = threads.lock().clone();
        let me = std::thread::current().id();
        assert_eq!(seen.len(), 4, "round {round}: four batches");
        assert_eq!(
            seen[0], me,
            "round {round}: the caller starts the first batch"
        );
        assert!(
            seen[1..].iter().all(|t| *t != me),
            "round {round}: the other batches start off the caller's thread: {seen:?}"
        );
    }
}
