//! The handshake: every rank says `Hello`, the leader checks the ranks
//! agree, sizes G2 and G3 from its byte budgets, sends `Configure`, and
//! waits until every rank is `Ready`, pinging the configured ones each
//! heartbeat interval meanwhile.
//!
//! Only the instance's own processes take part: a `Hello` must carry the
//! MAC of the instance secret over its fields and the sender's identity.
//! Anything else — a stranger, a frame of another protocol version, a
//! `Hello` for another instance, garbage — is answered with an error,
//! counted and ignored; it never stops the handshake. Errors among the
//! instance's own processes that waiting cannot fix fail at once and name
//! the rank: two processes claiming one rank, a rank whose block shape
//! differs from rank 0's, a rank that reports an error instead of `Ready`
//! or cannot be reached. On any failure every rank that said `Hello` is
//! told to shut down (and the message is flushed before the socket
//! closes), so it exits and removes its G3 file. If the deadline passes
//! the error names the missing ranks and what was refused meanwhile.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvbm_pool::Tier;

use crate::auth::{InstanceSecret, hello_mac_ok};
use crate::error::{DistError, Result};
use crate::proto::{
    BlockLabel, Configure, ErrorReply, Hello, Message, ProtoError, Ready, truncate,
};
use crate::transport::{RouterSocket, peer_name};

use super::refusals::{RefusalCause, Refusals};
use super::{Cluster, LeaderConfig};

/// How long a failed handshake waits for its `Shutdown`s to leave.
const FLUSH_MS: i32 = 2000;

pub(crate) fn run(
    router: &RouterSocket,
    config: &LeaderConfig,
    secret: &InstanceSecret,
    refusals: &mut Refusals,
) -> Result<Cluster> {
    let _span = tracing::info_span!("handshake", instance = config.instance).entered();
    let mut h = Handshake {
        router,
        config,
        secret,
        refusals,
        hellos: BTreeMap::new(),
    };
    let result = h.run();
    if let Err(e) = &result {
        tracing::warn!("handshake failed: {e}");
        for (peer, _) in h.hellos.values() {
            let _ = router.send(peer, &Message::Shutdown);
        }
        router.flush_on_close(FLUSH_MS);
    }
    result
}

fn error(message: String) -> Message {
    Message::Error(ErrorReply {
        transfer_id: None,
        message: truncate(message),
    })
}

/// Checks a `Hello` from `peer` against the instance: `Ok` when it is one
/// of the instance's processes, or why not.
pub(crate) fn admit(
    config: &LeaderConfig,
    secret: &InstanceSecret,
    peer: &[u8],
    h: &Hello,
) -> std::result::Result<(), (RefusalCause, String)> {
    if h.instance != config.instance || h.world_size != config.world_size {
        return Err((
            RefusalCause::WrongInstance,
            format!(
                "instance {:x} of world {} does not belong to instance {:x} of world {}",
                h.instance, h.world_size, config.instance, config.world_size
            ),
        ));
    }
    if !hello_mac_ok(secret, h.instance, h.rank, h.world_size, peer, &h.auth) {
        return Err((
            RefusalCause::Stranger,
            format!("hello for rank {} without a valid instance MAC", h.rank),
        ));
    }
    Ok(())
}

/// The cause of a frame the decoder refused.
pub(crate) fn decode_cause(e: &ProtoError) -> RefusalCause {
    match e {
        ProtoError::UnsupportedVersion { .. } => RefusalCause::WrongVersion,
        _ => RefusalCause::Malformed,
    }
}

struct Handshake<'a> {
    router: &'a RouterSocket,
    config: &'a LeaderConfig,
    secret: &'a InstanceSecret,
    refusals: &'a mut Refusals,
    hellos: BTreeMap<u32, (Vec<u8>, Hello)>,
}

