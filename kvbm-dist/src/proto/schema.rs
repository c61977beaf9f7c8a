//! The messages.
//!
//! Leader → worker: [`Configure`], [`Transfer`], [`RemotePull`], `Ping`,
//! `Cancel`, `Shutdown`, `ExportPeer`, `StopKeeping`, and [`PeerInfo`]
//! (connect to a peer).
//! A worker answers `ExportPeer` and a [`PeerInfo`] with its own one-rank
//! [`PeerInfo`] (or an [`ErrorReply`]). Worker → leader: [`Hello`], [`Ready`], [`Ack`],
//! `Pong`, [`ErrorReply`]. Leader ↔ leader: [`PeerInfo`]. Either side may
//! answer a frame it refuses with an [`ErrorReply`].

use kvbm_layout::LayoutDescriptor;
use kvbm_pool::Tier;

pub use crate::kept::BlockLabel;

/// One model instance (a leader and its workers) among several.
pub type InstanceId = u64;

/// `(source block, destination block)` on the wire.
pub type BlockPair = (u32, u32);

/// A worker introduces itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The instance the worker belongs to.
    pub instance: InstanceId,
    /// Its tensor-parallel rank, `< world_size`.
    pub rank: u32,
    /// Ranks of the instance.
    pub world_size: u32,
    /// Blocks of its G1 memory (equal to the layout's block count).
    pub device_blocks: u64,
    /// Bytes of one of its blocks (equal to the layout's block bytes).
    pub bytes_per_block: u64,
    /// Its G1 layout.
    pub layout: LayoutDescriptor,
    /// Proof that the worker holds the instance secret: the
    /// [`hello_mac`](crate::auth::hello_mac) of the instance, rank, world
    /// size and the worker's ZeroMQ identity.
    pub auth: [u8; crate::auth::MAC_BYTES],
}

/// The leader sizes a worker's G2 and G3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Configure {
    /// Blocks of host memory to allocate (0: no G2).
    pub g2_blocks: u64,
    /// Blocks of disk to allocate (0: no G3).
    pub g3_blocks: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// The leader pings this often; a worker that hears nothing for many
    /// intervals may give up on it.
    pub heartbeat_ms: u32,
    /// Checksum every block written into G2 or G3 and check it when the
    /// block is read back (see `crate::verify`); a block that fails the
    /// check is a failed pair.
    pub verify: bool,
}

/// A worker allocated what [`Configure`] asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ready {
    /// Its rank.
    pub rank: u32,
    /// Blocks of G2 it holds.
    pub g2_blocks: u64,
    /// Blocks of G3 it holds.
    pub g3_blocks: u64,
    /// The blocks its G3 held when opened, where G3 outlives the engine:
    /// `(slot, what it holds)`.
    pub recovered: Vec<(u32, BlockLabel)>,
    /// Records its kept G3 left out when opened (torn or damaged).
    pub rejected: u64,
    /// The same for its G2, where G2 outlives the engine.
    pub recovered_g2: Vec<(u32, BlockLabel)>,
    /// Records its kept G2 left out when opened.
    pub rejected_g2: u64,
    /// Microseconds it took to open G3 (a kept one's recovery included;
    /// 0 without G3).
    pub g3_open_us: u64,
}

/// A refusal or failure that has no better message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReply {
    /// The transfer concerned, when there is one.
    pub transfer_id: Option<u64>,
    /// What went wrong.
    pub message: String,
}

/// Copy blocks between two of the worker's tiers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// Names the transfer in its [`Ack`] and in `Cancel`.
    pub id: u64,
    /// Source tier (G1, G2 or G3).
    pub src: Tier,
    /// Destination tier (G1, G2 or G3), not the source.
    pub dst: Tier,
    /// Block pairs.
    pub pairs: Vec<BlockPair>,
    /// Into G2 or G3: what each pair's block holds (one per pair),
    /// recorded with it where the tier outlives the engine; empty
    /// otherwise.
    pub labels: Vec<BlockLabel>,
}

