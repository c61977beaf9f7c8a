//! The event loop's side of G4: peer exports and connects (one at a time,
//! answered by every rank with its own description) and remote pulls
//! (broadcast and acknowledged like copies).

use std::sync::mpsc;
use std::time::Instant;

use crate::error::{DistError, Result};
use crate::proto::{Message, PeerInfo, PeerRank, RemotePull};

use super::super::mover::nothing_landed;
use super::super::remote::{PeerRequest, PullRequest};
use super::EventLoop;

/// An export or connect waiting for every rank's description.
pub(crate) struct PendingPeerOp {
    replies: Vec<Option<PeerRank>>,
    reply: mpsc::Sender<Result<PeerInfo>>,
    deadline: Instant,
}

impl EventLoop {
    pub(super) fn start_peer_op(
        &mut self,
        request: PeerRequest,
        reply: mpsc::Sender<Result<PeerInfo>>,
    ) {
        if self.peer_op.is_some() {
            let _ = reply.send(Err(DistError::InvalidConfig(
                "another peer export or connect is in progress".into(),
            )));
            return;
        }
        if let Some(why) = self.degraded() {
            let _ = reply.send(Err(DistError::InvalidConfig(why)));
            return;
        }
        let message = match request {
            PeerRequest::Export => Message::ExportPeer,
            PeerRequest::Connect(p) => {
                if p.instance == self.config.instance {
                    let _ = reply.send(Err(DistError::InvalidConfig(
                        "a peer cannot be this instance".into(),
                    )));
                    return;
                }
                Message::PeerInfo(p)
            }
        };
        self.peer_op = Some(PendingPeerOp {
            replies: vec![None; self.ranks.len()],
            reply,
            deadline: Instant::now() + self.config.handshake_timeout,
        });
        for rank in 0..self.ranks.len() {
            if let Err(e) = self.router.send(&self.ranks[rank].identity, &message) {
                self.lose(rank, format!("unreachable: {e}"));
            }
        }
    }

    /// A rank's description (or its refusal) for the pending operation.
    pub(super) fn on_peer_reply(
        &mut self,
        rank: usize,
        reply: std::result::Result<PeerInfo, String>,
    ) {
        let Some(op) = self.peer_op.as_mut() else {
            tracing::warn!(rank, "a peer description nobody asked for");
            return;
        };
        let described = reply.and_then(|mut p| {
            if p.instance != self.config.instance || p.ranks.len() != 1 {
                return Err("answered with a description that is not its own".into());
            }
            Ok(p.ranks.remove(0))
        });
        match described {
            Ok(r) => op.replies[rank] = Some(r),
            Err(message) => return self.fail_peer_op(rank, message),
        }
        if op.replies.iter().all(Option::is_some)
            && let Some(op) = self.peer_op.take()
        {
            let _ = op.reply.send(Ok(PeerInfo {
                instance: self.config.instance,
                ranks: op.replies.into_iter().flatten().collect(),
            }));
        }
    }

    /// Fails the pending operation, if any, naming `rank`.
    pub(super) fn fail_peer_op(&mut self, rank: usize, message: String) {
        if let Some(op) = self.peer_op.take() {
            let _ = op.reply.send(Err(DistError::Worker {
                rank: rank as u32,
                message,
            }));
        }
    }

    pub(super) fn peer_op_clock(&mut self, now: Instant) {
        if let Some(op) = &self.peer_op
            && now > op.deadline
        {
            let missing: Vec<u32> = op
                .replies
                .iter()
                .enumerate()
                .filter(|(_, r)| r.is_none())
                .map(|(i, _)| i as u32)
                .collect();
            if let Some(op) = self.peer_op.take() {
                let _ = op.reply.send(Err(DistError::Timeout {
                    phase: "peer description",
                    waited_ms: self.config.handshake_timeout.as_millis() as u64,
                    missing,
                    rejected: Vec::new(),
                }));
            }
        }
    }

    pub(super) fn start_remote_pull(&mut self, p: PullRequest) {
        if let Some(why) = self.degraded() {
            p.copy.completer.complete(nothing_landed(why, p.copy.pairs));
            return;
        }
        let (peer, src, dst) = (p.peer, p.copy.src, p.copy.dst);
        self.broadcast(p.copy, |id, pairs| {
            Message::RemotePull(RemotePull {
                id,
                peer,
                src,
                dst,
                pairs,
            })
        });
    }
}
