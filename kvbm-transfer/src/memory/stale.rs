//! Disk files a killed process left behind: how they are recognised and
//! removed.
//!
//! A [`DiskAllocator`](super::DiskAllocator) names every file it creates
//! `kvbm-<pid>-<n>.blocks` and holds an exclusive `flock` on it for as long
//! as its [`DiskFile`](super::DiskFile) lives. The kernel drops that lock
//! when the process ends, however it ends, so a kvbm-named file whose lock
//! can be taken is a file nobody uses: one left by a process killed before
//! it could remove it (`kill -9`, a crash, a power cut), or one kept on
//! purpose with `set_persist`. Its bytes are never valid data for anyone
//! else — allocators only ever create new files — and
//! [`remove_stale_files`] deletes it.
//!
//! Creating a file and locking it happen under a shared lock on the
//! directory, and a sweep holds the directory's lock exclusively, so a
//! sweep never sees a file between its creation and its lock.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Result, TransferError};

/// The prefix of every disk file kvbm creates.
pub const FILE_PREFIX: &str = "kvbm-";
/// The extension of every disk file kvbm creates.
pub const FILE_EXTENSION: &str = "blocks";

/// The name of file number `n` of process `pid`.
pub(crate) fn file_name(pid: u32, n: u64) -> String {
    format!("{FILE_PREFIX}{pid}-{n}.{FILE_EXTENSION}")
}

/// The process id in a kvbm disk file's name (`kvbm-<pid>-<n>.blocks`),
/// or `None` when `name` is not one.
pub fn file_owner(name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix(FILE_PREFIX)?
        .strip_suffix(FILE_EXTENSION)?
        .strip_suffix('.')?;
    let (pid, n) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(n) {
        return None;
    }
    pid.parse().ok().filter(|_| digits(pid))
}

fn flock(file: &File, op: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: `file` owns an open descriptor for the whole call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Takes `file`'s exclusive lock without waiting: `Ok(false)` when another
/// open file holds it.
pub(crate) fn try_lock(file: &File) -> io::Result<bool> {
    match flock(file, libc::LOCK_EX | libc::LOCK_NB) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Takes `file`'s exclusive `flock` without waiting: `Ok(false)` when
/// another open file holds it. The lock lasts as long as `file` stays
/// open and goes with the process however it ends, which is how kvbm
/// tells what a live process uses from what a killed one left: its disk
/// files, and any other marker locked the same way.
pub fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    try_lock(file)
}

/// True when process `pid` exists (even if it is not ours to signal).
pub fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A lock on a directory, released when dropped. `None` where the file
/// system refuses locks on directories: files are still locked one by
/// one, only the window between creating and locking one stays open.
pub(crate) fn lock_dir(dir: &Path, exclusive: bool) -> Option<File> {
    let f = File::open(dir).ok()?;
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    };
    match flock(&f, op) {
        Ok(()) => Some(f),
        Err(e) => {
            tracing::debug!(dir = %dir.display(), error = %e, "cannot lock the directory");
            None
        }
    }
}

/// Removes every kvbm disk file in `dir` (not below it) that no live
/// process holds locked, and returns their paths. A missing directory has
/// none.
///
/// Files kept on purpose with `DiskFile::set_persist` are unlocked too:
/// call this only on directories whose kvbm files are all scratch (the G3
/// directory of a tier engine, a benchmark's directory).
pub fn remove_stale_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let err = |source| TransferError::Alloc {
        what: format!("directory {} (looking for stale files)", dir.display()),
        source,
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(err(e)),
    };
    let _dir_lock = lock_dir(dir, true);
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.map_err(err)?;
        let name = entry.file_name();
        if name.to_str().and_then(file_owner).is_none() {
            continue;
        }
        // Not through a link, and only regular files.
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = File::open(&path) else {
            continue; // removed meanwhile, or not ours to read
        };
        match try_lock(&file) {
            Ok(true) => match std::fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a stale disk file");
                }
            },
            Ok(false) => {} // in use
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "cannot test the lock of a disk file");
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_owner() {
        assert_eq!(file_owner(&file_name(4242, 7)), Some(4242));
        for bad in [
            "kvbm-12-3.blocks.tmp",
            "kvbm-12.blocks",
            "kvbm--3.blocks",
            "kvbm-x-3.blocks",
            "kvbm-1-+3.blocks",
            "other-1-2.blocks",
            "kvbm-1-2blocks",
        ] {
            assert_eq!(file_owner(bad), None, "{bad}");
        }
    }

    #[test]
    fn unlocked_files_go_and_locked_ones_stay() {
        let dir = std::env::temp_dir().join(format!("kvbm-stale-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let stale = dir.join(file_name(1, 0));
        let held = dir.join(file_name(2, 0));
        let other = dir.join("notes.txt");
        for p in [&stale, &held, &other] {
            std::fs::write(p, b"x").unwrap();
        }
        let holder = File::open(&held).unwrap();
        assert!(try_lock(&holder).unwrap());
        assert_eq!(remove_stale_files(&dir).unwrap(), vec![stale.clone()]);
        assert!(!stale.exists() && held.exists() && other.exists());
        drop(holder);
        assert_eq!(remove_stale_files(&dir).unwrap(), vec![held.clone()]);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(remove_stale_files(&dir).unwrap().is_empty());
    }
}
