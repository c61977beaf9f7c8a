//! The event loop's side of probes (feature `probe`, a test hook): test
//! patterns filled or checked in every rank's G1, answered by every rank.

use std::sync::mpsc;

use crate::error::{DistError, Result};
use crate::proto::{Message, Probe, ProbeOp, ProbeReply};

use super::super::RankState;
use super::EventLoop;

/// A probe waiting for every rank's reply.
pub(crate) struct PendingProbe {
    replies: Vec<Option<Vec<u32>>>,
    reply: mpsc::Sender<Result<Vec<Vec<u32>>>>,
}

impl EventLoop {
    pub(super) fn start_probe(
        &mut self,
        op: ProbeOp,
        blocks: Vec<(u32, u64)>,
        reply: mpsc::Sender<Result<Vec<Vec<u32>>>>,
    ) {
        if let Some(rank) = self.ranks.iter().position(|r| r.state != RankState::Live) {
            let _ = reply.send(Err(DistError::Worker {
                rank: rank as u32,
                message: "not live".into(),
            }));
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        let message = Message::Probe(Probe { id, op, blocks });
        self.probes.insert(
            id,
            PendingProbe {
                replies: vec![None; self.ranks.len()],
                reply,
            },
        );
        for rank in 0..self.ranks.len() {
            if let Err(e) = self.router.send(&self.ranks[rank].identity, &message) {
                self.lose(rank, format!("unreachable: {e}"));
            }
        }
    }

    pub(super) fn on_probe_reply(&mut self, rank: usize, r: ProbeReply) {
        let Some(p) = self.probes.get_mut(&r.id) else {
            return;
        };
        if let Some(e) = r.error {
            if let Some(p) = self.probes.remove(&r.id) {
                let _ = p.reply.send(Err(DistError::Worker {
                    rank: rank as u32,
                    message: e,
                }));
            }
            return;
        }
        p.replies[rank] = Some(r.mismatched);
        if p.replies.iter().all(Option::is_some)
            && let Some(p) = self.probes.remove(&r.id)
        {
            let _ = p.reply.send(Ok(p.replies.into_iter().flatten().collect()));
        }
    }

    /// Fails every pending probe: rank `rank` was lost for `reason`.
    pub(super) fn fail_probes(&mut self, rank: usize, reason: &str) {
        for (_, p) in self.probes.drain() {
            let _ = p.reply.send(Err(DistError::Worker {
                rank: rank as u32,
                message: format!("lost: {reason}"),
            }));
        }
    }
}
