//! Workers in the leader's own process reach it without a socket file.
//!
//! An engine that runs its scheduler and its only GPU worker in one process
//! (vLLM with one GPU does) still has a leader and a worker, and every copy
//! makes a round trip between them. Over IPC each direction passes two
//! ZeroMQ I/O threads and a kernel socket; over ZeroMQ's `inproc`
//! transport a frame goes straight from one socket's queue to the other's.
//! So every leader also binds an `inproc` name and records it here under
//! the endpoints it was given and bound; a worker started in the same
//! process finds it and connects there instead. Nothing else changes: the
//! worker still says `Hello` with its MAC, and heartbeats, acknowledgements
//! and loss handling are those of any worker.
//!
//! A copy still crosses four threads (tier engine, leader loop, worker
//! loop, back). So when the instance is that one worker, the worker lends
//! its leader its executor and tiers once configured ([`LocalRoute`]), and
//! the leader's mover runs copies on them directly: the same executor
//! moves the same bytes, and the caller waits on its completion without a
//! hop. The loan is withdrawn when the worker's loop ends, and the leader
//! stops using it once any rank was lost (the wire path then does the
//! bookkeeping of lost blocks).
//!
//! `inproc` connects only sockets of one ZeroMQ context, so the record
//! carries the leader's context. It also carries the process id: a child
//! forked after the leader started inherits the record, but not the
//! context's I/O threads, and must not use either.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvbm_transfer::Executor;
use parking_lot::Mutex;

use crate::error::{DistError, Result};
use crate::worker::Tiers;

/// What an in-process worker lends its leader: its executor and tiers.
pub(crate) struct LocalRoute {
    /// The worker that lent it (its ZeroMQ identity).
    pub(crate) lender: String,
    pub(crate) executor: Executor,
    pub(crate) tiers: Tiers,
}

/// Where a leader finds the route its in-process worker lent, if any.
pub(crate) type RouteSlot = Arc<Mutex<Option<Arc<LocalRoute>>>>;

/// A leader reachable in this process.
struct Entry {
    endpoints: Vec<String>,
    pid: u32,
    ctx: zmq::Context,
    name: String,
    route: RouteSlot,
}

/// A leader of this process, as a worker finds it.
pub(crate) struct InProcess {
    /// The leader's context (inproc connects only within one).
    pub(crate) ctx: zmq::Context,
    /// The leader's `inproc` endpoint.
    pub(crate) endpoint: String,
    /// Where the worker lends its route.
    pub(crate) route: RouteSlot,
}

/// Every leader of this process that is bound and not yet dropped.
static LEADERS: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A leader's `inproc` name, recorded until this is dropped.
pub(crate) struct Registration {
    name: String,
    route: RouteSlot,
}

/// Binds a fresh `inproc` name on the leader's `socket` (of context
/// `ctx`) and records it for `endpoints` (the one asked for and the one
/// bound, which differ when a port was left to the system; one with a
/// wildcard is not recorded).
pub(crate) fn register(
    ctx: &zmq::Context,
    socket: &zmq::Socket,
    endpoints: &[&str],
) -> Result<Registration> {
    let pid = std::process::id();
    let name = format!(
        "inproc://kvbm-leader-{pid}-{}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    socket
        .bind(&name)
        .map_err(DistError::zmq("bind the in-process endpoint"))?;
    let mut eps: Vec<String> = endpoints
        .iter()
        .filter(|e| !e.contains('*'))
        .map(|e| (*e).to_owned())
        .collect();
    eps.dedup();
    let route = RouteSlot::default();
    LEADERS.lock().push(Entry {
        endpoints: eps,
        pid,
        ctx: ctx.clone(),
        name: name.clone(),
        route: Arc::clone(&route),
    });
    Ok(Registration { name, route })
}

impl Registration {
    /// The `inproc` endpoint.
    #[cfg(test)]
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Where an in-process worker lends its route.
    pub(crate) fn route(&self) -> RouteSlot {
        Arc::clone(&self.route)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut leaders = LEADERS.lock();
        let gone: Vec<Entry> = leaders.extract_if(.., |e| e.name == self.name).collect();
        drop(leaders);
        // The context is released outside the lock: the last reference
        // waits there for its sockets to close.
        drop(gone);
    }
}

/// The leader of this process bound at `endpoint`, if there is one.
pub(crate) fn lookup(endpoint: &str) -> Option<InProcess> {
    let pid = std::process::id();
    LEADERS
        .lock()
        .iter()
        .find(|e| e.pid == pid && e.endpoints.iter().any(|x| x == endpoint))
        .map(|e| InProcess {
            ctx: e.ctx.clone(),
            endpoint: e.name.clone(),
            route: Arc::clone(&e.route),
        })
}

/// A worker's loan of its route, withdrawn on drop (when its loop ends).
pub(crate) struct Loan {
    slot: RouteSlot,
    lender: String,
}

impl Loan {
    /// A loan by the worker `lender` through `slot`; nothing lent yet.
    pub(crate) fn new(slot: RouteSlot, lender: String) -> Self {
        Loan { slot, lender }
    }

    /// Lends `executor` and `tiers` (replacing an earlier loan of this
    /// worker or another).
    pub(crate) fn lend(&self, executor: &Executor, tiers: &Tiers) {
        *self.slot.lock() = Some(Arc::new(LocalRoute {
            lender: self.lender.clone(),
            executor: executor.clone(),
            tiers: tiers.clone(),
        }));
    }

    /// Withdraws this worker's loan, if it is the one lent.
    pub(crate) fn withdraw(&self) {
        let mut slot = self.slot.lock();
        if slot.as_ref().is_some_and(|r| r.lender == self.lender) {
            *slot = None;
        }
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        self.withdraw();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leader_is_found_by_its_endpoints_until_dropped() {
        let ctx = zmq::Context::new();
        let socket = ctx.socket(zmq::ROUTER).unwrap();
        let reg = register(&ctx, &socket, &["ipc:///a", "ipc:///b"]).unwrap();
        let found = lookup("ipc:///b").unwrap();
        assert_eq!(found.endpoint, reg.name());
        assert!(lookup("ipc:///c").is_none());
        drop(reg);
        assert!(lookup("ipc:///a").is_none());
    }
}
