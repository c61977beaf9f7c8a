//! The leader: one per model instance, owning the logical state.
//!
//! Start it in two steps: [`PendingLeader::bind`] opens the ROUTER socket
//! (so workers can be launched against its endpoint), then
//! [`PendingLeader::handshake`] waits for every rank's `Hello`, checks the
//! ranks agree on the block shape, sizes G2 and G3 from byte budgets,
//! configures every worker and waits until all are ready. The resulting
//! [`Leader`] runs an event loop on its own thread and hands out a
//! [`DistMover`]: the tier engine's copies, broadcast to every worker.
//!
//! Faults. Every worker is pinged each heartbeat interval; one that stays
//! silent past the heartbeat timeout, cannot be reached, or leaves a
//! transfer unanswered past the transfer timeout is declared lost: every
//! transfer it was part of fails naming its rank (once the surviving
//! workers have stopped writing — they are told to cancel and the transfer
//! resolves on their acknowledgements, so no freed block is still being
//! written), and the instance is *degraded* — every copy fails at once —
//! until the rank rejoins. The lost worker's G2 and G3 bytes are gone, so
//! the leader marks every G2/G3 block as lost: a copy reading one fails
//! (nothing is ever served from bytes a worker lost) until a later copy
//! writes it again on every worker; the hook set with
//! [`Leader::on_worker_lost`] lets the owner of the tier engine drop those
//! blocks from its books (see [`evict_distributed_tiers`]). A worker that
//! comes back with the same rank and shape says `Hello`, is configured
//! again, and the instance is whole once it is `Ready`.
//!
//! Who may speak. Only the instance's own processes: the leader holds a
//! per-instance secret ([`PendingLeader::secret`], random unless the
//! configuration brings one), its owner hands it to the workers it starts
//! (in their environment: [`InstanceSecret::pass_to`]), and every `Hello`
//! must carry its MAC (see [`crate::auth`]). Frames from anyone else are
//! answered, counted by cause in [`ClusterStatus::refused`], logged at most
//! once per peer every few seconds, and otherwise ignored: they never stop
//! a handshake nor evict a live rank. On one host the endpoint
//! [`PRIVATE_ENDPOINT`] puts the socket in a directory only this user can
//! enter. On TCP every frame is encrypted with CURVE under a key derived
//! from the secret ([`crate::curve`]); a leader refuses a network endpoint
//! in a build without CURVE.
//!
//! Remote blocks (G4): [`Leader::export_peer`], [`Leader::connect_peer`]
//! and [`Leader::remote_pull`] (feature `nixl` on the workers) pull a peer
//! instance's G2 blocks into ours; see the `remote` module.

mod event_loop;
mod handshake;
mod lost;
mod mover;
mod refusals;
mod remote;

use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvbm_block::SequenceHash;
use kvbm_pool::{Tier, TierEngine};
use parking_lot::{Condvar, Mutex};

use crate::auth::InstanceSecret;
use crate::curve::{self, LeaderKey, LeaderPublicKey};
use crate::error::{DistError, Result};
use crate::proto::InstanceId;
use crate::transport::{PrivateDir, RouterSocket, WakeSender, wake_pair};

pub use mover::DistMover;
pub use refusals::{RefusalCause, RefusalCounts, WARN_EVERY};
pub use remote::{decode_peer_info, encode_peer_info};

/// The endpoint that binds an IPC socket in a new private directory (mode
/// 0700, under `$XDG_RUNTIME_DIR` or the temp dir, removed when the leader
/// goes): the choice for workers on the leader's host.
pub const PRIVATE_ENDPOINT: &str = "private";

