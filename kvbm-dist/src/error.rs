//! The crate's error type.

use crate::proto::ProtoError;

/// Everything that can go wrong between a leader and its workers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// A frame was refused by the decoder or by a bounds check.
    #[error("protocol: {0}")]
    Protocol(#[from] ProtoError),
    /// A ZeroMQ call failed.
    #[error("zeromq {what}: {source}")]
    Zmq {
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: zmq::Error,
    },
    /// Allocating or moving bytes failed on this side.
    #[error("transfer: {0}")]
    Transfer(#[from] kvbm_transfer::TransferError),
    /// A layout could not be built.
    #[error("layout: {0}")]
    Layout(#[from] kvbm_layout::LayoutError),
    /// A worker's shape differs from rank 0's.
    #[error("rank {rank} disagrees with rank 0: {reason}")]
    ShapeMismatch {
        /// The rank.
        rank: u32,
        /// What differs.
        reason: String,
    },
    /// Two of the instance's processes claimed the same rank.
    #[error("rank {rank} claimed twice (peers \"{first}\" and \"{second}\")")]
    DuplicateRank {
        /// The first claimant's identity, escaped.
        first: String,
        /// The rank.
        rank: u32,
        /// The second claimant's identity, escaped.
        second: String,
    },
    /// Not every rank said Hello (or Ready) in time.
    #[error("{phase} timed out after {waited_ms} ms; missing ranks {missing:?}{}", rejected_note(.rejected))]
    Timeout {
        /// `"hello"` or `"ready"`.
        phase: &'static str,
        /// How long the leader waited.
        waited_ms: u64,
        /// Ranks that did not answer.
        missing: Vec<u32>,
        /// The first few frames refused meanwhile, with why (identities
        /// escaped), and how many more.
        rejected: Vec<String>,
    },
    /// A worker reported an error instead of Ready.
    #[error("rank {rank} failed: {message}")]
    Worker {
        /// The rank.
        rank: u32,
        /// Its error text.
        message: String,
    },
    /// Bad configuration.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A tier's size holds more blocks than a tier can index.
    #[error(
        "{tier:?} of {bytes} bytes is {blocks} blocks of {block_bytes} bytes, more than the \
         {max_blocks} blocks a tier holds: at most {limit} bytes"
    )]
    TierTooLarge {
        /// G2 or G3.
        tier: kvbm_pool::Tier,
        /// The size asked for, over all workers.
        bytes: u64,
        /// Blocks it would hold.
        blocks: u64,
        /// Bytes of one block over all workers.
        block_bytes: u64,
        /// The most blocks a tier holds.
        max_blocks: u64,
        /// The largest size that fits.
        limit: u64,
    },
    /// The leader refused this worker's `Hello`.
    #[error("the leader refused this worker: {0}")]
    Refused(String),
    /// The leader (or the worker's connection to it) is gone.
    #[error("leader gone: {0}")]
    LeaderGone(String),
    /// An I/O error.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A kept G2 or G3 directory is open in another engine.
    #[error("kept directory {0} is in use by another engine (its lock is held)")]
    KeptInUse(std::path::PathBuf),
    /// An I/O error on a named file or directory (a kept tier's).
    #[error("{what}: {source}")]
    File {
        /// What was being done, naming the path.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Verify mode: a block's bytes do not match the checksum recorded
    /// when it was written (`expected: None`: none was recorded).
    #[error("checksum mismatch in {tier:?} slot {slot}: {}", mismatch_note(*.expected, *.found))]
    ChecksumMismatch {
        /// The tier whose slot failed the check.
        tier: kvbm_pool::Tier,
        /// The slot (block id) in that tier.
        slot: u32,
        /// The sum recorded when the slot was written, if one was.
        expected: Option<u64>,
        /// The sum of the bytes found.
        found: u64,
    },
    /// Verify mode: a block's bytes could not be read to be summed.
    #[error("checksum unavailable for {tier:?} slot {slot}: {reason}")]
    ChecksumUnavailable {
        /// The tier.
        tier: kvbm_pool::Tier,
        /// The slot (block id) in that tier.
        slot: u32,
        /// Why the bytes could not be read.
        reason: String,
    },
}

fn mismatch_note(expected: Option<u64>, found: u64) -> String {
    match expected {
        Some(e) => format!("recorded {e:016x}, found {found:016x}"),
        None => format!("no sum recorded (found {found:016x})"),
    }
}

fn rejected_note(rejected: &[String]) -> String {
    if rejected.is_empty() {
        String::new()
    } else {
        format!("; refused meanwhile: {}", rejected.join("; "))
    }
}

impl DistError {
    pub(crate) fn zmq(what: &'static str) -> impl FnOnce(zmq::Error) -> DistError {
        move |source| DistError::Zmq { what, source }
    }
}

/// Shorthand for results in this crate.
pub type Result<T, E = DistError> = std::result::Result<T, E>;
