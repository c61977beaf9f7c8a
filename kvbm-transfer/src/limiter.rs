//! A counting limiter with callback waiters: the executor's global bound on
//! batches in flight. A batch that finds no permit is queued (FIFO) and
//! started by whoever returns one — no thread waits and nothing spins.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;

type Waiter = Box<dyn FnOnce(Permit) + Send>;

pub(crate) struct Limiter {
    state: Mutex<(usize, VecDeque<Waiter>)>,
}

impl Limiter {
    pub(crate) fn new(permits: usize) -> Arc<Self> {
        Arc::new(Limiter {
            state: Mutex::new((permits.max(1), VecDeque::new())),
        })
    }

    /// Runs `f` with a permit now, or queues it until one is returned.
    pub(crate) fn acquire(self: &Arc<Self>, f: impl FnOnce(Permit) + Send + 'static) {
        {
            let mut st = self.state.lock();
            if st.0 == 0 {
                st.1.push_back(Box::new(f));
                return;
            }
            st.0 -= 1;
        }
        f(Permit {
            limiter: self.clone(),
        });
    }

    fn release(self: &Arc<Self>) {
        let waiter = {
            let mut st = self.state.lock();
            match st.1.pop_front() {
                Some(w) => w,
                None => {
                    st.0 += 1;
                    return;
                }
            }
        };
        waiter(Permit {
            limiter: self.clone(),
        });
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
