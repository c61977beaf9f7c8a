//! Whole-instance restarts of the tensor-parallel replay over a kept G3:
//! what an inference server's crash costs kvbm when its disk tier
//! outlives it.
//!
//! At each restart point, between two requests, the replay does what a
//! crash does and nothing more: it SIGKILLs every worker process and drops
//! the leader and the tier engine without a flush or a word to anyone.
//! Then it starts a new leader and new workers on the same G3 directories
//! (kept under an identity of the model shape, [`dist::kept_identity`]),
//! builds a new engine, registers what the workers found in G3
//! ([`kvbm_dist::leader::Leader::restore_kept`]) and goes on with the trace.
//! G1 is gone; G3 comes back, G2 too with [`Restarts::keep_g2`] (in
//! `/dev/shm`), and the engine's use history as it was last written
//! (every [`HISTORY_EVERY`] of the trace's time). Every onboarded block is
//! still checked on every rank against the pattern of its hash and rank.
//!
//! The same invocation first replays the trace without restarts, same
//! configuration, as the reference: the report sets each span's hit rate
//! (from one restart to the next) against the reference's over the same
//! requests. It also gives what each restart found (G3 blocks recovered
//! and rejected, how long from the kill to an engine ready, each worker's
//! G3 open time) and the G3 directories' files and disk use against the
//! configured G3 size.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use kvbm_block::SequenceHash;
use kvbm_pool::Tier as PoolTier;
use kvbm_pool::tier::TierEngine;
use serde::Serialize;

use super::dist::{self, Cluster, InstanceSpec, RunDir};
use kvbm_dist::kept::{HISTORY_EVERY, HistoryKeeper};

/// Where a kept G2 lives: host memory that outlives a process.
const SHM_DIR: &str = "/dev/shm";
use super::engine::{EngineDriver, G1Memory, RequestOutcome};
use super::{Plan, ReplayConfig};
use crate::error::{BenchError, Result};
use kvbm_testkit::trace::Request;

/// Where a replay crashes and restarts its whole instance (`--restarts`,
/// `--restart-seed`); none by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Restarts {
    /// How many restarts (0: none).
    pub count: u32,
    /// `None`: spread evenly over the trace; `Some(seed)`: at points drawn
    /// at random from the seed, no two of them (nor the first and the
    /// trace's start, nor the last and its end) closer than half the even
    /// spacing, so that every restart has requests to measure.
    pub seed: Option<u64>,
    /// Keep G2 across the restarts too (in `/dev/shm`), not only G3.
    pub keep_g2: bool,
}

impl Restarts {
    /// Whether any restart is asked for.
    pub fn any(&self) -> bool {
        self.count > 0
    }

    /// The requests before which the instance restarts, ascending and
    /// distinct, within `1..requests` (a restart before the first request
    /// would find nothing to keep). `requests / (count + 1)` apart when
    /// spread evenly; at least half that when drawn at random.
    pub fn points(&self, requests: usize) -> Result<Vec<usize>> {
        let k = self.count as usize;
        if k == 0 {
            return Ok(Vec::new());
        }
        if k >= requests {
            return Err(BenchError::Config(format!(
                "--restarts {k}: a trace of {requests} requests has room for at most {}",
                requests.saturating_sub(1)
            )));
        }
        let mut points: Vec<usize> = match self.seed {
            None => (1..=k).map(|i| i * requests / (k + 1)).collect(),
            Some(seed) => {
                // The k + 1 gaps between the start, the points and the end
                // are each `gap` long plus a share of the slack, which is
                // cut at k sorted random places.
                let gap = (requests / (2 * (k + 1))).max(1);
                let slack = requests - gap * (k + 1);
                let mut rng = SplitMix(seed);
                let mut cuts: Vec<usize> = (0..k)
                    .map(|_| (rng.next() % (slack as u64 + 1)) as usize)
                    .collect();
                cuts.sort_unstable();
                cuts.iter()
                    .enumerate()
                    .map(|(i, &c)| c + gap * (i + 1))
                    .collect()
            }
        };
        points.sort_unstable();
        points.dedup();
        Ok(points)
    }
}

