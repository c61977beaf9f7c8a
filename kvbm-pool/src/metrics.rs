//! The tier engine's metrics: counters kept in the engine (read back with
//! [`TierEngine::stats`](crate::tier::TierEngine::stats)) and mirrored to
//! the `metrics` crate facade, so any recorder the application installs
//! (Prometheus with the `prometheus` feature) sees them.
//!
//! Names (all prefixed `kvbm_`): `offload_blocks_total{path}`,
//! `offload_bytes_total{path}`, `offload_skipped_total{reason}` (policy
//! decisions only), `copy_failures_total{path,errno}` (blocks whose copy
//! failed, offload and onboard paths alike, by OS error: `ENOSPC`, `EIO`,
//! ..., `other` where the failure carried none),
//! `onboard_blocks_total{path}`, `onboard_bytes_total{path}`,
//! `onboard_failures_total` (requests), `transfer_seconds{path}` (histogram),
//! `offload_queue_depth` and `onboards_in_flight` (gauges),
//! `hit_rate{tier}` (gauge, percent of prompt blocks over the last
//! [`HIT_WINDOW`] matched requests), and for a G3 kept across restarts
//! `g3_recovered_blocks_total` (found again at start),
//! `g3_rejected_blocks_total` (left out at start: a record that was torn or
//! damaged, or a block not every rank held) and `g3_unreadable_blocks_total`
//! (blocks whose read failed, for a checksum or the disk; not read again
//! until rewritten); for a G2 kept across restarts `g2_recovered_blocks_total`
//! and `g2_rejected_blocks_total`.

use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::config::Tier;

use kvbm_transfer::TransferError;
use parking_lot::Mutex;

/// Requests in the hit-rate window.
pub const HIT_WINDOW: usize = 1024;

/// A copy path between tiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Path {
    /// G1 → G2 (offload).
    G1ToG2,
    /// G2 → G3 (offload of G2's victims).
    G2ToG3,
    /// G2 → G1 (onboard).
    G2ToG1,
    /// G3 → G1 (onboard).
    G3ToG1,
    /// G1 → G3 (write-back: a G1 victim G2 refused, offered to G3).
    G1ToG3,
}

impl Path {
    /// The label used in metric names.
    pub fn label(self) -> &'static str {
        match self {
            Path::G1ToG2 => "g1_g2",
            Path::G2ToG3 => "g2_g3",
            Path::G2ToG1 => "g2_g1",
            Path::G3ToG1 => "g3_g1",
            Path::G1ToG3 => "g1_g3",
        }
    }

    /// Whether the path moves blocks away from G1 (offload) rather than
    /// into it (onboard).
    pub fn is_offload(self) -> bool {
        matches!(self, Path::G1ToG2 | Path::G2ToG3 | Path::G1ToG3)
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Why an offload did not happen though nothing went wrong: a decision of
/// the engine or its policies. Copies that failed are not skips; they are
/// counted apart, by path and cause ([`TierStats::copy_failures`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// The target tier already holds the block.
    Present,
    /// The source block was freed before its copy started (cancelled).
    SourceGone,
    /// The admission policy turned it down.
    NotAdmitted,
    /// The target tier had no free or evictable block.
    TierFull,
    /// The offload queue was full.
    QueueFull,
    /// The engine has no such tier.
    NoTier,
}

impl SkipReason {
    /// The label used in metric names.
    pub fn label(self) -> &'static str {
        match self {
            SkipReason::Present => "present",
            SkipReason::SourceGone => "source_gone",
            SkipReason::NotAdmitted => "not_admitted",
            SkipReason::TierFull => "tier_full",
            SkipReason::QueueFull => "queue_full",
            SkipReason::NoTier => "no_tier",
        }
    }
}

/// What made a copy fail: the OS error behind it where there was one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailureCause {
    /// An OS error number (`libc::ENOSPC`, `libc::EIO`, ...) from the
    /// system call that failed.
    Errno(i32),
    /// A failure that carried no OS error: a backend error, a lost worker,
    /// a block the engine could not register.
    Other,
}

impl FailureCause {
    /// The cause of `error`: its OS error number where it has one.
    pub fn of(error: &TransferError) -> Self {
        error
            .os_error()
            .map_or(FailureCause::Other, FailureCause::Errno)
    }

    /// The label used in metric names and reports: the errno's symbolic
    /// name (`ENOSPC`), `errno_<n>` for one without a known name, `other`.
    pub fn label(self) -> Cow<'static, str> {
        match self {
            FailureCause::Errno(n) => match errno_name(n) {
                Some(name) => Cow::Borrowed(name),
                None => Cow::Owned(format!("errno_{n}")),
            },
            FailureCause::Other => Cow::Borrowed("other"),
        }
    }
}

