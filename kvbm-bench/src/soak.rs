//! The soak run: the tensor-parallel replay for a fixed time, with one
//! worker process killed (SIGKILL, as a crash) and restarted every
//! interval, to show that kvbm keeps serving correct bytes through real
//! losses and that nothing grows.
//!
//! The soak owns the worker processes (they are the replay's children,
//! started by [`replay::dist`](crate::replay::dist)), so killing one is a
//! `kill` of a known child and restarting it is starting the same command
//! line again; the new process says `Hello` with the instance's secret and
//! the leader takes it back as that rank.
//!
//! Between requests the driver watches the leader's record of losses.
//! After one, it waits until the instance is whole again and drops every
//! cached block from kvbm's books: the lost worker's slices of G2 and G3
//! are gone (the leader would refuse to read them anyway) and so is its
//! G1, which the workers own in this bench. A request that fails because a
//! rank was lost while it ran is counted by cause and abandoned; any other
//! error stops the soak. Every onboarded block is checked on every rank; a
//! mismatch is counted (the soak exits non-zero when there was one).
//!
//! The trace is replayed from the start again when it runs out, with the
//! same hashes, so later passes hit what earlier ones cached. Resident
//! memory (`VmRSS`) and open descriptors of the leader (this process) and
//! of every worker are read from `/proc` at the start, half an interval
//! in (caches warm, before the first kill) and at the end.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvbm_dist::leader::Leader;
use kvbm_pool::metrics::{SkipReason, TierStats};
use parking_lot::Mutex;
use serde::Serialize;

use crate::error::{BenchError, Result};
use crate::replay::dist::Workers;
use crate::replay::engine::EngineDriver;
use crate::replay::{ReplayConfig, dist, plan};
use crate::shutdown;

/// How a soak is run.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// The replay to run (its `workers` must be at least 1).
    pub replay: ReplayConfig,
    /// How long to run.
    pub duration: Duration,
    /// Kill and restart one worker this often (`None`: never).
    pub kill_every: Option<Duration>,
    /// How long a restarted rank may take to be whole again.
    pub rejoin_timeout: Duration,
}

/// Memory and descriptors of one process.
#[derive(Debug, Clone, Serialize)]
pub struct ProcSample {
    /// `leader` or `rank N`.
    pub role: String,
    /// Its process id.
    pub pid: u32,
    /// Resident memory, KiB (`VmRSS`).
    pub rss_kib: u64,
    /// Open file descriptors.
    pub open_files: usize,
}

/// One worker killed and started again.
#[derive(Debug, Clone, Serialize)]
pub struct Kill {
    /// Seconds from the start of the soak.
    pub at_s: f64,
    /// The rank.
    pub rank: u32,
    /// The killed process.
    pub killed_pid: u32,
    /// Its replacement.
    pub new_pid: u32,
    /// Seconds until the instance was whole again (`None`: not within the
    /// rejoin timeout).
    pub rejoin_s: Option<f64>,
    /// Stale G3 files of the killed process removed before the restart.
    pub stale_files_removed: usize,
}

/// Everything a soak reports.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    /// Workload description.
    pub workload: String,
    /// Worker processes.
    pub workers: u32,
    /// Seconds run.
    pub wall_s: f64,
    /// Times the trace was replayed from its start (1 for less than once).
    pub passes: u64,
    /// Requests replayed to the end.
    pub requests_served: u64,
    /// Requests abandoned because a rank was lost while they ran.
    pub requests_failed: u64,
    /// Onboarded blocks whose bytes were checked on every rank.
    pub blocks_verified: u64,
    /// Onboarded blocks that came back wrong (must be 0).
    pub mismatches: u64,
    /// Failures by cause: abandoned requests, losses the leader recorded
    /// (by reason), the engine's failed copies and onboards.
    pub failures: BTreeMap<String, u64>,
    /// Offloads the engine's policy skipped, by reason (not failures).
    pub offloads_skipped: BTreeMap<String, u64>,
    /// The kills.
    pub kills: Vec<Kill>,
    /// Leader and workers at the start.
    pub start: Vec<ProcSample>,
    /// Half a kill interval in, before the first kill (half-way through a
    /// run without kills).
    pub warm: Vec<ProcSample>,
    /// At the end.
    pub end: Vec<ProcSample>,
}

/// Reads `VmRSS` and counts the open descriptors of `pid`.
pub fn sample(role: String, pid: u32) -> Option<ProcSample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())?;
    let open_files = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    Some(ProcSample {
        role,
        pid,
        rss_kib,
        open_files,
    })
}

fn sample_all(workers: &Mutex<Workers>) -> Vec<ProcSample> {
    let pids = workers.lock().pids();
    let mut out: Vec<ProcSample> = sample("leader".into(), std::process::id())
        .into_iter()
        .collect();
    for (rank, pid) in pids.into_iter().enumerate() {
        if let Some(s) = pid.and_then(|p| sample(format!("rank {rank}"), p)) {
            out.push(s);
        }
    }
    out
}