/// splitmix64: the restart points' random numbers.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Files and disk use of the workers' G3 directories.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct G3Disk {
    /// G3 directories (one per rank, more if a rank had to open a sibling
    /// because its own was still locked).
    pub directories: usize,
    /// Files in them.
    pub files: usize,
    /// Bytes their files take on disk (allocated blocks, as `du` counts).
    pub allocated_bytes: u64,
    /// Their sizes summed (`du --apparent-size`).
    pub apparent_bytes: u64,
}

/// Walks the run's directory of worker files: its rank directories and
/// their files.
pub fn g3_disk(run_dir: &Path) -> Result<G3Disk> {
    use std::os::unix::fs::MetadataExt;
    let io = |e: std::io::Error| BenchError::Dir {
        dir: run_dir.to_path_buf(),
        problem: format!("cannot measure it: {e}"),
    };
    let mut out = G3Disk::default();
    for rank in std::fs::read_dir(run_dir).map_err(io)? {
        let rank = rank.map_err(io)?;
        if !rank.file_type().map_err(io)?.is_dir() {
            continue;
        }
        out.directories += 1;
        for f in std::fs::read_dir(rank.path()).map_err(io)? {
            let m = f.map_err(io)?.metadata().map_err(io)?;
            if m.is_file() {
                out.files += 1;
                out.allocated_bytes += m.blocks() * 512;
                out.apparent_bytes += m.len();
            }
        }
    }
    Ok(out)
}

/// Hits over a span of requests, against the uninterrupted run's.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Span {
    /// First request of the span (0-based).
    pub first_request: usize,
    /// Requests in it.
    pub requests: usize,
    /// Their prompt block references.
    pub block_references: u64,
    /// Their hit rate (all tiers), percent.
    pub hit_rate_pct: f64,
    /// The uninterrupted run's over the same requests, percent.
    pub reference_hit_rate_pct: f64,
    /// `hit_rate_pct ÷ reference_hit_rate_pct` (`None` when the
    /// reference hit nothing).
    pub ratio: Option<f64>,
    /// Their hits served from G3.
    pub g3_hits: u64,
    /// The uninterrupted run's G3 hits over the same requests.
    pub reference_g3_hits: u64,
}

impl Span {
    /// The span `range` of requests, from both runs' per-request hits
    /// (G1, G2, G3 blocks).
    fn of(
        requests: &[Request],
        range: std::ops::Range<usize>,
        ours: &[[u32; 3]],
        reference: &[[u32; 3]],
    ) -> Span {
        let refs: u64 = requests[range.clone()]
            .iter()
            .map(|r| r.hash_ids.len() as u64)
            .sum();
        let total = |hits: &[[u32; 3]]| -> u64 {
            hits[range.clone()]
                .iter()
                .map(|h| h.iter().map(|&n| u64::from(n)).sum::<u64>())
                .sum()
        };
        let g3 = |hits: &[[u32; 3]]| -> u64 {
            hits[range.clone()].iter().map(|h| u64::from(h[2])).sum()
        };
        let pct = |n: u64| {
            if refs == 0 {
                0.0
            } else {
                100.0 * n as f64 / refs as f64
            }
        };
        let (mine, theirs) = (total(ours), total(reference));
        Span {
            first_request: range.start,
            requests: range.len(),
            block_references: refs,
            hit_rate_pct: pct(mine),
            reference_hit_rate_pct: pct(theirs),
            ratio: (theirs > 0).then(|| mine as f64 / theirs as f64),
            g3_hits: g3(ours),
            reference_g3_hits: g3(reference),
        }
    }
}

