//! Semantic checks: what a well-formed frame must also satisfy.
//!
//! [`message`] runs inside both [`encode`](super::encode) and
//! [`decode`](super::decode), so what one side sends the other accepts.
//! [`TierBounds`] holds what only the receiver knows — how many blocks
//! each of its tiers has — and checks a request's block ids against it.

use std::collections::HashSet;

use kvbm_pool::Tier;

use super::error::ProtoError;
use super::schema::{Ack, BlockPair, Hello, Message, Ready, RemotePull, Transfer};
use super::{MAX_PAIRS, MAX_TIER_BLOCKS, MAX_WORLD_SIZE};

/// Checks the invariants of one message.
pub(crate) fn message(m: &Message) -> Result<(), ProtoError> {
    match m {
        Message::Hello(h) => hello(h),
        Message::Configure(c) => {
            blocks("g2 blocks", c.g2_blocks)?;
            blocks("g3 blocks", c.g3_blocks)?;
            if c.block_size == 0 {
                return Err(invalid("block size", "must be at least 1".into()));
            }
            if c.heartbeat_ms == 0 {
                return Err(invalid("heartbeat", "must be at least 1 ms".into()));
            }
            Ok(())
        }
        Message::Ready(r) => ready(r),
        Message::Transfer(t) => transfer(t),
        Message::Ack(a) => ack(a),
        Message::Pong { rank: r, .. } => rank(*r),
        #[cfg(feature = "probe")]
        Message::ProbeReply(p) => rank(p.rank),
        #[cfg(feature = "probe")]
        Message::Probe(_) => Ok(()),
        Message::PeerInfo(p) => {
            if p.ranks.is_empty() {
                return Err(invalid("peer ranks", "a peer has at least one rank".into()));
            }
            Ok(())
        }
        Message::RemotePull(r) => remote_pull(r),
        Message::Error(_)
        | Message::Ping { .. }
        | Message::Cancel { .. }
        | Message::Shutdown
        | Message::ExportPeer
        | Message::StopKeeping => Ok(()),
    }
}

/// Checks a `Hello`: its rank inside its world, and the block count and
/// size it announces against its layout.
fn hello(h: &Hello) -> Result<(), ProtoError> {
    if h.world_size == 0 || h.world_size > MAX_WORLD_SIZE {
        return Err(ProtoError::TooMany {
            what: "world size",
            value: u64::from(h.world_size),
            max: u64::from(MAX_WORLD_SIZE),
        });
    }
    rank(h.rank)?;
    if h.rank >= h.world_size {
        return Err(invalid(
            "rank",
            format!("rank {} outside a world of {}", h.rank, h.world_size),
        ));
    }
    // The descriptor rebuilt when it was decoded; recompute from it.
    let config = h.layout.config;
    if h.device_blocks != config.num_blocks() as u64 {
        return Err(invalid(
            "device blocks",
            format!(
                "{} announced, the layout has {}",
                h.device_blocks,
                config.num_blocks()
            ),
        ));
    }
    if h.bytes_per_block != config.block_bytes() {
        return Err(invalid(
            "bytes per block",
            format!(
                "{} announced, the layout's blocks are {}",
                h.bytes_per_block,
                config.block_bytes()
            ),
        ));
    }
    blocks("device blocks", h.device_blocks)
}

/// Checks a `Ready`: its rank, its tier sizes, and every kept slot inside
/// its tier.
fn ready(r: &Ready) -> Result<(), ProtoError> {
    rank(r.rank)?;
    blocks("g2 blocks", r.g2_blocks)?;
    blocks("g3 blocks", r.g3_blocks)?;
    for (what, kept, bound, tier) in [
        ("recovered blocks", &r.recovered, r.g3_blocks, "G3"),
        ("recovered G2 blocks", &r.recovered_g2, r.g2_blocks, "G2"),
    ] {
        if let Some(&(slot, _)) = kept.iter().find(|(s, _)| u64::from(*s) >= bound) {
            return Err(invalid(
                what,
                format!("slot {slot} beyond {bound} {tier} blocks"),
            ));
        }
    }
    Ok(())
}

/// Checks a `Transfer`: local tiers, two of them unless within G2, and
/// labels only into a kept tier, one per pair.
fn transfer(t: &Transfer) -> Result<(), ProtoError> {
    local_tier("source tier", t.src)?;
    local_tier("destination tier", t.dst)?;
    // Within one tier only G2 (host memory: the tier engine stages
    // G3 writes and reads in G2 slots beyond its pool).
    if t.src == t.dst && t.src != Tier::G2 {
        return Err(invalid(
            "transfer",
            format!("source and destination are both {:?}", t.src),
        ));
    }
    let kept_tier = matches!(t.dst, Tier::G2 | Tier::G3);
    if !t.labels.is_empty() && (!kept_tier || t.labels.len() != t.pairs.len()) {
        return Err(invalid(
            "block labels",
            format!(
                "{} labels for {} pairs into {:?} (one per pair, into G2 or G3 only)",
                t.labels.len(),
                t.pairs.len(),
                t.dst
            ),
        ));
    }
    Ok(())
}

