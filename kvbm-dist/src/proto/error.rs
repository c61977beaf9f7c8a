//! Decoding and validation errors.

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// The frame ends before a field it announces.
    #[error("frame truncated: {what} needs {need} bytes, {left} left")]
    Truncated {
        /// The field being read.
        what: &'static str,
        /// Bytes it needs.
        need: usize,
        /// Bytes left in the frame.
        left: usize,
    },
    /// The frame is longer than [`super::MAX_FRAME_BYTES`].
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    FrameTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The frame does not start with [`super::MAGIC`].
    #[error("bad magic {found:02x?}")]
    BadMagic {
        /// The first bytes found.
        found: [u8; 4],
    },
    /// The peer speaks another protocol version.
    #[error("unsupported protocol version {found} (this build speaks {supported})")]
    UnsupportedVersion {
        /// The version in the frame.
        found: u16,
        /// The version this build speaks.
        supported: u16,
    },
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// The header's flags byte is not zero.
    #[error("reserved header flags set: {0:#04x}")]
    ReservedFlags(u8),
    /// The header's body length disagrees with the frame.
    #[error("header announces a {announced}-byte body, the frame carries {actual}")]
    BodyLength {
        /// Length in the header.
        announced: u32,
        /// Bytes after the header.
        actual: usize,
    },
    /// Bytes left over after the message.
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
    /// A count or length above its limit.
    #[error("{what}: {value} exceeds the limit of {max}")]
    TooMany {
        /// The field.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The limit.
        max: u64,
    },
    /// An unknown tier code, or a tier a message may not name.
    #[error("{what}: tier code {code} is not allowed here")]
    BadTier {
        /// The field.
        what: &'static str,
        /// The code found.
        code: u8,
    },
    /// A field's value is inconsistent (rank outside the world, a layout
    /// that does not rebuild, text that is not UTF-8...).
    #[error("invalid {what}: {reason}")]
    Invalid {
        /// The field.
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// A block id outside the receiver's tier.
    #[error("block {block} is outside {tier} ({capacity} blocks)")]
    BlockOutOfRange {
        /// The tier, as a name.
        tier: &'static str,
        /// The block id.
        block: u64,
        /// The tier's block count.
        capacity: u64,
    },
    /// The same destination block twice in one request.
    #[error("destination block {0} appears twice")]
    DuplicateDestination(u32),
    /// A copy within one tier that reads and writes the same block.
    #[error("block {0} is both read and written by one copy within a tier")]
    ReadAndWritten(u32),
}
