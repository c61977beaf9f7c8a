//! A feeder: one thread per staging ring that enqueues staged copies chunk
//! after chunk, so the caller's `copy()` returns at once.
//!
//! Enqueuing a staged copy of 16,384 small runs costs 0.5–0.8 ms of CPU
//! (planning each slot plus ~64 DMA pieces per slot at ~0.6 µs each). When
//! one thread submits an onboard and then an offload, the offload's first
//! chunk reached the GPU only after the whole onboard had been enqueued — a
//! fifth of an 8 KiB-run copy lost on the H200 machine. With a feeder per
//! ring the two copies are enqueued by two threads at the same time. A
//! lone copy does not wait for this thread to wake: when the ring has
//! nothing queued, the caller enqueues the first chunks itself and the
//! feeder continues from there (see `StagedRing::submit`). The caller
//! tells the feeder first ([`Feeder::expect`]), so the thread wakes while
//! the caller enqueues and then polls for the job for a short while
//! instead of going back to sleep: the hand-off costs no second wake-up,
//! and the caller can return after one chunk (an onboard and an offload
//! submitted by one thread then start that much closer together).
//!
//! Jobs run in submission order (one ring's slots are reused in order).
//! A job that is never run still resolves its completion: the completer
//! inside it reports "completion lost" when dropped, never success.
//! Dropping the feeder runs every job already submitted, then joins.

use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One thread running submitted jobs in order with a handler it owns.
pub(crate) struct Feeder<J: Send + 'static> {
    tx: Option<Sender<Msg<J>>>,
    thread: Option<JoinHandle<()>>,
}

/// What the feeder's channel carries.
enum Msg<J> {
    Job(J),
    /// A job follows shortly (see [`Feeder::expect`]).
    Expect,
}

/// How long the thread polls for a job it was told to expect before it
/// sleeps again: longer than a caller's first chunk takes to enqueue
/// (40–55 µs on the H200 machine), short enough that a caller that never
/// submits wastes little.
const EXPECT_POLL: Duration = Duration::from_micros(250);

impl<J: Send + 'static> Feeder<J> {
    /// Starts the thread; `handler` runs each job.
    pub(crate) fn spawn(
        name: &str,
        mut handler: impl FnMut(J) + Send + 'static,
    ) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Msg<J>>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while let Ok(msg) = rx.recv() {
                    let job = match msg {
                        Msg::Job(job) => Some(job),
                        Msg::Expect => poll_for_job(&rx),
                    };
                    if let Some(job) = job {
                        handler(job);
                    }
                }
            })?;
        Ok(Feeder {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Hands `job` to the thread; gives it back when the thread is gone (it
    /// panicked), so the caller can run it itself or fail it.
    pub(crate) fn submit(&self, job: J) -> Result<(), J> {
        match &self.tx {
            Some(tx) => match tx.send(Msg::Job(job)) {
                Ok(()) => Ok(()),
                // `send` hands back the message it was given: the job.
                Err(e) => match e.0 {
                    Msg::Job(job) => Err(job),
                    Msg::Expect => Ok(()),
                },
            },
            None => Err(job),
        }
    }

    /// Wakes the thread to poll for a job the caller is about to submit
    /// (for up to `EXPECT_POLL`), so the job does not wait for a wake-up.
    /// Harmless if no job follows.
    pub(crate) fn expect(&self) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Msg::Expect);
        }
    }
}

/// After [`Msg::Expect`]: the next job if one comes within `EXPECT_POLL`
/// (further `Expect`s are skipped); `None` when none came or the channel
/// closed (the caller's loop then sleeps or ends).
fn poll_for_job<J>(rx: &Receiver<Msg<J>>) -> Option<J> {
    let until = Instant::now() + EXPECT_POLL;
    loop {
        match rx.try_recv() {
            Ok(Msg::Job(job)) => return Some(job),
            Ok(Msg::Expect) => {}
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) if Instant::now() >= until => return None,
            Err(TryRecvError::Empty) => std::hint::spin_loop(),
        }
    }
}

impl<J: Send + 'static> Drop for Feeder<J> {
    fn drop(&mut self) {
        // Closing the channel ends the loop once every queued job ran.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::{Completer, completion_pair};
    use std::sync::{Arc, Mutex};

    #[test]
    fn jobs_run_in_submission_order_on_another_thread() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let caller = std::thread::current().id();
        let s = Arc::clone(&seen);
        let feeder = Feeder::spawn("t-order", move |j: usize| {
            assert_ne!(std::thread::current().id(), caller);
            s.lock().unwrap().push(j);
        })
        .unwrap();
        for j in 0..500 {
            feeder.submit(j).unwrap();
        }
        drop(feeder);
        assert_eq!(*seen.lock().unwrap(), (0..500).collect::<Vec<_>>());
    }

    #[test]
    fn submit_returns_before_the_job_ran() {
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let go_rx = Mutex::new(go_rx);
        let ran = Arc::new(Mutex::new(0usize));
        let r = Arc::clone(&ran);
        let feeder = Feeder::spawn("t-async", move |()| {
            go_rx.lock().unwrap().recv().unwrap();
            *r.lock().unwrap() += 1;
        })
        .unwrap();
        // The first job blocks until released: submit must not wait for it.
        feeder.submit(()).unwrap();
        feeder.submit(()).unwrap();
        assert_eq!(*ran.lock().unwrap(), 0);
        go_tx.send(()).unwrap();
        go_tx.send(()).unwrap();
        drop(feeder);
        assert_eq!(*ran.lock().unwrap(), 2);
    }

    #[test]
    fn an_expected_job_runs_and_an_expect_without_one_is_harmless() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = Arc::clone(&seen);
        let feeder = Feeder::spawn("t-expect", move |j: usize| s.lock().unwrap().push(j)).unwrap();
        // Told, then the job within the poll window.
        feeder.expect();
        feeder.submit(1).unwrap();
        // Told, and no job for longer than the window: the thread sleeps
        // again and still takes the next job.
        feeder.expect();
        feeder.expect();
        std::thread::sleep(EXPECT_POLL * 4);
        feeder.submit(2).unwrap();
        feeder.expect();
        drop(feeder);
        assert_eq!(*seen.lock().unwrap(), vec![1, 2]);
    }

    /// A job whose handler panics is never reported successful: its
    /// completer resolves as lost, later jobs come back to the caller.
    #[test]
    fn a_dead_feeder_never_reports_success() {
        type Job = (bool, Completer<Result<(), crate::TransferError>>);
        let feeder = Feeder::spawn("t-panic", |(ok, c): Job| {
            if !ok {
                panic!("handler failed");
            }
            c.complete(Ok(()));
        })
        .unwrap();
        let (c1, done1) = completion_pair();
        assert!(feeder.submit((true, c1)).is_ok());
        assert!(done1.wait().is_ok());
        let (c2, done2) = completion_pair();
        assert!(feeder.submit((false, c2)).is_ok());
        assert!(done2.wait().is_err());
        // The thread is gone (or going): the next job comes back unrun, or
        // is dropped with the channel; either way it is not a success.
        let (c3, done3) = completion_pair();
        if let Err(job) = feeder.submit((true, c3)) {
            drop(job);
        }
        drop(feeder);
        assert!(done3.wait().is_err());
    }
}
