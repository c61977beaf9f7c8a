//! A worker: one process per GPU / tensor-parallel rank, owning the bytes.
//!
//! The worker introduces itself with a `Hello` (its G1 layout, which the
//! engine process gives it), allocates G2 (host memory) and G3 (a disk
//! file) when the leader's `Configure` says how many blocks, and then
//! executes `Transfer`s between its three tiers with a kvbm-transfer
//! [`Executor`], acknowledging each with exactly the pairs whose bytes
//! landed. Requests are checked against the worker's own tier sizes before
//! anything moves; a refused request is acknowledged as failed, never
//! executed. With feature `nixl` it also exposes G2 to peer instances and
//! pulls their G2 blocks into its own (`remote`).
//!
//! The worker proves it belongs to the instance with the MAC of the
//! instance secret in its `Hello` (see [`crate::auth`]). It gives up on a
//! silent leader: before the leader's `Configure` after
//! [`WorkerConfig::leader_timeout`] counted from the start (a leader that
//! never answers is an error, not a hang), and once configured after
//! [`HEARTBEAT_MISSES`] heartbeat intervals without a frame (at least a
//! second, at most the leader timeout), so a worker whose leader died
//! exits within a few heartbeats and its G3 file goes with it. A
//! connection that drops ends the worker sooner: once what arrived
//! before is read, it exits rather than wait for a heartbeat (or talk to
//! whoever listens on the endpoint next).
//!
//! Threads: one event loop owns the DEALER socket; transfers run on the
//! executor's threads and hand their acknowledgement back to the loop
//! through a channel and a wake-up, so the socket stays single-threaded.

#[cfg(feature = "cuda")]
pub mod device;
pub mod memory;
#[cfg(feature = "probe")]
pub mod probe;
mod remote;
mod tiers;
mod watch;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvbm_transfer::{CancelToken, Executor, ExecutorSpec, PhysicalLayout, TransferOutcome};

use crate::auth::{InstanceSecret, hello_mac, random_u64};
use crate::curve::{self, LeaderKey};
use crate::error::{DistError, Result};
use crate::proto::{
    Ack, AckFailure, BlockPair, Configure, ErrorReply, Hello, InstanceId, Message, Ready,
    TierBounds, Transfer, truncate,
};
#[cfg(feature = "probe")]
use crate::proto::{Probe, ProbeOp, ProbeReply};
use crate::transport::{DealerSocket, WakeSender, drain_disconnects, wake_pair};
use kvbm_pool::Tier;
pub(crate) use tiers::{Places, Tiers, g2_pin};
use watch::LeaderWatch;

/// What a worker needs to start.
pub struct WorkerConfig {
    /// The leader's endpoint.
    pub endpoint: String,
    /// The instance it belongs to.
    pub instance: InstanceId,
    /// Its rank.
    pub rank: u32,
    /// Ranks of the instance.
    pub world_size: u32,
    /// The instance secret (from the leader's owner), keying the MAC of
    /// the worker's `Hello`.
    pub secret: InstanceSecret,
    /// Its G1 memory, given by the engine process.
    pub g1: PhysicalLayout,
    /// Directory for the G3 file; without one a non-zero G3 size is refused.
    pub g3_dir: Option<PathBuf>,
    /// Keeps G2 across restarts in this directory: it should be in a
    /// memory-backed file system (`/dev/shm`), whose files G2's memory is
    /// mapped from. Needs `kept_identity`.
    pub g2_keep_dir: Option<PathBuf>,
    /// Keeps G3 (and G2 where `g2_keep_dir` is set) across restarts: what
    /// their bytes mean (the engine's model, dtype, block size, hash
    /// scheme, parallelism). A worker started again with the same
    /// identity and directories finds every block they held
    /// ([`crate::kept`]); `None`: G3 starts empty and its file is removed
    /// at exit.
    pub kept_identity: Option<String>,
    /// Moves the bytes; `None` assembles one for G1's memory
    /// ([`default_executor`]).
    pub executor: Option<Executor>,
    /// Fault injection: wait this long before starting each transfer (so a
    /// test can kill the worker while a transfer is in flight).
    #[cfg(feature = "fault-injection")]
    pub fault_delay: Duration,
    /// Exit when no frame came from the leader for this long, counted
    /// from the start (the leader answers `Hello` only once every rank
    /// said it, so this bounds the whole start-up); once configured, the
    /// heartbeat may cut it shorter.
    pub leader_timeout: Duration,
    /// Writes and checks test patterns in G1 for the leader (a test hook
    /// for benches and tests, feature `probe`); without one, probes are
    /// refused.
    #[cfg(feature = "probe")]
    pub probe: Option<Box<dyn probe::BlockProbe>>,
    /// Allocates G2 for a layout; `None` allocates pinned memory near G1's
    /// GPU (feature `cuda`), system memory for a host G1.
    pub g2_allocator: Option<G2Allocator>,
}

