//! G4 on the worker: its G2 exposed to peer instances and pulls from
//! theirs, through NIXL (feature `nixl`).
//!
//! Only leaders exchange metadata: the leader asks each worker to describe
//! its G2 (`ExportPeer`, answered with a one-rank `PeerInfo` carrying the
//! NIXL agent's exported description), and hands each worker a peer
//! instance's `PeerInfo`, of which rank `r` connects to our rank `r`.
//! Workers never talk to each other except through NIXL's reads. Every
//! check — the peer's world size and block shape, every remote descriptor
//! against what the peer registered, every block id — runs before any
//! read; a refused pull is a failed `Ack` in which nothing was read.
//!
//! The agent is created on the first request after `Configure` (only
//! instances that use G4 pay for a UCX agent) and dropped when a new
//! `Configure` replaces G2.

use crate::proto::{Ack, AckFailure, BlockPair, Message, PeerInfo, RemotePull, truncate};

use super::{Worker, error_reply};

#[cfg(feature = "nixl")]
use std::collections::HashMap;

#[cfg(feature = "nixl")]
use kvbm_transfer::nixl::{ConnectedPeer, NixlRemote, RemoteConfig, RemotePeer};

/// The worker's NIXL agent and connected peers (empty without `nixl`).
#[derive(Default)]
pub(crate) struct RemoteState {
    #[cfg(feature = "nixl")]
    agent: Option<NixlRemote>,
    #[cfg(feature = "nixl")]
    peers: HashMap<crate::proto::InstanceId, ConnectedPeer>,
}

impl Worker {
    fn refuse_pull(&self, id: u64, error: String, pairs: Vec<BlockPair>) -> Option<Message> {
        tracing::warn!(transfer = id, "remote pull refused: {error}");
        Some(Message::Ack(Ack {
            transfer_id: id,
            rank: self.rank,
            completed: Vec::new(),
            failure: Some(AckFailure {
                error: truncate(error),
                failed: pairs,
                os_error: None,
                checksum_mismatches: 0,
            }),
        }))
    }
}

#[cfg(not(feature = "nixl"))]
const NOT_BUILT: &str = "remote pulls are not supported by this worker (NIXL not built in)";

#[cfg(not(feature = "nixl"))]
impl Worker {
    pub(super) fn export_peer(&mut self) -> Message {
        let who = format!("instance {:x} rank {}", self.instance, self.rank);
        error_reply(None, format!("{who}: {NOT_BUILT}"))
    }

    pub(super) fn connect_peer(&mut self, peer: PeerInfo) -> Message {
        let who = format!("rank {} of {}", self.rank, self.world_size);
        error_reply(
            None,
            format!(
                "connect to instance {:x}: {who}: {NOT_BUILT}",
                peer.instance
            ),
        )
    }

    pub(super) fn remote_pull(&mut self, r: RemotePull) -> Option<Message> {
        self.refuse_pull(r.id, NOT_BUILT.into(), r.pairs)
    }
}

#[cfg(feature = "nixl")]
impl Worker {
    /// The agent over G2, created on first use.
    fn agent(&mut self) -> Result<&NixlRemote, String> {
        if self.remote.agent.is_none() {
            let g2 = self
                .tiers
                .layout(kvbm_pool::Tier::G2)
                .ok_or("no G2 to expose: the leader configured none")?
                .clone();
            let name = format!("kvbm-{:x}-rank{}", self.instance, self.rank);
            let agent = NixlRemote::new(&name, g2, RemoteConfig::default())
                .map_err(|e| format!("NIXL agent: {e}"))?;
            tracing::info!(agent = agent.agent_name(), "NIXL agent over G2");
            self.remote.agent = Some(agent);
        }
        self.remote
            .agent
            .as_ref()
            .ok_or_else(|| "no NIXL agent".to_string())
    }

    /// This rank's description, as a one-rank `PeerInfo`.
    fn describe(&mut self) -> Result<Message, String> {
        let agent = self.agent()?;
        let nixl_metadata = agent.export().map_err(|e| e.to_string())?;
        let layout = agent.local().layout().descriptor();
        Ok(Message::PeerInfo(PeerInfo {
            instance: self.instance,
            ranks: vec![crate::proto::PeerRank {
                nixl_metadata,
                layout,
            }],
        }))
    }

    pub(super) fn export_peer(&mut self) -> Message {
        self.describe()
            .unwrap_or_else(|e| error_reply(None, format!("export: {e}")))
    }

