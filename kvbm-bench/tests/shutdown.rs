//! Stopping a replay leaves nothing behind: SIGINT and SIGTERM end it
//! within seconds with its G3 files removed and its workers gone, and the
//! files of a run killed outright are removed by the next one (unless a
//! live process still holds them). Real processes, real signals.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A replay long enough to be interrupted (minutes at this size), its G3
/// in `dir`.
fn long_replay(dir: &Path, workers: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kvbm-bench"))
        .args([
            "replay",
            "--conversations",
            "50000",
            "--model",
            "tiny",
            "--scale",
            "32",
            "--g1",
            "0.01",
            "--g2",
            "0.02",
            "--g3",
            "0.05",
            "--workers",
            workers,
            "--no-svg",
            "--dir",
        ])
        .arg(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the kvbm-bench binary starts")
}

/// Every kvbm disk file under `dir`, at any depth.
fn g3_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(g3_files(&p));
        } else if p
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| kvbm_transfer::memory::file_owner(n).is_some())
        {
            out.push(p);
        }
    }
    out
}

fn wait_until(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `child` to exit within `timeout`; kills it and fails if not.
fn exit_within(child: &mut Child, timeout: Duration) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status, err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the replay did not exit within {timeout:?} of the signal");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0);
}

/// True when `file` is locked by someone else. Checked under the
/// directory's exclusive lock, as a sweep for stale files checks: a file
/// is created and locked under that directory's shared lock, so this never
/// sees one between the two steps (nor takes its lock before its owner).
fn locked(path: &Path) -> bool {
    let dir = File::open(path.parent().unwrap()).unwrap();
    // SAFETY: flock on a descriptor this function owns; it blocks until
    // no file is being created in the directory.
    let rc = unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    let f = File::open(path).unwrap();
    // SAFETY: flock on a descriptor this function owns.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    rc != 0
}

/// The children of `pid`, from /proc.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces.
        let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
        if after.split_whitespace().nth(1) == Some(&pid.to_string()) {
            out.push(p);
        }
    }
    out
}

/// True while `pid` runs (a zombie has ended).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().next().map(|st| st != "Z"))
        })
        .unwrap_or(false)
}

fn interrupted_replay_leaves_nothing(sig: i32, name: &str, workers: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut child = long_replay(dir.path(), workers);
    let want = if workers == "0" { 1 } else { 2 };
    wait_until("the G3 files", Duration::from_secs(60), || {
        g3_files(dir.path()).len() >= want
    });
    for f in g3_files(dir.path()) {
        assert!(locked(&f), "{} is in use but not locked", f.display());
    }
    let workers_pids = children(child.id());
    assert_eq!(workers_pids.len(), want - usize::from(workers == "0"));
    // Into the request loop.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the replay ended early"
    );
    signal(&child, sig);
    let (status, err) = exit_within(&mut child, Duration::from_secs(8));
    assert_eq!(status.code(), Some(128 + sig), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains(&format!("interrupted by {name}")),
        "stderr: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        g3_files(dir.path()).is_empty(),
        "left behind: {:?}",
        g3_files(dir.path())
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().starts_with("dist-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    for pid in workers_pids {
        wait_until("the workers to end", Duration::from_secs(2), || {
            !running(pid)
        });
    }
}

#[test]
fn sigint_stops_a_replay_and_removes_its_g3_file() {
    interrupted_replay_leaves_nothing(libc::SIGINT, "SIGINT", "0");
}

#[test]
fn sigterm_stops_a_replay_and_removes_its_g3_file() {
    interrupted_replay_leaves_nothing(libc::SIGTERM, "SIGTERM", "0");
}

#[test]
fn sigterm_stops_a_two_worker_replay_and_its_workers() {
    interrupted_replay_leaves_nothing(libc::SIGTERM, "SIGTERM", "2");
}

#[test]
fn sigint_stops_a_two_worker_replay_and_its_workers() {
    interrupted_replay_leaves_nothing(libc::SIGINT, "SIGINT", "2");
}

#[test]
fn files_of_killed_runs_are_removed_and_files_in_use_kept() {
    let dir = tempfile::tempdir().unwrap();
    // A pid that no longer runs.
    let mut gone = Command::new("true").spawn().unwrap();
    gone.wait().unwrap();
    let dead = gone.id();
    let stale = dir.path().join(format!("kvbm-{dead}-0.blocks"));
    std::fs::write(&stale, vec![0u8; 4096]).unwrap();
    let dead_run = dir.path().join(format!("dist-{dead}"));
    std::fs::create_dir_all(dead_run.join("rank0")).unwrap();
    let stale_rank = dead_run.join(format!("rank0/kvbm-{dead}-1.blocks"));
    std::fs::write(&stale_rank, b"old").unwrap();
    // A file a live process (this one) holds.
    let held = dir
        .path()
        .join(format!("kvbm-{}-999.blocks", std::process::id()));
    std::fs::write(&held, b"busy").unwrap();
    let holder = File::open(&held).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    let rc = unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(rc, 0);
    let o = Command::new(env!("CARGO_BIN_EXE_kvbm-bench"))
        .args([
            "replay",
            "--conversations",
            "20",
            "--model",
            "tiny",
            "--scale",
            "64",
            "--g3",
            "0.3",
            "--no-svg",
            "--json",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!stale.exists() && !stale_rank.exists() && !dead_run.exists());
    assert!(held.exists(), "a file in use was removed");
    let said: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("left by killed runs"))
        .collect();
    assert_eq!(said.len(), 1, "{err}");
    assert!(said[0].contains("removed 2 G3 files"), "{err}");
    // The run's own file is gone too.
    assert_eq!(g3_files(dir.path()), vec![held]);
    drop(holder);
}

#[test]
fn bad_dirs_and_empty_workloads_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plain");
    std::fs::write(&file, b"x").unwrap();
    let run = |args: &[&str], d: &Path| {
        let o = Command::new(env!("CARGO_BIN_EXE_kvbm-bench"))
            .args(args)
            .arg("--dir")
            .arg(d)
            .arg("--quiet")
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = run(&["replay", "--model", "tiny", "--scale", "64"], &file);
    assert!(
        e.contains(&format!(
            "--dir {}: is a file, not a directory",
            file.display()
        )),
        "{e}"
    );
    if Path::new("/proc/self").is_dir() {
        let e = run(
            &["replay", "--model", "tiny", "--scale", "64"],
            Path::new("/proc"),
        );
        assert!(
            e.contains("--dir /proc: not a directory we can create files in"),
            "{e}"
        );
    }
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    let e = run(&["replay", "--trace", empty.to_str().unwrap()], dir.path());
    assert!(e.contains("empty.jsonl: no requests"), "{e}");
    let e = run(&["replay", "--max-requests", "0"], dir.path());
    assert!(e.contains("--max-requests 0"), "{e}");
}

#[test]
fn a_replay_without_g3_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_kvbm-bench"))
        .args([
            "replay",
            "--conversations",
            "20",
            "--model",
            "tiny",
            "--scale",
            "64",
            "--g3",
            "0",
            "--no-svg",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!out.contains("O_DIRECT"), "{out}");
    assert!(out.contains("G3 none"), "{out}");
}
