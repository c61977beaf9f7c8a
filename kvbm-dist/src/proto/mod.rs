//! The wire protocol between a leader and its workers (and between the
//! leaders of two instances).
//!
//! Every message travels as one ZeroMQ frame: a fixed 12-byte header
//! (magic `KVBD`, protocol version, message kind, a zero flags byte, body
//! length) and a little-endian body. The format is hand-written rather than
//! derived because the decoder is the trust boundary of the process: each
//! field is read through a bounds-checked cursor, every length is checked
//! against both a per-field limit and the bytes actually left in the frame
//! before anything is allocated, and a frame that decodes is also
//! semantically valid (ranks inside the world, layouts that rebuild,
//! tiers that exist). What the decoder cannot know — the block counts of
//! the receiver's tiers — is checked by [`TierBounds`] before a request is
//! executed. A bad frame is always a [`ProtoError`], never a panic.
//!
//! The version lives in the header only: a peer of another version is
//! recognised (and named in the error) before its body is looked at.

pub(crate) mod codec;
mod error;
mod schema;
mod validate;

pub use codec::{decode, encode};
pub use error::ProtoError;
pub use schema::{
    Ack, AckFailure, BlockLabel, BlockPair, Configure, ErrorReply, Hello, InstanceId, Message,
    MessageKind, PeerInfo, PeerRank, Ready, RemotePull, Transfer,
};
#[cfg(feature = "probe")]
pub use schema::{Probe, ProbeOp, ProbeReply};
pub use validate::TierBounds;

/// Cuts `text` to at most [`MAX_TEXT_BYTES`] on a character boundary, so
/// an error text always fits its field.
pub fn truncate(mut text: String) -> String {
    if text.len() > MAX_TEXT_BYTES {
        let mut cut = MAX_TEXT_BYTES;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KVBD";
/// The protocol version this build speaks (2: `Hello` carries a MAC; 3:
/// an `Ack`'s failure carries the OS error number; 4: `Configure` carries
/// the verify flag and an `Ack`'s failure its checksum mismatches; 5: a
/// `Transfer` into G3 carries block labels and `Ready` the blocks a kept
/// G3 held; 6: `Ready` says how long G3 took to open; 7: labels into G2
/// too, and `Ready` the blocks a kept G2 held).
pub const PROTOCOL_VERSION: u16 = 7;
/// Bytes of the frame header.
pub const HEADER_BYTES: usize = 12;
/// Largest frame accepted (header included).
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// Most block pairs one transfer or acknowledgement carries.
pub const MAX_PAIRS: usize = 1 << 20;
/// Largest world (ranks of one instance).
pub const MAX_WORLD_SIZE: u32 = 1024;
/// Largest error text.
pub const MAX_TEXT_BYTES: usize = 4096;
/// Largest encoded layout descriptor.
pub const MAX_DESCRIPTOR_BYTES: usize = 64 << 10;
/// Largest NIXL metadata blob of one rank.
pub const MAX_NIXL_METADATA_BYTES: usize = 4 << 20;
/// Largest block count of one tier.
pub const MAX_TIER_BLOCKS: u64 = u32::MAX as u64;

#[cfg(test)]
mod tests;