/// A leader's parameters.
#[derive(Debug, Clone)]
pub struct LeaderConfig {
    /// Where to bind: [`PRIVATE_ENDPOINT`], `ipc:///path`, or
    /// `tcp://host:port` (`tcp://127.0.0.1:*` picks a free port).
    pub endpoint: String,
    /// The instance secret workers prove they hold; `None` draws a new
    /// random one when binding.
    pub secret: Option<InstanceSecret>,
    /// The instance.
    pub instance: InstanceId,
    /// Ranks to wait for.
    pub world_size: u32,
    /// G2 byte budget over all workers.
    pub g2_bytes: u64,
    /// G3 byte budget over all workers.
    pub g3_bytes: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// How long the handshake waits for each phase (hello, ready).
    pub handshake_timeout: Duration,
    /// How often workers are pinged.
    pub heartbeat_interval: Duration,
    /// A worker silent this long is lost.
    pub heartbeat_timeout: Duration,
    /// A transfer unanswered this long loses the workers that did not
    /// answer.
    pub transfer_timeout: Duration,
    /// Verify mode: workers checksum every block written into G2 or G3
    /// and fail a copy out of them whose bytes changed (off by default).
    pub verify: bool,
}

/// The leader's default handshake timeout (per phase: hello, ready).
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// How much longer than the leader's handshake timeout a worker waits for
/// its leader's first word: the leader answers the hellos only once every
/// rank said hello, so a worker that gave up first would leave, and be
/// blamed, for a rank that was late.
pub const WORKER_WAIT_MARGIN: Duration = Duration::from_secs(10);

/// The leader timeout for the workers of a leader whose handshake waits
/// `handshake_timeout`: longer, so that when a rank is late the leader's
/// error names that rank, and the ranks that came in time are told to
/// shut down rather than give up on their own.
pub fn worker_leader_timeout(handshake_timeout: Duration) -> Duration {
    handshake_timeout.saturating_add(WORKER_WAIT_MARGIN)
}

impl LeaderConfig {
    /// The leader timeout to give this leader's workers
    /// ([`worker_leader_timeout`] of its handshake timeout).
    pub fn worker_leader_timeout(&self) -> Duration {
        worker_leader_timeout(self.handshake_timeout)
    }

    /// A leader of `world_size` ranks on `endpoint` with the given budgets;
    /// 16-token blocks, a 30 s handshake timeout, 200 ms heartbeats, a 5 s
    /// heartbeat timeout and a 60 s transfer timeout.
    pub fn new(
        endpoint: impl Into<String>,
        instance: InstanceId,
        world_size: u32,
        g2_bytes: u64,
        g3_bytes: u64,
    ) -> Self {
        LeaderConfig {
            endpoint: endpoint.into(),
            secret: None,
            instance,
            world_size,
            g2_bytes,
            g3_bytes,
            block_size: 16,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            heartbeat_interval: Duration::from_millis(200),
            heartbeat_timeout: Duration::from_secs(5),
            transfer_timeout: Duration::from_secs(60),
            verify: false,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.world_size == 0 || self.world_size > crate::proto::MAX_WORLD_SIZE {
            return Err(DistError::InvalidConfig(format!(
                "world size {} outside 1..={}",
                self.world_size,
                crate::proto::MAX_WORLD_SIZE
            )));
        }
        if self.block_size == 0 {
            return Err(DistError::InvalidConfig(
                "block size must be at least 1".into(),
            ));
        }
        if self.heartbeat_interval.is_zero() || self.heartbeat_timeout <= self.heartbeat_interval {
            return Err(DistError::InvalidConfig(
                "the heartbeat timeout must exceed a non-zero heartbeat interval".into(),
            ));
        }
        Ok(())
    }
}

/// A bound leader waiting for its workers.
pub struct PendingLeader {
    config: LeaderConfig,
    curve: Option<LeaderPublicKey>,
    secret: InstanceSecret,
    router: RouterSocket,
    ctx: zmq::Context,
    /// The endpoint bound (a private directory's filled in).
    bound: String,
    dir: Option<PrivateDir>,
}

impl PendingLeader {
    /// Binds the leader's socket (in a new private directory for
    /// [`PRIVATE_ENDPOINT`]).
    pub fn bind(config: LeaderConfig) -> Result<PendingLeader> {
        config.validate()?;
        let secret = match &config.secret {
            Some(s) => s.clone(),
            None => InstanceSecret::generate()?,
        };
        let ctx = zmq::Context::new();
        let (endpoint, dir) = if config.endpoint == PRIVATE_ENDPOINT {
            let dir = PrivateDir::create()?;
            (dir.endpoint(), Some(dir))
        } else {
            (config.endpoint.clone(), None)
        };
        curve::check_endpoint(&endpoint)?;
        let curve = if curve::used_on(&endpoint) {
            Some(LeaderKey::derive(&secret)?)
        } else {
            None
        };
        if let Some(key) = &curve {
            tracing::info!(%endpoint, leader_key = %key.public(), "frames encrypted with CURVE");
        }
        let router = RouterSocket::bind(&ctx, &endpoint, curve.as_ref())?;
        Ok(PendingLeader {
            config,
            curve: curve.map(|k| *k.public()),
            secret,
            router,
            ctx,
            bound: endpoint,
            dir,
        })
    }

