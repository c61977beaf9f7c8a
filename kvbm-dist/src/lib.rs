//! # kvbm-dist
//!
//! kvbm across processes: a leader that owns the logical state (pools and
//! the tier engine from kvbm-pool) and one worker per GPU / tensor-parallel
//! rank that owns physical memory and executes transfers, talking over
//! ZeroMQ; and remote blocks (G4) pulled from peer instances over NIXL. It
//! is the top of the stack and reuses the pool and transfer logic below it
//! rather than duplicating it.
//!
//! With tensor parallelism every block has a slice on every rank, so one
//! logical copy is a copy on every worker, and it has happened only when
//! every worker says so. The leader's [`DistMover`](leader::DistMover)
//! makes exactly that the tier engine's notion of a copy: it broadcasts the
//! block pairs, completes when every worker acknowledged, and reports as
//! landed only the pairs that landed on all of them. A worker that dies or
//! falls silent fails every transfer it was part of (naming its rank), and
//! the G2/G3 blocks whose bytes died with it are never served again.
//!
//! Remote blocks (feature `nixl`): each worker exposes its G2 through a
//! NIXL agent; only the leaders exchange the agents' descriptions (a
//! `PeerInfo` frame), rank `r` of one instance connects to rank `r` of the
//! other, and a [`Leader::remote_pull`](leader::Leader::remote_pull) is
//! broadcast and acknowledged like a copy. Workers of different instances
//! meet only through NIXL's reads, each checked against what the peer
//! registered before it is posted.
//!
//! Map of the crate:
//! - [`auth`]: the instance secret and the MAC that admits a worker.
//! - [`curve`]: CURVE encryption of TCP traffic, keyed by the instance
//!   secret.
//! - [`proto`]: the versioned wire format, its validating decoder and the
//!   receiver-side bounds check.
//! - [`transport`]: ZeroMQ ROUTER/DEALER sockets speaking [`proto`]
//!   messages, and the wake-up pair that keeps each socket on one thread.
//! - `loan`: the only worker, in its leader's process, lends the leader
//!   its executor.
//! - [`worker`]: the worker process's loop, its tiers, and host memory
//!   shared with an engine process.
//! - [`leader`]: the handshake, the leader's event loop (broadcast,
//!   acknowledgements, heartbeats, faults, rejoin) and the distributed
//!   mover.
//! - [`private_dir`]: the 0700 directory of a leader's IPC socket, and
//!   the removal of those killed leaders left behind.
//! - [`node`]: the worker process's entry point (the `kvbm-dist-node`
//!   binary's `main`) and its arguments.
//! - [`error`]: the crate's error type, [`DistError`].

pub mod auth;
pub mod curve;
pub mod error;
pub mod kept;
pub mod leader;
mod loan;
pub mod node;
pub mod paged;
pub mod private_dir;
pub mod proto;
pub mod transport;
mod verify;
pub mod worker;

pub use error::{DistError, Result};
