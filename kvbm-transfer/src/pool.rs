//! A small pool of blocking worker threads.
//!
//! Workers sleep on a condition variable until a task arrives — nothing
//! spins. Dropping the pool lets queued tasks finish, then joins the
//! workers.

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

type Task = Box<dyn FnOnce() + Send>;

struct Queue {
    tasks: Mutex<(VecDeque<Task>, bool)>,
    cv: Condvar,
}

/// Worker threads that run boxed tasks in FIFO order.
pub(crate) struct WorkerPool {
    queue: Arc<Queue>,
    threads: Vec<JoinHandle<()>>,
}

impl WorkerPool {
    /// Starts `n` (at least one) workers named `name-i`.
    pub(crate) fn new(name: &str, n: usize) -> std::io::Result<Self> {
        let queue = Arc::new(Queue {
            tasks: Mutex::new((VecDeque::new(), false)),
            cv: Condvar::new(),
        });
        let mut threads = Vec::new();
        for i in 0..n.max(1) {
            let q = queue.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || worker(&q))?,
            );
        }
        Ok(WorkerPool { queue, threads })
    }

    /// Number of workers.
    pub(crate) fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Queues a task.
    pub(crate) fn spawn(&self, task: impl FnOnce() + Send + 'static) {
        self.queue.tasks.lock().0.push_back(Box::new(task));
        self.queue.cv.notify_one();
    }
}

fn worker(q: &Queue) {
    loop {
        let task = {
            let mut guard = q.tasks.lock();
            loop {
                if let Some(t) = guard.0.pop_front() {
                    break t;
                }
                if guard.1 {
                    return;
                }
                q.cv.wait(&mut guard);
            }
        };
        task();
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.queue.tasks.lock().1 = true;
        self.queue.cv.notify_all();
        let me = std::thread::current().id();
        for t in self.threads.drain(..) {
            // The last handle may be dropped by a task on one of the workers;
            // that worker exits by itself after the task, and joining it
            // from itself would deadlock.
            if t.thread().id() != me {
                // A worker that panicked has already reported it.
                let _ = t.join();
            }
        }
    }
}