    /// The endpoint workers connect to.
    pub fn endpoint(&self) -> &str {
        self.router.endpoint()
    }

    /// The leader's CURVE public key when its frames are encrypted (TCP,
    /// in a build with CURVE); workers derive it from the secret.
    pub fn curve_public(&self) -> Option<&LeaderPublicKey> {
        self.curve.as_ref()
    }

    /// The instance secret, to hand to the workers this leader's owner
    /// starts (see [`InstanceSecret::pass_to`]).
    pub fn secret(&self) -> &InstanceSecret {
        &self.secret
    }

    /// The executor the instance's one worker lends, when it runs in this
    /// process (see `loan`).
    fn borrow(&self, cluster: &Cluster) -> Option<crate::loan::RouteSlot> {
        let [identity] = cluster.identities.as_slice() else {
            return None;
        };
        crate::loan::borrow(&[&self.bound, self.router.endpoint()], identity)
    }

    /// Runs the handshake and starts the event loop. On failure every
    /// worker that said `Hello` is told to shut down.
    pub fn handshake(self) -> Result<Leader> {
        let mut refusals = refusals::Refusals::default();
        let mut cluster = handshake::run(&self.router, &self.config, &self.secret, &mut refusals)?;
        let (wake_tx, wake_rx) = wake_pair(&self.ctx)?;
        let wake = Arc::new(wake_tx);
        let (tx, rx) = mpsc::channel();
        let kept = std::mem::take(&mut cluster.kept);
        let mut initial = cluster.status();
        initial.refused = refusals.counts();
        let status = Arc::new(StatusCell::new(initial));
        let hook: LostHook = Arc::new(Mutex::new(None));
        let mover = Arc::new(DistMover::new(
            tx.clone(),
            Arc::clone(&wake),
            &cluster,
            self.borrow(&cluster),
            Arc::clone(&status),
        ));
        let lp = event_loop::EventLoop::new(
            self.config.clone(),
            self.secret.clone(),
            refusals,
            self.router,
            wake_rx,
            rx,
            cluster,
            Arc::clone(&status),
            Arc::clone(&hook),
        );
        let thread = std::thread::Builder::new()
            .name("kvbm-leader".into())
            .spawn(move || lp.run())
            .map_err(|source| DistError::Io {
                what: "start the leader thread",
                source,
            })?;
        Ok(Leader {
            tx,
            wake,
            kept,
            thread: Some(thread),
            mover,
            status,
            hook,
            _ctx: self.ctx,
            _dir: self.dir,
        })
    }
}

/// What the handshake established.
#[derive(Debug, Clone)]
pub(crate) struct Cluster {
    pub(crate) identities: Vec<Vec<u8>>,
    /// Rank 0's hello: the shape every rank (and every rejoining one) has.
    pub(crate) reference: crate::proto::Hello,
    pub(crate) configure: crate::proto::Configure,
    /// What every rank's kept G3 held at start.
    pub(crate) kept: handshake::KeptTiers,
}

impl Cluster {
    fn status(&self) -> ClusterStatus {
        ClusterStatus {
            ranks: vec![RankState::Live; self.identities.len()],
            g1_blocks: self.reference.layout.config.num_blocks(),
            g2_blocks: self.configure.g2_blocks as usize,
            g3_blocks: self.configure.g3_blocks as usize,
            losses: Vec::new(),
            lost_blocks: (0, 0),
            refused: RefusalCounts::default(),
            verify_mismatches: 0,
        }
    }
}

/// A rank as the leader sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankState {
    /// Ready and answering.
    Live,
    /// Lost; copies fail until it rejoins.
    Lost {
        /// Why it was declared lost.
        reason: String,
    },
    /// Said `Hello` again and is being configured.
    Rejoining,
}