impl std::fmt::Display for FailureCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label())
    }
}

/// The symbolic names of the errors a copy between memory and files can
/// meet.
fn errno_name(n: i32) -> Option<&'static str> {
    const NAMES: &[(i32, &str)] = &[
        (libc::ENOSPC, "ENOSPC"),
        (libc::EDQUOT, "EDQUOT"),
        (libc::EIO, "EIO"),
        (libc::EROFS, "EROFS"),
        (libc::EFBIG, "EFBIG"),
        (libc::ENODEV, "ENODEV"),
        (libc::ENXIO, "ENXIO"),
        (libc::ESTALE, "ESTALE"),
        (libc::EBADF, "EBADF"),
        (libc::EINVAL, "EINVAL"),
        (libc::EFAULT, "EFAULT"),
        (libc::ENOMEM, "ENOMEM"),
        (libc::EAGAIN, "EAGAIN"),
        (libc::EINTR, "EINTR"),
        (libc::EBUSY, "EBUSY"),
        (libc::EPERM, "EPERM"),
        (libc::EACCES, "EACCES"),
        (libc::ENOENT, "ENOENT"),
        (libc::EMFILE, "EMFILE"),
        (libc::ENFILE, "ENFILE"),
        (libc::EPIPE, "EPIPE"),
        (libc::ETIMEDOUT, "ETIMEDOUT"),
        (libc::ECANCELED, "ECANCELED"),
        (libc::EOPNOTSUPP, "EOPNOTSUPP"),
        (libc::ENOSYS, "ENOSYS"),
    ];
    NAMES.iter().find(|(e, _)| *e == n).map(|(_, name)| *name)
}

/// Blocks whose copy failed on one path for one cause. Nothing of them was
/// registered: a failed offload leaves the block where it was, a failed
/// onboard fails its request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyFailures {
    /// The copy path.
    pub path: Path,
    /// What made the copies fail.
    pub cause: FailureCause,
    /// Blocks that did not land.
    pub blocks: u64,
}

/// A snapshot of the engine's counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TierStats {
    /// Blocks copied per path, indexed like [`Path`] (G1→G2, G2→G3,
    /// G2→G1, G3→G1, G1→G3).
    pub blocks: [u64; 5],
    /// Bytes copied per path.
    pub bytes: [u64; 5],
    /// Copies (batches) per path: each covers one or more blocks.
    pub transfers: [u64; 5],
    /// Time the copies of each path took, summed, in nanoseconds
    /// (`transfer_nanos / transfers` is a path's mean copy latency).
    pub transfer_nanos: [u64; 5],
    /// Offloads skipped per reason, in [`SkipReason`] order (decisions
    /// only: failed copies are in [`TierStats::copy_failures`]).
    pub skipped: [u64; 6],
    /// Blocks whose copy failed, per path and cause, sorted by path then
    /// cause; only pairs that failed at least once appear.
    pub copy_failures: Vec<CopyFailures>,
    /// Onboard requests that failed (their own copy failed, or a shared
    /// onboard they waited on did).
    pub onboard_failures: u64,
    /// Requests matched.
    pub requests: u64,
    /// Prompt blocks looked up by matches.
    pub lookups: u64,
    /// Blocks found per tier (G1, G2, G3) by matches, before the
    /// full-prompt give-back.
    pub hits: [u64; 3],
    /// Blocks currently waiting in the offload queue.
    pub queue_depth: u64,
    /// G3 blocks found again at start (a G3 kept across restarts).
    pub g3_recovered: u64,
    /// G3 blocks left out at start: torn or damaged records, blocks not
    /// every rank held, slots G3 no longer has.
    pub g3_rejected: u64,
    /// G3 blocks whose read failed (checksum or disk), not read again
    /// until written again.
    pub g3_unreadable: u64,
    /// G2 blocks found again at start (a G2 kept across restarts).
    pub g2_recovered: u64,
    /// G2 blocks left out at start, as for G3.
    pub g2_rejected: u64,
}

impl TierStats {
    /// Blocks copied on `path`.
    pub fn blocks_on(&self, path: Path) -> u64 {
        self.blocks[path.index()]
    }

    /// Offloads skipped for `reason`.
    pub fn skipped_for(&self, reason: SkipReason) -> u64 {
        self.skipped[reason as usize]
    }

    /// Blocks whose copy on `path` failed, all causes together.
    pub fn failed_on(&self, path: Path) -> u64 {
        self.copy_failures
            .iter()
            .filter(|f| f.path == path)
            .map(|f| f.blocks)
            .sum()
    }