/// The thread that kills a rank every `every`, round robin, and starts it
/// again at once.
struct Killer {
    workers: Arc<Mutex<Workers>>,
    leader: Arc<Leader>,
    every: Duration,
    rejoin_timeout: Duration,
    start: Instant,
    /// No kill at or after this.
    deadline: Instant,
    stop: Arc<AtomicBool>,
    kills: Arc<Mutex<Vec<Kill>>>,
    /// Kills begun, counted before each kill.
    started: Arc<AtomicU64>,
}

fn killer(k: Killer) -> Result<()> {
    let Killer {
        workers,
        leader,
        every,
        rejoin_timeout,
        start,
        deadline,
        stop,
        kills,
        started,
    } = k;
    let world = workers.lock().pids().len() as u32;
    let mut next = start + every;
    let mut n = 0u32;
    while next < deadline {
        while Instant::now() < next {
            if stop.load(Ordering::Relaxed) || shutdown::requested().is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let rank = n % world;
        n += 1;
        let at_s = start.elapsed().as_secs_f64();
        let losses_before = leader.status().losses.len();
        started.fetch_add(1, Ordering::SeqCst);
        let (killed_pid, new_pid, stale) = {
            let mut w = workers.lock();
            let killed = w.kill(rank)?;
            // The dead process's lock is gone with it: its file is stale.
            let stale = match w.g3_dir(rank) {
                Some(d) => kvbm_transfer::memory::remove_stale_files(d)?.len(),
                None => 0,
            };
            (killed, w.restart(rank)?, stale)
        };
        let t0 = Instant::now();
        // Whole again only once the leader has seen the loss: the new
        // process is then the live rank.
        let rejoin_s = leader
            .wait_for(rejoin_timeout, |s| {
                s.is_whole() && s.losses.len() > losses_before
            })
            .then(|| t0.elapsed().as_secs_f64());
        kills.lock().push(Kill {
            at_s,
            rank,
            killed_pid,
            new_pid,
            rejoin_s,
            stale_files_removed: stale,
        });
        next += every;
    }
    Ok(())
}

/// The worker-killing thread, when there is one, and what it shares.
struct KillerThread {
    /// Set to stop the thread.
    stop: Arc<AtomicBool>,
    /// The kills done.
    kills: Arc<Mutex<Vec<Kill>>>,
    /// Kills begun.
    started: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl KillerThread {
    /// Starts killing a rank every `--kill-every` (no thread without it),
    /// from `start` until `deadline`.
    fn start(
        cfg: &SoakConfig,
        cluster: &dist::Cluster,
        leader: &Arc<Leader>,
        start: Instant,
        deadline: Instant,
    ) -> KillerThread {
        let stop = Arc::new(AtomicBool::new(false));
        let kills = Arc::new(Mutex::new(Vec::new()));
        let started = Arc::new(AtomicU64::new(0));
        let thread = cfg.kill_every.map(|every| {
            let k = Killer {
                workers: Arc::clone(&cluster.workers),
                leader: Arc::clone(leader),
                every,
                rejoin_timeout: cfg.rejoin_timeout,
                start,
                deadline,
                stop: Arc::clone(&stop),
                kills: Arc::clone(&kills),
                started: Arc::clone(&started),
            };
            std::thread::spawn(move || killer(k))
        });
        KillerThread {
            stop,
            kills,
            started,
            thread,
        }
    }

    /// Stops the thread and waits for it; its error, if it failed.
    fn finish(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(|t| t.join()) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(e))) => Err(e),
            Some(Err(_)) => Err(BenchError::Tier(
                "the worker-killing thread panicked".into(),
            )),
        }
    }
}

/// Runs the soak; `progress(served, elapsed)` is called after each request.
pub fn run_soak(cfg: &SoakConfig, mut progress: impl FnMut(u64, Duration)) -> Result<SoakReport> {
    let rc = &cfg.replay;
    if rc.workers == 0 {
        return Err(BenchError::Config(
            "a soak needs --workers 1 or more".into(),
        ));
    }
    if cfg.kill_every.is_some_and(|d| d.is_zero()) {
        return Err(BenchError::Config("--kill-every must be positive".into()));
    }
    let p = plan(rc)?;
    let (engine, g1, _, cluster) = dist::engine(rc, p.knobs, p.page, p.caps)?;
    let leader = Arc::clone(&cluster.leader);
    let mut driver = EngineDriver::new(engine, g1, rc.block_tokens);
    let start_samples = sample_all(&cluster.workers);
    let start = Instant::now();
    let deadline = start + cfg.duration;
    // Caches warm, before the first kill.
    let warm_at = start + cfg.kill_every.unwrap_or(cfg.duration / 2) / 2;
    let mut killer = KillerThread::start(cfg, &cluster, &leader, start, deadline);
    let watch = Watch {
        leader: &leader,
        kills_started: &killer.started,
        cluster: &cluster,
    };
    let outcome = drive(cfg, &mut driver, &watch, deadline, warm_at, &mut progress);
    let killed = killer.finish();
    let mut run = outcome?;
    killed?;
    let end = sample_all(&cluster.workers);
    let stats = driver.engine().stats();
    add_failures(&mut run, &stats, &leader);
    let kills = killer.kills.lock().clone();
    Ok(SoakReport {
        workload: rc.workload.clone(),
        workers: rc.workers,
        wall_s: start.elapsed().as_secs_f64(),
        passes: run.passes,
        requests_served: run.served,
        requests_failed: run.failed,
        blocks_verified: driver.verified_blocks,
        mismatches: run.mismatches,
        failures: run.failures,
        offloads_skipped: skipped_by_reason(&stats),
        kills,
        start: start_samples,
        warm: run.warm,
        end,
    })
}