/// One restart as measured.
#[derive(Debug, Clone, Serialize)]
pub struct RestartRow {
    /// The restart's position in the trace, as a fraction of its
    /// requests.
    pub at_fraction: f64,
    /// The requests the restarted instance served (until the next restart
    /// or the end), against the uninterrupted run's.
    pub span: Span,
    /// The span's hit-rate ratio in ten equal parts, in order: how fast
    /// the restarted instance catches up (`None` for a part without
    /// requests or reference hits).
    pub recovery: Vec<Option<f64>>,
    /// Blocks the crashed engine had booked in G3 at the crash.
    pub g3_held_at_crash: usize,
    /// G3 blocks the new engine registered from the kept G3 (its
    /// `g3_recovered`).
    pub g3_recovered: u64,
    /// G2 blocks it registered from a kept G2 (`g2_recovered`; 0 unless
    /// G2 is kept).
    pub g2_recovered: u64,
    /// Blocks the use history read back at the restart remembered (the
    /// history is written every [`HISTORY_EVERY`] of trace time, so it
    /// misses what happened since the last write).
    pub history_blocks: usize,
    /// G3 blocks left out (its `g3_rejected`: torn or damaged records,
    /// blocks not every rank held).
    pub g3_rejected: u64,
    /// Recovered blocks the span's requests referenced (first references
    /// since the restart): what the kept G3 could have served.
    pub recovered_referenced: u64,
    /// Of those, the ones they hit: bytes served by the kept G3. The rest
    /// followed a block that missed (a prefix stops at its first miss) or
    /// had left G3 by then.
    pub recovered_hits: u64,
    /// Recovered blocks no request of the span referenced that had left G3
    /// by its end (evicted for blocks the new engine offloaded).
    pub recovered_evicted_unreferenced: u64,
    /// Requests from the restart to the first hit on a recovered block
    /// (`Some(0)`: the first request; `None`: no such hit).
    pub first_recovered_hit_after: Option<usize>,
    /// The first request after the restart: the leading blocks of its
    /// prompt the kept G3 held (all it can hit, G1 and G2 being empty).
    pub first_request_kept_prefix: usize,
    /// The first request after the restart: blocks it hit, all from G3.
    pub first_request_g3_hits: usize,
    /// Onboarded blocks checked on every rank in the span.
    pub verified_blocks: u64,
    /// Seconds from the first SIGKILL to the new engine ready: workers
    /// started, G3 opened, leader handshake, engine built, G3 registered.
    pub restart_s: f64,
    /// Of those, registering the recovered blocks in the new engine
    /// (`Leader::restore_kept`).
    pub restore_s: f64,
    /// Each rank's G3 open time (recovery included), milliseconds, as
    /// its worker reported it.
    pub g3_open_ms: Vec<f64>,
    /// The G3 directories once the new engine was ready.
    pub g3_disk: G3Disk,
}

/// What the restarts of a replay cost, against an uninterrupted run of
/// the same configuration in the same invocation.
#[derive(Debug, Clone, Serialize)]
pub struct RestartReport {
    /// The identity G3 was kept under (each worker adds its rank).
    pub identity: String,
    /// Whether G2 was kept too.
    pub g2_kept: bool,
    /// The seed the restart points were drawn from (`None`: spread
    /// evenly).
    pub seed: Option<u64>,
    /// The restarts, in trace order.
    pub rows: Vec<RestartRow>,
    /// Every request before the first restart: both runs did the same
    /// until then (ratio 1).
    pub before_first_restart: Span,
    /// Every request from the first restart to the end.
    pub after_first_restart: Span,
    /// The uninterrupted run's hit rate over the whole trace, percent.
    pub reference_hit_rate_pct: f64,
    /// Blocks the uninterrupted run checked on every rank.
    pub reference_verified_blocks: u64,
    /// The uninterrupted run's wall time, seconds.
    pub reference_wall_s: f64,
    /// G3 blocks whose read failed (checksum or disk) over all engines.
    pub g3_unreadable: u64,
    /// The G3 directories after the run.
    pub g3_disk_end: G3Disk,
    /// The configured G3 size: the data bytes the leader asks of all
    /// workers (G3 blocks × block bytes).
    pub g3_configured_bytes: u64,
    /// The workers' G3 data files as laid out (disk-aligned), all ranks.
    pub g3_data_file_bytes: u64,
    /// The workers' slot records (a header and one record per block),
    /// all ranks.
    pub g3_record_bytes: u64,
}

