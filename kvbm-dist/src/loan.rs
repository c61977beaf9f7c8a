//! The only worker of an instance, in its leader's process, lends the
//! leader its executor.
//!
//! An engine that runs its scheduler and its only GPU worker in one process
//! (vLLM with one GPU does) still has a leader and a worker, and a copy
//! sent through them crosses four threads (tier engine, leader loop, worker
//! loop, and back), each a wake-up. So a worker of a one-rank instance
//! offers its executor and tiers under the endpoint it connects to, and
//! lends them once configured ([`LocalRoute`]); a leader whose one rank
//! turns out to be that worker (same process, same endpoint, the identity
//! that completed the handshake) borrows them, and its mover runs copies on
//! them directly: the same executor moves the same bytes, and the caller
//! waits on its completion without a hop. The worker and the leader may
//! start in either order (vLLM starts its workers first).
//!
//! Everything else stays on the socket: handshake, heartbeats, probes. The
//! loan is withdrawn when the worker's loop ends or a configure fails, and
//! the leader stops borrowing once any rank was lost, so the bookkeeping of
//! lost blocks stays on the wire path. Offers carry the process id: a child
//! forked after a worker started inherits the table but must not borrow
//! from it.

use std::sync::Arc;

use kvbm_transfer::Executor;
use parking_lot::Mutex;

use crate::worker::Tiers;

/// What a worker lends its leader: its executor and tiers.
pub(crate) struct LocalRoute {
    pub(crate) executor: Executor,
    pub(crate) tiers: Tiers,
}

/// Where a worker puts its loan and its leader finds it.
pub(crate) type RouteSlot = Arc<Mutex<Option<Arc<LocalRoute>>>>;

/// A worker's offer.
struct Offer {
    endpoint: String,
    identity: Vec<u8>,
    pid: u32,
    slot: RouteSlot,
}

/// Every offer of this process's live workers.
static OFFERS: Mutex<Vec<Offer>> = Mutex::new(Vec::new());

/// A worker's side: offered at start, lent once configured, withdrawn on
/// drop (when its loop ends).
pub(crate) struct Loan {
    slot: RouteSlot,
}

impl Loan {
    /// Offers a loan by the worker `identity` connecting to `endpoint`;
    /// nothing is lent yet.
    pub(crate) fn offer(endpoint: &str, identity: &[u8]) -> Self {
        let slot = RouteSlot::default();
        OFFERS.lock().push(Offer {
            endpoint: endpoint.to_owned(),
            identity: identity.to_vec(),
            pid: std::process::id(),
            slot: Arc::clone(&slot),
        });
        Loan { slot }
    }

    /// Lends `executor` and `tiers`, replacing an earlier loan.
    pub(crate) fn lend(&self, executor: &Executor, tiers: &Tiers) {
        *self.slot.lock() = Some(Arc::new(LocalRoute {
            executor: executor.clone(),
            tiers: tiers.clone(),
        }));
    }

    /// Takes the loan back (the offer stays).
    pub(crate) fn withdraw(&self) {
        *self.slot.lock() = None;
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        self.withdraw();
        let mut offers = OFFERS.lock();
        offers.retain(|o| !Arc::ptr_eq(&o.slot, &self.slot));
    }
}

/// The slot of the worker of this process with `identity` that connects
/// to one of `endpoints`, if it offered one.
pub(crate) fn borrow(endpoints: &[&str], identity: &[u8]) -> Option<RouteSlot> {
    let pid = std::process::id();
    OFFERS
        .lock()
        .iter()
        .find(|o| {
            o.pid == pid && o.identity == identity && endpoints.contains(&o.endpoint.as_str())
        })
        .map(|o| Arc::clone(&o.slot))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offer_is_found_by_endpoint_and_identity_until_dropped() {
        let loan = Loan::offer("ipc:///a", b"w0");
        assert!(borrow(&["ipc:///b", "ipc:///a"], b"w0").is_some());
        assert!(borrow(&["ipc:///a"], b"w1").is_none());
        assert!(borrow(&["ipc:///b"], b"w0").is_none());
        drop(loan);
        assert!(borrow(&["ipc:///a"], b"w0").is_none());
    }
}
