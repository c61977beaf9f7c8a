//! Turning "the GPU finished" into a future, without a polling loop.
//!
//! Each lane of streams has one watcher thread. A copy records a
//! blocking-sync event after its last operation and hands the event to the
//! watcher, which sleeps in `cuEventSynchronize` (the driver wakes it) and
//! then resolves the copy's [`Completion`] with the driver's verdict: a
//! stream error resolves the completion with that error, so a failed copy
//! never reports success. The watcher also releases what the copy had to
//! keep alive (memory regions, descriptor buffers) only then.
//!
//! The driver's wake-up after the GPU's interrupt is slow, a noticeable
//! share of even a large copy. So for host ↔ device copies the watcher
//! first sleeps until shortly before the copy can have ended at the
//! earliest (its bytes at line rate, counted from the call), then polls the
//! event: busily until a short budget (0.5 ms by default) past that end,
//! then with short sleeps between queries (every 20 µs, with a 1 µs timer
//! slack on the watcher thread) for at most as long again as the copy's
//! shortest duration, and only then sleeps in the driver. The second phase
//! is for copies that run well below line rate — each direction of an
//! onboard and an offload at once, a copy behind the model's kernels —
//! which outlast the busy budget and would otherwise pay the driver's
//! wake-up; it costs a query per interval, not a core.
//!
//! Offloads (and device-to-device copies): only the last copy handed to a
//! watcher is polled. A copy with another queued behind it on its lane
//! ends with the link still busy (the next copy follows on the same
//! streams), so learning of its end a wake-up later delays no byte; the
//! watcher sleeps in the driver for it. An engine that keeps several
//! offloads in flight then costs a sleeping thread rather than a spinning
//! one: the watcher of a stream of small offloads then uses a small
//! fraction of a core where polling every copy keeps it busy much of the
//! time, for the same rate. Onboards are polled whatever follows them: a
//! request waits on each, and the driver's wake-up would add itself to the
//! wait of every onboard but the last of a queue.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::device::CudaDevice;
use super::error::{CudaError, CudaResult};
use super::handles::{Event, EventKind, Stream};
use crate::completion::{Completer, Outcome, SLEEP_MARGIN, completion_pair};

/// The outcome of one CUDA copy: the crate's [`crate::Completion`] (a
/// future, a blocking wait or a callback), resolved by the driver's verdict.
pub type Completion = crate::completion::Completion<CudaResult<()>>;

impl Outcome for CudaResult<()> {
    fn abandoned() -> Self {
        Err(CudaError::CompletionLost)
    }
}

/// A copy handed to the watcher: the event after its last operation and
/// what must stay alive until then.
struct Watch {
    event: Event,
    /// How the watcher polls before sleeping in the driver (see
    /// [`Watcher::watch`]).
    spin_from: Option<Poll>,
    keep_alive: Vec<Box<dyn Any + Send>>,
    completer: Completer<CudaResult<()>>,
}

/// When and how long a watcher polls a copy's event.
#[derive(Debug, Clone, Copy)]
struct Poll {
    /// The earliest the copy can end.
    from: Instant,
    /// Busy polling from `from` on.
    busy: Duration,
    /// Then a query every `interval` until `until` (zero: none).
    interval: Duration,
    until: Instant,
}

/// How a copy's completion is polled: when the copy was asked for, the
/// shortest time it can take (its bytes at line rate), the busy-polling
/// budget and the interval of the sleeping polls after it (zero: none).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PollPlan {
    pub asked: Instant,
    pub shortest: Duration,
    pub busy: Duration,
    pub interval: Duration,
}

/// One watcher thread and the channel feeding it.
pub(crate) struct Watcher {
    tx: Option<Sender<Watch>>,
    thread: Option<JoinHandle<()>>,
    /// When the copies handed over so far can end at the earliest.
    busy_until: Mutex<Option<Instant>>,
    /// Completion events whose copies ended, for the next copies to record
    /// (creating and destroying an event costs driver calls on the way of
    /// every copy).
    spare: Arc<Mutex<Vec<Event>>>,
}

/// Most spare events a watcher keeps.
const SPARE_EVENTS: usize = 64;

