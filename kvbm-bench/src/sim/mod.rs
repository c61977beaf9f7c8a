//! Cache simulators: how many prompt blocks would a cache of a given size,
//! under a given admission and eviction policy, have served?
//!
//! [`replay`](mod@replay) holds the one replay loop and hit-rate definition (prefix
//! contiguous, every block recorded after its lookup). Around it:
//! [`lru::LruSim`] and [`belady::BeladySim`] are the single-cache
//! references that bracket what policy can win; [`tiered`] puts the engine's
//! G1 in front of kvbm's G2/G3 and reports the per-tier split; the policy
//! study's winner lives in [`reuse_score`].
//!
//! The bound studies: [`trace_index`] computes every use's past and future
//! once; [`scored_tiers`] runs G2/G3 under any per-block ranking
//! ([`hindsight`]: calibrated in hindsight; [`online`]: learned as it goes;
//! recency; the oracle); [`arc`] is adaptive replacement as kvbm's G2;
//! [`gaps`] files hits by reuse gap.

pub mod arc;
pub mod belady;
pub mod gaps;
pub mod hindsight;
pub mod lru;
pub mod online;
pub mod recency;
pub mod replay;
pub mod reuse_score;
pub mod scored_tiers;
pub mod tiered;
pub mod trace_index;

pub use belady::BeladySim;
pub use lru::{LruSim, TouchOrder};
pub use replay::{CacheSim, ReplayStats, RequestCtx, Tier, capacity_for, replay};
pub use tiered::{G1Keeps, KvbmTiers, LruFeed, LruTiers, TierCapacities, TieredSim};
