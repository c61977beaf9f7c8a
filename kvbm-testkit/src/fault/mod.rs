//! Fault injection under kvbm-transfer's disk backend.
//!
//! [`FaultyEngine`] wraps any [`IoEngine`] and, following a list of
//! [`FaultRule`]s, turns chosen operations into errors (`EIO`, `ENOSPC`,
//! `EINTR`, `EAGAIN`), short transfers, or delays, or holds them at a
//! [`Gate`] until the test lets them through — and can make the whole
//! disk vanish at any moment through its [`FaultControl`]. It sits exactly
//! where the production engine sits, so the backend code that handles the
//! faults is the code production runs.

use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use kvbm_transfer::Result;
use kvbm_transfer::disk::{IoDir, IoEngine, IoOp, IoSink};
use kvbm_transfer::memory::MemoryRegion;
use parking_lot::Mutex;

use crate::gate::Gate;

/// What happens to a matched operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fails with this OS error number (`libc::EIO`, `libc::ENOSPC`,
    /// `libc::EINTR`, `libc::EAGAIN`...), moving nothing.
    Errno(i32),
    /// Moves at most this many bytes and reports the short count.
    Short(u32),
    /// Runs the operation after this delay.
    Delay(Duration),
    /// Holds the operation at the [`FaultControl::gate`] (closed until the
    /// test opens it) and runs it when the gate lets it through.
    Hold,
}

/// When a fault fires.
#[derive(Debug, Clone)]
pub struct FaultRule {
    /// Only operations in this direction (any when `None`).
    pub dir: Option<IoDir>,
    /// Only operations overlapping these file bytes (any when `None`).
    pub file_range: Option<Range<u64>>,
    /// Skip this many matching operations first.
    pub skip: usize,
    /// Fire at most this many times (`usize::MAX`: always).
    pub times: usize,
    /// What to do.
    pub fault: Fault,
}

impl FaultRule {
    /// A rule that fires on every operation.
    pub fn always(fault: Fault) -> Self {
        FaultRule {
            dir: None,
            file_range: None,
            skip: 0,
            times: usize::MAX,
            fault,
        }
    }

    /// Limits the rule to operations overlapping `range` of a file.
    pub fn on_range(mut self, range: Range<u64>) -> Self {
        self.file_range = Some(range);
        self
    }

    /// Limits the rule to one direction.
    pub fn on_dir(mut self, dir: IoDir) -> Self {
        self.dir = Some(dir);
        self
    }

    /// Skips the first `n` matching operations.
    pub fn after(mut self, n: usize) -> Self {
        self.skip = n;
        self
    }

    /// Fires at most `n` times.
    pub fn times(mut self, n: usize) -> Self {
        self.times = n;
        self
    }

    fn matches(&self, op: &IoOp) -> bool {
        self.dir.is_none_or(|d| d == op.dir)
            && self
                .file_range
                .as_ref()
                .is_none_or(|r| op.file_offset < r.end && r.start < op.file_offset + op.len as u64)
    }
}

struct RuleState {
    rule: FaultRule,
    seen: usize,
    fired: usize,
}

/// Live control over a [`FaultyEngine`]: make the disk vanish, read
/// counts, let held operations through.
#[derive(Debug)]
pub struct FaultControl {
    vanished: AtomicBool,
    vanish_after: AtomicUsize,
    ops: AtomicUsize,
    injected: AtomicUsize,
    gate: Arc<Gate>,
}

impl Default for FaultControl {
    fn default() -> Self {
        FaultControl {
            vanished: AtomicBool::new(false),
            vanish_after: AtomicUsize::new(0),
            ops: AtomicUsize::new(0),
            injected: AtomicUsize::new(0),
            gate: Gate::closed(),
        }
    }
}

impl FaultControl {
    /// From now on every operation fails with `ENODEV`, as if the device
    /// were unplugged.
    pub fn vanish(&self) {
        self.vanished.store(true, Ordering::Release);
    }

    /// The disk vanishes once `n` more operations have been submitted.
    pub fn vanish_after(&self, n: usize) {
        self.vanish_after
            .store(self.ops.load(Ordering::Acquire) + n + 1, Ordering::Release);
    }

