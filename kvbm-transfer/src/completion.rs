//! Completion handles and cancellation.
//!
//! A [`Completion`] is the receiving half of a transfer: a std future (no
//! runtime needed), a blocking [`Completion::wait`], or a callback
//! ([`Completion::on_complete`]) for code that chains work — backends and the
//! executor chain on callbacks so that nothing ever polls. A completion made
//! from an already-known result ([`Completion::ready`]) allocates nothing and
//! never blocks. The sending half, [`Completer`], is handed to whoever does
//! the work (a worker thread, an io_uring completion thread, a CUDA host
//! callback); if it is dropped unresolved the completion resolves to
//! [`Outcome::abandoned`] instead of hanging.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::TransferError;

/// A value a completion can resolve to; it knows what to say when the worker
/// vanished without resolving it.
pub trait Outcome: Send + 'static {
    /// The value reported when the [`Completer`] was dropped unresolved.
    fn abandoned() -> Self;
}

impl<T: Send + 'static> Outcome for Result<T, TransferError> {
    fn abandoned() -> Self {
        Err(TransferError::Abandoned("completer dropped"))
    }
}

type Callback<T> = Box<dyn FnOnce(T) + Send>;

enum State<T> {
    Pending {
        waker: Option<Waker>,
        callback: Option<Callback<T>>,
        /// When the result is due (see [`Completer::due_at`]).
        due: Option<Due>,
    },
    Done(Option<T>),
}

/// When a result is due and how long a blocked waiter polls for it.
#[derive(Debug, Clone, Copy)]
struct Due {
    at: Instant,
    spin: Duration,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    cv: Condvar,
    /// Set once resolved, for waiters polling without the lock.
    done: AtomicBool,
}

/// The receiving half: resolves once to a `T`.
#[must_use = "a completion does nothing unless waited on, awaited or given a callback"]
pub struct Completion<T: Outcome = Result<(), TransferError>> {
    inner: Inner<T>,
}

enum Inner<T> {
    Ready(Option<T>),
    Pending(Arc<Shared<T>>),
}

/// The sending half: resolve it exactly once with [`Completer::complete`].
pub struct Completer<T: Outcome = Result<(), TransferError>> {
    shared: Option<Arc<Shared<T>>>,
}

/// Makes a linked completer/completion pair.
pub fn completion_pair<T: Outcome>() -> (Completer<T>, Completion<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State::Pending {
            waker: None,
            callback: None,
            due: None,
        }),
        cv: Condvar::new(),
        done: AtomicBool::new(false),
    });
    (
        Completer {
            shared: Some(shared.clone()),
        },
        Completion {
            inner: Inner::Pending(shared),
        },
    )
}

impl<T: Outcome> Completer<T> {
    /// Resolves the completion. Runs its callback, if one is set, on this
    /// thread.
    pub fn complete(mut self, value: T) {
        if let Some(shared) = self.shared.take() {
            resolve(&shared, value);
        }
    }

    /// Says the result cannot come before `at` and will likely come soon
    /// after: a thread blocked in [`Completion::wait`] then sleeps until
    /// shortly before `at` and polls until `spin` after it before blocking
    /// again (see [`poll_until_due`]), so it does not pay a thread wake-up
    /// after the result arrived (on a virtual machine a wake-up is a
    /// noticeable share of even a large copy). Futures and callbacks are
    /// unaffected; [`Completion::map`] and the executor's transfers carry
    /// the due time on.
    pub fn due_at(&self, at: Instant, spin: Duration) {
        let Some(shared) = &self.shared else { return };
        let mut state = shared.state.lock();
        if let State::Pending { due, .. } = &mut *state {
            *due = Some(Due { at, spin });
            drop(state);
            // A waiter already blocked wakes to read it (long before `at`).
            shared.cv.notify_all();
        }
    }
}

impl<T: Outcome> Drop for Completer<T> {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            resolve(&shared, T::abandoned());
        }
    }
}

fn resolve<T: Outcome>(shared: &Shared<T>, value: T) {
    let mut state = shared.state.lock();
    match std::mem::replace(&mut *state, State::Done(None)) {
        State::Pending {
            callback: Some(cb), ..
        } => {
            drop(state);
            shared.done.store(true, Ordering::Release);
            cb(value);
        }
        State::Pending {
            waker,
            callback: None,
            ..
        } => {
            *state = State::Done(Some(value));
            drop(state);
            shared.done.store(true, Ordering::Release);
            shared.cv.notify_all();
            if let Some(w) = waker {
                w.wake();
            }
        }
        // Resolving twice is impossible: `complete` consumes the completer.
        State::Done(v) => *state = State::Done(v),
    }
}