    pub(super) fn connect_peer(&mut self, p: PeerInfo) -> Message {
        match self.try_connect(&p) {
            Ok(()) => self
                .describe()
                .unwrap_or_else(|e| error_reply(None, format!("connect: {e}"))),
            Err(e) => {
                // The error may quote the peer's metadata.
                let e = crate::transport::printable(&e.to_string());
                tracing::warn!(peer = p.instance, "connect refused: {e}");
                error_reply(None, format!("connect to instance {:x}: {e}", p.instance))
            }
        }
    }

    fn try_connect(&mut self, p: &PeerInfo) -> Result<(), String> {
        if p.instance == self.instance {
            return Err("a peer cannot be this instance".into());
        }
        if p.ranks.len() != self.world_size as usize {
            return Err(format!(
                "the peer has {} ranks, this instance {}",
                p.ranks.len(),
                self.world_size
            ));
        }
        let mine = &p.ranks[self.rank as usize];
        let peer = RemotePeer::import(&mine.nixl_metadata).map_err(|e| e.to_string())?;
        if peer.layout().descriptor() != mine.layout {
            return Err("the peer's layout differs from its NIXL description".into());
        }
        let rank = self.rank;
        if let Some(old) = self.remote.peers.get(&p.instance)
            && old.peer().agent_name() != peer.agent_name()
        {
            // The peer's worker restarted: forget the old agent first.
            let old = old.clone();
            if let Some(agent) = &self.remote.agent {
                agent.disconnect(&old).map_err(|e| e.to_string())?;
            }
            self.remote.peers.remove(&p.instance);
        }
        let connected = self.agent()?.connect(&peer).map_err(|e| e.to_string())?;
        tracing::info!(
            rank,
            peer = p.instance,
            agent = peer.agent_name(),
            "connected"
        );
        self.remote.peers.insert(p.instance, connected);
        Ok(())
    }

    pub(super) fn remote_pull(&mut self, r: RemotePull) -> Option<Message> {
        use kvbm_pool::Tier;
        if self.inflight.contains_key(&r.id) {
            let error = format!("transfer id {} already in flight", r.id);
            return self.refuse_pull(r.id, error, Vec::new());
        }
        if (r.src, r.dst) != (Tier::G2, Tier::G2) {
            let error = format!("remote {:?} -> local {:?}: only G2 -> G2", r.src, r.dst);
            return self.refuse_pull(r.id, error, r.pairs);
        }
        let (Some(agent), Some(peer)) = (&self.remote.agent, self.remote.peers.get(&r.peer)) else {
            let error = format!("instance {:x} is not connected", r.peer);
            return self.refuse_pull(r.id, error, r.pairs);
        };
        let pairs: Vec<(usize, usize)> = r
            .pairs
            .iter()
            .map(|&(s, d)| (s as usize, d as usize))
            .collect();
        // A kept G2 slot the pull overwrites no longer holds the block its
        // record names (the pulled block is not recorded: it is not kept).
        if let Err(e) = self.tiers.forget_targets(Tier::G2, &pairs) {
            return self.refuse_pull(r.id, format!("G2 records: {e}"), r.pairs);
        }
        // Every remote descriptor and local id is checked before a read.
        let completion = match agent.pull(peer, &pairs) {
            Ok(c) => c,
            Err(e) => return self.refuse_pull(r.id, e.to_string(), r.pairs),
        };
        // A posted read cannot be called back: the token only marks the id
        // as in flight (the pull ends on its own, and is acknowledged).
        self.inflight
            .insert(r.id, kvbm_transfer::CancelToken::new());
        let (id, rank, acks, wake) = (r.id, self.rank, self.acks.clone(), self.wake.clone());
        tracing::debug!(
            transfer = id,
            peer = r.peer,
            blocks = pairs.len(),
            "remote pull"
        );
        // Verify mode: what landed in G2 is summed there (the peer's bytes
        // cannot be checked here; later reads of these slots are).
        let verify = self
            .tiers
            .checksums()
            .cloned()
            .zip(self.tiers.end(Tier::G2));
        match verify {
            Some((sums, g2)) => {
                let src = crate::verify::End {
                    tier: Tier::G4,
                    layout: g2.layout.clone(),
                };
                let settled = pairs.clone();
                sums.settle_later(src, g2, settled, completion, move |outcome, n| {
                    let mut ack = super::ack_of(id, rank, &pairs, outcome);
                    if let Some(f) = &mut ack.failure {
                        f.checksum_mismatches = n;
                    }
                    let _ = acks.send(Message::Ack(ack));
                    wake.wake();
                });
            }
            None => completion.on_complete(move |outcome| {
                let _ = acks.send(Message::Ack(super::ack_of(id, rank, &pairs, outcome)));
                wake.wake();
            }),
        }
        None
    }
}