/// Allocates a worker's G2 for a layout.
pub type G2Allocator = Box<dyn Fn(kvbm_layout::Layout) -> Result<PhysicalLayout> + Send>;

impl WorkerConfig {
    /// A worker of `rank` in a world of `world_size` of the instance whose
    /// secret is `secret`, with `g1`, the defaults elsewhere (no G3
    /// directory, a CPU executor, no fault delay, a leader timeout that
    /// outlasts the default leader handshake: 40 s).
    pub fn new(
        endpoint: impl Into<String>,
        instance: InstanceId,
        rank: u32,
        world_size: u32,
        g1: PhysicalLayout,
        secret: InstanceSecret,
    ) -> Self {
        WorkerConfig {
            endpoint: endpoint.into(),
            instance,
            rank,
            world_size,
            secret,
            g1,
            g3_dir: None,
            g2_keep_dir: None,
            kept_identity: None,
            executor: None,
            #[cfg(feature = "fault-injection")]
            fault_delay: Duration::ZERO,
            leader_timeout: crate::leader::worker_leader_timeout(
                crate::leader::DEFAULT_HANDSHAKE_TIMEOUT,
            ),
            #[cfg(feature = "probe")]
            probe: None,
            g2_allocator: None,
        }
    }
}

/// The executor a worker builds when given none, from its G1's memory:
/// memcpy and the disk backend for a host G1; with feature `cuda`, the
/// CUDA backend and a pinned bounce pool for a G1 on a GPU.
pub fn default_executor(g1: &PhysicalLayout) -> Result<Executor> {
    Ok(executor_spec(g1)?.disk(true).build()?)
}

/// What an executor for `g1` needs: the CUDA backend for a device G1
/// (feature `cuda`), memcpy alone for a host G1.
#[cfg(feature = "cuda")]
pub fn executor_spec(g1: &PhysicalLayout) -> Result<ExecutorSpec> {
    Ok(match g1.kind() {
        kvbm_transfer::MemoryKind::Device(ordinal) => ExecutorSpec::device(
            kvbm_transfer::cuda::CudaDevice::open(ordinal as usize)
                .map_err(kvbm_transfer::cuda::backend::to_transfer_error)?,
        ),
        _ => ExecutorSpec::host(),
    })
}

/// What an executor for `g1` needs: memcpy for a host G1; a device G1
/// needs feature `cuda`.
#[cfg(not(feature = "cuda"))]
pub fn executor_spec(g1: &PhysicalLayout) -> Result<ExecutorSpec> {
    if let kvbm_transfer::MemoryKind::Device(_) = g1.kind() {
        return Err(DistError::InvalidConfig(
            "G1 is device memory: build kvbm-dist with feature `cuda`".into(),
        ));
    }
    Ok(ExecutorSpec::host())
}

/// Heartbeat intervals without a frame after which a configured worker
/// gives its leader up.
pub const HEARTBEAT_MISSES: u32 = 10;

