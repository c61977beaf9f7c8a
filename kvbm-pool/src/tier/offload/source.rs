//! What the offload queue holds: each queued block's source, and what
//! keeps a source's bytes valid while they are copied (a held G1 pool
//! block, or the guard of an engine-owned block's request).

use std::sync::Arc;

use kvbm_block::SequenceHash;
use parking_lot::{Condvar, Mutex};

use crate::pool::{ImmutableBlock, WeakBlock};

/// One queued offload: its source and its parent's hash.
pub(super) struct Pending {
    source: Source,
    parent: Option<SequenceHash>,
}

impl Pending {
    /// A block of kvbm's G1 pool, held only weakly until its copy starts.
    pub(super) fn pool(block: WeakBlock, parent: Option<SequenceHash>) -> Self {
        Self {
            source: Source::Pool(block),
            parent,
        }
    }

    /// A block the engine owns (`id`, `hash`), valid until the request of
    /// `guard` is released.
    pub(super) fn engine(
        id: u32,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
        guard: &Arc<EngineGuard>,
    ) -> Self {
        Self {
            source: Source::Engine {
                id,
                hash,
                guard: Arc::clone(guard),
                _queued: Queued::new(guard),
            },
            parent,
        }
    }

    /// The block's hash.
    pub(super) fn hash(&self) -> SequenceHash {
        self.source.hash()
    }

    /// The block's parent's hash.
    pub(super) fn parent(&self) -> Option<SequenceHash> {
        self.parent
    }

    /// The source's block id and what keeps its bytes valid until its copy
    /// ends; `None` when the source is gone (a pool block freed since it
    /// was queued, or an engine block whose request was released).
    pub(super) fn hold(self) -> Option<(u32, Hold)> {
        match self.source {
            Source::Pool(w) => w
                .upgrade()
                .map(|b| (b.block_id(), Hold::Block { _block: b })),
            Source::Engine { id, guard, .. } => {
                guard.copy_started().then(|| (id, Hold::Engine(guard)))
            }
        }
    }
}

/// Where a queued offload reads from.
enum Source {
    /// A block of kvbm's G1 pool, held only weakly until its copy starts.
    Pool(WeakBlock),
    /// A block the engine owns, valid until its request is released.
    Engine {
        id: u32,
        hash: SequenceHash,
        guard: Arc<EngineGuard>,
        /// Counts the block as queued until the worker has dealt with it.
        _queued: Queued,
    },
}

/// One engine block waiting in the offload queue, counted on its guard
/// from enqueue until the worker started its copy or skipped it (or the
/// queue dropped it).
struct Queued(Arc<EngineGuard>);

impl Queued {
    fn new(guard: &Arc<EngineGuard>) -> Self {
        guard.state.lock().queued += 1;
        Queued(Arc::clone(guard))
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        let mut s = self.0.state.lock();
        s.queued = s.queued.saturating_sub(1);
        if s.queued == 0 {
            self.0.cv.notify_all();
        }
    }
}

impl Source {
    fn hash(&self) -> SequenceHash {
        match self {
            Source::Pool(w) => w.sequence_hash(),
            Source::Engine { hash, .. } => *hash,
        }
    }
}

/// What keeps a source's bytes valid while they are copied.
pub(super) enum Hold {
    Block { _block: ImmutableBlock },
    Engine(Arc<EngineGuard>),
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Hold::Engine(g) = self {
            g.copy_ended();
        }
    }
}

#[derive(Default)]
struct GuardState {
    released: bool,
    copying: usize,
    /// Blocks still in the queue.
    queued: usize,
}

/// Engine-owned G1 blocks of one request queued for offload: the request's
/// release waits for copies in progress and cancels the others.
#[derive(Default)]
pub(crate) struct EngineGuard {
    state: Mutex<GuardState>,
    cv: Condvar,
}

impl EngineGuard {
    fn copy_started(&self) -> bool {
        let mut s = self.state.lock();
        if s.released {
            return false;
        }
        s.copying += 1;
        true
    }

    fn copy_ended(&self) {
        let mut s = self.state.lock();
        s.copying = s.copying.saturating_sub(1);
        if s.copying == 0 {
            self.cv.notify_all();
        }
    }

    /// Waits up to `timeout` until none of the request's blocks is queued
    /// or being copied; true when that is so.
    pub(crate) fn wait_idle(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut s = self.state.lock();
        while s.queued > 0 || s.copying > 0 {
            if self.cv.wait_until(&mut s, deadline).timed_out() {
                return s.queued == 0 && s.copying == 0;
            }
        }
        true
    }

    /// No copy starts after this returns, and none is running.
    pub(crate) fn release(&self) {
        let mut s = self.state.lock();
        s.released = true;
        while s.copying > 0 {
            self.cv.wait(&mut s);
        }
    }
}