    /// Operations submitted so far (including resubmissions).
    pub fn ops(&self) -> usize {
        self.ops.load(Ordering::Acquire)
    }

    /// Faults injected so far.
    pub fn injected(&self) -> usize {
        self.injected.load(Ordering::Acquire)
    }

    /// The gate that operations matched by a [`Fault::Hold`] rule wait at
    /// (closed at first). Its counts cover those operations only: `ended`
    /// and `delivered` count one just before and just after the
    /// operation's result is handed on.
    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }
}

/// Counts an operation that passed the gate as ended, then hands its
/// result on.
struct GateSink {
    inner: Arc<dyn IoSink>,
    gate: Arc<Gate>,
}

impl IoSink for GateSink {
    fn complete(&self, token: u64, result: io::Result<usize>) {
        self.gate.ended();
        self.inner.complete(token, result);
        self.gate.delivered();
    }

    fn wanted(&self) -> bool {
        self.inner.wanted()
    }
}

/// An [`IoEngine`] that injects faults into another.
pub struct FaultyEngine<E: IoEngine> {
    inner: Arc<E>,
    rules: Mutex<Vec<RuleState>>,
    control: Arc<FaultControl>,
}

impl<E: IoEngine> FaultyEngine<E> {
    /// Wraps `inner` with no rules.
    pub fn new(inner: E) -> Self {
        FaultyEngine {
            inner: Arc::new(inner),
            rules: Mutex::new(Vec::new()),
            control: Arc::default(),
        }
    }

    /// Adds a rule (rules are tried in the order added; the first that
    /// fires wins).
    pub fn with(self, rule: FaultRule) -> Self {
        self.rules.lock().push(RuleState {
            rule,
            seen: 0,
            fired: 0,
        });
        self
    }

    /// The control handle.
    pub fn control(&self) -> Arc<FaultControl> {
        self.control.clone()
    }

    fn pick(&self, op: &IoOp) -> Option<Fault> {
        let mut rules = self.rules.lock();
        for st in rules.iter_mut() {
            if !st.rule.matches(op) {
                continue;
            }
            st.seen += 1;
            if st.seen > st.rule.skip && st.fired < st.rule.times {
                st.fired += 1;
                return Some(st.rule.fault);
            }
        }
        None
    }
}

impl<E: IoEngine> IoEngine for FaultyEngine<E> {
    fn name(&self) -> &'static str {
        "faulty"
    }

    fn submit(&self, ops: Vec<IoOp>) {
        let mut pass = Vec::with_capacity(ops.len());
        for mut op in ops {
            let n = self.control.ops.fetch_add(1, Ordering::AcqRel) + 1;
            let after = self.control.vanish_after.load(Ordering::Acquire);
            if after != 0 && n >= after {
                self.control.vanished.store(true, Ordering::Release);
            }
            if self.control.vanished.load(Ordering::Acquire) {
                self.control.injected.fetch_add(1, Ordering::AcqRel);
                op.sink
                    .complete(op.token, Err(io::Error::from_raw_os_error(libc::ENODEV)));
                continue;
            }
            match self.pick(&op) {
                None => pass.push(op),
                Some(fault) => {
                    self.control.injected.fetch_add(1, Ordering::AcqRel);
                    match fault {
                        Fault::Errno(e) => op
                            .sink
                            .complete(op.token, Err(io::Error::from_raw_os_error(e))),
                        Fault::Short(keep) => {
                            op.len = op.len.min(keep.max(1));
                            pass.push(op);
                        }
                        Fault::Delay(d) => {
                            let inner = self.inner.clone();
                            std::thread::spawn(move || {
                                std::thread::sleep(d);
                                inner.submit(vec![op]);
                            });
                        }
                        Fault::Hold => {
                            let inner = self.inner.clone();
                            let gate = &self.control.gate;
                            op.sink = Arc::new(GateSink {
                                inner: op.sink,
                                gate: Arc::clone(gate),
                            });
                            let work = Box::new(move |_: &Arc<Gate>| inner.submit(vec![op]));
                            if let Some(work) = gate.arrive(work) {
                                work(gate);
                            }
                        }
                    }
                }
            }
        }
        self.inner.submit(pass);
    }

    fn register_memory(&self, region: &MemoryRegion) -> Result<bool> {
        self.inner.register_memory(region)
    }
}