/// Runs a worker until the leader says `Shutdown` (`Ok`), goes silent
/// (`Err(LeaderGone)`) or refuses it (`Err(Refused)`).
pub fn run(mut config: WorkerConfig) -> Result<()> {
    let executor = match config.executor.clone() {
        Some(e) => e,
        None => default_executor(&config.g1)?,
    };
    let identity = worker_identity(&config)?;
    let loan = offer_loan(&config, &identity);
    let ctx = zmq::Context::new();
    let started = Instant::now();
    let curve = if curve::used_on(&config.endpoint) {
        Some(*LeaderKey::derive(&config.secret)?.public())
    } else {
        None
    };
    let socket =
        DealerSocket::connect(&ctx, &config.endpoint, identity.as_bytes(), curve.as_ref())?;
    let monitor = socket.watch_disconnects(&ctx)?;
    let (wake_tx, wake_rx) = wake_pair(&ctx)?;
    let (ack_tx, ack_rx) = mpsc::channel::<Message>();
    socket.send(&hello(&config, &identity))?;
    let _span = tracing::info_span!("worker", rank = config.rank).entered();
    tracing::info!(%identity, endpoint = %config.endpoint, curve = curve.is_some(), "hello sent");
    let mut w = Worker::new(&mut config, executor, ack_tx, Arc::new(wake_tx), loan);
    let mut watch = LeaderWatch::new(started);
    loop {
        let limit = watch.silence_limit(config.leader_timeout);
        {
            let mut items = [
                socket.raw().as_poll_item(zmq::POLLIN),
                wake_rx.socket().as_poll_item(zmq::POLLIN),
                monitor.as_poll_item(zmq::POLLIN),
            ];
            zmq::poll(&mut items, watch.tick().as_millis() as i64)
                .map_err(DistError::zmq("poll"))?;
        }
        wake_rx.drain();
        if drain_disconnects(&monitor) {
            // The leader's process is gone (or closed its socket): whatever
            // it sent before still gets read, then the worker exits
            // instead of waiting for a heartbeat, or for whoever listens on
            // the endpoint next.
            watch.disconnected();
        }
        while let Ok(ack) = ack_rx.try_recv() {
            if let Message::Ack(a) = &ack {
                w.inflight.remove(&a.transfer_id);
            }
            socket.send(&ack)?;
        }
        if w.serve_frames(&socket, &mut watch)? {
            return Ok(());
        }
        if let Some(why) = watch.gone(limit, &config, curve.is_some()) {
            w.cancel_inflight();
            tracing::warn!("{why}; exiting");
            return Err(DistError::LeaderGone(why));
        }
    }
}

/// The identity a worker's socket introduces itself with: its instance,
/// rank and process, and a random nonce so no two connections share one.
fn worker_identity(config: &WorkerConfig) -> Result<String> {
    Ok(format!(
        "{:x}/{}/{:x}-{:016x}",
        config.instance,
        config.rank,
        std::process::id(),
        random_u64()?
    ))
}

/// The only worker of an instance offers its leader its executor, in case
/// the leader runs in this process (see `loan`). A worker whose copies are
/// held back (fault injection) keeps them on the wire.
fn offer_loan(config: &WorkerConfig, identity: &str) -> Option<crate::loan::Loan> {
    #[cfg(feature = "fault-injection")]
    let held_back = !config.fault_delay.is_zero();
    #[cfg(not(feature = "fault-injection"))]
    let held_back = false;
    (config.world_size == 1 && !held_back)
        .then(|| crate::loan::Loan::offer(&config.endpoint, identity.as_bytes()))
}

/// The `Hello` a worker introduces itself with: its place in the instance,
/// its G1's shape and layout, and the MAC that proves it knows the
/// instance secret.
fn hello(config: &WorkerConfig, identity: &str) -> Message {
    let layout = config.g1.layout();
    Message::Hello(Hello {
        instance: config.instance,
        rank: config.rank,
        world_size: config.world_size,
        device_blocks: layout.config().num_blocks() as u64,
        bytes_per_block: layout.config().block_bytes(),
        layout: layout.descriptor(),
        auth: hello_mac(
            &config.secret,
            config.instance,
            config.rank,
            config.world_size,
            identity.as_bytes(),
        ),
    })
}

struct Worker {
    instance: InstanceId,
    rank: u32,
    world_size: u32,
    /// G4: this worker's NIXL agent over G2 and the peers it connected.
    remote: remote::RemoteState,
    #[cfg(feature = "probe")]
    probe: Option<Box<dyn probe::BlockProbe>>,
    g2_allocator: Option<G2Allocator>,
    tiers: Tiers,
    g3_dir: Option<PathBuf>,
    g2_keep_dir: Option<PathBuf>,
    kept_identity: Option<String>,
    executor: Executor,
    fault_delay: Duration,
    inflight: HashMap<u64, CancelToken>,
    acks: mpsc::Sender<Message>,
    wake: Arc<WakeSender>,
    /// The executor and tiers lent to a leader in this process.
    loan: Option<crate::loan::Loan>,
}