/// One restart as it happened, before the spans are known.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    at: usize,
    g3_held_at_crash: usize,
    g3_recovered: u64,
    g2_recovered: u64,
    history_blocks: usize,
    g3_rejected: u64,
    recovered_referenced: u64,
    recovered_hits: u64,
    recovered_evicted_unreferenced: u64,
    first_recovered_hit_after: Option<usize>,
    first_request: (usize, usize),
    verified_before: u64,
    restart_s: f64,
    restore_s: f64,
    g3_open_ms: Vec<f64>,
    g3_disk: G3Disk,
}

/// What a pass with a kept G3 leaves for the report.
#[derive(Debug, Clone)]
pub(crate) struct Log {
    identity: String,
    g2_kept: bool,
    events: Vec<Event>,
    disk_end: G3Disk,
    configured_bytes: u64,
    data_file_bytes: u64,
    record_bytes: u64,
}

/// The instance of a pass with a kept G3, and its restarts.
///
/// Hold it longer than the [`EngineDriver`] of the same pass: dropping it
/// drops the leader's workers, which the engine's leader tells to exit
/// only once the engine is gone.
pub(crate) struct Restarter {
    spec: InstanceSpec,
    run_dir: Arc<RunDir>,
    /// The kept G2's directories in `/dev/shm`, removed with the pass.
    _g2_dir: Option<RunDir>,
    /// The engine's use history, written beside the kept tiers as an
    /// engine does and read back at each restart.
    history: HistoryKeeper,
    cluster: Option<Cluster>,
    points: Vec<usize>,
    next: usize,
    block_tokens: u32,
    /// Every block the pass has seen.
    seen: HashSet<u64>,
    /// Blocks seen since the last restart.
    seen_since: HashSet<u64>,
    /// The blocks the last restart found in G3.
    recovered: HashSet<u64>,
    since_restart: usize,
    events: Vec<Event>,
    /// The crashed leaders' teardowns, running beside the replay.
    teardowns: Vec<std::thread::JoinHandle<()>>,
}

impl Restarter {
    /// Starts the first instance of a pass with a kept G3, to restart
    /// before each request of `points`; returns it with its engine and
    /// G1.
    pub(crate) fn start(
        cfg: &ReplayConfig,
        plan: &Plan,
        points: Vec<usize>,
    ) -> Result<(Restarter, TierEngine, G1Memory)> {
        if plan.caps[2] == 0 {
            return Err(BenchError::Config(
                "--restarts keeps G3 across restarts: give G3 some capacity (--g3)".into(),
            ));
        }
        let mut spec = dist::spec(cfg, plan.knobs, plan.page, plan.caps, true)?;
        let run_dir = Arc::new(RunDir::create(&cfg.disk_dir)?);
        let g2_dir = if cfg.restarts.keep_g2 {
            let shm = Path::new(SHM_DIR);
            if !shm.is_dir() {
                return Err(BenchError::Config(format!(
                    "--restart-keep-g2 keeps G2 in {SHM_DIR}, which this host lacks"
                )));
            }
            let dir = RunDir::create(shm)?;
            spec.g2_keep_dir = Some(dir.path().to_path_buf());
            Some(dir)
        } else {
            None
        };
        let (engine, g1, cluster) = dist::launch(&spec, Arc::clone(&run_dir))?;
        let history = HistoryKeeper::new(run_dir.path().join("uses"), HISTORY_EVERY);
        let r = Restarter {
            spec,
            run_dir,
            _g2_dir: g2_dir,
            history,
            cluster: Some(cluster),
            points,
            next: 0,
            block_tokens: cfg.block_tokens,
            seen: HashSet::new(),
            seen_since: HashSet::new(),
            recovered: HashSet::new(),
            since_restart: 0,
            events: Vec::new(),
            teardowns: Vec::new(),
        };
        Ok((r, engine, g1))
    }

    /// Writes the engine's use history when [`HISTORY_EVERY`] of the
    /// trace's time passed since the last write (call between requests,
    /// with the time of the request just replayed): as often per request
    /// as an engine serving the trace live would.
    pub(crate) fn keep_history(&mut self, engine: &TierEngine, trace_ms: u64) {
        self.history
            .maybe_save(engine, std::time::Duration::from_millis(trace_ms));
    }