impl Watcher {
    /// Starts a watcher thread named `name`; `poll_followed` says whether
    /// it polls for copies with another queued behind them as for the last
    /// (otherwise it sleeps in the driver for them).
    pub(crate) fn spawn(device: &CudaDevice, name: &str, poll_followed: bool) -> CudaResult<Self> {
        let (tx, rx) = channel::<Watch>();
        let device = device.clone();
        let spare = Arc::new(Mutex::new(Vec::new()));
        let spare_back = Arc::clone(&spare);
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || watch_loop(&device, rx, poll_followed, &spare_back))
            .map_err(|e| CudaError::Os {
                call: "thread spawn",
                source: Arc::new(e),
            })?;
        Ok(Watcher {
            tx: Some(tx),
            thread: Some(thread),
            busy_until: Mutex::new(None),
            spare,
        })
    }

    /// Records a completion event on `stream` and returns the completion the
    /// watcher will resolve. `keep_alive` is dropped after the event fired;
    /// if the event cannot be recorded it is handed back with the error, so
    /// the caller can drain the GPU before releasing it.
    #[allow(clippy::type_complexity)]
    ///
    /// `spin`: how to poll (see [`PollPlan`]). Sleeping in the driver until
    /// the GPU's interrupt costs a slow wake-up (a noticeable share of even
    /// a large copy); the watcher instead sleeps until the earliest end of
    /// the copy (after the copies handed to it before),
    /// polls the event busily for the budget, then every interval for as
    /// long again as the shortest duration, before falling back to the
    /// driver's blocking wait. The earliest end must be a true lower bound:
    /// a watcher that sleeps past the real end wakes late by the difference.
    pub(crate) fn watch(
        &self,
        stream: &Stream,
        keep_alive: Vec<Box<dyn Any + Send>>,
        spin: Option<PollPlan>,
    ) -> Result<Completion, (CudaError, Vec<Box<dyn Any + Send>>)> {
        let (completer, completion) = completion_pair();
        match self.watch_with(stream, keep_alive, spin, completer) {
            Ok(()) => Ok(completion),
            Err((e, keep, _)) => Err((e, keep)),
        }
    }

    /// [`Watcher::watch`] resolving a completer the caller already handed
    /// out (the staged path's feeder returns the completion before the copy
    /// is enqueued). On error the completer comes back unresolved with
    /// what to keep alive.
    #[allow(clippy::type_complexity)]
    pub(crate) fn watch_with(
        &self,
        stream: &Stream,
        keep_alive: Vec<Box<dyn Any + Send>>,
        spin: Option<PollPlan>,
        completer: Completer<CudaResult<()>>,
    ) -> Result<
        (),
        (
            CudaError,
            Vec<Box<dyn Any + Send>>,
            Completer<CudaResult<()>>,
        ),
    > {
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let event = match spare.map_or_else(|| Event::new(stream.device(), EventKind::Blocking), Ok)
        {
            Ok(e) => e,
            Err(e) => return Err((e, keep_alive, completer)),
        };
        if let Err(e) = event.record(stream) {
            return Err((e, keep_alive, completer));
        }
        let spin_from = spin.map(|plan| {
            let mut busy = self.busy_until.lock().unwrap_or_else(|p| p.into_inner());
            let end = busy.filter(|&b| b > plan.asked).unwrap_or(plan.asked) + plan.shortest;
            *busy = Some(end);
            Poll {
                from: end,
                busy: plan.busy,
                interval: plan.interval,
                until: end + plan.busy + plan.shortest,
            }
        });
        if let Some(poll) = spin_from {
            // A thread blocked on the completion polls over the same busy
            // window instead of waiting for a wake-up after it.
            completer.due_at(poll.from, poll.busy);
        }
        let Some(tx) = self.tx.as_ref() else {
            // Only after drop began; nothing can be watched any more.
            return Err((CudaError::CompletionLost, keep_alive, completer));
        };
        let watch = Watch {
            event,
            spin_from,
            keep_alive,
            completer,
        };
        match tx.send(watch) {
            Ok(()) => Ok(()),
            Err(std::sync::mpsc::SendError(w)) => {
                // The watcher is gone: wait here instead, so the verdict is
                // still the driver's.
                let r = w.event.synchronize();
                drop(w.event);
                drop(w.keep_alive);
                w.completer.complete(r);
                Ok(())
            }
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watch_loop(
    device: &CudaDevice,
    rx: Receiver<Watch>,
    poll_followed: bool,
    spare: &Mutex<Vec<Event>>,
) {
    let bound = device.bind();
    // SAFETY: PR_SET_TIMERSLACK takes an unsigned long of nanoseconds and
    // changes only this thread's timer slack (so its 20 µs polling sleeps
    // are not stretched to the default 50 µs); failure is harmless.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong) };
    // Copies handed over behind the one being watched, in order.
    let mut behind: VecDeque<Watch> = VecDeque::new();
    while let Some(w) = behind.pop_front().or_else(|| rx.recv().ok()) {
        let result = match &bound {
            Ok(()) => {
                if let Some(poll) = w.spin_from {
                    let mut is_followed = || {
                        behind.extend(rx.try_iter());
                        !behind.is_empty()
                    };
                    poll_until_done(&w.event, poll, poll_followed, &mut is_followed);
                }
                w.event.synchronize()
            }
            Err(e) => Err(e.clone()),
        };
        // The copy ended: whoever waits for it learns first, and what it
        // kept alive goes after.
        let ok = result.is_ok();
        w.completer.complete(result);
        drop(w.keep_alive);
        let mut spare = spare.lock().unwrap_or_else(|p| p.into_inner());
        if ok && spare.len() < SPARE_EVENTS {
            spare.push(w.event);
        }
    }
}

/// Sleeps until shortly before the earliest end, polls `event` busily
/// until the budget past it, then every interval until the deadline;
/// returns when it fired, failed, or the polling ran out (the caller then
/// sleeps in the driver). Unless `poll_followed`, it stops polling as soon
/// as `is_followed()` says another copy is queued behind this one.
fn poll_until_done(
    event: &Event,
    poll: Poll,
    poll_followed: bool,
    is_followed: &mut dyn FnMut() -> bool,
) {
    let pending = || event.is_pending();
    // Whether polling is cut short for a copy with another behind it.
    let cut = !poll_followed;
    if cut && is_followed() {
        return;
    }
    // Sleeping right up to the earliest end risks waking after it (a
    // sleeping thread's wake-up on a virtual machine can outlast a small
    // copy): sleep until shortly before, then poll.
    let now = Instant::now();
    if poll.from > now + SLEEP_MARGIN {
        std::thread::sleep(poll.from - now - SLEEP_MARGIN);
    }
    let busy_until = poll.from.max(Instant::now()) + poll.busy;
    while pending() {
        if Instant::now() >= busy_until || (cut && is_followed()) {
            break;
        }
        std::hint::spin_loop();
    }
    if poll.interval.is_zero() {
        return;
    }
    while pending() {
        if Instant::now() >= poll.until || (cut && is_followed()) {
            return;
        }
        std::thread::sleep(poll.interval);
    }
}
