//! # kvbm-layout
//!
//! The bottom of the kvbm stack and entirely pure: it describes how the KV
//! cache's fixed-size blocks are laid out in memory (layout configs and
//! layout kinds), computes where each `(block, layer, K/V)` chunk lives,
//! recognises an inference engine's KV tensors as layouts, plans copies
//! between two layouts as a minimal list of contiguous runs, and serialises
//! layout descriptors for peers. It does no I/O, uses no `unsafe` and knows
//! nothing about CUDA; every crate above it executes the plans made here.