/// Checks an `Ack`: its rank, the pairs it names within the limit, and no
/// more checksum mismatches than failed pairs.
fn ack(a: &Ack) -> Result<(), ProtoError> {
    rank(a.rank)?;
    let failed = a.failure.as_ref().map_or(0, |f| f.failed.len());
    if a.completed.len() + failed > MAX_PAIRS {
        return Err(ProtoError::TooMany {
            what: "acknowledged pairs",
            value: (a.completed.len() + failed) as u64,
            max: MAX_PAIRS as u64,
        });
    }
    if let Some(f) = &a.failure
        && f.checksum_mismatches as usize > f.failed.len()
    {
        return Err(invalid(
            "ack checksum mismatches",
            format!(
                "{} mismatches among {} failed pairs",
                f.checksum_mismatches,
                f.failed.len()
            ),
        ));
    }
    Ok(())
}

/// Checks a `RemotePull`: from a peer's G2 or G3 into a local G1 or G2.
fn remote_pull(r: &RemotePull) -> Result<(), ProtoError> {
    if !matches!(r.src, Tier::G2 | Tier::G3) {
        return Err(ProtoError::BadTier {
            what: "remote source tier",
            code: super::codec::tier_code(r.src),
        });
    }
    if !matches!(r.dst, Tier::G1 | Tier::G2) {
        return Err(ProtoError::BadTier {
            what: "remote destination tier",
            code: super::codec::tier_code(r.dst),
        });
    }
    Ok(())
}

fn invalid(what: &'static str, reason: String) -> ProtoError {
    ProtoError::Invalid { what, reason }
}

fn rank(r: u32) -> Result<(), ProtoError> {
    if r >= MAX_WORLD_SIZE {
        return Err(ProtoError::TooMany {
            what: "rank",
            value: u64::from(r),
            max: u64::from(MAX_WORLD_SIZE - 1),
        });
    }
    Ok(())
}

fn blocks(what: &'static str, n: u64) -> Result<(), ProtoError> {
    if n > MAX_TIER_BLOCKS {
        return Err(ProtoError::TooMany {
            what,
            value: n,
            max: MAX_TIER_BLOCKS,
        });
    }
    Ok(())
}

fn local_tier(what: &'static str, t: Tier) -> Result<(), ProtoError> {
    match t {
        Tier::G1 | Tier::G2 | Tier::G3 => Ok(()),
        Tier::G4 => Err(ProtoError::BadTier {
            what,
            code: super::codec::tier_code(t),
        }),
    }
}

/// The block counts of a receiver's tiers (0: the tier is absent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierBounds {
    /// G1 blocks.
    pub g1: u64,
    /// G2 blocks.
    pub g2: u64,
    /// G3 blocks.
    pub g3: u64,
}

impl TierBounds {
    /// Block count of `tier` (0 for G4: no local blocks).
    pub fn capacity(&self, tier: Tier) -> u64 {
        match tier {
            Tier::G1 => self.g1,
            Tier::G2 => self.g2,
            Tier::G3 => self.g3,
            Tier::G4 => 0,
        }
    }

    /// Checks that every source id is inside `src`, every destination id
    /// inside `dst`, and that no destination repeats.
    pub fn check_pairs(&self, src: Tier, dst: Tier, pairs: &[BlockPair]) -> Result<(), ProtoError> {
        let (ns, nd) = (self.capacity(src), self.capacity(dst));
        let mut seen = HashSet::with_capacity(pairs.len());
        for &(s, d) in pairs {
            if u64::from(s) >= ns {
                return Err(ProtoError::BlockOutOfRange {
                    tier: tier_name(src),
                    block: u64::from(s),
                    capacity: ns,
                });
            }
            if u64::from(d) >= nd {
                return Err(ProtoError::BlockOutOfRange {
                    tier: tier_name(dst),
                    block: u64::from(d),
                    capacity: nd,
                });
            }
            if !seen.insert(d) {
                return Err(ProtoError::DuplicateDestination(d));
            }
        }
        // A copy within a tier never writes a block it reads (the copy's
        // parts run in any order).
        if src == dst
            && let Some(&(s, _)) = pairs.iter().find(|(s, _)| seen.contains(s))
        {
            return Err(ProtoError::ReadAndWritten(s));
        }
        Ok(())
    }
}

/// A tier's name for messages.
pub(crate) fn tier_name(t: Tier) -> &'static str {
    match t {
        Tier::G1 => "G1",
        Tier::G2 => "G2",
        Tier::G3 => "G3",
        Tier::G4 => "G4",
    }
}