/// Sleeps until shortly before `at` (in short naps, so a result that came
/// early, such as an error, is not slept through), polls `ready` up to
/// `at`, then for up to `spin` more; returns whether `ready` said yes. For
/// a thread that waits for something due at a known time (a copy's bytes
/// at line rate) and would rather not pay a thread wake-up after it.
///
/// The waiter's timer slack is the kernel's default (50 µs on Linux): a
/// sleep may end that much late. So the last 60 µs before `at` are
/// polled, not slept: a copy due in 40 µs is not learnt of 50 µs after it
/// landed.
pub fn poll_until_due(at: Instant, spin: Duration, mut ready: impl FnMut() -> bool) -> bool {
    const NAP: Duration = Duration::from_micros(200);
    loop {
        if ready() {
            return true;
        }
        let now = Instant::now();
        if now >= at {
            break;
        }
        let left = at - now;
        if left <= SLEEP_MARGIN {
            std::hint::spin_loop();
            continue;
        }
        std::thread::sleep((left - SLEEP_MARGIN).min(NAP));
    }
    let until = Instant::now() + spin;
    loop {
        if ready() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::hint::spin_loop();
    }
}

fn poll_until(done: &AtomicBool, due: Due) {
    poll_until_due(due.at, due.spin, || done.load(Ordering::Acquire));
}

/// How long before a result's due time a blocked waiter stops sleeping
/// and polls: more than a sleep can overrun by (the default timer slack).
pub(crate) const SLEEP_MARGIN: Duration = Duration::from_micros(60);

impl<T: Outcome> Completion<T> {
    /// A completion that is already resolved; costs no allocation.
    pub fn ready(value: T) -> Self {
        Completion {
            inner: Inner::Ready(Some(value)),
        }
    }

    /// True when the result is available without waiting.
    pub fn is_done(&self) -> bool {
        match &self.inner {
            Inner::Ready(_) => true,
            Inner::Pending(s) => matches!(*s.state.lock(), State::Done(_)),
        }
    }

    /// Blocks the calling thread until the result is available.
    pub fn wait(self) -> T {
        match self.inner {
            Inner::Ready(v) => v.unwrap_or_else(T::abandoned),
            Inner::Pending(shared) => {
                let mut state = shared.state.lock();
                let mut polled = false;
                loop {
                    if let State::Done(v) = &mut *state {
                        return v.take().unwrap_or_else(T::abandoned);
                    }
                    if let State::Pending { due: Some(due), .. } = &*state
                        && !polled
                    {
                        let due = *due;
                        polled = true;
                        parking_lot::MutexGuard::unlocked(&mut state, || {
                            poll_until(&shared.done, due)
                        });
                        continue;
                    }
                    shared.cv.wait(&mut state);
                }
            }
        }
    }

    /// When the result is due and how long a blocked waiter polls for it
    /// after that, as the completer said so far (see
    /// [`Completer::due_at`]); `None` when it did not, or when resolved.
    pub fn due(&self) -> Option<(Instant, Duration)> {
        match &self.inner {
            Inner::Ready(_) => None,
            Inner::Pending(s) => match &*s.state.lock() {
                State::Pending { due: Some(d), .. } => Some((d.at, d.spin)),
                _ => None,
            },
        }
    }

    /// The result passed through `f` (on the thread that resolves this
    /// completion; `f` must not block), due when this one is due: a
    /// waiter of the new completion polls as a waiter of this one would.
    pub fn map<U: Outcome>(self, f: impl FnOnce(T) -> U + Send + 'static) -> Completion<U> {
        if let Inner::Ready(v) = self.inner {
            return Completion::ready(f(v.unwrap_or_else(T::abandoned)));
        }
        let (completer, completion) = completion_pair();
        if let Some((at, spin)) = self.due() {
            completer.due_at(at, spin);
        }
        self.on_complete(move |v| completer.complete(f(v)));
        completion
    }

    /// Runs `f` with the result: right now if it is available, otherwise on
    /// the thread that resolves it. `f` must not block.
    pub fn on_complete(self, f: impl FnOnce(T) + Send + 'static) {
        match self.inner {
            Inner::Ready(v) => f(v.unwrap_or_else(T::abandoned)),
            Inner::Pending(shared) => {
                let mut state = shared.state.lock();
                match &mut *state {
                    State::Done(v) => {
                        let v = v.take().unwrap_or_else(T::abandoned);
                        drop(state);
                        f(v);
                    }
                    State::Pending { callback, .. } => *callback = Some(Box::new(f)),
                }
            }
        }
    }
}