impl Handshake<'_> {
    /// Counts and answers a refused frame.
    fn refuse(&mut self, peer: &[u8], cause: RefusalCause, detail: String) {
        self.refusals.refuse(peer, cause, &detail);
        let _ = self.router.send(peer, &error(format!("refused: {detail}")));
    }

    fn rank_of(&self, peer: &[u8]) -> Option<u32> {
        self.hellos
            .iter()
            .find(|(_, (p, _))| p == peer)
            .map(|(&r, _)| r)
    }

    /// Waits for a frame until `deadline` (or `tick`, whichever first);
    /// false once the deadline passed.
    fn wait(&self, deadline: Instant, tick: Option<Duration>) -> Result<bool> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let left = tick.map_or(left, |t| t.min(left));
        let mut items = [self.router.raw().as_poll_item(zmq::POLLIN)];
        zmq::poll(&mut items, left.as_millis().max(1) as i64).map_err(DistError::zmq("poll"))?;
        Ok(true)
    }

    fn timeout(&self, phase: &'static str, started: Instant, missing: Vec<u32>) -> DistError {
        DistError::Timeout {
            phase,
            waited_ms: started.elapsed().as_millis() as u64,
            missing,
            rejected: self.refusals.samples(),
        }
    }

    fn send(&self, rank: u32, message: &Message) -> Result<()> {
        let (peer, _) = &self.hellos[&rank];
        self.router
            .send(peer, message)
            .map_err(|e| DistError::Worker {
                rank,
                message: format!("unreachable during the handshake: {e}"),
            })
    }

    /// Runs the handshake: every rank's `Hello`, one `Configure` for all,
    /// every rank's `Ready`.
    fn run(&mut self) -> Result<Cluster> {
        self.await_hellos()?;
        let (reference, configure) = self.configure_all()?;
        let kept = self.await_ready(&configure)?;
        Ok(Cluster {
            identities: self.hellos.values().map(|(p, _)| p.clone()).collect(),
            reference,
            configure,
            kept,
        })
    }

    /// Reads frames until every rank said `Hello`; errors when the
    /// handshake timeout passes first.
    fn await_hellos(&mut self) -> Result<()> {
        let world = self.config.world_size;
        let started = Instant::now();
        let deadline = started + self.config.handshake_timeout;
        while self.hellos.len() < world as usize {
            if !self.wait(deadline, None)? {
                let missing = (0..world)
                    .filter(|r| !self.hellos.contains_key(r))
                    .collect();
                return Err(self.timeout("hello", started, missing));
            }
            while let Some(r) = self.router.try_recv()? {
                self.on_hello_phase_frame(r.peer, r.message)?;
            }
        }
        Ok(())
    }

    /// Checks that every rank has rank 0's block shape and G1 layout, sizes
    /// G2 and G3 and sends every rank the `Configure`; returns rank 0's
    /// `Hello` and the `Configure`.
    fn configure_all(&self) -> Result<(Hello, Configure)> {
        let world = self.config.world_size;
        let reference = self.hellos[&0].1.clone();
        for (&rank, (_, h)) in &self.hellos {
            if let Some(reason) = shape_difference(&reference, h) {
                return Err(DistError::ShapeMismatch { rank, reason });
            }
        }
        let bytes_per_block = reference.bytes_per_block;
        let per_block_all = bytes_per_block.saturating_mul(u64::from(world));
        let configure = Configure {
            g2_blocks: tier_blocks(Tier::G2, self.config.g2_bytes, per_block_all)?,
            g3_blocks: tier_blocks(Tier::G3, self.config.g3_bytes, per_block_all)?,
            block_size: self.config.block_size,
            heartbeat_ms: self
                .config
                .heartbeat_interval
                .as_millis()
                .clamp(1, u32::MAX as u128) as u32,
            verify: self.config.verify,
        };
        tracing::info!(
            g2 = configure.g2_blocks,
            g3 = configure.g3_blocks,
            "configuring {world} workers"
        );
        for rank in 0..world {
            self.send(rank, &Message::Configure(configure))?;
        }
        Ok((reference, configure))
    }

    /// Reads frames until every rank said `Ready` to `configure`, pinging
    /// the ranks every heartbeat meanwhile; returns what their kept tiers
    /// hold. Errors when the handshake timeout passes first.
    fn await_ready(&mut self, configure: &Configure) -> Result<KeptTiers> {
        let world = self.config.world_size;
        let mut readiness = Readiness::new(world as usize);
        let started = Instant::now();
        let deadline = started + self.config.handshake_timeout;
        let beat = self.config.heartbeat_interval;
        let mut next_ping = started + beat;
        let mut seq = 0u64;
        while readiness.ready.iter().any(|r| !r) {
            if !self.wait(
                deadline,
                Some(next_ping.saturating_duration_since(Instant::now())),
            )? {
                let missing = (0..world)
                    .filter(|&r| !readiness.ready[r as usize])
                    .collect();
                return Err(self.timeout("ready", started, missing));
            }
            while let Some(r) = self.router.try_recv()? {
                if let Some(m) = self.on_ready_phase_frame(r.peer, r.message, configure)? {
                    readiness.note(m);
                }
            }
            // Configured workers hear from the leader every heartbeat, so
            // they can tell a slow handshake from a dead leader.
            if Instant::now() >= next_ping {
                next_ping = Instant::now() + beat;
                seq += 1;
                for rank in 0..world {
                    self.send(rank, &Message::Ping { seq })?;
                }
            }
        }
        Ok(readiness.into_kept())
    }

    fn on_hello_phase_frame(
        &mut self,
        peer: Vec<u8>,
        message: std::result::Result<Message, ProtoError>,
    ) -> Result<()> {
        let h = match message {
            Ok(Message::Hello(h)) => h,
            Ok(other) => {
                let cause = if self.rank_of(&peer).is_some() {
                    RefusalCause::Malformed
                } else {
                    RefusalCause::Stranger
                };
                self.refuse(
                    &peer,
                    cause,
                    format!("expected a hello, got {:?}", other.kind()),
                );
                return Ok(());
            }
            Err(e) => {
                self.refuse(&peer, decode_cause(&e), format!("refused frame: {e}"));
                return Ok(());
            }
        };
        if let Err((cause, detail)) = admit(self.config, self.secret, &peer, &h) {
            self.refuse(&peer, cause, detail);
            return Ok(());
        }
        match self.hellos.get(&h.rank) {
            Some((first, _)) if *first == peer => Ok(()), // a repeated hello
            Some((first, _)) => {
                // Both hold the secret: two of the instance's own
                // processes were started for one rank.
                let e = DistError::DuplicateRank {
                    rank: h.rank,
                    first: peer_name(first),
                    second: peer_name(&peer),
                };
                let _ = self.router.send(&peer, &error(e.to_string()));
                let _ = self.router.send(&peer, &Message::Shutdown);
                Err(e)
            }
            None => {
                tracing::info!(peer = %peer_name(&peer), rank = h.rank, "hello");
                self.hellos.insert(h.rank, (peer, h));
                Ok(())
            }
        }
    }

    /// Handles a frame while waiting for `Ready`; returns the `Ready` of
    /// the rank that became ready, if one did (with the blocks its kept
    /// tiers hold).
    fn on_ready_phase_frame(
        &mut self,
        peer: Vec<u8>,
        message: std::result::Result<Message, ProtoError>,
        configure: &Configure,
    ) -> Result<Option<Ready>> {
        let rank = self.rank_of(&peer);
        match (rank, message) {
            (Some(rank), Ok(Message::Ready(m))) if m.rank == rank => {
                if m.g2_blocks != configure.g2_blocks || m.g3_blocks != configure.g3_blocks {
                    return Err(DistError::Worker {
                        rank,
                        message: format!(
                            "ready with {}/{} G2/G3 blocks, {}/{} configured",
                            m.g2_blocks, m.g3_blocks, configure.g2_blocks, configure.g3_blocks
                        ),
                    });
                }
                Ok(Some(m))
            }
            (Some(rank), Ok(Message::Error(e))) => Err(DistError::Worker {
                rank,
                message: e.message,
            }),
            // A repeated hello, an answer to a ping.
            (Some(_), Ok(Message::Hello(_) | Message::Pong { .. })) => Ok(None),
            (_, Err(e)) => {
                self.refuse(&peer, decode_cause(&e), format!("refused frame: {e}"));
                Ok(None)
            }
            (None, Ok(Message::Hello(h))) => {
                let (cause, detail) = match admit(self.config, self.secret, &peer, &h) {
                    Err(why) => why,
                    Ok(()) => (
                        RefusalCause::Malformed,
                        format!("rank {} already said hello", h.rank),
                    ),
                };
                self.refuse(&peer, cause, detail);
                Ok(None)
            }
            (rank, Ok(other)) => {
                let cause = if rank.is_some() {
                    RefusalCause::Malformed
                } else {
                    RefusalCause::Stranger
                };
                self.refuse(
                    &peer,
                    cause,
                    format!("expected ready, got {:?}", other.kind()),
                );
                Ok(None)
            }
        }
    }
}

