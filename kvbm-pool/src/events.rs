//! KV events: what a tier stores and removes, for KV-aware routers.
//!
//! Events are produced under the pool's exclusive registry lock, in the
//! order the registry changed, and handed to every subscriber as one batch
//! per pool operation. A subscriber first receives a snapshot of what the
//! pool holds, so replaying its stream always gives the pool's contents.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};

use kvbm_block::SequenceHash;
use parking_lot::Mutex;

use crate::config::Tier;

/// One change of a tier's contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvEvent {
    /// A block was registered: its prefix is now matchable in `tier`.
    Stored {
        /// The block's sequence hash.
        hash: SequenceHash,
        /// Its parent's sequence hash (`None` for a first block).
        parent: Option<SequenceHash>,
        /// The tier that holds it.
        tier: Tier,
    },
    /// A block was evicted: its prefix is no longer in `tier`.
    Removed {
        /// The block's sequence hash.
        hash: SequenceHash,
        /// The tier that held it.
        tier: Tier,
    },
}

/// The events of one pool operation, in order.
pub type KvEventBatch = Arc<[KvEvent]>;

/// The subscribers of one pool.
#[derive(Default)]
pub(crate) struct EventHub {
    active: AtomicBool,
    subscribers: Mutex<Vec<Sender<KvEventBatch>>>,
}

impl EventHub {
    /// Whether anyone listens (checked before building events at all).
    pub(crate) fn active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// Adds a subscriber whose first batch is `snapshot` (when non-empty).
    pub(crate) fn subscribe(&self, snapshot: Vec<KvEvent>) -> Receiver<KvEventBatch> {
        let (tx, rx) = channel();
        if !snapshot.is_empty() {
            // The receiver is alive in our hands: sending cannot fail.
            let _ = tx.send(snapshot.into());
        }
        let mut subs = self.subscribers.lock();
        subs.push(tx);
        self.active.store(true, Ordering::Relaxed);
        rx
    }

    /// Delivers one batch to every subscriber, dropping those that left.
    pub(crate) fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let batch: KvEventBatch = events.into();
        let mut subs = self.subscribers.lock();
        subs.retain(|tx| tx.send(Arc::clone(&batch)).is_ok());
        if subs.is_empty() {
            self.active.store(false, Ordering::Relaxed);
        }
    }
}