impl Worker {
    /// A worker not yet configured: G1 from `config` (whose probe and G2
    /// allocator it takes), no G2 or G3 yet, nothing in flight.
    fn new(
        config: &mut WorkerConfig,
        executor: Executor,
        acks: mpsc::Sender<Message>,
        wake: Arc<WakeSender>,
        loan: Option<crate::loan::Loan>,
    ) -> Self {
        Worker {
            instance: config.instance,
            rank: config.rank,
            world_size: config.world_size,
            remote: remote::RemoteState::default(),
            tiers: Tiers::new(config.g1.clone()),
            g3_dir: config.g3_dir.clone(),
            g2_keep_dir: config.g2_keep_dir.clone(),
            kept_identity: config.kept_identity.clone(),
            #[cfg(feature = "probe")]
            probe: config.probe.take(),
            g2_allocator: config.g2_allocator.take(),
            executor,
            #[cfg(feature = "fault-injection")]
            fault_delay: config.fault_delay,
            #[cfg(not(feature = "fault-injection"))]
            fault_delay: Duration::ZERO,
            inflight: HashMap::new(),
            acks,
            wake,
            loan,
        }
    }

    /// Reads and answers every frame waiting on `socket`, noting each in
    /// `watch`; `true` when the leader said `Shutdown` (the transfers in
    /// flight are then cancelled). Errors when the leader refused this
    /// worker before configuring it, or when a reply cannot be sent.
    fn serve_frames(&mut self, socket: &DealerSocket, watch: &mut LeaderWatch) -> Result<bool> {
        while let Some(received) = socket.try_recv()? {
            watch.heard();
            match received.message {
                Ok(Message::Shutdown) => {
                    tracing::info!("shutdown");
                    self.cancel_inflight();
                    return Ok(true);
                }
                Ok(Message::Error(e)) if !watch.configured() => {
                    // Refused before being configured (a wrong secret,
                    // instance or shape): nothing to wait for.
                    tracing::warn!("the leader refused this worker: {}", e.message);
                    return Err(DistError::Refused(e.message));
                }
                Ok(m) => {
                    if let Message::Configure(c) = &m {
                        watch.set_heartbeat(c.heartbeat_ms);
                    }
                    if let Some(reply) = self.handle(m) {
                        socket.send(&reply)?;
                    }
                }
                Err(e) => {
                    tracing::warn!("refused a frame from the leader: {e}");
                    socket.send(&Message::Error(ErrorReply {
                        transfer_id: None,
                        message: truncate(format!("refused frame: {e}")),
                    }))?;
                }
            }
        }
        Ok(false)
    }

    /// Cancels every transfer in flight.
    fn cancel_inflight(&self) {
        for t in self.inflight.values() {
            t.cancel();
        }
    }

    fn handle(&mut self, message: Message) -> Option<Message> {
        match message {
            Message::Configure(c) => Some(self.configure(c)),
            Message::Transfer(t) => self.transfer(t),
            Message::Cancel { transfer_id } => {
                if let Some(t) = self.inflight.get(&transfer_id) {
                    t.cancel();
                }
                None
            }
            #[cfg(feature = "probe")]
            Message::Probe(p) => Some(self.probe(p)),
            Message::Ping { seq } => Some(Message::Pong {
                seq,
                rank: self.rank,
            }),
            Message::RemotePull(r) => self.remote_pull(r),
            Message::ExportPeer => Some(self.export_peer()),
            Message::StopKeeping => {
                // Nothing to answer: the leader goes on either way, and a
                // record left behind names a block stored before the reset.
                match self.tiers.stop_keeping() {
                    Ok(()) => {
                        tracing::info!("the cache was reset: the kept tiers record nothing more")
                    }
                    Err(e) => tracing::error!("the cache was reset, but {e}"),
                }
                None
            }
            Message::PeerInfo(p) => Some(self.connect_peer(p)),
            Message::Error(e) => {
                tracing::warn!(transfer = ?e.transfer_id, "leader reports: {}", e.message);
                None
            }
            other => {
                tracing::warn!(kind = ?other.kind(), "unexpected message from the leader");
                Some(Message::Error(ErrorReply {
                    transfer_id: None,
                    message: format!("a worker does not accept {:?}", other.kind()),
                }))
            }
        }
    }

