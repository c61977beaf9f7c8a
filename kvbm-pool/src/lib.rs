//! # kvbm-pool
//!
//! Where logical blocks meet physical memory: per-tier block pools with a
//! registry by sequence hash, eviction policies behind one trait, prefix
//! matching, KV events, and the tier engine that offloads blocks G1→G2→G3,
//! matches a request's prefix across tiers and onboards it back, exposed to
//! an engine's scheduler through the slot API. It builds on kvbm-block for
//! the logical state and kvbm-transfer for moving bytes, and never talks to
//! the network; kvbm-dist spreads it over processes.
