//! The pool's gate: a reader-writer lock split into per-thread shards.
//!
//! Matching, presence checks and releases only need to keep the set of
//! cached hashes from changing under them (shared access); registering
//! and evicting change it (exclusive access). One `RwLock` would make every
//! shared acquisition write the same lock word, so two threads matching
//! different prefixes would bounce that cache line on every call. Here a
//! reader locks only its own thread's shard (each on its own cache lines)
//! and a writer locks every shard, in order. Writers pay a few more
//! uncontended lock operations per call — they already work on a whole
//! batch of blocks per call — and readers share nothing.

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::core::{Padded, thread_shard};

/// Shards of the gate: enough for the threads of one engine's scheduler.
const GATE_SHARDS: usize = 4;

/// A reader-writer lock whose readers lock only their thread's shard.
pub(crate) struct Gate {
    shards: Box<[Padded<RwLock<()>>]>,
}

/// Shared access: the calling thread's shard, read-locked.
pub(crate) type ReadGate<'a> = RwLockReadGuard<'a, ()>;

/// Exclusive access: every shard, write-locked.
pub(crate) struct WriteGate<'a> {
    _shards: Vec<RwLockWriteGuard<'a, ()>>,
}

impl Gate {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..GATE_SHARDS).map(|_| Padded(RwLock::new(()))).collect(),
        }
    }

    /// Shared access for the calling thread.
    pub(crate) fn read(&self) -> ReadGate<'_> {
        self.shards[thread_shard(self.shards.len())].0.read()
    }

    /// Exclusive access: waits for every reader of every shard. Shards are
    /// always locked in index order, so writers cannot deadlock each other.
    pub(crate) fn write(&self) -> WriteGate<'_> {
        WriteGate {
            _shards: self.shards.iter().map(|s| s.0.write()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    use super::*;

    /// A writer excludes readers on every thread (each thread reads through
    /// its own shard).
    #[test]
    fn writer_excludes_readers_of_every_shard() {
        let gate = Gate::new();
        let inside = AtomicUsize::new(0);
        let readers_seen_writer = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..GATE_SHARDS + 1 {
                s.spawn(|| {
                    for _ in 0..2_000 {
                        let _r = gate.read();
                        if inside.load(SeqCst) != 0 {
                            readers_seen_writer.fetch_add(1, SeqCst);
                        }
                    }
                });
            }
            s.spawn(|| {
                for _ in 0..500 {
                    let _w = gate.write();
                    inside.store(1, SeqCst);
                    std::hint::spin_loop();
                    inside.store(0, SeqCst);
                }
            });
        });
        assert_eq!(readers_seen_writer.load(SeqCst), 0);
    }
}
