//! Frames the leader refuses: counted by cause, logged sparingly.
//!
//! Anyone who can reach the endpoint can send frames, so a refusal is
//! never a reason to stop: the frame is answered with an error, counted
//! (the counts show in [`ClusterStatus::refused`](super::ClusterStatus)),
//! and logged at most once per peer per [`WARN_EVERY`], with the number
//! suppressed since. Peers beyond [`MAX_TRACKED`] share one allowance, so
//! a crowd of identities cannot flood the log either. Identities are
//! printed escaped ([`peer_name`]), and so is the reason, which may quote
//! the peer's frame ([`printable`]).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::transport::{peer_name, printable};

/// At most one warning per peer this often.
pub const WARN_EVERY: Duration = kvbm_pool::rate_limit::WARN_EVERY;
/// Peers remembered individually; the rest share one allowance.
const MAX_TRACKED: usize = 256;
/// Refusals kept as text for a handshake's timeout error.
const MAX_SAMPLES: usize = 8;

/// Why a frame was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalCause {
    /// A peer that is not one of the instance's processes: a `Hello` whose
    /// MAC does not match, or any other frame from an identity no
    /// authenticated worker holds.
    Stranger,
    /// A frame of another protocol version.
    WrongVersion,
    /// A `Hello` naming another instance or world size.
    WrongInstance,
    /// A frame that does not decode, or a message the leader does not
    /// accept at that point.
    Malformed,
}

impl RefusalCause {
    fn name(self) -> &'static str {
        match self {
            RefusalCause::Stranger => "stranger",
            RefusalCause::WrongVersion => "wrong version",
            RefusalCause::WrongInstance => "wrong instance",
            RefusalCause::Malformed => "malformed",
        }
    }
}

/// Frames refused since the leader bound its socket, by cause.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RefusalCounts {
    /// From peers that are not the instance's processes (bad or missing
    /// MAC, unknown identity).
    pub stranger: u64,
    /// Of another protocol version.
    pub wrong_version: u64,
    /// `Hello`s for another instance or world size.
    pub wrong_instance: u64,
    /// Undecodable, or not acceptable where they came.
    pub malformed: u64,
}

impl RefusalCounts {
    /// Every refused frame.
    pub fn total(&self) -> u64 {
        self.stranger + self.wrong_version + self.wrong_instance + self.malformed
    }
}

/// One peer's (or the shared) warning allowance.
#[derive(Debug, Clone, Copy)]
struct Allowance {
    last_warned: Instant,
    suppressed: u64,
}

/// The counts, the warning allowances and a few samples.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    counts: RefusalCounts,
    peers: HashMap<Vec<u8>, Allowance>,
    shared: Option<Allowance>,
    samples: Vec<String>,
}

impl Refusals {
    pub(crate) fn counts(&self) -> RefusalCounts {
        self.counts
    }

    /// The first few refusals as text, and how many more there were.
    pub(crate) fn samples(&self) -> Vec<String> {
        let mut v = self.samples.clone();
        let more = self.counts.total().saturating_sub(v.len() as u64);
        if more > 0 {
            v.push(format!("{more} more"));
        }
        v
    }

    /// Counts a refusal of `peer`'s frame and warns if its allowance lets
    /// it.
    pub(crate) fn refuse(&mut self, peer: &[u8], cause: RefusalCause, detail: &str) {
        let c = &mut self.counts;
        *match cause {
            RefusalCause::Stranger => &mut c.stranger,
            RefusalCause::WrongVersion => &mut c.wrong_version,
            RefusalCause::WrongInstance => &mut c.wrong_instance,
            RefusalCause::Malformed => &mut c.malformed,
        } += 1;
        let name = peer_name(peer);
        let detail = printable(detail);
        if self.samples.len() < MAX_SAMPLES {
            self.samples
                .push(format!("\"{name}\" ({}): {detail}", cause.name()));
        }
        let now = Instant::now();
        let slot = if let Some(a) = self.peers.get_mut(peer) {
            Some(a)
        } else if self.peers.len() < MAX_TRACKED {
            self.peers.insert(
                peer.to_vec(),
                Allowance {
                    last_warned: now.checked_sub(WARN_EVERY * 2).unwrap_or(now),
                    suppressed: 0,
                },
            );
            self.peers.get_mut(peer)
        } else {
            None
        };
        let shared = slot.is_none();
        let a = match slot {
            Some(a) => a,
            None => self.shared.get_or_insert(Allowance {
                last_warned: now.checked_sub(WARN_EVERY * 2).unwrap_or(now),
                suppressed: 0,
            }),
        };
        if now.duration_since(a.last_warned) < WARN_EVERY {
            a.suppressed += 1;
            return;
        }
        let suppressed = std::mem::take(&mut a.suppressed);
        a.last_warned = now;
        let who = if shared { "one of many peers" } else { "peer" };
        let since = if suppressed > 0 {
            format!("; {suppressed} more refused since the last warning")
        } else {
            String::new()
        };
        tracing::warn!(
            "refused a frame from {who} \"{name}\" ({}): {detail}{since}",
            cause.name()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_every_refusal_and_keeps_few_samples() {
        let mut r = Refusals::default();
        for _ in 0..1000 {
            r.refuse(b"a\nb", RefusalCause::Stranger, "x");
        }
        r.refuse(b"c", RefusalCause::WrongVersion, "y");
        for i in 0..600u32 {
            r.refuse(&i.to_le_bytes(), RefusalCause::Malformed, "z");
        }
        let c = r.counts();
        assert_eq!((c.stranger, c.wrong_version, c.malformed), (1000, 1, 600));
        assert_eq!(c.total(), 1601);
        let s = r.samples();
        assert_eq!(s.len(), MAX_SAMPLES + 1);
        assert!(s[0].contains("a\\nb"), "{s:?}");
        assert!(r.peers.len() <= MAX_TRACKED);
    }
}
