//! Gates that hold work in flight until the test lets it through.
//!
//! A test that shows what happens while work is in flight — what a cancel
//! reports, what a queue leaves waiting, that nothing lands after a call
//! returned — needs the work to stay in flight exactly as long as it
//! looks, whatever the machine's speed. A [`Gate`] holds each piece of work
//! that reaches it until the test lets it through ([`Gate::allow`],
//! [`Gate::open`]) and counts what arrived, passed and ended, so that the
//! test waits on those events ([`Gate::wait_until`]) instead of sleeping.
//!
//! [`GatedBackend`] puts a gate in front of any [`TransferBackend`]; the
//! fault injector's [`Fault::Hold`](crate::fault::Fault::Hold) puts one in
//! front of a disk engine's operations. An open gate holds nothing and
//! only counts, which makes a [`GatedBackend`] a counting backend too; it
//! also notes when the backend it wraps has been dropped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_transfer::{
    BackendKind, Completion, MemoryKind, MemoryRegion, Result, TransferBackend, TransferJob,
    completion_pair,
};
use parking_lot::{Condvar, Mutex};

/// What a [`Gate`] has seen so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GateCounts {
    /// Pieces of work that reached the gate.
    pub arrived: usize,
    /// Pieces let through (at once by an open gate, or released later).
    pub passed: usize,
    /// Pieces let through whose work has ended (counted just before their
    /// result is handed on, so whatever that result sets off sees it
    /// counted).
    pub ended: usize,
    /// Pieces whose result has been handed on, counted once whatever the
    /// result set off on the same thread has returned: a test that waits
    /// for this knows those consequences have happened.
    pub delivered: usize,
    /// Backends behind this gate that have been dropped (see
    /// [`GatedBackend`]).
    pub dropped: usize,
}

impl GateCounts {
    /// Pieces waiting at the gate.
    pub fn held(&self) -> usize {
        self.arrived - self.passed
    }

    /// Pieces let through and not ended yet.
    pub fn running(&self) -> usize {
        self.passed - self.ended
    }
}

/// Work held at a gate: it starts the work when called.
type HeldWork = Box<dyn FnOnce(&Arc<Gate>) + Send>;

#[derive(Default)]
struct GateState {
    /// Open for good: everything passes at once.
    open: bool,
    /// Pieces a closed gate still lets through as they come.
    permits: usize,
    counts: GateCounts,
    /// Held work, oldest first.
    held: Vec<HeldWork>,
}

/// Holds work until the test lets it through, and counts it (see the
/// module documentation).
#[derive(Default)]
pub struct Gate {
    state: Mutex<GateState>,
    cv: Condvar,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("Gate")
            .field("open", &s.open)
            .field("permits", &s.permits)
            .field("counts", &s.counts)
            .finish()
    }
}

impl Gate {
    /// A closed gate: everything that arrives waits.
    pub fn closed() -> Arc<Gate> {
        Arc::new(Gate::default())
    }

    /// An open gate: everything passes at once, counted.
    pub fn opened() -> Arc<Gate> {
        let gate = Gate::default();
        gate.state.lock().open = true;
        Arc::new(gate)
    }

    /// What the gate has seen so far.
    pub fn counts(&self) -> GateCounts {
        self.state.lock().counts
    }

    /// Lets the `n` oldest held pieces through, and as many of those that
    /// arrive later as `n` leaves over. Held work starts on this thread.
    pub fn allow(self: &Arc<Self>, n: usize) {
        let released = {
            let mut s = self.state.lock();
            let now = n.min(s.held.len());
            s.permits += n - now;
            s.counts.passed += now;
            s.held.drain(..now).collect::<Vec<_>>()
        };
        self.cv.notify_all();
        for work in released {
            work(self);
        }
    }

    /// Opens the gate for good: everything held passes (starting on this
    /// thread), and so does everything that arrives later.
    pub fn open(self: &Arc<Self>) {
        let released = {
            let mut s = self.state.lock();
            s.open = true;
            s.counts.passed += s.held.len();
            std::mem::take(&mut s.held)
        };
        self.cv.notify_all();
        for work in released {
            work(self);
        }
    }

    /// Waits until `ready` holds for the counts, at most `timeout`; returns
    /// the counts that satisfied it, or `None` on timeout (then the test
    /// fails saying what it waited for).
    pub fn wait_until(
        &self,
        timeout: Duration,
        mut ready: impl FnMut(&GateCounts) -> bool,
    ) -> Option<GateCounts> {
        let deadline = Instant::now() + timeout;
        let mut s = self.state.lock();
        loop {
            if ready(&s.counts) {
                return Some(s.counts);
            }
            if self.cv.wait_until(&mut s, deadline).timed_out() {
                return ready(&s.counts).then_some(s.counts);
            }
        }
    }

    /// Takes one arriving piece: `Some(work)` back when it passes now,
    /// `None` when the gate keeps it.
    pub(crate) fn arrive(&self, work: HeldWork) -> Option<HeldWork> {
        let mut s = self.state.lock();
        s.counts.arrived += 1;
        let now = if s.open || s.permits > 0 {
            if !s.open {
                s.permits -= 1;
            }
            s.counts.passed += 1;
            Some(work)
        } else {
            s.held.push(work);
            None
        };
        drop(s);
        self.cv.notify_all();
        now
    }

    /// One piece that passed has ended.
    pub(crate) fn ended(&self) {
        self.state.lock().counts.ended += 1;
        self.cv.notify_all();
    }

    /// The result of one piece that ended has been handed on.
    pub(crate) fn delivered(&self) {
        self.state.lock().counts.delivered += 1;
        self.cv.notify_all();
    }

    fn dropped(&self) {
        self.state.lock().counts.dropped += 1;
        self.cv.notify_all();
    }
}

/// Notes on its gate when dropped.
struct DropNote(Arc<Gate>);

impl Drop for DropNote {
    fn drop(&mut self) {
        self.0.dropped();
    }
}

/// A [`TransferBackend`] whose jobs wait at a [`Gate`] before they are
/// submitted to the backend it wraps. Everything else (name, kind, the
/// pairs it supports, memory registration) is the wrapped backend's.
/// When the wrapper is dropped, so is the wrapped backend (unless jobs
/// still hold it), and then the gate counts a drop.
pub struct GatedBackend<B: TransferBackend> {
    // Dropped in this order: the backend first, then the note.
    inner: Arc<B>,
    gate: Arc<Gate>,
    _note: DropNote,
}

impl<B: TransferBackend> GatedBackend<B> {
    /// Puts `inner` behind `gate`.
    pub fn new(inner: B, gate: Arc<Gate>) -> Self {
        GatedBackend {
            inner: Arc::new(inner),
            _note: DropNote(Arc::clone(&gate)),
            gate,
        }
    }

    /// The gate.
    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }
}

impl<B: TransferBackend> TransferBackend for GatedBackend<B> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }

    fn supports(&self, src: MemoryKind, dst: MemoryKind) -> bool {
        self.inner.supports(src, dst)
    }

    fn submit(&self, job: TransferJob) -> Completion {
        let (tx, rx) = completion_pair();
        let inner = Arc::clone(&self.inner);
        let work: HeldWork = Box::new(move |gate: &Arc<Gate>| {
            let gate = Arc::clone(gate);
            inner.submit(job).on_complete(move |result| {
                gate.ended();
                tx.complete(result);
                gate.delivered();
            });
        });
        if let Some(work) = self.gate.arrive(work) {
            work(&self.gate);
        }
        rx
    }

    fn register_memory(&self, region: &MemoryRegion) -> Result<bool> {
        self.inner.register_memory(region)
    }
}
