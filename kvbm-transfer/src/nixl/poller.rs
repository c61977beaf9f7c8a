//! The completion poller: one thread that asks NIXL about every request in
//! flight.
//!
//! NIXL reports completion only through `getXferStatus` (no callback, no
//! file descriptor), so somebody has to ask. This thread does, for every
//! request of one backend, so the cost is one thread however many requests
//! are in flight. While requests run and none finishes it backs off — a few
//! `yield`s, then sleeps doubling from [`MIN_SLEEP`] to [`MAX_SLEEP`],
//! cut short when new work arrives; with nothing in flight it sleeps on a
//! condition variable and costs nothing.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::{Result, TransferError};

/// Rounds without progress spent yielding before the first sleep.
const YIELD_ROUNDS: u32 = 4;
/// First sleep after the yields.
const MIN_SLEEP: Duration = Duration::from_micros(20);
/// Longest sleep between two rounds while requests are in flight; bounds
/// the latency the poller adds to a finished request.
const MAX_SLEEP: Duration = Duration::from_micros(500);

/// A request NIXL is working on.
pub(crate) trait InFlight: Send {
    /// Asks NIXL once: `None` while it runs, then its result.
    fn check(&mut self) -> Option<Result<()>>;
    /// Consumes the request once `check` gave a result (or the poller is
    /// being torn down without a result, which it never is while NIXL
    /// still owns the request's memory).
    fn finish(self: Box<Self>, result: Result<()>);
}

#[derive(Default)]
struct Incoming {
    items: Vec<Box<dyn InFlight>>,
    shutdown: bool,
}

struct Shared {
    incoming: Mutex<Incoming>,
    cv: Condvar,
}

/// One polling thread.
pub(crate) struct Poller {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Poller {
    /// Starts the thread.
    pub(crate) fn new(name: &str) -> Result<Self> {
        let shared = Arc::new(Shared {
            incoming: Mutex::new(Incoming::default()),
            cv: Condvar::new(),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || run(&s))
            .map_err(|source| TransferError::Alloc {
                what: "NIXL poller thread".into(),
                source,
            })?;
        Ok(Poller {
            shared,
            thread: Some(thread),
        })
    }

    /// Hands a posted request to the thread.
    pub(crate) fn watch(&self, item: Box<dyn InFlight>) {
        self.shared.incoming.lock().items.push(item);
        self.shared.cv.notify_one();
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.shared.incoming.lock().shutdown = true;
        self.shared.cv.notify_one();
        if let Some(t) = self.thread.take()
            && t.thread().id() != std::thread::current().id()
        {
            // The thread leaves once every request in flight has finished:
            // NIXL may still be writing into their memory until then.
            let _ = t.join();
        }
    }
}

fn run(shared: &Shared) {
    let mut active: Vec<Box<dyn InFlight>> = Vec::new();
    let mut idle_rounds = 0u32;
    loop {
        {
            let mut inc = shared.incoming.lock();
            if active.is_empty() && inc.items.is_empty() {
                if inc.shutdown {
                    return;
                }
                shared.cv.wait(&mut inc);
            } else if idle_rounds > YIELD_ROUNDS && inc.items.is_empty() {
                let shift = (idle_rounds - YIELD_ROUNDS - 1).min(16);
                let sleep = MIN_SLEEP.saturating_mul(1 << shift).min(MAX_SLEEP);
                // New work ends the sleep early.
                shared.cv.wait_for(&mut inc, sleep);
            }
            active.append(&mut inc.items);
        }
        if idle_rounds > 0 && idle_rounds <= YIELD_ROUNDS {
            std::thread::yield_now();
        }
        let mut progressed = false;
        let mut i = 0;
        while i < active.len() {
            match active[i].check() {
                Some(result) => {
                    progressed = true;
                    active.swap_remove(i).finish(result);
                }
                None => i += 1,
            }
        }
        idle_rounds = if progressed { 0 } else { idle_rounds + 1 };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::{Completer, completion_pair};
    use std::sync::atomic::{AtomicU32, Ordering};

    struct Countdown {
        left: u32,
        checks: Arc<AtomicU32>,
        done: Option<Completer>,
    }

    impl InFlight for Countdown {
        fn check(&mut self) -> Option<Result<()>> {
            self.checks.fetch_add(1, Ordering::Relaxed);
            if self.left == 0 {
                return Some(Ok(()));
            }
            self.left -= 1;
            None
        }
        fn finish(mut self: Box<Self>, result: Result<()>) {
            if let Some(c) = self.done.take() {
                c.complete(result);
            }
        }
    }

    #[test]
    fn every_request_finishes_once_and_drop_waits_for_them() {
        let poller = Poller::new("test-poller").unwrap();
        let checks = Arc::new(AtomicU32::new(0));
        let completions: Vec<_> = (0..20)
            .map(|i| {
                let (done, completion) = completion_pair();
                poller.watch(Box::new(Countdown {
                    left: i * 3,
                    checks: checks.clone(),
                    done: Some(done),
                }));
                completion
            })
            .collect();
        drop(poller);
        for c in completions {
            c.wait().unwrap();
        }
        // Each request is checked at least once more than it counts down.
        assert!(checks.load(Ordering::Relaxed) >= (0..20).map(|i| i * 3 + 1).sum());
    }
}
