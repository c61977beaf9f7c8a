//! Errors of the NIXL module.
//!
//! Two kinds of failure have their own types because callers act on them
//! differently: [`NixlUnavailable`] (no runtime, no plugin — fall back to
//! another backend or skip) and [`RemoteError`] (a peer's bytes or a pull
//! request that must be refused before anything is read). Failures of a
//! transfer that NIXL accepted travel as [`TransferError`], like every other
//! backend's, so the executor reports them unchanged.

use crate::error::TransferError;

/// NIXL cannot be used in this process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NixlUnavailable {
    /// `libnixl_capi.so` could not be loaded.
    #[error(
        "NIXL runtime not found: libnixl_capi.so is not loadable (install the nixl-cu13 wheel and put its .nixl_cu13.mesonpy.libs directory on LD_LIBRARY_PATH)"
    )]
    RuntimeMissing,
    /// The runtime loaded but lacks a plugin.
    #[error("NIXL plugin {0} is not available (plugins found: {1})")]
    PluginMissing(&'static str, String),
    /// The agent or backend could not be created.
    #[error("NIXL {what} could not be created: {detail}")]
    Setup {
        /// What was being created.
        what: &'static str,
        /// NIXL's error.
        detail: String,
    },
}

impl From<NixlUnavailable> for TransferError {
    fn from(e: NixlUnavailable) -> Self {
        TransferError::Backend {
            backend: "nixl",
            message: e.to_string(),
        }
    }
}

/// A peer description or a remote pull that is refused before any read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// The bytes end before the structure does.
    #[error("peer description truncated: needed {needed} bytes, {available} available")]
    Truncated {
        /// Bytes the next field needs.
        needed: u64,
        /// Bytes left.
        available: u64,
    },
    /// The bytes do not start with the peer-description magic.
    #[error("not a kvbm peer description (bad magic)")]
    BadMagic,
    /// A format version this build does not read.
    #[error("peer description version {found} is not supported (this build reads {supported})")]
    UnsupportedVersion {
        /// Version found.
        found: u16,
        /// Version understood.
        supported: u16,
    },
    /// A length field is over its limit.
    #[error("peer description field {field} is {len} bytes, more than the limit of {limit}")]
    TooLarge {
        /// Which field.
        field: &'static str,
        /// Its claimed length.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// The structure is well-framed but its contents are inconsistent.
    #[error("malformed peer description: {0}")]
    Malformed(String),
    /// The peer's blocks are not shaped like ours.
    #[error("peer block shape differs from ours: {0}")]
    ShapeMismatch(String),
    /// A block id is outside a layout.
    #[error("{side} block {block} out of range ({num_blocks} blocks)")]
    BlockOutOfRange {
        /// `"remote"` or `"local"`.
        side: &'static str,
        /// The block id.
        block: usize,
        /// Blocks in that layout.
        num_blocks: usize,
    },
    /// A destination block appears twice in one pull.
    #[error("local block {0} is the destination of two pairs")]
    DuplicateDestination(usize),
    /// A chunk of a block falls outside the region the peer described.
    #[error(
        "remote extent [{offset}, +{len}) of block {block} lies outside region {region} ({region_len} bytes)"
    )]
    ExtentOutsideRegion {
        /// Block id.
        block: usize,
        /// Region index.
        region: usize,
        /// Offset in the region.
        offset: u64,
        /// Length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// NIXL has no registration of the peer covering a described region:
    /// the description claims memory the peer never registered.
    #[error("peer {agent} did not register region {region} ([{addr:#x}, +{len}))")]
    NotRegistered {
        /// The peer's agent name.
        agent: String,
        /// Region index.
        region: usize,
        /// Its address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// The peer's memory is of a kind remote pulls do not read.
    #[error("remote pulls read host memory; region {region} is {kind}")]
    UnsupportedMemory {
        /// Region index.
        region: usize,
        /// Its kind, as described.
        kind: String,
    },
    /// The peer is not (or no longer) connected.
    #[error("peer {0} is not connected")]
    UnknownPeer(String),
    /// NIXL refused the peer's metadata or the request.
    #[error("NIXL refused {what}: {detail}")]
    Nixl {
        /// What was refused.
        what: &'static str,
        /// NIXL's error.
        detail: String,
    },
    /// The NIXL runtime is not usable.
    #[error(transparent)]
    Unavailable(#[from] NixlUnavailable),
}

impl From<RemoteError> for TransferError {
    fn from(e: RemoteError) -> Self {
        TransferError::InvalidRequest(e.to_string())
    }
}

/// A NIXL library error as a [`TransferError`].
pub(crate) fn nixl_err(what: &str, e: nixl_sys::NixlError) -> TransferError {
    TransferError::Backend {
        backend: "nixl",
        message: format!("{what}: {e}"),
    }
}