/// Why part of a transfer did not land on a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckFailure {
    /// The worker's error text.
    pub error: String,
    /// Pairs whose destination must be treated as garbage.
    pub failed: Vec<BlockPair>,
    /// The OS error number behind the failure (`ENOSPC`, `EIO`...), where
    /// there was one, so the leader counts failures by cause.
    pub os_error: Option<i32>,
    /// How many of the failed pairs failed their checksum check (verify
    /// mode), so the leader counts them.
    pub checksum_mismatches: u32,
}

/// A worker finished a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    /// The transfer.
    pub transfer_id: u64,
    /// The worker's rank.
    pub rank: u32,
    /// Pairs whose bytes landed on this worker.
    pub completed: Vec<BlockPair>,
    /// Set when not every pair landed.
    pub failure: Option<AckFailure>,
}

/// What a peer instance's leader tells ours about one of its ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerRank {
    /// Opaque NIXL agent metadata (at most
    /// [`MAX_NIXL_METADATA_BYTES`](super::MAX_NIXL_METADATA_BYTES)).
    pub nixl_metadata: Vec<u8>,
    /// The layout of the memory it exposes.
    pub layout: LayoutDescriptor,
}

/// Leader ↔ leader: how to reach a peer instance's blocks (G4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer instance.
    pub instance: InstanceId,
    /// One entry per rank, in rank order.
    pub ranks: Vec<PeerRank>,
}

/// Leader → worker: pull blocks of a peer instance into a local tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemotePull {
    /// Names the transfer in its [`Ack`].
    pub id: u64,
    /// The peer instance (announced earlier by a [`PeerInfo`]).
    pub peer: InstanceId,
    /// The peer's tier read from (G2 or G3).
    pub src: Tier,
    /// The local tier written (G1 or G2).
    pub dst: Tier,
    /// `(peer block, local block)` pairs.
    pub pairs: Vec<BlockPair>,
}

/// What a [`Probe`] does to each block.
#[cfg(feature = "probe")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeOp {
    /// Write the block's pattern.
    Fill,
    /// Compare the block with its pattern.
    Check,
}

/// Leader → worker: write or check test patterns in G1 blocks (benches
/// and tests drive an engine with no real model this way; a worker
/// without a probe refuses). The leader sends it only while no transfer
/// touches those blocks. A test hook (feature `probe`): a build without
/// it refuses the message kind as unknown.
#[cfg(feature = "probe")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Names the probe in its reply.
    pub id: u64,
    /// Fill or check.
    pub op: ProbeOp,
    /// `(G1 block, seed)`: the pattern is a function of the seed and the
    /// worker's rank.
    pub blocks: Vec<(u32, u64)>,
}

/// Worker → leader: a probe's result (feature `probe`).
#[cfg(feature = "probe")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeReply {
    /// The probe.
    pub id: u64,
    /// The worker's rank.
    pub rank: u32,
    /// Blocks whose bytes differ from their pattern (checks only).
    pub mismatched: Vec<u32>,
    /// Set when the probe could not run.
    pub error: Option<String>,
}

/// Every message of the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Worker → leader: introduction.
    Hello(Hello),
    /// Leader → worker: tier sizes.
    Configure(Configure),
    /// Worker → leader: tiers allocated.
    Ready(Ready),
    /// Either way: a refusal or failure.
    Error(ErrorReply),
    /// Leader → worker: copy blocks.
    Transfer(Transfer),
    /// Worker → leader: a transfer ended.
    Ack(Ack),
    /// Leader → worker: are you there?
    Ping {
        /// Echoed in the `Pong`.
        seq: u64,
    },
    /// Worker → leader: yes.
    Pong {
        /// The `Ping`'s sequence number.
        seq: u64,
        /// The worker's rank.
        rank: u32,
    },
    /// Leader → worker: stop a transfer (it still gets its `Ack`).
    Cancel {
        /// The transfer.
        transfer_id: u64,
    },
    /// Leader → worker: exit.
    Shutdown,
    /// Leader ↔ leader: a peer instance's NIXL metadata and layouts.
    PeerInfo(PeerInfo),
    /// Leader → worker: pull remote blocks.
    RemotePull(RemotePull),
    /// Leader → worker: fill or check test patterns (feature `probe`).
    #[cfg(feature = "probe")]
    Probe(Probe),
    /// Worker → leader: a probe's result (feature `probe`).
    #[cfg(feature = "probe")]
    ProbeReply(ProbeReply),
    /// Leader → worker: describe your G2 for peers (answered with a
    /// one-rank [`PeerInfo`]).
    ExportPeer,
    /// Leader → worker: the engine's cache was reset; empty the records
    /// of the tiers kept across restarts and record nothing more.
    StopKeeping,
}