    fn configure(&mut self, c: Configure) -> Message {
        if !self.inflight.is_empty() {
            return error_reply(None, "configure while transfers are in flight".into());
        }
        let places = Places {
            g3_dir: self.g3_dir.as_deref(),
            g2_keep_dir: self.g2_keep_dir.as_deref(),
            identity: self.kept_identity.as_deref(),
        };
        match self
            .tiers
            .configure(&c, places, &self.executor, self.g2_allocator.as_deref())
        {
            Ok(()) => {
                // The agent exposed the G2 just replaced: peers reconnect.
                self.remote = remote::RemoteState::default();
                if let Some(loan) = &self.loan {
                    loan.lend(&self.executor, &self.tiers);
                }
                tracing::info!(g2 = c.g2_blocks, g3 = c.g3_blocks, "configured");
                Message::Ready(Ready {
                    rank: self.rank,
                    g2_blocks: c.g2_blocks,
                    g3_blocks: c.g3_blocks,
                    recovered: kept_blocks(&self.tiers.g3_found().blocks),
                    rejected: self.tiers.g3_found().rejected,
                    recovered_g2: kept_blocks(&self.tiers.g2_found().blocks),
                    rejected_g2: self.tiers.g2_found().rejected,
                    g3_open_us: u64::try_from(self.tiers.g3_open().as_micros()).unwrap_or(u64::MAX),
                })
            }
            Err(e) => {
                if let Some(loan) = &self.loan {
                    loan.withdraw();
                }
                tracing::warn!("configure failed: {e}");
                error_reply(None, format!("configure failed: {e}"))
            }
        }
    }

    #[cfg(feature = "probe")]
    fn probe(&self, p: Probe) -> Message {
        let reply = |mismatched, error| {
            Message::ProbeReply(ProbeReply {
                id: p.id,
                rank: self.rank,
                mismatched,
                error,
            })
        };
        let Some(probe) = &self.probe else {
            return reply(Vec::new(), Some("this worker has no probe".into()));
        };
        let g1 = self.tiers.g1();
        let n = g1.layout().config().num_blocks();
        let mut mismatched = Vec::new();
        for &(b, seed) in &p.blocks {
            if b as usize >= n {
                return reply(
                    Vec::new(),
                    Some(format!("block {b} is outside G1 ({n} blocks)")),
                );
            }
            let r = match p.op {
                ProbeOp::Fill => probe.fill(g1, b as usize, seed, self.rank),
                ProbeOp::Check => probe.check(g1, b as usize, seed, self.rank).map(|ok| {
                    if !ok {
                        mismatched.push(b);
                    }
                }),
            };
            if let Err(e) = r {
                return reply(Vec::new(), Some(truncate(e)));
            }
        }
        reply(mismatched, None)
    }

