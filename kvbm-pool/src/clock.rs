//! The release clock: the stamps that order inactive blocks for eviction.
//!
//! Every release stamps the blocks it makes inactive, and eviction takes
//! the smallest stamp among the policy shards' candidates, so stamps must
//! order releases across shards too — releases on different threads go to
//! different shards. A shared counter orders them, but then every release
//! writes one cache line that every releasing thread writes: two threads
//! matching and releasing disjoint prefixes pull that line from each other
//! on every call, a fixed cost that a short prefix cannot amortise.
//!
//! So a stamp is a time instead: the monotonic clock, read once per release
//! call (16 stamps per nanosecond since the pool was made), or one past the
//! shard's previous stamp when that is larger; the other blocks of the
//! same call take the stamps after it. Reading the clock writes nothing
//! shared, so threads releasing at once share no line on the way. The
//! order this gives:
//! - within a shard (one thread; or threads that share a shard, whose
//!   releases are serialised by its lock): strictly increasing, exactly the
//!   release order — what the model-based tests predict;
//! - across shards: the order of the clock reads, so exact for releases
//!   that happen one after the other (the later call reads the clock after
//!   the earlier one did), down to the clock's resolution (a nanosecond on
//!   Linux); releases that overlap in time interleave in clock order.

use std::time::Instant;

/// Stamps per nanosecond: a call's consecutive stamps stay within a
/// nanosecond of its clock read unless it releases more than this many
/// blocks per nanosecond, which no release does.
const STAMPS_PER_NS_SHIFT: u32 = 4;

/// The pool's release clock.
#[derive(Debug)]
pub(crate) struct ReleaseClock {
    epoch: Instant,
}

impl ReleaseClock {
    pub(crate) fn new() -> Self {
        Self {
            epoch: Instant::now(),
        }
    }

    /// The current time in stamps since the pool was made (saturating
    /// after 2^60 ns, some 36 years).
    fn now(&self) -> u64 {
        let ns = self.epoch.elapsed().as_nanos();
        let ns = u64::try_from(ns)
            .unwrap_or(u64::MAX)
            .min(u64::MAX >> STAMPS_PER_NS_SHIFT);
        ns << STAMPS_PER_NS_SHIFT
    }

    /// Stamps for one release call of a shard whose latest stamp is
    /// `last` (updated as stamps are handed out).
    pub(crate) fn call<'a>(&'a self, last: &'a mut u64) -> CallStamps<'a> {
        CallStamps {
            clock: self,
            last,
            read: false,
        }
    }
}

/// The stamps of one release call: the first reads the clock, the rest
/// follow it.
pub(crate) struct CallStamps<'a> {
    clock: &'a ReleaseClock,
    last: &'a mut u64,
    read: bool,
}

impl CallStamps<'_> {
    /// The next stamp: above every stamp this shard handed out before.
    pub(crate) fn next(&mut self) -> u64 {
        let after = self.last.saturating_add(1);
        let stamp = if self.read {
            after
        } else {
            self.read = true;
            self.clock.now().max(after)
        };
        *self.last = stamp;
        stamp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits until the clock has moved on by a microsecond, more than any
    /// platform's clock resolution.
    fn tick(clock: &ReleaseClock) {
        let t = clock.now();
        while clock.now() < t + (1_000 << STAMPS_PER_NS_SHIFT) {
            std::hint::spin_loop();
        }
    }

    #[test]
    fn stamps_rise_within_a_shard_and_follow_time_across_shards() {
        let clock = ReleaseClock::new();
        let (mut a, mut b) = (0u64, 0u64);
        let mut seen = Vec::new();
        for round in 0..100 {
            // Shard `a` releases a batch, then shard `b` a single block,
            // each call after the previous one.
            let mut call = clock.call(&mut a);
            for _ in 0..(round % 7 + 1) {
                seen.push(call.next());
            }
            tick(&clock);
            seen.push(clock.call(&mut b).next());
            tick(&clock);
        }
        // Every stamp is above every earlier one: within a call by
        // construction, across calls (and shards) by the clock.
        assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
        assert!(seen[0] >= 1);
    }

    #[test]
    fn a_shard_keeps_rising_when_the_clock_does_not() {
        let clock = ReleaseClock::new();
        let mut last = 0u64;
        // Many calls within one clock tick: still strictly increasing.
        let stamps: Vec<u64> = (0..1000).map(|_| clock.call(&mut last).next()).collect();
        assert!(stamps.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_shard_ahead_of_the_clock_keeps_rising() {
        let clock = ReleaseClock::new();
        let mut last = u64::MAX - 3;
        let mut call = clock.call(&mut last);
        let s: Vec<u64> = (0..3).map(|_| call.next()).collect();
        assert_eq!(s, [u64::MAX - 2, u64::MAX - 1, u64::MAX]);
    }
}