/// One loss, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loss {
    /// The rank.
    pub rank: u32,
    /// Why.
    pub reason: String,
}

/// The instance as the leader sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterStatus {
    /// One state per rank.
    pub ranks: Vec<RankState>,
    /// G1 blocks per worker.
    pub g1_blocks: usize,
    /// G2 blocks per worker.
    pub g2_blocks: usize,
    /// G3 blocks per worker.
    pub g3_blocks: usize,
    /// Every loss so far, oldest first.
    pub losses: Vec<Loss>,
    /// G2 and G3 blocks whose bytes were lost with a worker and not
    /// written since (copies from them fail).
    pub lost_blocks: (usize, usize),
    /// Frames refused since the leader bound its socket, by cause.
    pub refused: RefusalCounts,
    /// Verify mode: blocks whose bytes failed their checksum on a read,
    /// summed over workers (each failed its copy).
    pub verify_mismatches: u64,
}

impl ClusterStatus {
    /// True when every rank is live.
    pub fn is_whole(&self) -> bool {
        self.ranks.iter().all(|r| *r == RankState::Live)
    }
}

/// The status, with a condition variable for waiters.
pub(crate) struct StatusCell {
    status: Mutex<ClusterStatus>,
    changed: Condvar,
}

impl StatusCell {
    fn new(status: ClusterStatus) -> Self {
        StatusCell {
            status: Mutex::new(status),
            changed: Condvar::new(),
        }
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut ClusterStatus)) {
        f(&mut self.status.lock());
        self.changed.notify_all();
    }
}

/// Called (on the leader's thread) with the rank of every lost worker.
pub type LostCallback = Box<dyn Fn(u32) + Send + Sync>;
pub(crate) type LostHook = Arc<Mutex<Option<LostCallback>>>;

/// Commands from API threads to the event loop.
pub(crate) enum Command {
    Copy(mover::CopyRequest),
    #[cfg(feature = "probe")]
    Probe {
        op: crate::proto::ProbeOp,
        blocks: Vec<(u32, u64)>,
        reply: mpsc::Sender<Result<Vec<Vec<u32>>>>,
    },
    Peer {
        request: remote::PeerRequest,
        reply: mpsc::Sender<Result<crate::proto::PeerInfo>>,
    },
    RemotePull(remote::PullRequest),
    /// The engine's cache was reset: every worker empties its kept
    /// records and records nothing more.
    StopKeeping,
    Shutdown,
}

/// A running leader. Dropping it shuts the workers down.
pub struct Leader {
    tx: mpsc::Sender<Command>,
    wake: Arc<WakeSender>,
    /// What every rank's kept G3 held at start.
    kept: handshake::KeptTiers,
    thread: Option<JoinHandle<()>>,
    mover: Arc<DistMover>,
    status: Arc<StatusCell>,
    hook: LostHook,
    _ctx: zmq::Context,
    /// The private directory of the endpoint, removed after the loop ends.
    _dir: Option<PrivateDir>,
}

impl std::fmt::Debug for Leader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leader")
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

impl Leader {
    /// The distributed mover, for [`TierEngine::builder_with_mover`] (or
    /// direct use).
    pub fn mover(&self) -> Arc<DistMover> {
        Arc::clone(&self.mover)
    }

    /// The blocks every rank's G3 held when it was opened, where G3 is
    /// kept across restarts (`WorkerConfig::kept_identity`): `(slot,
    /// label)`.
    pub fn kept_g3(&self) -> &[(u32, crate::proto::BlockLabel)] {
        &self.kept.g3.blocks
    }

    /// The blocks every rank's G2 held when it was opened, where G2 is
    /// kept across restarts (`WorkerConfig::g2_keep_dir`): `(slot, label)`.
    pub fn kept_g2(&self) -> &[(u32, crate::proto::BlockLabel)] {
        &self.kept.g2.blocks
    }

