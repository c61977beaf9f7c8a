//! A counting limiter with callback waiters: the executor's bound on
//! batches in flight in one direction. A batch that finds no permit is
//! queued (FIFO) and started by whoever returns one — no thread waits and
//! nothing spins. A
//! queued batch whose transfer was cancelled can be flushed out without a
//! permit ([`Limiter::flush_cancelled`]), so cancelling never waits for
//! other transfers' batches.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::completion::CancelToken;

/// Called with a permit, or with `None` when flushed after a cancel.
type Waiter = Box<dyn FnOnce(Option<Permit>) + Send>;

pub(crate) struct Limiter {
    state: Mutex<(usize, VecDeque<(CancelToken, Waiter)>)>,
}

impl Limiter {
    pub(crate) fn new(permits: usize) -> Arc<Self> {
        Arc::new(Limiter {
            state: Mutex::new((permits.max(1), VecDeque::new())),
        })
    }

    /// Runs `f` with a permit now, or queues it until one is returned (or
    /// until `cancel` is set and [`Limiter::flush_cancelled`] runs).
    pub(crate) fn acquire(
        self: &Arc<Self>,
        cancel: &CancelToken,
        f: impl FnOnce(Option<Permit>) + Send + 'static,
    ) {
        {
            let mut st = self.state.lock();
            if st.0 == 0 {
                st.1.push_back((cancel.clone(), Box::new(f)));
                return;
            }
            st.0 -= 1;
        }
        f(Some(Permit {
            limiter: self.clone(),
        }));
    }

    /// Runs every queued waiter whose token is cancelled, without a permit.
    pub(crate) fn flush_cancelled(&self) {
        let flushed: Vec<Waiter> = {
            let mut st = self.state.lock();
            let (cancelled, kept): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut st.1)
                .into_iter()
                .partition(|(c, _)| c.is_cancelled());
            st.1 = kept;
            cancelled.into_iter().map(|(_, w)| w).collect()
        };
        for w in flushed {
            w(None);
        }
    }

    fn release(self: &Arc<Self>) {
        let waiter = {
            let mut st = self.state.lock();
            match st.1.pop_front() {
                Some((_, w)) => w,
                None => {
                    st.0 += 1;
                    return;
                }
            }
        };
        waiter(Some(Permit {
            limiter: self.clone(),
        }));
    }
}

/// Held while a batch is in flight.
pub(crate) struct Permit {
    limiter: Arc<Limiter>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.limiter.release();
    }
}
