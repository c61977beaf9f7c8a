//! Stopping a run on SIGINT or SIGTERM without leaving anything behind.
//!
//! After [`install`], the first SIGINT or SIGTERM is only recorded. The
//! replay calls [`check`] between requests (when no transfer is in flight)
//! and returns [`BenchError::Interrupted`]; unwinding from there drops the
//! tier engine (its G3 file is removed), the leader (which tells its
//! workers to exit), the worker processes (reaped, killed if they linger)
//! and the run's directory of worker files. The binary then prints one line
//! and exits with 128 + the signal number.
//!
//! A run that does not get there within [`GRACE`] of the signal (blocked in
//! a start-up or a transfer that does not return), a second signal, or a
//! signal to a command with no such loop (nothing has called [`check`]) is
//! ended by force: the registered child processes are killed, the
//! registered files and directories removed ([`guard_path`],
//! [`guard_pid`]), one line printed, and the process exits with the same
//! code.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{BenchError, Result};

/// How long a signalled run may take to stop on its own before it is
/// stopped by force.
pub const GRACE: Duration = Duration::from_secs(4);

static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Whether a loop of this run calls [`check`]: without one, a signal ends
/// the run at once.
static CHECKED: AtomicBool = AtomicBool::new(false);
static NEXT_GUARD: AtomicU64 = AtomicU64::new(0);
static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    paths: Vec::new(),
    pids: Vec::new(),
});

struct Registry {
    paths: Vec<(u64, PathBuf)>,
    pids: Vec<(u64, u32)>,
}

/// A registration for forced clean-up; dropping it takes it back.
#[derive(Debug)]
#[must_use = "the registration ends when the guard is dropped"]
pub struct Guard(u64);

impl Drop for Guard {
    fn drop(&mut self) {
        let mut r = REGISTRY.lock();
        r.paths.retain(|(id, _)| *id != self.0);
        r.pids.retain(|(id, _)| *id != self.0);
    }
}

/// Registers a file or directory to remove if the run is stopped by force.
pub fn guard_path(path: &Path) -> Guard {
    let id = NEXT_GUARD.fetch_add(1, Ordering::Relaxed);
    REGISTRY.lock().paths.push((id, path.to_path_buf()));
    Guard(id)
}

/// Registers a child process to kill if the run is stopped by force.
pub fn guard_pid(pid: u32) -> Guard {
    let id = NEXT_GUARD.fetch_add(1, Ordering::Relaxed);
    REGISTRY.lock().pids.push((id, pid));
    Guard(id)
}

/// The name of signal `sig` (`SIGINT`, `SIGTERM`).
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// The signal that asked this run to stop, if one did.
pub fn requested() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// `Err(BenchError::Interrupted)` once SIGINT or SIGTERM has arrived.
pub fn check() -> Result<()> {
    CHECKED.store(true, Ordering::Relaxed);
    match requested() {
        None => Ok(()),
        Some(signal) => Err(BenchError::Interrupted {
            signal: signal_name(signal),
            code: 128 + signal as u8,
        }),
    }
}

/// Catches SIGINT and SIGTERM from now on (see the module docs). Call it
/// once, from a binary's `main`.
pub fn install() -> Result<()> {
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM])
        .map_err(|e| BenchError::Config(format!("cannot catch SIGINT/SIGTERM: {e}")))?;
    std::thread::Builder::new()
        .name("kvbm-bench-signals".into())
        .spawn(move || {
            let Some(first) = signals.forever().next() else {
                return;
            };
            SIGNAL.store(first, Ordering::SeqCst);
            // A run that never stops on its own (no loop checks) ends now.
            let grace = if CHECKED.load(Ordering::Relaxed) {
                GRACE
            } else {
                Duration::ZERO
            };
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if signals.pending().next().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            force_exit(first);
        })
        .map_err(|e| BenchError::Config(format!("cannot start the signal thread: {e}")))?;
    Ok(())
}

/// Kills the registered children, removes the registered paths, says so
/// and exits.
fn force_exit(signal: i32) -> ! {
    let (paths, pids) = {
        let r = REGISTRY.lock();
        (
            r.paths.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>(),
            r.pids.iter().map(|&(_, p)| p).collect::<Vec<_>>(),
        )
    };
    for pid in &pids {
        if let Ok(pid) = libc::pid_t::try_from(*pid) {
            // SAFETY: kill(2) with a pid this process started and a valid
            // signal has no memory effects.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    for pid in &pids {
        if let Ok(pid) = libc::pid_t::try_from(*pid) {
            let mut status = 0;
            // SAFETY: `status` is a valid out-pointer; a pid that is not
            // our child just fails with ECHILD.
            unsafe { libc::waitpid(pid, &mut status, 0) };
        }
    }
    for p in &paths {
        let _ = if p.is_dir() {
            std::fs::remove_dir_all(p)
        } else {
            std::fs::remove_file(p)
        };
    }
    eprintln!(
        "kvbm-bench: interrupted by {}: stopped by force; {} worker processes killed, {} G3 paths removed",
        signal_name(signal),
        pids.len(),
        paths.len()
    );
    std::process::exit(128 + signal)
}
