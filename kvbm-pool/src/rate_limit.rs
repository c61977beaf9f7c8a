//! Warnings that can repeat by the thousand (every failed copy of a disk
//! that filled up, every refused frame) are printed at most once per
//! interval; the next one printed says how many were held back meanwhile.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How often a rate-limited warning prints at most, by default.
pub const WARN_EVERY: Duration = Duration::from_secs(5);

/// One kind of warning's allowance: at most one line per interval.
///
/// ```
/// use kvbm_pool::rate_limit::{RateLimit, WARN_EVERY};
/// static COPY_FAILED: RateLimit = RateLimit::new(WARN_EVERY);
/// if let Some(held_back) = COPY_FAILED.check() {
///     eprintln!("a copy failed ({held_back} more such warnings held back)");
/// }
/// ```
#[derive(Debug)]
pub struct RateLimit {
    every: Duration,
    /// When a line last printed, and the lines held back since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl RateLimit {
    /// An allowance of one line every `every`.
    pub const fn new(every: Duration) -> Self {
        RateLimit {
            every,
            state: parking_lot::const_mutex((None, 0)),
        }
    }

    /// Whether a warning may print now: `Some(n)`, `n` being the warnings
    /// held back since the last one printed, or `None` (then this one is
    /// counted as held back).
    pub fn check(&self) -> Option<u64> {
        self.check_at(Instant::now())
    }

    /// [`check`](Self::check) at the time `now`.
    pub fn check_at(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock();
        if state
            .0
            .is_some_and(|last| now.saturating_duration_since(last) < self.every)
        {
            state.1 += 1;
            return None;
        }
        state.0 = Some(now);
        Some(std::mem::take(&mut state.1))
    }
}

impl Default for RateLimit {
    /// One line every [`WARN_EVERY`].
    fn default() -> Self {
        RateLimit::new(WARN_EVERY)
    }
}

/// `"; N more since the last warning"` for `held_back` > 0, else nothing:
/// the tail of a rate-limited warning.
pub fn held_back_note(held_back: u64) -> String {
    if held_back == 0 {
        String::new()
    } else {
        format!("; {held_back} more like it since the last warning")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_and_the_next_counts_the_rest() {
        let limit = RateLimit::new(Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(limit.check_at(t0), Some(0));
        for ms in [1, 100, 4_999] {
            assert_eq!(limit.check_at(t0 + Duration::from_millis(ms)), None);
        }
        let t1 = t0 + Duration::from_secs(5);
        assert_eq!(limit.check_at(t1), Some(3));
        assert_eq!(limit.check_at(t1 + Duration::from_secs(1)), None);
        assert_eq!(limit.check_at(t1 + Duration::from_secs(60)), Some(1));
        assert_eq!(held_back_note(0), "");
        assert_eq!(held_back_note(3), "; 3 more like it since the last warning");
    }
}
