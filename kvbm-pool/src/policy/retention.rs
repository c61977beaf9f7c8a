//! Retention hints: what an application knows about a request's future
//! that the cache cannot learn in time.
//!
//! An agent framework knows a tool call is running and the conversation
//! will come back in about `T`; a chat front end knows a conversation was
//! closed. A [`RetentionHint`] says so for one request's blocks, and the
//! tiers act on it:
//!
//! - [`RetentionHint::ReturnsWithin`] *keeps* the blocks until `T × slack`
//!   has passed since the hint was given. While kept, a block due back
//!   within the reuse score's horizon ranks above the blocks its tier's
//!   score keeps for their own sake, by how soon it is due (kept blocks
//!   that return later are evicted before those that return sooner), and
//!   G1 (write-back mode) holds back its eviction when `T` is short. When the protection lapses the block ranks by its
//!   history again, so a wrong `T` costs at most `T × slack` of
//!   residence.
//! - [`RetentionHint::Done`] marks the blocks first to evict and not
//!   worth admitting into a full lower tier. It marks the conversation's own
//!   blocks: from the deepest block toward the root while the use count
//!   grows by at most one per block (each earlier turn carried the blocks
//!   before it once more), so a prefix other traffic shares (a system
//!   prompt) is left alone, and none that another request's hint keeps.
//!   A done hint is acted on only if, when it is given, enough done hints
//!   have not been proven wrong (see
//!   [`UseHistory::done_trusted`](super::UseHistory::done_trusted));
//!   one given while they are not trusted is only kept to be judged, so a
//!   block's rank never changes after its hint.
//!
//! Any later request that carries a block clears its mark: a hint covers
//! the time until the next use. Time is milliseconds of a [`HintClock`]:
//! the wall clock in a live engine, or times the caller sets (a replay's
//! trace timestamps).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvbm_block::SequenceHash;

/// A request's retention hint, for the blocks it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetentionHint {
    /// A follow-up that carries these blocks again is expected within this
    /// time (e.g. a tool call is running).
    ReturnsWithin(Duration),
    /// Nothing will come back for these blocks (the conversation was closed).
    Done,
}

/// The time base of retention hints.
#[derive(Clone, Copy, Debug)]
pub enum HintClock {
    /// Milliseconds since the given instant (a live engine).
    Wall(Instant),
    /// Milliseconds the caller sets (a replay: trace timestamps).
    Manual(u64),
}

impl HintClock {
    /// The current time in milliseconds.
    pub fn now_ms(&self) -> u64 {
        match self {
            HintClock::Wall(epoch) => epoch.elapsed().as_millis() as u64,
            HintClock::Manual(ms) => *ms,
        }
    }
}

/// What a hint left on one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    /// Kept until this time (ms); `until` is the hint's time plus
    /// `T × slack`.
    Keep {
        /// When the block is expected back: the hint's time plus `T`.
        due: u64,
        /// When the protection lapses.
        until: u64,
        /// The hint's `T`, milliseconds.
        within: u64,
    },
    /// First to evict.
    Done,
    /// A done hint given while done hints were not trusted: acted on
    /// nowhere, kept only to learn whether it proves wrong.
    Doubted,
}

/// The marks hints left, per block, with their lapse rule.
#[derive(Debug, Clone)]
pub struct Retentions {
    marks: HashMap<SequenceHash, Mark>,
    slack: f64,
    /// Map size after the last purge of lapsed marks.
    purged_at: usize,
}

impl Retentions {
    /// No marks; protections last `slack` times the hinted time (at
    /// least 1).
    pub fn new(slack: f64) -> Self {
        Self {
            marks: HashMap::new(),
            slack: if slack.is_finite() {
                slack.max(1.0)
            } else {
                1.0
            },
            purged_at: 0,
        }
    }

    /// Whether any block carries a mark.
    pub fn is_empty(&self) -> bool {
        self.marks.is_empty()
    }

    /// Marks kept (lapsed ones included until the next purge).
    pub fn len(&self) -> usize {
        self.marks.len()
    }

    /// The slack factor.
    pub fn slack(&self) -> f64 {
        self.slack
    }

    /// Applies `hint`, given at `now`, to `hashes` (a request's blocks in
    /// prompt order); `uses` tells how many requests carried a block. A
    /// done hint marks its blocks [`Mark::Done`] when `trusted`, else
    /// [`Mark::Doubted`].
    pub fn apply(
        &mut self,
        hashes: &[SequenceHash],
        hint: RetentionHint,
        now: u64,
        trusted: bool,
        uses: impl Fn(SequenceHash) -> u32,
    ) {
        match hint {
            RetentionHint::ReturnsWithin(t) => {
                let within = t.as_millis().min(u128::from(u64::MAX / 4)) as u64;
                let until = now.saturating_add((within as f64 * self.slack).ceil() as u64);
                let due = now.saturating_add(within);
                for &h in hashes {
                    let keep = match self.marks.get(&h) {
                        Some(Mark::Keep { until: u, .. }) if *u >= until => continue,
                        _ => Mark::Keep { due, until, within },
                    };
                    self.marks.insert(h, keep);
                }
            }
            RetentionHint::Done => {
                // From the deepest block toward the root, while the use
                // count grows by at most one a block (each earlier turn of
                // the conversation carried the blocks before it once more); a
                // larger step means other traffic shares the prefix there.
                let mut previous: Option<u32> = None;
                for &h in hashes.iter().rev() {
                    let count = uses(h);
                    if previous.is_some_and(|p| count > p.saturating_add(1)) {
                        break;
                    }
                    previous = Some(count);
                    if self.keep_until(h, now).is_none() {
                        let mark = if trusted { Mark::Done } else { Mark::Doubted };
                        self.marks.insert(h, mark);
                    }
                }
            }
        }
        self.purge(now);
    }

