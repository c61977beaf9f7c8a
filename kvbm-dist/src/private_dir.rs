//! The private directory of a leader's IPC socket, and the sweep of those
//! killed leaders left behind.
//!
//! Each directory is named `kvbm-dist-<pid>-<random>` and holds a `lock`
//! file its leader keeps `flock`ed for as long as the directory lives (the
//! mechanism of kvbm-transfer's disk files): the kernel drops the lock
//! when the process ends, however it ends. A directory whose creator is
//! gone and whose lock is free was left by a leader killed outright
//! (`kill -9`); the next leader to create one in the same place removes
//! it. A directory whose lock is held, or whose creator still runs, is
//! never touched, nor one of another user's.

use std::fs::File;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use kvbm_transfer::memory::{process_alive, try_lock_exclusive};

use crate::error::{DistError, Result};

/// The prefix of every private directory's name.
const PREFIX: &str = "kvbm-dist-";
/// The file inside whose lock says the directory is in use.
const LOCK_FILE: &str = "lock";

/// A directory only this user can enter (mode 0700), created under
/// `$XDG_RUNTIME_DIR` (or the temp dir) and removed with everything in it
/// when dropped: where a leader's IPC socket lives on one host.
#[derive(Debug)]
pub struct PrivateDir {
    path: PathBuf,
    /// Locked while this lives: the directory is in use.
    _lock: File,
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> DistError {
    move |source| DistError::Io { what, source }
}

impl PrivateDir {
    /// Creates a new private directory in the default place, first
    /// removing those killed leaders left there.
    pub fn create() -> Result<PrivateDir> {
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|p| p.is_dir())
            .unwrap_or_else(std::env::temp_dir);
        Self::create_in(&base)
    }

    /// Creates a new private directory in `base`, first removing those
    /// killed leaders left there ([`remove_stale_private_dirs`]).
    pub fn create_in(base: &Path) -> Result<PrivateDir> {
        let removed = remove_stale_private_dirs(base);
        if !removed.is_empty() {
            tracing::info!(
                "removed {} private socket directories under {} left by killed leaders",
                removed.len(),
                base.display()
            );
        }
        let path = base.join(format!(
            "{PREFIX}{}-{:016x}",
            std::process::id(),
            crate::auth::random_u64()?
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(io_err("create the private endpoint directory"))?;
        let lock = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path.join(LOCK_FILE));
        let lock = match lock {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&path);
                return Err(io_err("create the private directory's lock file")(e));
            }
        };
        let dir = PrivateDir { path, _lock: lock };
        if !try_lock_exclusive(&dir._lock).map_err(io_err("lock the private directory"))? {
            return Err(DistError::InvalidConfig(format!(
                "{} is locked by another process",
                dir.path.display()
            )));
        }
        let mode = std::fs::symlink_metadata(&dir.path)
            .map_err(io_err("stat the private endpoint directory"))?
            .mode();
        if mode & 0o077 != 0 {
            return Err(DistError::InvalidConfig(format!(
                "{} has mode {:o}, not 0700",
                dir.path.display(),
                mode & 0o777
            )));
        }
        Ok(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The IPC endpoint of a leader socket inside it.
    pub fn endpoint(&self) -> String {
        format!("ipc://{}", self.path.join("leader.sock").display())
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The process id in a private directory's name
/// (`kvbm-dist-<pid>-<16 hex digits>`), or `None` when `name` is not one.
fn owner(name: &str) -> Option<u32> {
    let (pid, random) = name.strip_prefix(PREFIX)?.split_once('-')?;
    let hex = random.len() == 16 && random.bytes().all(|b| b.is_ascii_hexdigit());
    let digits = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
    (hex && digits).then(|| pid.parse().ok()).flatten()
}

/// True when `dir`'s lock file is held by a live process (a leader in
/// another PID namespace, say), or cannot be tested.
fn lock_held(dir: &Path) -> bool {
    match File::open(dir.join(LOCK_FILE)) {
        Ok(f) => !try_lock_exclusive(&f).unwrap_or(false),
        Err(e) => e.kind() != io::ErrorKind::NotFound,
    }
}

/// Removes the private directories in `base` (not below it) that killed
/// leaders left behind and returns them: directories of this user, named
/// like one, whose creating process is gone and whose lock is free.
pub fn remove_stale_private_dirs(base: &Path) -> Vec<PathBuf> {
    // SAFETY: `geteuid` has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let mut removed = Vec::new();
    for entry in std::fs::read_dir(base).into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(owner) else {
            continue;
        };
        // Not through a link, only directories, only this user's.
        let Ok(meta) = std::fs::symlink_metadata(entry.path()) else {
            continue;
        };
        if !meta.is_dir() || meta.uid() != uid || pid == std::process::id() {
            continue;
        }
        let path = entry.path();
        if process_alive(pid) || lock_held(&path) {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => removed.push(path),
            Err(e) => {
                tracing::debug!(dir = %path.display(), error = %e, "cannot remove a stale private directory");
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pid of a process that has exited.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    fn left_behind(base: &Path, pid: u32, random: &str) -> (PathBuf, File) {
        let dir = base.join(format!("{PREFIX}{pid}-{random}"));
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("leader.sock"), b"").unwrap();
        let lock = File::create(dir.join(LOCK_FILE)).unwrap();
        (dir, lock)
    }

    #[test]
    fn names_carry_the_owner() {
        assert_eq!(owner("kvbm-dist-42-00000000deadbeef"), Some(42));
        for bad in [
            "kvbm-dist-42-deadbeef",
            "kvbm-dist--00000000deadbeef",
            "kvbm-dist-4x-00000000deadbeef",
            "kvbm-dist-42-00000000deadbeefX",
            "other-42-00000000deadbeef",
        ] {
            assert_eq!(owner(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_killed_leaders_directory_goes_and_a_live_ones_stays() {
        let base = tempfile::tempdir().unwrap();
        let pid = dead_pid();
        // Left by a leader killed outright: its process is gone, its lock
        // free.
        let (stale, _unlocked) = left_behind(base.path(), pid, "00000000000000aa");
        // A dead pid here, but its lock held: a live leader in another
        // PID namespace.
        let (held, holder) = left_behind(base.path(), pid, "00000000000000bb");
        assert!(try_lock_exclusive(&holder).unwrap());
        // A live leader's, and something else's.
        let live = PrivateDir::create_in(base.path()).unwrap();
        let other = base.path().join(format!("{PREFIX}notes"));
        std::fs::create_dir(&other).unwrap();

        let next = PrivateDir::create_in(base.path()).unwrap();
        assert!(!stale.exists(), "the stale directory is still there");
        for kept in [&held, live.path(), &other, next.path()] {
            assert!(kept.exists(), "{} was removed", kept.display());
        }
        // Once its lock is free, the other namespace's goes too.
        drop(holder);
        assert_eq!(remove_stale_private_dirs(base.path()), vec![held.clone()]);
        drop(live);
        drop(next);
    }
}
