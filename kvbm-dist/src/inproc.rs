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
//! `inproc` connects only sockets of one ZeroMQ context, so the record
//! carries the leader's context. It also carries the process id: a child
//! forked after the leader started inherits the record, but not the
//! context's I/O threads, and must not use either.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::error::{DistError, Result};

/// A leader reachable in this process.
struct Entry {
    endpoints: Vec<String>,
    pid: u32,
    ctx: zmq::Context,
    name: String,
}

/// Every leader of this process that is bound and not yet dropped.
static LEADERS: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A leader's `inproc` name, recorded until this is dropped.
#[derive(Debug)]
pub(crate) struct Registration {
    name: String,
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
    LEADERS.lock().push(Entry {
        endpoints: eps,
        pid,
        ctx: ctx.clone(),
        name: name.clone(),
    });
    Ok(Registration { name })
}

impl Registration {
    /// The `inproc` endpoint.
    #[cfg(test)]
    pub(crate) fn name(&self) -> &str {
        &self.name
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

/// The context and `inproc` endpoint of the leader of this process bound
/// at `endpoint`, if there is one.
pub(crate) fn lookup(endpoint: &str) -> Option<(zmq::Context, String)> {
    let pid = std::process::id();
    LEADERS
        .lock()
        .iter()
        .find(|e| e.pid == pid && e.endpoints.iter().any(|x| x == endpoint))
        .map(|e| (e.ctx.clone(), e.name.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leader_is_found_by_its_endpoints_until_dropped() {
        let ctx = zmq::Context::new();
        let socket = ctx.socket(zmq::ROUTER).unwrap();
        let reg = register(&ctx, &socket, &["ipc:///a", "ipc:///b"]).unwrap();
        let (_, name) = lookup("ipc:///b").unwrap();
        assert_eq!(name, reg.name());
        assert!(lookup("ipc:///c").is_none());
        drop(reg);
        assert!(lookup("ipc:///a").is_none());
    }
}