    /// A request carries `hash` again: its mark is spent.
    pub fn used(&mut self, hash: SequenceHash) {
        if !self.marks.is_empty() {
            self.marks.remove(&hash);
        }
    }

    /// When `hash` is due back and when its protection lapses, if a live
    /// hint keeps it at `now`: `(due, until)`.
    pub fn keep_until(&self, hash: SequenceHash, now: u64) -> Option<(u64, u64)> {
        match self.marks.get(&hash) {
            Some(&Mark::Keep { due, until, .. }) if until > now => Some((due, until)),
            _ => None,
        }
    }

    /// The live keep mark of `hash` at `now`: `(until, within)`.
    pub fn keep(&self, hash: SequenceHash, now: u64) -> Option<(u64, u64)> {
        match self.marks.get(&hash) {
            Some(&Mark::Keep { until, within, .. }) if until > now => Some((until, within)),
            _ => None,
        }
    }

    /// Whether `hash` is marked first to evict.
    pub fn is_done(&self, hash: SequenceHash) -> bool {
        matches!(self.marks.get(&hash), Some(Mark::Done))
    }

    /// Whether a done hint, acted on or doubted, names `hash`.
    pub fn said_done(&self, hash: SequenceHash) -> bool {
        matches!(self.marks.get(&hash), Some(Mark::Done | Mark::Doubted))
    }

    /// The mark of `hash`, lapsed or not.
    pub fn get(&self, hash: SequenceHash) -> Option<Mark> {
        self.marks.get(&hash).copied()
    }

    /// Drops lapsed keep marks once the map has doubled since the last
    /// purge (memory stays proportional to the live marks and the blocks
    /// marked done since).
    fn purge(&mut self, now: u64) {
        if self.marks.len() < 1024 || self.marks.len() < 2 * self.purged_at {
            return;
        }
        self.marks.retain(|_, m| match m {
            Mark::Keep { until, .. } => *until > now,
            Mark::Done | Mark::Doubted => true,
        });
        self.purged_at = self.marks.len();
    }

    /// Forgets done marks of blocks `keep` rejects (the history forgot
    /// them), so the map stays bounded.
    pub fn forget_done(&mut self, keep: impl Fn(SequenceHash) -> bool) {
        self.marks
            .retain(|&h, m| !matches!(m, Mark::Done | Mark::Doubted) || keep(h));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Retentions {
        fn apply_trusted(
            &mut self,
            hashes: &[SequenceHash],
            hint: RetentionHint,
            now: u64,
            uses: impl Fn(SequenceHash) -> u32,
        ) {
            self.apply(hashes, hint, now, true, uses);
        }
    }

    fn h(x: u64) -> SequenceHash {
        SequenceHash(x)
    }

    #[test]
    fn keep_lapses_after_slack_times_the_hint() {
        let mut r = Retentions::new(2.0);
        r.apply_trusted(
            &[h(1), h(2)],
            RetentionHint::ReturnsWithin(Duration::from_secs(10)),
            1_000,
            |_| 1,
        );
        assert_eq!(r.keep_until(h(1), 1_000), Some((11_000, 21_000)));
        assert_eq!(r.keep_until(h(2), 20_999), Some((11_000, 21_000)));
        assert_eq!(r.keep_until(h(2), 21_000), None);
        r.used(h(1));
        assert_eq!(r.keep_until(h(1), 1_000), None);
    }

    #[test]
    fn done_spares_shared_and_kept_blocks() {
        let mut r = Retentions::new(2.0);
        // Block 7 is kept by another request's hint.
        r.apply_trusted(
            &[h(7)],
            RetentionHint::ReturnsWithin(Duration::from_secs(5)),
            0,
            |_| 1,
        );
        // Block 1 is a shared prefix (9 uses); 2, 7, 3 and 4 are this
        // conversation's own (3, 2, 2 and 1 uses: one turn more each).
        let uses = |x: SequenceHash| match x.0 {
            1 => 9,
            2 => 3,
            4 => 1,
            _ => 2,
        };
        r.apply_trusted(
            &[h(1), h(2), h(7), h(3), h(4)],
            RetentionHint::Done,
            100,
            uses,
        );
        assert!(!r.is_done(h(1)));
        assert!(r.is_done(h(2)) && r.is_done(h(3)) && r.is_done(h(4)));
        assert!(!r.is_done(h(7)));
        assert!(r.keep_until(h(7), 100).is_some());
    }
}
