//! Cache simulators: how many prompt blocks would a cache of a given size,
//! under a given admission and eviction policy, have served?
//!
//! [`replay`](mod@replay) holds the one replay loop and hit-rate definition (prefix
//! contiguous, every block recorded after its lookup). Around it:
//! [`lru::LruSim`] and [`belady::BeladySim`] are the single-cache
//! references that bracket what policy can win; [`tiered`] puts the engine's
//! G1 in front of kvbm's G2/G3 and reports the per-tier split; the policy
//! study's winner lives in [`reuse_score`].

pub mod belady;
pub mod lru;
pub mod recency;
pub mod replay;
pub mod reuse_score;
pub mod tiered;

pub use belady::BeladySim;
pub use lru::{LruSim, TouchOrder};
pub use replay::{CacheSim, ReplayStats, RequestCtx, Tier, capacity_for, replay};
pub use tiered::{KvbmTiers, LruFeed, LruTiers, TierCapacities, TieredSim};