/// The kind byte of each message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MessageKind {
    /// [`Message::Hello`].
    Hello = 1,
    /// [`Message::Configure`].
    Configure = 2,
    /// [`Message::Ready`].
    Ready = 3,
    /// [`Message::Error`].
    Error = 4,
    /// [`Message::Transfer`].
    Transfer = 5,
    /// [`Message::Ack`].
    Ack = 6,
    /// [`Message::Ping`].
    Ping = 7,
    /// [`Message::Pong`].
    Pong = 8,
    /// [`Message::Cancel`].
    Cancel = 9,
    /// [`Message::Shutdown`].
    Shutdown = 10,
    /// [`Message::PeerInfo`].
    PeerInfo = 11,
    /// [`Message::RemotePull`].
    RemotePull = 12,
    /// [`Message::Probe`] (feature `probe`; a build without it keeps the
    /// number unused).
    #[cfg(feature = "probe")]
    Probe = 13,
    /// [`Message::ProbeReply`] (feature `probe`, as [`MessageKind::Probe`]).
    #[cfg(feature = "probe")]
    ProbeReply = 14,
    /// [`Message::ExportPeer`].
    ExportPeer = 15,
    /// [`Message::StopKeeping`].
    StopKeeping = 16,
}

impl MessageKind {
    /// The kind of a byte, if it names one.
    pub fn from_byte(b: u8) -> Option<MessageKind> {
        use MessageKind::*;
        Some(match b {
            1 => Hello,
            2 => Configure,
            3 => Ready,
            4 => Error,
            5 => Transfer,
            6 => Ack,
            7 => Ping,
            8 => Pong,
            9 => Cancel,
            10 => Shutdown,
            11 => PeerInfo,
            12 => RemotePull,
            #[cfg(feature = "probe")]
            13 => Probe,
            #[cfg(feature = "probe")]
            14 => ProbeReply,
            15 => ExportPeer,
            16 => StopKeeping,
            _ => return None,
        })
    }
}

impl Message {
    /// This message's kind.
    pub fn kind(&self) -> MessageKind {
        match self {
            Message::Hello(_) => MessageKind::Hello,
            Message::Configure(_) => MessageKind::Configure,
            Message::Ready(_) => MessageKind::Ready,
            Message::Error(_) => MessageKind::Error,
            Message::Transfer(_) => MessageKind::Transfer,
            Message::Ack(_) => MessageKind::Ack,
            Message::Ping { .. } => MessageKind::Ping,
            Message::Pong { .. } => MessageKind::Pong,
            Message::Cancel { .. } => MessageKind::Cancel,
            Message::Shutdown => MessageKind::Shutdown,
            Message::PeerInfo(_) => MessageKind::PeerInfo,
            Message::RemotePull(_) => MessageKind::RemotePull,
            #[cfg(feature = "probe")]
            Message::Probe(_) => MessageKind::Probe,
            #[cfg(feature = "probe")]
            Message::ProbeReply(_) => MessageKind::ProbeReply,
            Message::ExportPeer => MessageKind::ExportPeer,
            Message::StopKeeping => MessageKind::StopKeeping,
        }
    }
}