/// Adds to `run`'s failures the engine's copy failures by path and cause,
/// the onboards they failed, and the ranks the leader lost by cause.
fn add_failures(run: &mut Run, stats: &TierStats, leader: &Leader) {
    for f in &stats.copy_failures {
        *run.failures
            .entry(format!("{} copy failed: {}", f.path.label(), f.cause))
            .or_default() += f.blocks;
    }
    if stats.onboard_failures > 0 {
        run.failures
            .insert("onboard failed".into(), stats.onboard_failures);
    }
    for loss in leader.status().losses {
        // The reason without the peer it names: one entry per cause.
        let cause = loss.reason.split(" (").next().unwrap_or_default();
        *run.failures
            .entry(format!("rank lost: {cause}"))
            .or_default() += 1;
    }
}

/// The offloads the engine skipped, by reason (reasons that never came up
/// left out).
fn skipped_by_reason(stats: &TierStats) -> BTreeMap<String, u64> {
    [
        SkipReason::Present,
        SkipReason::SourceGone,
        SkipReason::NotAdmitted,
        SkipReason::TierFull,
        SkipReason::QueueFull,
        SkipReason::NoTier,
    ]
    .into_iter()
    .map(|r| (r.label().to_string(), stats.skipped_for(r)))
    .filter(|(_, n)| *n > 0)
    .collect()
}

#[derive(Default)]
struct Run {
    passes: u64,
    served: u64,
    failed: u64,
    mismatches: u64,
    failures: BTreeMap<String, u64>,
    warm: Vec<ProcSample>,
}

/// What the request loop watches besides its requests.
struct Watch<'a> {
    leader: &'a Leader,
    /// Kills begun so far (counted before the kill).
    kills_started: &'a AtomicU64,
    cluster: &'a dist::Cluster,
}

/// The request loop: until `deadline`, through every loss.
fn drive(
    cfg: &SoakConfig,
    driver: &mut EngineDriver,
    watch: &Watch<'_>,
    deadline: Instant,
    warm_at: Instant,
    progress: &mut impl FnMut(u64, Duration),
) -> Result<Run> {
    let requests = &cfg.replay.requests;
    let leader = watch.leader;
    let start = Instant::now();
    let mut run = Run::default();
    // Losses and kills already dealt with.
    let mut seen_losses = 0;
    let mut seen_kills = 0;
    let mut index = 0usize;
    while Instant::now() < deadline {
        shutdown::check()?;
        if run.warm.is_empty() && Instant::now() >= warm_at {
            run.warm = sample_all(&watch.cluster.workers);
        }
        // After a kill or a loss: whole again (with every kill recorded as
        // a loss), then nothing cached is trusted.
        let kills = watch.kills_started.load(Ordering::SeqCst);
        let status = leader.status();
        if kills > seen_kills || status.losses.len() > seen_losses || !status.is_whole() {
            let want = seen_losses + (kills - seen_kills) as usize;
            if !leader.wait_for(cfg.rejoin_timeout, |s| {
                s.is_whole() && s.losses.len() >= want
            }) {
                return Err(BenchError::Tier(format!(
                    "kvbm-dist: the instance was not whole again within {:?}: {:?}",
                    cfg.rejoin_timeout,
                    leader.status().ranks
                )));
            }
            driver.forget_cached();
            seen_losses = leader.status().losses.len();
            seen_kills = kills;
        }
        let at = index % requests.len();
        if at == 0 {
            run.passes += 1;
        }
        let outcome = driver.request(index, &requests[at]);
        if let Err(e) = outcome {
            driver.abandon(index);
            // A kill or loss since the last check explains the failure
            // (a rank replaced between an onboard and its check shows
            // fresh memory, so even a mismatch then is the kill's).
            let lost = || {
                let s = leader.status();
                watch.kills_started.load(Ordering::SeqCst) > seen_kills
                    || s.losses.len() > seen_losses
                    || !s.is_whole()
            };
            if lost() {
                run.failed += 1;
                *run.failures
                    .entry("request abandoned: a rank was lost while it ran".into())
                    .or_default() += 1;
            } else if let BenchError::Corrupt { .. } = e {
                run.mismatches += 1;
                *run.failures.entry("mismatch".into()).or_default() += 1;
            } else {
                return Err(e);
            }
        } else {
            run.served += 1;
        }
        index += 1;
        progress(run.served, start.elapsed());
    }
    if run.warm.is_empty() {
        run.warm = sample_all(&watch.cluster.workers);
    }
    Ok(run)
}
