//! # kvbm-layout
//!
//! The bottom of the kvbm stack and entirely pure: it describes how the KV
//! cache's fixed-size blocks are laid out in memory (layout configs and
//! layout kinds), computes where each `(block, layer, K/V)` chunk lives,
//! recognises an inference engine's KV tensors as layouts, plans copies
//! between two layouts as a minimal list of contiguous runs, and serialises
//! layout descriptors for peers. It does no I/O, uses no `unsafe` and knows
//! nothing about CUDA; every crate above it executes the plans made here.
//!
//! Where to start:
//! * [`LayoutConfig`] (the block shape, validated) and [`Layout`] (a kind
//!   plus strides; [`Layout::chunk`] is the address math);
//! * [`recognise_kv_tensors`] turns an engine's tensors (shape, strides,
//!   dtype) into a [`Layout`], refusing what it cannot address exactly;
//! * [`plan_copy`] / [`CopyPlanner`] produce a [`CopyPlan`]: the fewest
//!   contiguous [`CopyRun`]s that move a set of blocks between two layouts;
//! * [`LayoutDescriptor`] is the versioned wire form a peer validates;
//! * with the `proptest` feature, `strategies` generates layouts and copy
//!   cases for the property tests of crates above.
//!
//! ```
//! use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind, plan_copy};
//!
//! // 32 layers, K and V, 16 tokens of 8 heads x 128 bf16 values.
//! let config = LayoutConfig::new(64, 32, 2, 16, 8 * 128, 2)?;
//! let gpu = Layout::new(config, LayoutKind::LayerSeparate(BlockOrder::BlockFirst))?;
//! let host = Layout::new(config.with_alignment(4096)?, LayoutKind::FullyContiguous)?;
//! let plan = plan_copy(&gpu, &host, &[(7, 0), (3, 1)])?;
//! assert_eq!(plan.total_bytes(), 2 * config.block_bytes());
//! assert_eq!(plan.len(), 2 * 32); // one run per block and layer: K and V are adjacent
//! # Ok::<(), kvbm_layout::LayoutError>(())
//! ```
#![forbid(unsafe_code)]

mod config;
mod descriptor;
mod error;
mod layout;
mod plan;
#[cfg(feature = "proptest")]
pub mod strategies;
mod tensor;

pub use config::LayoutConfig;
pub use descriptor::{LAYOUT_DESCRIPTOR_VERSION, LayoutDescriptor};
pub use error::{LayoutError, Result};
pub use layout::{BlockOrder, Chunk, Layout, LayoutKind, LayoutStrides};
pub use plan::{CopyPlan, CopyPlanner, CopyRun, RunOrder, plan_copy, plan_copy_ordered};
pub use tensor::{KvAxis, KvTensorFormat, RecognisedLayout, TensorView, recognise_kv_tensors};
