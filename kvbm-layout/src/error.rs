//! The one error type of this crate.
//!
//! Everything here works on caller-provided numbers (configs, indices, engine
//! tensor shapes, bytes from a peer), so every bad input becomes a
//! [`LayoutError`] value; nothing in this crate panics on input.

use thiserror::Error;

/// Every way a layout operation can refuse its input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A dimension of the config is zero.
    #[error("{name} must be at least 1, got 0")]
    ZeroDimension {
        /// Which dimension (`num_blocks`, `num_layers`, `page_size`, ...).
        name: &'static str,
    },
    /// `outer_dim` is neither 1 (MLA) nor 2 (K and V).
    #[error("outer_dim must be 1 (MLA) or 2 (K and V), got {0}")]
    InvalidOuterDim(usize),
    /// `dtype_bytes` is not the size of a supported element type.
    #[error("dtype_bytes must be 1, 2, 4 or 8, got {0}")]
    InvalidDtypeBytes(usize),
    /// The alignment is zero or not a power of two.
    #[error("alignment must be a power of two, got {0}")]
    InvalidAlignment(u64),
    /// A size computed from the config does not fit `u64` (or `usize`).
    #[error("{what} overflows the address space")]
    SizeOverflow {
        /// Which quantity overflowed.
        what: &'static str,
    },
    /// More regions than a transfer engine can address (regions are `u32`).
    #[error("{0} regions do not fit a u32 region index")]
    TooManyRegions(usize),
    /// A block index is outside the layout.
    #[error("block {index} out of range (layout has {count} blocks)")]
    BlockOutOfRange {
        /// The index asked for.
        index: usize,
        /// How many blocks the layout has.
        count: usize,
    },
    /// A layer index is outside the layout.
    #[error("layer {index} out of range (layout has {count} layers)")]
    LayerOutOfRange {
        /// The index asked for.
        index: usize,
        /// How many layers the layout has.
        count: usize,
    },
    /// An outer (K/V) index is outside the layout.
    #[error("outer index {index} out of range (outer_dim is {count})")]
    OuterOutOfRange {
        /// The index asked for.
        index: usize,
        /// The layout's `outer_dim`.
        count: usize,
    },
    /// A region index is outside the layout.
    #[error("region {index} out of range (layout has {count} regions)")]
    RegionOutOfRange {
        /// The index asked for.
        index: usize,
        /// How many regions the layout has.
        count: usize,
    },
    /// Explicit strides would make chunks overlap or contradict the kind.
    #[error("invalid strides: {reason}")]
    InvalidStrides {
        /// What is wrong and what was expected.
        reason: String,
    },
    /// Two layouts in one copy plan do not have the same block shape.
    #[error("block shapes differ: source {field} = {src}, destination {field} = {dst}")]
    ShapeMismatch {
        /// The config field that differs.
        field: &'static str,
        /// Its value in the source layout.
        src: u64,
        /// Its value in the destination layout.
        dst: u64,
    },
    /// The same destination block appears twice in one plan (two writers).
    #[error("destination block {0} appears more than once in the copy plan")]
    DuplicateDestination(usize),
    /// An engine tensor does not match the expected form.
    #[error("unsupported KV tensor: {reason}")]
    UnsupportedTensor {
        /// What was expected and what was found.
        reason: String,
    },
    /// A serialised descriptor could not be decoded.
    #[error("malformed layout descriptor: {0}")]
    MalformedDescriptor(String),
    /// A descriptor has a version this build does not understand.
    #[error("unsupported layout descriptor version {found} (this build reads {supported})")]
    UnsupportedDescriptorVersion {
        /// The version in the descriptor.
        found: u32,
        /// The version this build reads and writes.
        supported: u32,
    },
    /// A descriptor's recorded facts disagree with the layout it describes.
    #[error("layout descriptor is inconsistent: {0}")]
    InconsistentDescriptor(String),
}

/// Shorthand for results of this crate.
pub type Result<T, E = LayoutError> = std::result::Result<T, E>;
