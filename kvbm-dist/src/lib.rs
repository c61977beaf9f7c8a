//! # kvbm-dist
//!
//! kvbm across processes: a leader that owns the logical state (pools and
//! the tier engine from kvbm-pool) and one worker per GPU / tensor-parallel
//! rank that owns physical memory and executes transfers, talking over
//! ZeroMQ; and remote blocks (G4) pulled from peer instances over NIXL. It
//! is the top of the stack and reuses the pool and transfer logic below it
//! rather than duplicating it.
