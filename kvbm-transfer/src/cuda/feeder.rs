//! A feeder: one thread per staging ring that enqueues staged copies chunk
//! after chunk, so the caller's `copy()` returns at once.
//!
//! Enqueuing a staged copy of many small runs takes the CPU a while
//! (planning each slot, plus dozens of DMA pieces per slot, each a driver
//! call). When one thread submits an onboard and then an offload, the
//! offload's first chunk reaches the GPU only after the whole onboard has
//! been enqueued, and a copy of small runs loses a sizeable share of its
//! time that way.
//! With a feeder per ring the two copies are enqueued by two threads at the
//! same time. A lone copy does not wait for this thread to wake: when the
//! ring has nothing queued, the caller enqueues the first chunks itself and
//! the feeder continues from there (see `StagedRing::submit`).
//!
//! Jobs run in submission order (one ring's slots are reused in order).
//! A job that is never run still resolves its completion: the completer
//! inside it reports "completion lost" when dropped, never success.
//! Dropping the feeder runs every job already submitted, then joins.

use std::sync::mpsc::{Sender, channel};
use std::thread::JoinHandle;

/// One thread running submitted jobs in order with a handler it owns.
pub(crate) struct Feeder<J: Send + 'static> {
    tx: Option<Sender<J>>,
    thread: Option<JoinHandle<()>>,
}

impl<J: Send + 'static> Feeder<J> {
    /// Starts the thread; `handler` runs each job.
    pub(crate) fn spawn(
        name: &str,
        mut handler: impl FnMut(J) + Send + 'static,
    ) -> std::io::Result<Self> {
        let (tx, rx) = channel::<J>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for job in rx {
                    handler(job);
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
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
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
