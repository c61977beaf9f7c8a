//! How a worker decides its leader is gone: silence past a limit (the
//! leader timeout until configured, then a few heartbeats), or a dropped
//! connection, each with a grace period to read what is still on its way.

use std::time::{Duration, Instant};

use super::{HEARTBEAT_MISSES, WorkerConfig};

/// How often the loop looks at the clock when nothing arrives (at most).
const TICK: Duration = Duration::from_millis(200);
/// The shortest silence a configured worker tolerates.
const MIN_SILENCE: Duration = Duration::from_secs(1);
/// How long a worker whose connection to the leader dropped still reads
/// what arrived before (a `Shutdown`) before it exits.
const DISCONNECT_GRACE: Duration = Duration::from_millis(300);

/// How long the leader may stay silent: the leader timeout until the
/// worker is configured, then [`HEARTBEAT_MISSES`] heartbeats.
fn silence_limit(leader_timeout: Duration, heartbeat_ms: Option<u32>) -> Duration {
    match heartbeat_ms {
        None => leader_timeout,
        Some(ms) => (Duration::from_millis(u64::from(ms)) * HEARTBEAT_MISSES)
            .max(MIN_SILENCE)
            .min(leader_timeout),
    }
}

/// What to add to "the leader is gone" when nothing was ever heard over
/// CURVE: a leader of another secret looks exactly like no leader.
fn curve_hint(curve: bool, last_heard: Option<Instant>) -> &'static str {
    if curve && last_heard.is_none() {
        "; the CURVE handshake never completed: is the instance secret the leader's?"
    } else {
        ""
    }
}

/// What a worker knows of its leader's liveness.
pub(super) struct LeaderWatch {
    /// When the worker started: silence counts from here until a frame.
    started: Instant,
    /// When the last frame from the leader arrived.
    last_heard: Option<Instant>,
    /// When the silence limit was first seen passed: the socket gets one
    /// more grace period to deliver what is already on its way.
    silence_grace: Option<Instant>,
    /// The heartbeat interval the leader's `Configure` set, once it came.
    heartbeat_ms: Option<u32>,
    /// When the connection to the leader was first seen dropped.
    disconnected: Option<Instant>,
}

impl LeaderWatch {
    /// Watching from `started`, nothing heard yet.
    pub(super) fn new(started: Instant) -> Self {
        LeaderWatch {
            started,
            last_heard: None,
            silence_grace: None,
            heartbeat_ms: None,
            disconnected: None,
        }
    }

    /// How long the leader may stay silent now (see [`silence_limit`]).
    pub(super) fn silence_limit(&self, leader_timeout: Duration) -> Duration {
        silence_limit(leader_timeout, self.heartbeat_ms)
    }

    /// How long one poll may wait: the tick, shortened to the heartbeat
    /// interval once there is one.
    pub(super) fn tick(&self) -> Duration {
        self.heartbeat_ms.map_or(TICK, |ms| {
            TICK.min(Duration::from_millis(u64::from(ms.max(10))))
        })
    }

    /// Notes that the connection to the leader dropped (the first time
    /// counts).
    pub(super) fn disconnected(&mut self) {
        if self.disconnected.is_none() {
            self.disconnected = Some(Instant::now());
        }
    }

    /// Notes a frame from the leader: it is not silent.
    pub(super) fn heard(&mut self) {
        self.last_heard = Some(Instant::now());
        self.silence_grace = None;
    }

    /// Whether the leader's `Configure` came (and with it a heartbeat).
    pub(super) fn configured(&self) -> bool {
        self.heartbeat_ms.is_some()
    }

    /// Notes the heartbeat interval a `Configure` set.
    pub(super) fn set_heartbeat(&mut self, ms: u32) {
        self.heartbeat_ms = Some(ms);
    }

    /// Why the worker gives its leader up, when it does: the connection
    /// dropped a grace period ago, or the leader has been silent past
    /// `limit` and one more grace period.
    pub(super) fn gone(
        &mut self,
        limit: Duration,
        config: &WorkerConfig,
        curve: bool,
    ) -> Option<String> {
        if let Some(t) = self.disconnected
            && t.elapsed() > DISCONNECT_GRACE
        {
            return Some(format!(
                "the connection to the leader at {} closed{}",
                config.endpoint,
                curve_hint(curve, self.last_heard)
            ));
        }
        let silent = self.last_heard.unwrap_or(self.started).elapsed();
        if silent <= limit {
            return None;
        }
        // A process that was stopped or descheduled wakes up with its
        // leader's frames still on their way from the kernel to the
        // socket (a `Shutdown` among them): read for one grace period
        // before calling the leader gone.
        let deadline = *self
            .silence_grace
            .get_or_insert_with(|| Instant::now() + DISCONNECT_GRACE);
        if Instant::now() < deadline {
            return None;
        }
        Some(match (self.last_heard, self.heartbeat_ms) {
            (None, _) => format!(
                "no answer from the leader at {} within {:?} (leader timeout){}",
                config.endpoint,
                config.leader_timeout,
                curve_hint(curve, None)
            ),
            (Some(_), None) => format!(
                "the leader at {} fell silent during the handshake for {silent:?} (leader timeout {:?})",
                config.endpoint, config.leader_timeout
            ),
            (Some(_), Some(ms)) => format!(
                "no heartbeat from the leader at {} for {silent:?} (pinged every {ms} ms)",
                config.endpoint
            ),
        })
    }
}
