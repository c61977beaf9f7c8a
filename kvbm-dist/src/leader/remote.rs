//! G4 on the leader: describing this instance to peer instances,
//! connecting to theirs, and pulling their G2 blocks into ours.
//!
//! Only leaders exchange metadata. [`Leader::export_peer`] collects every
//! rank's NIXL description of its G2 into one [`PeerInfo`], which travels
//! to the peer's leader as an encoded frame ([`encode_peer_info`] /
//! [`decode_peer_info`]); [`Leader::connect_peer`] hands a peer's
//! [`PeerInfo`] to every worker, and rank `r` connects to the peer's rank
//! `r`. A [`Leader::remote_pull`] is then broadcast like a copy: it
//! completes when every worker acknowledged, and what landed is what landed
//! on all of them. The workers check every remote descriptor against what
//! the peer registered before any read; a refusal fails the pull naming
//! the rank.

use std::sync::mpsc;

use kvbm_pool::Tier;
use kvbm_pool::tier::TierMover;
use kvbm_transfer::{CancelToken, Completion, TransferOutcome, completion_pair};

use crate::error::{DistError, Result};
use crate::proto::{InstanceId, MAX_PAIRS, Message, PeerInfo};

use super::mover::{CopyRequest, nothing_landed};
use super::{Command, Leader};

/// What a peer operation asks of every worker.
pub(crate) enum PeerRequest {
    /// Describe your G2.
    Export,
    /// Connect to this peer instance.
    Connect(PeerInfo),
}

/// A pull from a peer instance on its way to the event loop.
pub(crate) struct PullRequest {
    pub(crate) peer: InstanceId,
    pub(crate) copy: CopyRequest,
}

/// A [`PeerInfo`] as the frame leaders exchange.
pub fn encode_peer_info(info: &PeerInfo) -> Result<Vec<u8>> {
    Ok(crate::proto::encode(&Message::PeerInfo(info.clone()))?)
}

/// The [`PeerInfo`] in a frame from a peer's leader, validated.
pub fn decode_peer_info(frame: &[u8]) -> Result<PeerInfo> {
    match crate::proto::decode(frame)? {
        Message::PeerInfo(p) => Ok(p),
        other => Err(DistError::InvalidConfig(format!(
            "expected a PeerInfo frame, got {:?}",
            other.kind()
        ))),
    }
}

impl Leader {
    fn peer_op(&self, request: PeerRequest) -> Result<PeerInfo> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(Command::Peer { request, reply })
            .map_err(|_| DistError::LeaderGone("the event loop stopped".into()))?;
        self.wake.wake();
        rx.recv()
            .map_err(|_| DistError::LeaderGone("the event loop stopped".into()))?
    }

    /// Every rank's description of its G2 (NIXL agent metadata, registered
    /// regions, layout), in rank order: what a peer instance's leader needs
    /// to pull from this instance. Fails naming the first rank that could
    /// not describe itself (no G2, no NIXL runtime, NIXL not built in).
    pub fn export_peer(&self) -> Result<PeerInfo> {
        self.peer_op(PeerRequest::Export)
    }

    /// Connects every rank `r` of this instance to rank `r` of `peer`
    /// (obtained from its leader's [`Leader::export_peer`]). The peer must
    /// have this instance's world size and block shape, and every region it
    /// describes must be registered with its agent; errors name the rank
    /// that refused.
    pub fn connect_peer(&self, peer: &PeerInfo) -> Result<()> {
        let world = self.status().ranks.len();
        if peer.ranks.len() != world {
            return Err(DistError::InvalidConfig(format!(
                "peer instance {:x} has {} ranks, this instance {world}",
                peer.instance,
                peer.ranks.len()
            )));
        }
        self.peer_op(PeerRequest::Connect(peer.clone())).map(|_| ())
    }

    /// Pulls `(peer block, local block)` pairs from the G2 of connected
    /// instance `peer` into this instance's G2, on every worker. Resolves
    /// when every worker has answered: `Ok` when every pair landed
    /// everywhere; otherwise a failure whose `completed` pairs landed on
    /// every worker and whose error names the rank. A pull that any worker
    /// refuses (an unknown peer, a remote block the peer does not have, a
    /// local block out of range, a destination twice) reads nothing there.
    pub fn remote_pull(
        &self,
        peer: InstanceId,
        pairs: Vec<(usize, usize)>,
    ) -> Completion<TransferOutcome> {
        let g2 = self.mover.capacity(Tier::G2).unwrap_or(0);
        if g2 == 0 {
            return Completion::ready(nothing_landed("this instance has no G2".into(), pairs));
        }
        if pairs.len() > MAX_PAIRS {
            let e = format!("{} pairs in one pull (at most {MAX_PAIRS})", pairs.len());
            return Completion::ready(nothing_landed(e, pairs));
        }
        if let Some(&(s, d)) = pairs
            .iter()
            .find(|&&(s, d)| d >= g2 || u32::try_from(s).is_err())
        {
            let e = format!("pair ({s}, {d}) is outside the tiers ({g2} G2 blocks)");
            return Completion::ready(nothing_landed(e, pairs));
        }
        if pairs.is_empty() {
            return Completion::ready(Ok(kvbm_transfer::TransferReport::default()));
        }
        let (completer, completion) = completion_pair();
        let request = PullRequest {
            peer,
            copy: CopyRequest {
                src: Tier::G2,
                dst: Tier::G2,
                pairs,
                labels: Vec::new(),
                cancel: CancelToken::new(),
                completer,
            },
        };
        // A stopped loop drops the request and its completer: the
        // completion resolves as abandoned rather than hanging.
        let _ = self.tx.send(Command::RemotePull(request));
        self.wake.wake();
        completion
    }
}
