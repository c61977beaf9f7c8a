//! One KV event stream for all tiers, for a KV-aware router.
//!
//! Each pool publishes its own batches (already tagged with the tier); a
//! small forwarder thread per pool merges them into one channel. A
//! forwarder ends when the subscriber's receiver is dropped and its pool
//! next publishes, or when its pool goes away.

use std::sync::mpsc::{Receiver, channel};

use crate::events::KvEventBatch;
use crate::pool::BlockPool;

/// The KV events of `pools`, merged into one stream.
pub(crate) fn merged(pools: Vec<BlockPool>) -> Receiver<KvEventBatch> {
    let (tx, rx) = channel();
    for pool in pools {
        let from = pool.subscribe();
        let tx = tx.clone();
        let spawned = std::thread::Builder::new()
            .name("kvbm-events".into())
            .spawn(move || {
                while let Ok(batch) = from.recv() {
                    if tx.send(batch).is_err() {
                        break;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start an event forwarder: {e}");
        }
    }
    rx
}