    /// How long each rank took to open its G3 when it became ready (a kept
    /// G3's recovery included; zero without G3), in rank order.
    pub fn g3_open_times(&self) -> &[Duration] {
        &self.kept.g3_open
    }

    /// Registers [`Leader::kept_g2`] and [`Leader::kept_g3`] in `engine`'s
    /// G2 and G3 (built on this leader's mover), so its first requests hit
    /// what the last engine left in host memory and on disk. Returns how
    /// many blocks it registered in each.
    pub fn restore_kept(&self, engine: &TierEngine) -> Restored {
        let mut restored = Restored::default();
        for (tier, kept) in [(Tier::G2, &self.kept.g2), (Tier::G3, &self.kept.g3)] {
            let blocks: Vec<(u32, kvbm_pool::tier::BlockLabel)> = kept
                .blocks
                .iter()
                .map(|&(slot, l)| (slot, (SequenceHash(l.hash), l.parent.map(SequenceHash))))
                .collect();
            let n = engine.restore(tier, &blocks, kept.rejected);
            if !blocks.is_empty() || kept.rejected > 0 {
                tracing::info!(
                    tier = ?tier,
                    kept = blocks.len(),
                    registered = n,
                    rejected = kept.rejected,
                    "kept blocks found again"
                );
            }
            match tier {
                Tier::G2 => restored.g2 = n,
                _ => restored.g3 = n,
            }
        }
        restored
    }

    /// A snapshot of the instance.
    pub fn status(&self) -> ClusterStatus {
        self.status.status.lock().clone()
    }

    /// Waits until every rank is live, up to `timeout`; true if it is.
    pub fn wait_whole(&self, timeout: Duration) -> bool {
        self.wait_for(timeout, ClusterStatus::is_whole)
    }

    /// Waits until `ready(status)` holds, up to `timeout`; true if it does.
    pub fn wait_for(&self, timeout: Duration, ready: impl Fn(&ClusterStatus) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut s = self.status.status.lock();
        while !ready(&s) {
            if self.status.changed.wait_until(&mut s, deadline).timed_out() {
                return ready(&s);
            }
        }
        true
    }

    /// Has every worker fill (or check) the test pattern of `(seed, rank)`
    /// in G1 blocks `(block, seed)`, through the probe it was started
    /// with. Returns, per rank, the blocks whose bytes differ (empty for a
    /// fill). Only call it while no copy touches those blocks. A test hook
    /// (feature `probe`).
    #[cfg(feature = "probe")]
    pub fn probe(
        &self,
        op: crate::proto::ProbeOp,
        blocks: Vec<(u32, u64)>,
    ) -> Result<Vec<Vec<u32>>> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(Command::Probe { op, blocks, reply })
            .map_err(|_| DistError::LeaderGone("the event loop stopped".into()))?;
        self.wake.wake();
        rx.recv()
            .map_err(|_| DistError::LeaderGone("the event loop stopped".into()))?
    }

    /// Sets the callback run (on the leader's thread, so it must not block
    /// on the leader) whenever a worker is lost. It runs before the loss
    /// shows in [`Leader::status`].
    pub fn on_worker_lost(&self, callback: impl Fn(u32) + Send + Sync + 'static) {
        *self.hook.lock() = Some(Box::new(callback));
    }

    /// Tells every worker to exit and stops the event loop.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = self.tx.send(Command::Shutdown);
            self.wake.wake();
            // A panicked loop has nothing left to clean up.
            let _ = t.join();
        }
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Drops every evictable block of G2 and G3 from `engine`'s books: what a
/// [`Leader::on_worker_lost`] callback does when a worker's bytes are
/// gone. Blocks held by requests stay booked until released; copies from
/// them fail (the leader knows they are lost) rather than serve garbage.
pub fn evict_distributed_tiers(engine: &TierEngine) -> usize {
    [Tier::G2, Tier::G3]
        .into_iter()
        .filter_map(|t| engine.pool(t))
        .map(|p| p.evict(p.capacity()))
        .sum()
}

/// How many kept blocks [`Leader::restore_kept`] registered per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Restored {
    /// In G2.
    pub g2: usize,
    /// In G3.
    pub g3: usize,
}

#[cfg(test)]
pub(crate) mod tests;