impl<E: Send + 'static> Completion<Result<(), E>>
where
    Result<(), E>: Outcome,
{
    /// One completion for many: resolves when all have, to the first error
    /// (in completion order) or `Ok(())`. Free when they are all ready.
    pub fn join_all(parts: impl IntoIterator<Item = Completion<Result<(), E>>>) -> Self {
        let parts: Vec<_> = parts.into_iter().collect();
        let mut first_err = None;
        let mut pending = Vec::new();
        for p in parts {
            match p.inner {
                Inner::Ready(v) => {
                    if let Some(Err(e)) = v
                        && first_err.is_none()
                    {
                        first_err = Some(e);
                    }
                }
                Inner::Pending(_) => pending.push(p),
            }
        }
        if pending.is_empty() {
            return Completion::ready(first_err.map_or(Ok(()), Err));
        }
        let (completer, completion) = completion_pair();
        let join = Arc::new(JoinState {
            remaining: AtomicUsize::new(pending.len()),
            first_err: Mutex::new(first_err),
            completer: Mutex::new(Some(completer)),
        });
        for p in pending {
            let join = join.clone();
            p.on_complete(move |r| join.arrive(r));
        }
        completion
    }
}

struct JoinState<E: Send + 'static>
where
    Result<(), E>: Outcome,
{
    remaining: AtomicUsize,
    first_err: Mutex<Option<E>>,
    completer: Mutex<Option<Completer<Result<(), E>>>>,
}

impl<E: Send + 'static> JoinState<E>
where
    Result<(), E>: Outcome,
{
    fn arrive(&self, r: Result<(), E>) {
        if let Err(e) = r {
            let mut first = self.first_err.lock();
            if first.is_none() {
                *first = Some(e);
            }
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let err = self.first_err.lock().take();
            if let Some(c) = self.completer.lock().take() {
                c.complete(err.map_or(Ok(()), Err));
            }
        }
    }
}

// The value is never pinned structurally: `poll` only moves it out.
impl<T: Outcome> Unpin for Completion<T> {}

impl<T: Outcome> Future for Completion<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = self.get_mut();
        match &mut this.inner {
            Inner::Ready(v) => Poll::Ready(v.take().unwrap_or_else(T::abandoned)),
            Inner::Pending(shared) => {
                let mut state = shared.state.lock();
                match &mut *state {
                    State::Done(v) => Poll::Ready(v.take().unwrap_or_else(T::abandoned)),
                    State::Pending { waker, .. } => {
                        match waker {
                            Some(w) if w.will_wake(cx.waker()) => {}
                            _ => *waker = Some(cx.waker().clone()),
                        }
                        Poll::Pending
                    }
                }
            }
        }
    }
}

/// A shared cancellation flag. Backends check it between units of work and
/// resolve with [`TransferError::Cancelled`] once everything they started
/// has settled.
#[derive(Debug, Clone, Default)]
pub struct CancelToken {
    flag: Arc<AtomicBool>,
}

impl CancelToken {
    /// A fresh, uncancelled token.
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests cancellation; work not yet started will not start.
    pub fn cancel(&self) {
        self.flag.store(true, Ordering::Release);
    }

    /// Whether cancellation was requested.
    pub fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }
}

/// A job made of parts that finish on other threads: the first real error
/// wins (a cancellation never hides one), and the last part to settle
/// resolves the job's completion with it.
pub(crate) struct Countdown {
    remaining: AtomicUsize,
    failed: AtomicBool,
    error: Mutex<Option<TransferError>>,
    completer: Mutex<Option<Completer>>,
}

impl Countdown {
    /// `parts` parts (at least one) resolving `completer`.
    pub(crate) fn new(parts: usize, completer: Completer) -> Self {
        Countdown {
            remaining: AtomicUsize::new(parts),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            completer: Mutex::new(Some(completer)),
        }
    }

    /// Whether a part failed (the others may stop early).
    pub(crate) fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Records a part's failure.
    pub(crate) fn fail(&self, e: TransferError) {
        self.failed.store(true, Ordering::Release);
        let mut slot = self.error.lock();
        if slot.is_none() || matches!(*slot, Some(TransferError::Cancelled)) {
            *slot = Some(e);
        }
    }