    /// Blocks whose copy on `path` failed for `cause`.
    pub fn failed_for(&self, path: Path, cause: FailureCause) -> u64 {
        self.copy_failures
            .iter()
            .filter(|f| f.path == path && f.cause == cause)
            .map(|f| f.blocks)
            .sum()
    }

    /// Blocks whose offload copy failed (G1 → G2, G2 → G3, G1 → G3).
    pub fn offload_copy_failures(&self) -> u64 {
        self.copy_failures
            .iter()
            .filter(|f| f.path.is_offload())
            .map(|f| f.blocks)
            .sum()
    }

    /// Blocks whose onboard copy failed (G2 → G1, G3 → G1).
    pub fn onboard_copy_failures(&self) -> u64 {
        self.copy_failures
            .iter()
            .filter(|f| !f.path.is_offload())
            .map(|f| f.blocks)
            .sum()
    }

    /// Mean latency of one copy on `path`, `None` before the first.
    pub fn mean_transfer(&self, path: Path) -> Option<Duration> {
        let n = self.transfers[path.index()];
        (n > 0).then(|| Duration::from_nanos(self.transfer_nanos[path.index()] / n))
    }
}

/// The counters.
#[derive(Debug, Default)]
pub(crate) struct EngineMetrics {
    blocks: [AtomicU64; 5],
    bytes: [AtomicU64; 5],
    transfers: [AtomicU64; 5],
    transfer_nanos: [AtomicU64; 5],
    skipped: [AtomicU64; 6],
    failures: Mutex<BTreeMap<(Path, FailureCause), u64>>,
    onboard_failures: AtomicU64,
    requests: AtomicU64,
    lookups: AtomicU64,
    hits: [AtomicU64; 3],
    queue_depth: AtomicU64,
    window: Mutex<HitWindow>,
    /// Blocks registered in G3 before their write landed (write-behind).
    registered_ahead: AtomicU64,
    g3_recovered: AtomicU64,
    g3_rejected: AtomicU64,
    g2_recovered: AtomicU64,
    g2_rejected: AtomicU64,
    g3_unreadable: AtomicU64,
}

#[derive(Debug, Default)]
struct HitWindow {
    entries: VecDeque<[u64; 4]>,
    sums: [u64; 4],
}

impl EngineMetrics {
    pub(crate) fn copied(&self, path: Path, blocks: u64, bytes: u64, took: Duration) {
        self.blocks[path.index()].fetch_add(blocks, Relaxed);
        self.bytes[path.index()].fetch_add(bytes, Relaxed);
        self.transfers[path.index()].fetch_add(1, Relaxed);
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.transfer_nanos[path.index()].fetch_add(nanos, Relaxed);
        let label = path.label();
        if path.is_offload() {
            metrics::counter!("kvbm_offload_blocks_total", "path" => label).increment(blocks);
            metrics::counter!("kvbm_offload_bytes_total", "path" => label).increment(bytes);
        } else {
            metrics::counter!("kvbm_onboard_blocks_total", "path" => label).increment(blocks);
            metrics::counter!("kvbm_onboard_bytes_total", "path" => label).increment(bytes);
        }
        metrics::histogram!("kvbm_transfer_seconds", "path" => label).record(took.as_secs_f64());
    }

    pub(crate) fn skipped(&self, reason: SkipReason, n: u64) {
        if n == 0 {
            return;
        }
        self.skipped[reason as usize].fetch_add(n, Relaxed);
        metrics::counter!("kvbm_offload_skipped_total", "reason" => reason.label()).increment(n);
    }

    /// `blocks` blocks whose copy on `path` failed for `cause`.
    pub(crate) fn copy_failed(&self, path: Path, cause: FailureCause, blocks: u64) {
        if blocks == 0 {
            return;
        }
        *self.failures.lock().entry((path, cause)).or_default() += blocks;
        metrics::counter!(
            "kvbm_copy_failures_total",
            "path" => path.label(),
            "errno" => cause.label(),
        )
        .increment(blocks);
    }

    /// A kept G2 or G3 (`tier`) gave back `recovered` blocks at start and
    /// left out `rejected`.
    pub(crate) fn reopened(&self, tier: Tier, recovered: u64, rejected: u64) {
        if tier == Tier::G2 {
            self.g2_recovered.fetch_add(recovered, Relaxed);
            self.g2_rejected.fetch_add(rejected, Relaxed);
            metrics::counter!("kvbm_g2_recovered_blocks_total").increment(recovered);
            metrics::counter!("kvbm_g2_rejected_blocks_total").increment(rejected);
        } else {
            self.g3_recovered.fetch_add(recovered, Relaxed);
            self.g3_rejected.fetch_add(rejected, Relaxed);
            metrics::counter!("kvbm_g3_recovered_blocks_total").increment(recovered);
            metrics::counter!("kvbm_g3_rejected_blocks_total").increment(rejected);
        }
    }

