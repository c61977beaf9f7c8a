//! The tier engine's error type.

use kvbm_transfer::TransferError;

use crate::PoolError;
use crate::tier::RequestId;

/// What a tier-engine call can fail with. Offload never fails towards the
/// engine (a skipped offload is counted, not reported); these errors come
/// from construction, matching and onboarding.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// The configuration or the tier layouts cannot build an engine.
    #[error("invalid tier configuration: {0}")]
    InvalidConfig(String),
    /// A tier's memory does not hold blocks of the engine's KV shape.
    #[error("{what}: {dimension} is {found}, the KV shape says {expected}")]
    ShapeMismatch {
        /// Which memory (e.g. "G1 (the engine's tensors)").
        what: String,
        /// The dimension that differs.
        dimension: &'static str,
        /// The KV shape's value.
        expected: usize,
        /// The memory's value.
        found: usize,
    },
    /// A pool refused to be built or to hand out blocks.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The request id is not known (never matched, or already released).
    #[error("unknown request {0}")]
    UnknownRequest(RequestId),
    /// The request already has an onboard in progress or completed.
    #[error("request {0} is already onboarding")]
    AlreadyOnboarding(RequestId),
    /// The request id is already in use by a live request.
    #[error("request {0} already exists")]
    DuplicateRequest(RequestId),
    /// The engine passed a different number of destination blocks than the
    /// match found.
    #[error("request {request}: {expected} blocks to onboard, {given} destinations given")]
    DestinationMismatch {
        /// The request.
        request: RequestId,
        /// Blocks the match holds for onboarding.
        expected: usize,
        /// Destination blocks passed.
        given: usize,
    },
    /// Copying the request's blocks into G1 failed; nothing of it was
    /// reported loaded and everything it held was released.
    #[error("onboard of request {request} failed: {source}")]
    Onboard {
        /// The request.
        request: RequestId,
        /// The transfer error.
        #[source]
        source: TransferError,
    },
    /// The request was released while its onboard ran.
    #[error("request {0} was released during its onboard")]
    Released(RequestId),
    /// Another request was onboarding the same blocks and failed; this
    /// request holds no loaded block for them.
    #[error("request {0}: a shared onboard of its prefix failed")]
    SharedOnboardFailed(RequestId),
    /// The slot has fewer allocated G1 blocks than the engine committed.
    #[error("request {request}: {committed} blocks committed, {allocated} allocated")]
    NotAllocated {
        /// The request.
        request: RequestId,
        /// Blocks the engine committed.
        committed: usize,
        /// Blocks allocated and not yet committed.
        allocated: usize,
    },
    /// The slot is still onboarding; wait for it first.
    #[error("request {0} is still onboarding")]
    StillOnboarding(RequestId),
    /// Building a memory layout or executor failed.
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// The engine is shutting down.
    #[error("the tier engine is shut down")]
    Shutdown,
}