/// Why `h` does not match `reference`, if it does not.
pub(crate) fn shape_difference(reference: &Hello, h: &Hello) -> Option<String> {
    if h.bytes_per_block != reference.bytes_per_block {
        return Some(format!(
            "{} bytes per block, rank 0 has {}",
            h.bytes_per_block, reference.bytes_per_block
        ));
    }
    if h.device_blocks != reference.device_blocks {
        return Some(format!(
            "{} device blocks, rank 0 has {}",
            h.device_blocks, reference.device_blocks
        ));
    }
    if h.layout != reference.layout {
        return Some(format!(
            "layout {:?} / {:?}, rank 0 has {:?} / {:?}",
            h.layout.kind, h.layout.config, reference.layout.kind, reference.layout.config
        ));
    }
    None
}

/// Blocks of `block_bytes` in a `tier` of `bytes`; an error when a tier
/// cannot index that many.
fn tier_blocks(tier: Tier, bytes: u64, block_bytes: u64) -> Result<u64> {
    let blocks = bytes / block_bytes.max(1);
    let max_blocks = crate::proto::MAX_TIER_BLOCKS;
    if blocks <= max_blocks {
        return Ok(blocks);
    }
    Err(DistError::TierTooLarge {
        tier,
        bytes,
        blocks,
        block_bytes,
        max_blocks,
        limit: max_blocks
            .saturating_mul(block_bytes)
            .saturating_add(block_bytes.saturating_sub(1)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tier_larger_than_its_index_is_refused_with_its_limit() {
        let max = crate::proto::MAX_TIER_BLOCKS;
        assert_eq!(tier_blocks(Tier::G2, max * 4096, 4096).unwrap(), max);
        assert_eq!(tier_blocks(Tier::G2, 4096 * 3 + 5, 4096).unwrap(), 3);
        let e = tier_blocks(Tier::G3, (max + 1) * 4096, 4096).unwrap_err();
        let DistError::TierTooLarge { tier, limit, .. } = &e else {
            panic!("{e}");
        };
        assert_eq!((*tier, *limit), (Tier::G3, max * 4096 + 4095));
        let text = e.to_string();
        assert!(
            text.starts_with("G3 of ") && text.contains(&limit.to_string()),
            "{text}"
        );
    }
}

/// The kept blocks of a tier every rank holds in the same slot under the
/// same label (a block is whole only with every rank's slice), and how many
/// were left out: `rejected` records the ranks refused, plus the blocks
/// some rank lacks (counted once per rank that holds them).
fn kept_everywhere(per_rank: Vec<Vec<(u32, BlockLabel)>>, rejected: u64) -> KeptTier {
    let total: usize = per_rank.iter().map(Vec::len).sum();
    let world = per_rank.len();
    let mut ranks = per_rank.into_iter();
    let Some(first) = ranks.next() else {
        return KeptTier::default();
    };
    let mut blocks: Vec<(u32, BlockLabel)> = first;
    for other in ranks {
        let theirs: std::collections::HashSet<(u32, BlockLabel)> = other.into_iter().collect();
        blocks.retain(|b| theirs.contains(b));
    }
    let partial = (total - blocks.len() * world) as u64;
    KeptTier {
        blocks,
        rejected: rejected + partial,
    }
}

/// What the ranks' kept G2 and G3 held at start.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeptTiers {
    /// G2's, where G2 is kept.
    pub(crate) g2: KeptTier,
    /// G3's, where G3 is kept.
    pub(crate) g3: KeptTier,
    /// How long each rank took to open its G3, in rank order.
    pub(crate) g3_open: Vec<Duration>,
}

/// The `Ready`s heard so far during the handshake, per rank.
struct Readiness {
    /// Whether each rank said `Ready`.
    ready: Vec<bool>,
    /// The blocks each rank's kept G3 holds.
    kept: Vec<Vec<(u32, BlockLabel)>>,
    /// The blocks each rank's kept G2 holds.
    kept_g2: Vec<Vec<(u32, BlockLabel)>>,
    /// G3 records the ranks left out, summed.
    rejected_records: u64,
    /// G2 records the ranks left out, summed.
    rejected_g2: u64,
    /// How long each rank took to open its G3.
    g3_open: Vec<Duration>,
}

impl Readiness {
    /// Nothing heard yet from `world` ranks.
    fn new(world: usize) -> Self {
        Readiness {
            ready: vec![false; world],
            kept: vec![Vec::new(); world],
            kept_g2: vec![Vec::new(); world],
            rejected_records: 0,
            rejected_g2: 0,
            g3_open: vec![Duration::ZERO; world],
        }
    }

    /// Notes (and logs) a rank's accepted `Ready`.
    fn note(&mut self, m: Ready) {
        let rank = m.rank as usize;
        tracing::info!(
            rank,
            kept_g2_blocks = m.recovered_g2.len(),
            kept_g3_blocks = m.recovered.len(),
            rejected = m.rejected + m.rejected_g2,
            g3_open_ms = m.g3_open_us as f64 / 1e3,
            "ready"
        );
        self.ready[rank] = true;
        self.kept[rank] = m.recovered;
        self.kept_g2[rank] = m.recovered_g2;
        self.rejected_records += m.rejected;
        self.rejected_g2 += m.rejected_g2;
        self.g3_open[rank] = Duration::from_micros(m.g3_open_us);
    }

    /// What the kept tiers hold on every rank.
    fn into_kept(self) -> KeptTiers {
        KeptTiers {
            g2: kept_everywhere(self.kept_g2, self.rejected_g2),
            g3: kept_everywhere(self.kept, self.rejected_records),
            g3_open: self.g3_open,
        }
    }
}

/// What the ranks' kept copies of one tier held at start.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeptTier {
    /// Blocks every rank holds: `(slot, label)`.
    pub(crate) blocks: Vec<(u32, BlockLabel)>,
    /// Blocks and records left out.
    pub(crate) rejected: u64,
}
