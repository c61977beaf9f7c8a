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
//! So a stamp is a time instead: the CPU's counter (`quanta::Clock::raw`:
//! the TSC on x86-64, the system counter on AArch64, the OS monotonic clock
//! where neither is usable), read once per release call, 16 stamps per tick
//! since the pool was made, or one past the shard's previous stamp when
//! that is larger; the other blocks of the same call take the stamps after
//! it. Reading the counter writes nothing shared, so threads releasing at
//! once share no line on the way. The order this gives:
//! - within a shard (one thread; or threads that share a shard, whose
//!   releases are serialised by its lock): strictly increasing, exactly the
//!   release order — what the model-based tests predict;
//! - across shards: the order of the counter reads, so exact for releases
//!   that happen one after the other (the later call reads the counter
//!   after the earlier one did), down to the counter's resolution (a tick:
//!   well under a nanosecond for the TSC); releases that overlap in time
//!   interleave in counter order.
//!
//! Why the raw counter and not `std::time::Instant`: `Instant::now()` goes
//! through the vDSO (its data lines, and a fence before the counter read),
//! several times the cost of a raw read in a tight loop and more inside
//! the pool's cache-hungry match + release loop, which a lone thread then
//! pays on every call; the raw counter read is one instruction and touches
//! no memory. It relies on the counter
//! being synchronised across cores, as every modern x86-64 and AArch64
//! system's is (quanta checks for an invariant TSC and otherwise falls back
//! to the OS clock); were it not, only the cross-shard order would blur.
//! The counter's rate is calibrated once per process (a few milliseconds,
//! at most 200) the first time a pool is made.

/// Stamps per counter tick (as a shift): a call's consecutive stamps stay
/// within a tick of its counter read unless it releases more than 16
/// blocks per tick, which no release does (a tick is at most a nanosecond
/// or so; releasing a block takes several).
const STAMPS_PER_TICK_SHIFT: u32 = 4;

/// The pool's release clock.
#[derive(Debug)]
pub(crate) struct ReleaseClock {
    clock: quanta::Clock,
    epoch: u64,
}

impl ReleaseClock {
    pub(crate) fn new() -> Self {
        let clock = quanta::Clock::new();
        let epoch = clock.raw();
        Self { clock, epoch }
    }

    /// The current time in stamps since the pool was made (saturating
    /// after 2^60 ticks: a decade at 3 GHz; from then on only the order
    /// within a shard holds).
    fn now(&self) -> u64 {
        let ticks = self
            .clock
            .raw()
            .saturating_sub(self.epoch)
            .min(u64::MAX >> STAMPS_PER_TICK_SHIFT);
        ticks << STAMPS_PER_TICK_SHIFT
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

    /// Waits until the counter has moved on by 1,000 ticks, far more than
    /// its resolution.
    fn tick(clock: &ReleaseClock) {
        let t = clock.now();
        while clock.now() < t + (1_000 << STAMPS_PER_TICK_SHIFT) {
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