    /// Whether the instance restarts before request `index`.
    pub(crate) fn due(&self, index: usize) -> bool {
        self.points.get(self.next) == Some(&index)
    }

    /// Crashes the instance `driver` drives and starts it again on the
    /// same G3 directories (see the module); returns the driver of the new
    /// engine, its counters carried over.
    pub(crate) fn restart(&mut self, driver: EngineDriver, index: usize) -> Result<EngineDriver> {
        self.close_span(driver.engine());
        let held = match driver.engine().pool(PoolTier::G3) {
            Some(g3) => self
                .seen
                .iter()
                .filter(|&&h| g3.contains(SequenceHash(h)))
                .count(),
            None => 0,
        };
        let verified_before = driver.verified_blocks;
        let cluster = self
            .cluster
            .take()
            .ok_or_else(|| BenchError::Tier("no instance to restart".into()))?;
        let t0 = Instant::now();
        {
            let mut workers = cluster.workers.lock();
            for rank in 0..self.spec.world {
                workers.kill(rank)?;
            }
        }
        // The engine and the leader go as a crash takes them: nothing is
        // flushed (the last request's offloads had drained, as after
        // every request) and the workers are dead before the leader could
        // tell them anything. The dead leader's sockets may wait up to 2 s
        // for goodbyes no worker will read: a crashed process waits for
        // nothing, so that happens beside the new instance.
        let carried = driver.crash();
        if let Ok(t) = std::thread::Builder::new()
            .name("kvbm-crashed-leader".into())
            .spawn(move || drop(cluster))
        {
            self.teardowns.push(t);
        }
        let (engine, g1, cluster) = dist::launch(&self.spec, Arc::clone(&self.run_dir))?;
        let t1 = Instant::now();
        let history_blocks = self.history.load(&engine);
        cluster.leader.restore_kept(&engine);
        let restore_s = t1.elapsed().as_secs_f64();
        let restart_s = t0.elapsed().as_secs_f64();
        let stats = engine.stats();
        self.recovered = cluster
            .leader
            .kept_g3()
            .iter()
            .chain(cluster.leader.kept_g2())
            .map(|(_, l)| l.hash)
            .collect();
        let g3_open_ms = cluster
            .leader
            .g3_open_times()
            .iter()
            .map(|d| d.as_secs_f64() * 1e3)
            .collect();
        self.cluster = Some(cluster);
        self.events.push(Event {
            at: index,
            g3_held_at_crash: held,
            g3_recovered: stats.g3_recovered,
            g2_recovered: stats.g2_recovered,
            history_blocks,
            g3_rejected: stats.g3_rejected,
            recovered_referenced: 0,
            recovered_hits: 0,
            recovered_evicted_unreferenced: 0,
            first_recovered_hit_after: None,
            first_request: (0, 0),
            verified_before,
            restart_s,
            restore_s,
            g3_open_ms,
            g3_disk: g3_disk(self.run_dir.path())?,
        });
        self.next += 1;
        self.seen_since.clear();
        self.since_restart = 0;
        Ok(EngineDriver::resume(engine, g1, self.block_tokens, carried))
    }

    /// Notes what `request` hit (`outcome`): the first hits on blocks the
    /// last restart recovered were served by the kept G3.
    pub(crate) fn observe(&mut self, request: &Request, outcome: &RequestOutcome) {
        if let Some(e) = self.events.last_mut() {
            if self.since_restart == 0 {
                let kept = request
                    .hash_ids
                    .iter()
                    .take_while(|h| self.recovered.contains(h))
                    .count();
                let g3 = outcome
                    .prefix
                    .iter()
                    .filter(|&&t| t == crate::sim::Tier::G3)
                    .count();
                e.first_request = (kept, g3);
            }
            let hits = request
                .hash_ids
                .iter()
                .take(outcome.prefix.len())
                .filter(|h| self.recovered.contains(h) && !self.seen_since.contains(h))
                .count() as u64;
            if hits > 0 && e.first_recovered_hit_after.is_none() {
                e.first_recovered_hit_after = Some(self.since_restart);
            }
            e.recovered_hits += hits;
            e.recovered_referenced += request
                .hash_ids
                .iter()
                .filter(|h| self.recovered.contains(h) && !self.seen_since.contains(h))
                .count() as u64;
            self.seen_since.extend(request.hash_ids.iter().copied());
        }
        self.seen.extend(request.hash_ids.iter().copied());
        self.since_restart += 1;
    }