    /// `blocks` G3 blocks could not be read back.
    pub(crate) fn g3_unreadable(&self, blocks: u64) {
        self.g3_unreadable.fetch_add(blocks, Relaxed);
        metrics::counter!("kvbm_g3_unreadable_blocks_total").increment(blocks);
    }

    pub(crate) fn onboard_failed(&self) {
        self.onboard_failures.fetch_add(1, Relaxed);
        metrics::counter!("kvbm_onboard_failures_total").increment(1);
    }

    pub(crate) fn queue_depth(&self, depth: usize) {
        self.queue_depth.store(depth as u64, Relaxed);
        metrics::gauge!("kvbm_offload_queue_depth").set(depth as f64);
    }

    pub(crate) fn onboards_in_flight(&self, n: usize) {
        metrics::gauge!("kvbm_onboards_in_flight").set(n as f64);
    }

    /// One matched request: `lookups` prompt blocks, `hits` per tier.
    pub(crate) fn matched(&self, lookups: u64, hits: [u64; 3]) {
        self.requests.fetch_add(1, Relaxed);
        self.lookups.fetch_add(lookups, Relaxed);
        for (c, h) in self.hits.iter().zip(hits) {
            c.fetch_add(h, Relaxed);
        }
        let entry = [lookups, hits[0], hits[1], hits[2]];
        let mut w = self.window.lock();
        w.entries.push_back(entry);
        for (s, v) in w.sums.iter_mut().zip(entry) {
            *s += v;
        }
        if w.entries.len() > HIT_WINDOW
            && let Some(old) = w.entries.pop_front()
        {
            for (s, v) in w.sums.iter_mut().zip(old) {
                *s -= v;
            }
        }
        let sums = w.sums;
        drop(w);
        if sums[0] > 0 {
            for (tier, hits) in [("g1", sums[1]), ("g2", sums[2]), ("g3", sums[3])] {
                metrics::gauge!("kvbm_hit_rate", "tier" => tier)
                    .set(100.0 * hits as f64 / sums[0] as f64);
            }
        }
    }

    /// Blocks stored into G2 or G3 so far (counted after they were
    /// registered there): it changes whenever a match could find more.
    pub(crate) fn stored(&self) -> u64 {
        [Path::G1ToG2, Path::G2ToG3, Path::G1ToG3]
            .into_iter()
            .map(|p| self.blocks[p.index()].load(Relaxed))
            .sum::<u64>()
            + self.registered_ahead.load(Relaxed)
    }

    /// `blocks` blocks registered in G3 ahead of their write (matches find
    /// them from now on; their bytes are counted when the write lands).
    pub(crate) fn registered_ahead(&self, blocks: u64) {
        self.registered_ahead.fetch_add(blocks, Relaxed);
    }

    pub(crate) fn snapshot(&self) -> TierStats {
        let load = |a: &[AtomicU64]| -> Vec<u64> { a.iter().map(|x| x.load(Relaxed)).collect() };
        let mut s = TierStats::default();
        s.blocks.copy_from_slice(&load(&self.blocks));
        s.bytes.copy_from_slice(&load(&self.bytes));
        s.transfers.copy_from_slice(&load(&self.transfers));
        s.transfer_nanos
            .copy_from_slice(&load(&self.transfer_nanos));
        s.skipped.copy_from_slice(&load(&self.skipped));
        s.copy_failures = self
            .failures
            .lock()
            .iter()
            .map(|(&(path, cause), &blocks)| CopyFailures {
                path,
                cause,
                blocks,
            })
            .collect();
        s.hits.copy_from_slice(&load(&self.hits));
        s.onboard_failures = self.onboard_failures.load(Relaxed);
        s.requests = self.requests.load(Relaxed);
        s.lookups = self.lookups.load(Relaxed);
        s.queue_depth = self.queue_depth.load(Relaxed);
        s.g3_recovered = self.g3_recovered.load(Relaxed);
        s.g3_rejected = self.g3_rejected.load(Relaxed);
        s.g2_recovered = self.g2_recovered.load(Relaxed);
        s.g2_rejected = self.g2_rejected.load(Relaxed);
        s.g3_unreadable = self.g3_unreadable.load(Relaxed);
        s
    }
}

/// Installs a Prometheus recorder as the global `metrics` recorder and
/// returns the handle whose `render()` gives the exposition text (serve it
/// from your own HTTP endpoint).
#[cfg(feature = "prometheus")]
pub fn install_prometheus() -> Result<metrics_exporter_prometheus::PrometheusHandle, String> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| e.to_string())
}
