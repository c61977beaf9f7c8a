//! The leader's event loop: the only thread that touches the ROUTER socket.
//!
//! Each turn it takes new copies from the mover, reads every frame the
//! workers sent, and then looks at the clock: pings are due, a worker has
//! been silent too long, a transfer is overdue, a caller cancelled. It
//! sleeps in `zmq::poll` on the socket and the wake-up receiver, at most
//! one heartbeat interval.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use kvbm_pool::Tier;
use kvbm_transfer::{
    CancelToken, Completer, TransferError, TransferFailure, TransferOutcome, TransferReport,
};

use crate::auth::InstanceSecret;
use crate::proto::{Ack, AckFailure, ErrorReply, Hello, Message, Ready, Transfer, truncate};
use crate::transport::{Received, RouterSocket, WakeReceiver, peer_name};

use super::handshake::{admit, decode_cause, shape_difference};
use super::lost::LostBlocks;
use super::mover::{CopyRequest, dist_error, nothing_landed};
use super::refusals::{RefusalCause, Refusals};
use super::{Cluster, Command, LeaderConfig, Loss, LostHook, RankState, StatusCell};

mod peers;
#[cfg(feature = "probe")]
mod probes;

/// One rank's connection.
struct Rank {
    identity: Vec<u8>,
    state: RankState,
    last_heard: Instant,
}

/// A copy broadcast to the workers, waiting for their answers.
struct Inflight {
    dst: Tier,
    pairs: Vec<(usize, usize)>,
    pair_set: HashSet<(u32, u32)>,
    /// Per rank: its acknowledgement, once it came.
    acks: Vec<Option<Ack>>,
    /// Per rank: why it will never answer (it was lost).
    lost: Vec<Option<String>>,
    cancel: CancelToken,
    cancel_sent: bool,
    deadline: Instant,
    completer: Completer<TransferOutcome>,
}

impl Inflight {
    fn answered(&self, rank: usize) -> bool {
        self.acks[rank].is_some() || self.lost[rank].is_some()
    }
}

pub(crate) struct EventLoop {
    /// Probes waiting for every rank (feature `probe`).
    #[cfg(feature = "probe")]
    probes: HashMap<u64, probes::PendingProbe>,
    /// The export or connect waiting for every rank (one at a time).
    peer_op: Option<peers::PendingPeerOp>,
    config: LeaderConfig,
    secret: InstanceSecret,
    refusals: Refusals,
    /// Identities of processes that were replaced or lost: never admitted
    /// again (a copied `Hello` of theirs stays useless).
    burned: HashSet<Vec<u8>>,
    router: RouterSocket,
    wake: WakeReceiver,
    commands: mpsc::Receiver<Command>,
    reference: Hello,
    configure: crate::proto::Configure,
    ranks: Vec<Rank>,
    inflight: HashMap<u64, Inflight>,
    next_id: u64,
    next_ping: Instant,
    ping_seq: u64,
    lost_blocks: LostBlocks,
    status: Arc<StatusCell>,
    hook: LostHook,
    block_bytes: u64,
    /// Whether the workers' kept tiers still record blocks (a reset stops
    /// them, and a worker that rejoins after it is told so again).
    keeping: bool,
}