    /// One part is done (after `fail` if it failed); the last one resolves
    /// the completion.
    pub(crate) fn settle(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let result = match self.error.lock().take() {
            Some(e) => Err(e),
            None => Ok(()),
        };
        if let Some(c) = self.completer.lock().take() {
            c.complete(result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    type R = Result<(), TransferError>;

    #[test]
    fn ready_is_done_and_free() {
        let c: Completion<R> = Completion::ready(Ok(()));
        assert!(c.is_done());
        assert!(c.wait().is_ok());
        let c: Completion<R> = Completion::ready(Err(TransferError::Cancelled));
        assert!(matches!(
            futures::executor::block_on(c),
            Err(TransferError::Cancelled)
        ));
    }

    #[test]
    fn a_waiter_told_when_the_result_is_due_still_gets_it() {
        // Told before it blocks, while blocked, with a due time in the past
        // and with no polling budget: each gets its value.
        for (hint_first, ahead_ms, spin_us) in [(true, 5, 500), (false, 5, 500), (false, 0, 0)] {
            let (completer, completion) = completion_pair::<Result<u32, TransferError>>();
            let due = Instant::now() + Duration::from_millis(ahead_ms);
            if hint_first {
                completer.due_at(due, Duration::from_micros(spin_us));
            }
            let t = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(2));
                if !hint_first {
                    completer.due_at(due, Duration::from_micros(spin_us));
                }
                std::thread::sleep(Duration::from_millis(8));
                completer.complete(Ok(7));
            });
            assert_eq!(completion.wait().unwrap(), 7);
            t.join().unwrap();
        }
    }

    #[test]
    fn a_mapped_completion_keeps_its_due_time_and_maps_the_result() {
        let (completer, completion) = completion_pair::<Result<u32, TransferError>>();
        let at = Instant::now() + Duration::from_millis(2);
        completer.due_at(at, Duration::from_micros(50));
        let mapped = completion.map(|r| r.map(|v| v * 2));
        assert_eq!(mapped.due(), Some((at, Duration::from_micros(50))));
        let t = std::thread::spawn(move || mapped.wait());
        completer.complete(Ok(21));
        assert_eq!(t.join().unwrap().unwrap(), 42);
        let ready =
            Completion::<Result<u32, TransferError>>::ready(Ok(1)).map(|r| r.map(|v| v + 1));
        assert_eq!(ready.due(), None);
        assert_eq!(ready.wait().unwrap(), 2);
    }

    #[test]
    fn wait_blocks_until_another_thread_completes() {
        let (tx, rx) = completion_pair::<R>();
        assert!(!rx.is_done());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.complete(Err(TransferError::Cancelled));
        });
        assert!(matches!(rx.wait(), Err(TransferError::Cancelled)));
        t.join().unwrap();
    }

    #[test]
    fn future_is_woken() {
        let (tx, rx) = completion_pair::<R>();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.complete(Ok(()));
        });
        assert!(futures::executor::block_on(rx).is_ok());
        t.join().unwrap();
    }

    #[test]
    fn dropped_completer_reports_abandoned_not_success() {
        let (tx, rx) = completion_pair::<R>();
        drop(tx);
        assert!(matches!(rx.wait(), Err(TransferError::Abandoned(_))));
    }

    #[test]
    fn callback_runs_before_or_after_resolution() {
        let (got_tx, got_rx) = std::sync::mpsc::channel();
        let (tx, rx) = completion_pair::<R>();
        let g = got_tx.clone();
        rx.on_complete(move |r| g.send(r.is_ok()).unwrap());
        tx.complete(Ok(()));
        let (tx, rx) = completion_pair::<R>();
        tx.complete(Err(TransferError::Cancelled));
        rx.on_complete(move |r| got_tx.send(r.is_ok()).unwrap());
        assert_eq!(got_rx.iter().take(2).collect::<Vec<_>>(), vec![true, false]);
    }

    #[test]
    fn join_all_waits_for_every_part_and_keeps_the_first_error() {
        let pairs: Vec<_> = (0..4).map(|_| completion_pair::<R>()).collect();
        let (txs, rxs): (Vec<_>, Vec<_>) = pairs.into_iter().unzip();
        let mut parts = rxs;
        parts.push(Completion::ready(Ok(())));
        let joined = Completion::join_all(parts);
        let mut txs = txs.into_iter();
        txs.next().unwrap().complete(Ok(()));
        txs.next().unwrap().complete(Err(TransferError::Cancelled));
        assert!(!joined.is_done());
        txs.next()
            .unwrap()
            .complete(Err(TransferError::InvalidRequest("later".into())));
        txs.next().unwrap().complete(Ok(()));
        assert!(matches!(joined.wait(), Err(TransferError::Cancelled)));
        assert!(Completion::<R>::join_all(Vec::new()).wait().is_ok());
    }
}