    /// Ends the span of the last restart, whose engine is `engine`: counts
    /// the recovered blocks it never referenced that left G3.
    fn close_span(&mut self, engine: &TierEngine) {
        let (Some(e), Some(g3)) = (self.events.last_mut(), engine.pool(PoolTier::G3)) else {
            return;
        };
        e.recovered_evicted_unreferenced = self
            .recovered
            .iter()
            .filter(|&&h| !self.seen_since.contains(&h) && !g3.contains(SequenceHash(h)))
            .count() as u64;
    }

    /// What the pass leaves for the report, at its end (`driver` drives
    /// its last engine); measures the G3 directories now, its instance
    /// still up.
    pub(crate) fn log(&mut self, driver: &EngineDriver) -> Result<Log> {
        self.close_span(driver.engine());
        for t in self.teardowns.drain(..) {
            // A panicked teardown has nothing left to clean up.
            let _ = t.join();
        }
        let world = u64::from(self.spec.world);
        let blocks = self.spec.g3_blocks as u64;
        Ok(Log {
            identity: self.spec.kept_identity.clone().unwrap_or_default(),
            g2_kept: self.spec.g2_keep_dir.is_some(),
            events: self.events.clone(),
            disk_end: g3_disk(self.run_dir.path())?,
            configured_bytes: self.spec.g3_bytes(),
            data_file_bytes: self.spec.rank_g3_file_bytes()? * world,
            record_bytes: kvbm_dist::kept::record_file_bytes(blocks) * world,
        })
    }
}