impl EventLoop {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        config: LeaderConfig,
        secret: InstanceSecret,
        refusals: Refusals,
        router: RouterSocket,
        wake: WakeReceiver,
        commands: mpsc::Receiver<Command>,
        cluster: Cluster,
        status: Arc<StatusCell>,
        hook: LostHook,
    ) -> Self {
        let now = Instant::now();
        let world = cluster.identities.len() as u64;
        EventLoop {
            next_ping: now,
            ranks: cluster
                .identities
                .into_iter()
                .map(|identity| Rank {
                    identity,
                    state: RankState::Live,
                    last_heard: now,
                })
                .collect(),
            lost_blocks: LostBlocks::new(
                cluster.configure.g2_blocks as usize,
                cluster.configure.g3_blocks as usize,
            ),
            block_bytes: cluster.reference.bytes_per_block.saturating_mul(world),
            reference: cluster.reference,
            configure: cluster.configure,
            config,
            secret,
            refusals,
            burned: HashSet::new(),
            router,
            wake,
            commands,
            inflight: HashMap::new(),
            #[cfg(feature = "probe")]
            probes: HashMap::new(),
            peer_op: None,
            next_id: 1,
            ping_seq: 0,
            status,
            hook,
            keeping: true,
        }
    }

    pub(crate) fn run(mut self) {
        let _span = tracing::info_span!("leader", instance = self.config.instance).entered();
        loop {
            let timeout = self
                .config
                .heartbeat_interval
                .min(self.next_ping.saturating_duration_since(Instant::now()));
            {
                let mut items = [
                    self.router.raw().as_poll_item(zmq::POLLIN),
                    self.wake.socket().as_poll_item(zmq::POLLIN),
                ];
                if let Err(e) = zmq::poll(&mut items, timeout.as_millis().max(1) as i64) {
                    tracing::error!("leader poll failed: {e}; stopping");
                    break;
                }
            }
            self.wake.drain();
            if !self.take_commands() {
                break;
            }
            let refused = self.refusals.counts();
            loop {
                match self.router.try_recv() {
                    Ok(Some(r)) => self.on_frame(r),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!("receive failed: {e}");
                        break;
                    }
                }
            }
            if self.refusals.counts() != refused {
                let counts = self.refusals.counts();
                self.status.update(|s| s.refused = counts);
            }
            self.on_clock();
        }
        for rank in &self.ranks {
            let _ = self.router.send(&rank.identity, &Message::Shutdown);
        }
        // The shutdowns leave before the socket closes.
        self.router.flush_on_close(2000);
        let ids: Vec<u64> = self.inflight.keys().copied().collect();
        for id in ids {
            if let Some(t) = self.inflight.remove(&id) {
                t.completer
                    .complete(nothing_landed("the leader shut down".into(), t.pairs));
            }
        }
    }

    /// Returns false on shutdown.
    fn take_commands(&mut self) -> bool {
        loop {
            match self.commands.try_recv() {
                Ok(Command::Copy(c)) => self.start_copy(c),
                #[cfg(feature = "probe")]
                Ok(Command::Probe { op, blocks, reply }) => self.start_probe(op, blocks, reply),
                Ok(Command::Peer { request, reply }) => self.start_peer_op(request, reply),
                Ok(Command::RemotePull(p)) => self.start_remote_pull(p),
                Ok(Command::StopKeeping) => self.stop_keeping(),
                Ok(Command::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => return false,
                Err(mpsc::TryRecvError::Empty) => return true,
            }
        }
    }

    /// Why copies fail at once, when a rank is not live.
    fn degraded(&self) -> Option<String> {
        let (rank, r) = self
            .ranks
            .iter()
            .enumerate()
            .find(|(_, r)| r.state != RankState::Live)?;
        let why = match &r.state {
            RankState::Lost { reason } => format!("lost: {reason}"),
            _ => "rejoining".into(),
        };
        Some(format!("instance degraded: rank {rank} is {why}"))
    }

    fn start_copy(&mut self, mut c: CopyRequest) {
        if let Some(why) = self.degraded() {
            c.completer.complete(nothing_landed(why, c.pairs));
            return;
        }
        if let Some(&(s, _)) = c
            .pairs
            .iter()
            .find(|&&(s, _)| self.lost_blocks.is_lost(c.src, s))
        {
            c.completer.complete(nothing_landed(
                format!(
                    "{:?} block {s} lost its bytes with a worker and was not written since",
                    c.src
                ),
                c.pairs,
            ));
            return;
        }
        let (src, dst) = (c.src, c.dst);
        let labels = std::mem::take(&mut c.labels);
        self.broadcast(c, |id, pairs| {
            Message::Transfer(Transfer {
                id,
                src,
                dst,
                pairs,
                labels,
            })
        });
    }

    /// Sends the transfer `message(id, wire pairs)` to every worker and
    /// waits for their acknowledgements.
    fn broadcast(&mut self, c: CopyRequest, message: impl FnOnce(u64, Vec<(u32, u32)>) -> Message) {
        if c.cancel.is_cancelled() {
            c.completer.complete(Err(Box::new(TransferFailure {
                error: TransferError::Cancelled,
                completed: Vec::new(),
                failed: c.pairs,
                culprit: None,
            })));
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        // Ids were checked against the tiers, which fit in u32.
        let wire: Vec<(u32, u32)> = c.pairs.iter().map(|&(s, d)| (s as u32, d as u32)).collect();
        let message = message(id, wire.clone());
        let world = self.ranks.len();
        self.inflight.insert(
            id,
            Inflight {
                dst: c.dst,
                pairs: c.pairs,
                pair_set: wire.into_iter().collect(),
                acks: vec![None; world],
                lost: vec![None; world],
                cancel: c.cancel,
                cancel_sent: false,
                deadline: Instant::now() + self.config.transfer_timeout,
                completer: c.completer,
            },
        );
        tracing::debug!(transfer = id, kind = ?message.kind(), src = ?c.src, dst = ?c.dst, "broadcast");
        for rank in 0..world {
            if let Err(e) = self.router.send(&self.ranks[rank].identity, &message) {
                self.lose(rank, format!("unreachable: {e}"));
            }
        }
        self.try_resolve(id);
    }

    fn rank_of(&self, peer: &[u8]) -> Option<usize> {
        self.ranks.iter().position(|r| r.identity == peer)
    }

    fn on_frame(&mut self, r: Received) {
        let rank = self.rank_of(&r.peer);
        if let Some(rank) = rank {
            self.ranks[rank].last_heard = Instant::now();
        }
        let message = match r.message {
            Ok(m) => m,
            Err(e) => {
                self.refuse(&r.peer, decode_cause(&e), format!("refused frame: {e}"));
                return;
            }
        };
        if let Some(rank) = rank
            && matches!(self.ranks[rank].state, RankState::Lost { .. })
            && !matches!(message, Message::Hello(_))
        {
            // A lost worker that speaks again has been stalled: its bytes
            // are written off, it must exit and come back as a new process.
            tracing::warn!(rank, "a lost worker spoke again; telling it to exit");
            let _ = self.router.send(&r.peer, &Message::Shutdown);
            return;
        }
        match (rank, message) {
            (_, Message::Hello(h)) => self.on_hello(r.peer, h),
            (Some(_), Message::Pong { .. }) => {}
            (Some(rank), Message::Ready(m)) if self.ranks[rank].state == RankState::Rejoining => {
                self.on_rejoined(rank, &r.peer, &m);
            }
            (Some(rank), Message::Ack(a)) => self.on_ack(rank, a),
            #[cfg(feature = "probe")]
            (Some(rank), Message::ProbeReply(p)) => self.on_probe_reply(rank, p),
            (Some(rank), Message::PeerInfo(p)) => self.on_peer_reply(rank, Ok(p)),
            (Some(rank), Message::Error(e)) => self.on_worker_error(rank, e),
            (rank, other) => {
                let cause = if rank.is_some() {
                    RefusalCause::Malformed
                } else {
                    RefusalCause::Stranger
                };
                let detail = format!("a leader does not accept {:?} here", other.kind());
                self.refuse(&r.peer, cause, detail);
            }
        }
    }

    /// Tells every worker that is not lost to empty its kept records and
    /// record nothing more; a worker lost now hears it when it rejoins.
    fn stop_keeping(&mut self) {
        self.keeping = false;
        for rank in 0..self.ranks.len() {
            if matches!(self.ranks[rank].state, RankState::Lost { .. }) {
                continue;
            }
            if let Err(e) = self
                .router
                .send(&self.ranks[rank].identity, &Message::StopKeeping)
            {
                self.lose(rank, format!("unreachable: {e}"));
            }
        }
    }

    /// A rejoining worker's `Ready`: live again when it has its rank and
    /// the configured tier sizes (told to stop keeping when the cache was
    /// reset), else told to exit and lost.
    fn on_rejoined(&mut self, rank: usize, peer: &[u8], m: &Ready) {
        if m.rank as usize == rank
            && m.g2_blocks == self.configure.g2_blocks
            && m.g3_blocks == self.configure.g3_blocks
        {
            tracing::info!(rank, "rejoined");
            if !self.keeping
                && let Err(e) = self.router.send(peer, &Message::StopKeeping)
            {
                self.lose(rank, format!("unreachable: {e}"));
                return;
            }
            self.ranks[rank].state = RankState::Live;
            self.publish();
        } else {
            tracing::warn!(rank, "rejoining worker is ready with the wrong shape");
            let _ = self.router.send(peer, &Message::Shutdown);
            self.lose(rank, "ready with the wrong shape".into());
        }
    }

    /// A worker's `Error`: about a transfer, it fails all of that rank's
    /// pairs of it; otherwise it answers the peer operation under way, or
    /// loses a rank that was rejoining.
    fn on_worker_error(&mut self, rank: usize, e: ErrorReply) {
        match e.transfer_id {
            Some(id) => {
                let failed = self
                    .inflight
                    .get(&id)
                    .map(|t| t.pair_set.iter().copied().collect())
                    .unwrap_or_default();
                self.on_ack(
                    rank,
                    Ack {
                        transfer_id: id,
                        rank: rank as u32,
                        completed: Vec::new(),
                        failure: Some(AckFailure {
                            error: e.message,
                            failed,
                            os_error: None,
                            checksum_mismatches: 0,
                        }),
                    },
                );
            }
            None => {
                tracing::warn!(rank, "worker reports: {}", e.message);
                if self.peer_op.is_some() && self.ranks[rank].state == RankState::Live {
                    self.on_peer_reply(rank, Err(e.message));
                } else if self.ranks[rank].state == RankState::Rejoining {
                    self.lose(rank, format!("failed to rejoin: {}", e.message));
                }
            }
        }
    }

    /// Counts and answers a refused frame (logged sparingly).
    fn refuse(&mut self, peer: &[u8], cause: RefusalCause, detail: String) {
        self.refusals.refuse(peer, cause, &detail);
        let _ = self
            .router
            .send(peer, &error(None, format!("refused: {detail}")));
    }

    fn on_hello(&mut self, peer: Vec<u8>, h: Hello) {
        if let Err((cause, detail)) = admit(&self.config, &self.secret, &peer, &h) {
            // A stranger's hello, even for a live rank, changes nothing.
            self.refuse(&peer, cause, detail);
            return;
        }
        let rank = h.rank as usize;
        if self.ranks[rank].identity == peer {
            return; // a repeated hello
        }
        if self.burned.contains(&peer) {
            let detail = format!("identity of a replaced process cannot rejoin rank {rank}");
            self.refuse(&peer, RefusalCause::Malformed, detail);
            return;
        }
        let name = peer_name(&peer);
        if let Some(d) = shape_difference(&self.reference, &h) {
            // One of the instance's own processes, built for another shape.
            tracing::warn!(peer = %name, "refused hello: rank {rank} cannot rejoin: {d}");
            let _ = self.router.send(
                &peer,
                &error(None, format!("rank {rank} cannot rejoin: {d}")),
            );
            let _ = self.router.send(&peer, &Message::Shutdown);
            return;
        }
        if self.ranks[rank].state == RankState::Live {
            // A new process of the instance for a rank we thought alive:
            // the old one is gone.
            self.lose(rank, format!("replaced by a new process ({name})"));
        }
        tracing::info!(rank, peer = %name, "rejoining");
        let old = std::mem::replace(&mut self.ranks[rank].identity, peer);
        self.burned.insert(old);
        let r = &mut self.ranks[rank];
        r.state = RankState::Rejoining;
        r.last_heard = Instant::now();
        if let Err(e) = self.router.send(
            &self.ranks[rank].identity,
            &Message::Configure(self.configure),
        ) {
            self.lose(rank, format!("unreachable while rejoining: {e}"));
            return;
        }
        self.publish();
    }

    fn on_ack(&mut self, rank: usize, mut a: Ack) {
        let Some(t) = self.inflight.get_mut(&a.transfer_id) else {
            tracing::debug!(
                rank,
                transfer = a.transfer_id,
                "ack for no transfer in flight"
            );
            return;
        };
        if t.answered(rank) {
            return;
        }
        let bogus = if a.rank as usize != rank {
            Some(format!("ack names rank {}", a.rank))
        } else {
            a.completed
                .iter()
                .chain(a.failure.iter().flat_map(|f| f.failed.iter()))
                .find(|p| !t.pair_set.contains(p))
                .map(|p| format!("ack names pair {p:?}, which is not part of the transfer"))
        };
        if let Some(why) = bogus {
            tracing::warn!(rank, transfer = a.transfer_id, "invalid ack: {why}");
            a = Ack {
                transfer_id: a.transfer_id,
                rank: rank as u32,
                completed: Vec::new(),
                failure: Some(AckFailure {
                    error: format!("invalid ack: {why}"),
                    failed: t.pair_set.iter().copied().collect(),
                    os_error: None,
                    checksum_mismatches: 0,
                }),
            };
        }
        let id = a.transfer_id;
        let mismatches = a.failure.as_ref().map_or(0, |f| f.checksum_mismatches);
        t.acks[rank] = Some(a);
        if mismatches > 0 {
            self.status
                .update(|s| s.verify_mismatches += u64::from(mismatches));
        }
        self.try_resolve(id);
    }

    /// Resolves transfer `id` if every rank answered.
    fn try_resolve(&mut self, id: u64) {
        let Some(t) = self.inflight.get(&id) else {
            return;
        };
        if !(0..self.ranks.len()).all(|r| t.answered(r)) {
            return;
        }
        let Some(t) = self.inflight.remove(&id) else {
            return;
        };
        let outcome = self.outcome(&t);
        if let Ok(r) = &outcome {
            tracing::debug!(transfer = id, blocks = r.blocks, "done");
        } else if let Err(f) = &outcome {
            tracing::warn!(transfer = id, "failed: {f}");
        }
        let restored: &[(usize, usize)] = match &outcome {
            Ok(_) => &t.pairs,
            Err(f) => &f.completed,
        };
        let was_lost = self.lost_blocks.count(t.dst);
        for &(_, d) in restored {
            self.lost_blocks.restore(t.dst, d);
        }
        if self.lost_blocks.count(t.dst) != was_lost {
            self.publish();
        }
        t.completer.complete(outcome);
    }

    fn outcome(&self, t: &Inflight) -> TransferOutcome {
        if let Some((rank, why)) = t
            .lost
            .iter()
            .enumerate()
            .find_map(|(r, l)| l.as_ref().map(|l| (r, l)))
        {
            // A lost worker's bytes are unknown: nothing landed anywhere.
            return nothing_landed(format!("rank {rank} lost: {why}"), t.pairs.clone());
        }
        // Every rank acked: what landed is what landed on all of them.
        let mut landed: Option<HashSet<(u32, u32)>> = None;
        let mut first_failure: Option<(usize, String, Option<i32>)> = None;
        for (rank, a) in t.acks.iter().enumerate() {
            let Some(a) = a else { continue };
            let set: HashSet<(u32, u32)> = a.completed.iter().copied().collect();
            landed = Some(match landed {
                None => set,
                Some(l) => l.intersection(&set).copied().collect(),
            });
            if let Some(f) = &a.failure
                && first_failure.is_none()
            {
                first_failure = Some((rank, f.error.clone(), f.os_error));
            }
        }
        let landed = landed.unwrap_or_default();
        if first_failure.is_none() && landed.len() == t.pairs.len() {
            return Ok(TransferReport {
                blocks: t.pairs.len(),
                bytes: t.pairs.len() as u64 * self.block_bytes,
            });
        }
        let (completed, failed): (Vec<_>, Vec<_>) = t
            .pairs
            .iter()
            .partition(|&&(s, d)| landed.contains(&(s as u32, d as u32)));
        let error = match first_failure {
            Some(_) if t.cancel.is_cancelled() => TransferError::Cancelled,
            Some((rank, message, os_error)) => TransferError::Remote {
                origin: format!("kvbm-dist rank {rank}"),
                message,
                os_error,
            },
            None => dist_error("a worker acknowledged fewer pairs than were sent".into()),
        };
        Err(Box::new(TransferFailure {
            error,
            completed,
            failed,
            culprit: None,
        }))
    }

    /// Declares `rank` lost: fails its transfers (after the survivors
    /// stop), marks G2/G3 lost, degrades the instance until it rejoins.
    fn lose(&mut self, rank: usize, reason: String) {
        if matches!(self.ranks[rank].state, RankState::Lost { .. }) {
            return;
        }
        tracing::warn!(rank, "worker lost: {reason}");
        // If it is still there (stalled, not dead), it must stop writing:
        // it rejoins as a new process.
        let _ = self
            .router
            .send(&self.ranks[rank].identity, &Message::Shutdown);
        self.ranks[rank].state = RankState::Lost {
            reason: reason.clone(),
        };
        self.lost_blocks.lose_all();
        self.fail_peer_op(rank, format!("lost: {reason}"));
        #[cfg(feature = "probe")]
        self.fail_probes(rank, &reason);
        let ids: Vec<u64> = self.inflight.keys().copied().collect();
        for &id in &ids {
            let Some(t) = self.inflight.get_mut(&id) else {
                continue;
            };
            if !t.answered(rank) {
                t.lost[rank] = Some(reason.clone());
            }
            // The survivors stop writing; the transfer resolves on their
            // acknowledgements, after which nothing more lands.
            if !t.cancel_sent {
                t.cancel_sent = true;
                let cancel = Message::Cancel { transfer_id: id };
                let pending: Vec<usize> =
                    (0..self.ranks.len()).filter(|&r| !t.answered(r)).collect();
                for r in pending {
                    let _ = self.router.send(&self.ranks[r].identity, &cancel);
                }
            }
        }
        // The hook (dropping lost blocks from the books) runs before the
        // loss is published, so whoever sees the loss sees the books
        // already cleaned.
        if let Some(hook) = self.hook.lock().as_ref() {
            hook(rank as u32);
        }
        self.status.update(|s| {
            s.losses.push(Loss {
                rank: rank as u32,
                reason: reason.clone(),
            })
        });
        self.publish();
        for id in ids {
            self.try_resolve(id);
        }
    }

    fn publish(&self) {
        let states: Vec<RankState> = self.ranks.iter().map(|r| r.state.clone()).collect();
        let lost = (
            self.lost_blocks.count(Tier::G2),
            self.lost_blocks.count(Tier::G3),
        );
        self.status.update(|s| {
            s.ranks = states;
            s.lost_blocks = lost;
        });
    }

    /// What the clock brings: peer-operation timeouts, silent workers and
    /// overdue transfers lost, cancels sent, pings sent.
    fn on_clock(&mut self) {
        let now = Instant::now();
        self.peer_op_clock(now);
        self.lose_silent(now);
        self.lose_overdue(now);
        self.send_cancels();
        if now >= self.next_ping {
            self.next_ping = now + self.config.heartbeat_interval;
            self.ping();
        }
    }

    /// Loses the workers silent for longer than allowed. A rejoining one is
    /// setting its tiers up (G2 and G3 allocated, which takes seconds for
    /// large tiers) and answers nothing meanwhile: it gets the handshake's
    /// allowance, as at the first start.
    fn lose_silent(&mut self, now: Instant) {
        for rank in 0..self.ranks.len() {
            let r = &self.ranks[rank];
            let allowed = match r.state {
                RankState::Rejoining => self.config.handshake_timeout,
                _ => self.config.heartbeat_timeout,
            };
            if !matches!(r.state, RankState::Lost { .. })
                && now.duration_since(r.last_heard) > allowed
            {
                let silent = now.duration_since(r.last_heard).as_millis();
                self.lose(rank, format!("silent for {silent} ms"));
            }
        }
    }

    /// Overdue transfers lose the ranks that did not answer them (told to
    /// exit).
    fn lose_overdue(&mut self, now: Instant) {
        let overdue: Vec<(u64, Vec<usize>)> = self
            .inflight
            .iter()
            .filter(|(_, t)| now > t.deadline)
            .map(|(&id, t)| {
                (
                    id,
                    (0..self.ranks.len()).filter(|&r| !t.answered(r)).collect(),
                )
            })
            .collect();
        for (id, ranks) in overdue {
            for rank in ranks {
                let _ = self
                    .router
                    .send(&self.ranks[rank].identity, &Message::Shutdown);
                self.lose(
                    rank,
                    format!(
                        "transfer {id} unanswered after {:?}",
                        self.config.transfer_timeout
                    ),
                );
            }
        }
    }

    /// Sends `Cancel` for newly cancelled transfers to the ranks that have
    /// not answered them yet.
    fn send_cancels(&mut self) {
        let mut cancels = Vec::new();
        for (&id, t) in self.inflight.iter_mut() {
            if !t.cancel_sent && t.cancel.is_cancelled() {
                t.cancel_sent = true;
                cancels.push((
                    id,
                    (0..self.ranks.len())
                        .filter(|&r| !t.answered(r))
                        .collect::<Vec<_>>(),
                ));
            }
        }
        for (id, ranks) in cancels {
            for r in ranks {
                let _ = self.router.send(
                    &self.ranks[r].identity,
                    &Message::Cancel { transfer_id: id },
                );
            }
        }
    }

    /// Pings every rank not lost; a rank that cannot be reached is lost.
    fn ping(&mut self) {
        self.ping_seq += 1;
        let ping = Message::Ping { seq: self.ping_seq };
        for rank in 0..self.ranks.len() {
            if matches!(self.ranks[rank].state, RankState::Lost { .. }) {
                continue;
            }
            if let Err(e) = self.router.send(&self.ranks[rank].identity, &ping) {
                self.lose(rank, format!("unreachable: {e}"));
            }
        }
    }
}

fn error(transfer_id: Option<u64>, message: String) -> Message {
    Message::Error(ErrorReply {
        transfer_id,
        message: truncate(message),
    })
}