    fn transfer(&mut self, t: Transfer) -> Option<Message> {
        let refuse = |error: String, pairs: Vec<BlockPair>| {
            tracing::warn!(transfer = t.id, "refused: {error}");
            Some(Message::Ack(Ack {
                transfer_id: t.id,
                rank: self.rank,
                completed: Vec::new(),
                failure: Some(AckFailure {
                    error: truncate(error),
                    failed: pairs,
                    os_error: None,
                    checksum_mismatches: 0,
                }),
            }))
        };
        if self.inflight.contains_key(&t.id) {
            return refuse(
                format!("transfer id {} already in flight", t.id),
                Vec::new(),
            );
        }
        let bounds: TierBounds = self.tiers.bounds();
        if let Err(e) = bounds.check_pairs(t.src, t.dst, &t.pairs) {
            return refuse(e.to_string(), t.pairs);
        }
        if self.tiers.layout(t.src).is_none() || self.tiers.layout(t.dst).is_none() {
            return refuse(format!("{:?} -> {:?}: tier absent", t.src, t.dst), t.pairs);
        }
        let cancel = CancelToken::new();
        self.inflight.insert(t.id, cancel.clone());
        let job = Job {
            tiers: self.tiers.clone(),
            id: t.id,
            rank: self.rank,
            src: t.src,
            dst: t.dst,
            pairs: t.pairs,
            labels: t.labels,
            cancel,
            executor: self.executor.clone(),
            acks: self.acks.clone(),
            wake: Arc::clone(&self.wake),
        };
        tracing::debug!(transfer = t.id, src = ?t.src, dst = ?t.dst, blocks = job.pairs.len(), "transfer");
        if self.fault_delay.is_zero() {
            job.start();
        } else {
            let delay = self.fault_delay;
            let spawned = std::thread::Builder::new()
                .name("kvbm-delayed-transfer".into())
                .spawn(move || {
                    std::thread::sleep(delay);
                    job.start();
                });
            if let Err(e) = spawned {
                self.inflight.remove(&t.id);
                return Some(error_reply(Some(t.id), format!("cannot start: {e}")));
            }
        }
        None
    }
}

fn error_reply(transfer_id: Option<u64>, message: String) -> Message {
    Message::Error(ErrorReply {
        transfer_id,
        message: truncate(message),
    })
}

/// One transfer on its way to the executor.
struct Job {
    /// The worker's tiers (and their checksums and G3 records).
    tiers: Tiers,
    id: u64,
    rank: u32,
    src: Tier,
    dst: Tier,
    pairs: Vec<BlockPair>,
    /// What each block written into a kept G3 holds (or nothing).
    labels: Vec<crate::kept::BlockLabel>,
    cancel: CancelToken,
    executor: Executor,
    acks: mpsc::Sender<Message>,
    wake: Arc<WakeSender>,
}

impl Job {
    fn start(self) {
        let pairs: Vec<(usize, usize)> = self
            .pairs
            .iter()
            .map(|&(s, d)| (s as usize, d as usize))
            .collect();
        let (id, rank, acks, wake) = (self.id, self.rank, self.acks, self.wake);
        let settled = pairs.clone();
        self.tiers.copy(
            &self.executor,
            self.src,
            self.dst,
            settled,
            self.labels,
            self.cancel,
            move |outcome, mismatches| {
                let mut ack = ack_of(id, rank, &pairs, outcome);
                if let Some(f) = &mut ack.failure {
                    f.checksum_mismatches = mismatches;
                }
                let _ = acks.send(Message::Ack(ack));
                wake.wake();
            },
        );
    }
}

/// The acknowledgement of an executor outcome.
fn ack_of(id: u64, rank: u32, pairs: &[(usize, usize)], outcome: TransferOutcome) -> Ack {
    let wire = |v: &[(usize, usize)]| -> Vec<BlockPair> {
        // Every id came off the wire as a u32.
        v.iter().map(|&(s, d)| (s as u32, d as u32)).collect()
    };
    match outcome {
        Ok(_) => Ack {
            transfer_id: id,
            rank,
            completed: wire(pairs),
            failure: None,
        },
        Err(f) => Ack {
            transfer_id: id,
            rank,
            completed: wire(&f.completed),
            failure: Some(AckFailure {
                os_error: f.error.os_error(),
                checksum_mismatches: 0,
                error: truncate(f.to_string()),
                failed: {
                    // Everything that is not known to have landed failed.
                    let done: std::collections::HashSet<_> = f.completed.iter().copied().collect();
                    wire(
                        &pairs
                            .iter()
                            .copied()
                            .filter(|p| !done.contains(p))
                            .collect::<Vec<_>>(),
                    )
                },
            }),
        },
    }
}

/// A kept tier's blocks as `Ready` carries them.
fn kept_blocks(blocks: &[crate::kept::Recovered]) -> Vec<(u32, crate::kept::BlockLabel)> {
    blocks
        .iter()
        .take(crate::proto::MAX_PAIRS)
        .map(|r| (r.slot, r.label))
        .collect()
}

#[cfg(test)]
mod tests;