/// The restart report of a pass (`ours`, with its `log`) against the
/// uninterrupted `reference` pass: per-request hits `[G1, G2, G3]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn report(
    restarts: Restarts,
    requests: &[Request],
    log: Log,
    ours: &[[u32; 3]],
    verified_end: u64,
    g3_unreadable: u64,
    reference: &[[u32; 3]],
    reference_verified_blocks: u64,
    reference_wall_s: f64,
) -> RestartReport {
    let n = requests.len();
    let ends: Vec<usize> = log
        .events
        .iter()
        .skip(1)
        .map(|e| e.at)
        .chain(std::iter::once(n))
        .collect();
    let verified_ends: Vec<u64> = log
        .events
        .iter()
        .skip(1)
        .map(|e| e.verified_before)
        .chain(std::iter::once(verified_end))
        .collect();
    let rows = log
        .events
        .iter()
        .zip(ends.iter().zip(&verified_ends))
        .map(|(e, (&end, &verified))| RestartRow {
            at_fraction: e.at as f64 / n.max(1) as f64,
            span: Span::of(requests, e.at..end, ours, reference),
            recovery: (0..10)
                .map(|i| {
                    let len = end - e.at;
                    let part = e.at + len * i / 10..e.at + len * (i + 1) / 10;
                    Span::of(requests, part, ours, reference).ratio
                })
                .collect(),
            g3_held_at_crash: e.g3_held_at_crash,
            g3_recovered: e.g3_recovered,
            g2_recovered: e.g2_recovered,
            history_blocks: e.history_blocks,
            g3_rejected: e.g3_rejected,
            recovered_referenced: e.recovered_referenced,
            recovered_hits: e.recovered_hits,
            recovered_evicted_unreferenced: e.recovered_evicted_unreferenced,
            first_recovered_hit_after: e.first_recovered_hit_after,
            first_request_kept_prefix: e.first_request.0,
            first_request_g3_hits: e.first_request.1,
            verified_blocks: verified - e.verified_before,
            restart_s: e.restart_s,
            restore_s: e.restore_s,
            g3_open_ms: e.g3_open_ms.clone(),
            g3_disk: e.g3_disk,
        })
        .collect();
    let first = log.events.first().map_or(n, |e| e.at);
    RestartReport {
        identity: log.identity,
        g2_kept: log.g2_kept,
        seed: restarts.seed,
        rows,
        before_first_restart: Span::of(requests, 0..first, ours, reference),
        after_first_restart: Span::of(requests, first..n, ours, reference),
        reference_hit_rate_pct: Span::of(requests, 0..n, reference, reference).hit_rate_pct,
        reference_verified_blocks,
        reference_wall_s,
        g3_unreadable,
        g3_disk_end: log.disk_end,
        g3_configured_bytes: log.configured_bytes,
        g3_data_file_bytes: log.data_file_bytes,
        g3_record_bytes: log.record_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_points_are_spread_and_random_ones_follow_the_seed() {
        let even = Restarts {
            count: 1,
            seed: None,
            keep_g2: false,
        };
        assert_eq!(even.points(100).unwrap(), [50]);
        let three = Restarts {
            count: 3,
            seed: None,
            keep_g2: false,
        };
        assert_eq!(three.points(100).unwrap(), [25, 50, 75]);
        assert_eq!(three.points(4).unwrap(), [1, 2, 3]);
        let e = three.points(3).unwrap_err().to_string();
        assert!(e.contains("at most 2"), "{e}");
        assert!(Restarts::default().points(0).unwrap().is_empty());
        for seed in 0..200 {
            let r = Restarts {
                count: 20,
                seed: Some(seed),
                keep_g2: false,
            };
            let p = r.points(12_031).unwrap();
            assert_eq!(p.len(), 20);
            // Half the even spacing (572 requests) apart, and from the ends.
            let gap = 12_031 / 42;
            assert!(p.windows(2).all(|w| w[1] - w[0] >= gap), "{p:?}");
            assert!(p[0] >= gap && 12_031 - p[19] >= gap, "{p:?}");
            assert_eq!(p, r.points(12_031).unwrap());
            let few = Restarts {
                count: 3,
                seed: Some(seed),
                keep_g2: false,
            };
            let p = few.points(5).unwrap();
            assert!(p.windows(2).all(|w| w[0] < w[1]), "{p:?}");
            assert!(p.iter().all(|&i| (1..5).contains(&i)), "{p:?}");
        }
        // Different seeds, different points.
        let a = Restarts {
            count: 3,
            seed: Some(1),
            keep_g2: false,
        }
        .points(1000)
        .unwrap();
        let b = Restarts {
            count: 3,
            seed: Some(2),
            keep_g2: false,
        }
        .points(1000)
        .unwrap();
        assert_ne!(a, b);
        let all = Restarts {
            count: 9,
            seed: Some(7),
            keep_g2: false,
        };
        assert_eq!(all.points(10).unwrap(), (1..10).collect::<Vec<_>>());
    }

    #[test]
    fn spans_compare_hits_over_the_same_requests() {
        let req = |blocks: u64| Request {
            timestamp_ms: 0,
            input_length: 512 * blocks as u32,
            output_length: 1,
            hash_ids: (0..blocks).collect(),
        };
        let requests = [req(4), req(4), req(2)];
        let ours = [[0, 0, 0], [1, 0, 1], [0, 0, 2]];
        let reference = [[0, 0, 0], [2, 1, 0], [1, 1, 0]];
        let s = Span::of(&requests, 1..3, &ours, &reference);
        assert_eq!((s.first_request, s.requests, s.block_references), (1, 2, 6));
        assert!((s.hit_rate_pct - 200.0 / 3.0).abs() < 1e-9);
        assert!((s.reference_hit_rate_pct - 500.0 / 6.0).abs() < 1e-9);
        assert_eq!(s.ratio, Some(0.8));
        assert_eq!((s.g3_hits, s.reference_g3_hits), (3, 0));
        let none = Span::of(&requests, 0..1, &ours, &reference);
        assert_eq!(none.ratio, None);
    }
}
