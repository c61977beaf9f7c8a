//! The directory of a run's disk files (`--dir`): checked before use, with
//! what is wrong said in words, and cleared of the files of killed runs.
//!
//! A replay puts its G3 file directly in the directory and its workers'
//! files in `dist-<pid>/rank<r>/` below it. Every such file is named
//! `kvbm-<pid>-<n>.blocks` and locked while its process uses it
//! (kvbm-transfer's disk files), so [`remove_stale`] can tell the files of
//! a run that was killed (`kill -9`, a crash) from those of a run still
//! going: it removes only files whose lock is free, and only the
//! `dist-<pid>` directories of processes that no longer exist.

use std::io;
use std::path::{Path, PathBuf};

use kvbm_transfer::memory::remove_stale_files;

use crate::error::{BenchError, Result};

/// The prefix of a tensor-parallel replay's directory of worker files.
pub const DIST_PREFIX: &str = "dist-";

fn dir_err(dir: &Path, problem: impl Into<String>) -> BenchError {
    BenchError::Dir {
        dir: dir.to_path_buf(),
        problem: problem.into(),
    }
}

/// Why creating something in a directory failed, in words.
fn why(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => "permission denied".into(),
        Some(libc::EROFS) => "a read-only file system".into(),
        Some(libc::ENOSPC) => "no space left on the file system".into(),
        Some(libc::EDQUOT) => "over the disk quota".into(),
        // /proc, /sys and the like: the directory exists, yet a new name
        // in it does not.
        Some(libc::ENOENT) => "the file system does not take new files".into(),
        Some(libc::ENOTDIR) => "a part of the path is a file".into(),
        _ => e.to_string(),
    }
}

/// Checks that `dir` is (or can be made) a directory this process can
/// create files in, creating it if missing.
pub fn prepare(dir: &Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_file() => return Err(dir_err(dir, "is a file, not a directory")),
        Ok(m) if !m.is_dir() => return Err(dir_err(dir, "is not a directory")),
        Ok(_) => {}
        Err(e)
            if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENOTDIR) =>
        {
            std::fs::create_dir_all(dir)
                .map_err(|e| dir_err(dir, format!("cannot create it: {}", why(&e))))?;
        }
        Err(e) => return Err(dir_err(dir, format!("cannot look at it: {}", why(&e)))),
    }
    let probe = dir.join(format!(".kvbm-probe-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(dir_err(
            dir,
            format!("not a directory we can create files in ({})", why(&e)),
        )),
    }
}

pub use kvbm_transfer::memory::process_alive;

/// Removes the files of killed runs under `dir` (see the module docs) and
/// returns them; says so in one log line when there were any.
pub fn remove_stale(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = remove_stale_files(dir)?;
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix(DIST_PREFIX))
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if pid == std::process::id() || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let run = entry.path();
            let alive = process_alive(pid);
            for rank in std::fs::read_dir(&run).into_iter().flatten().flatten() {
                if rank.file_type().is_ok_and(|t| t.is_dir()) {
                    removed.extend(remove_stale_files(&rank.path())?);
                    if !alive {
                        let _ = std::fs::remove_dir(rank.path());
                    }
                }
            }
            if !alive {
                let _ = std::fs::remove_dir(&run);
            }
        }
    }
    if !removed.is_empty() {
        tracing::warn!(
            "removed {} G3 files under {} left by killed runs (no live process held their lock)",
            removed.len(),
            dir.display()
        );
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_directories_are_named_in_words() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = prepare(&file).unwrap_err().to_string();
        assert!(e.ends_with(": is a file, not a directory"), "{e}");
        let e = prepare(&file.join("sub")).unwrap_err().to_string();
        assert!(
            e.ends_with("cannot create it: a part of the path is a file"),
            "{e}"
        );
        if Path::new("/proc/self").is_dir() {
            let e = prepare(Path::new("/proc")).unwrap_err().to_string();
            assert!(
                e.starts_with("--dir /proc: not a directory we can create files in"),
                "{e}"
            );
        }
        let fresh = tmp.path().join("a/b");
        prepare(&fresh).unwrap();
        assert!(fresh.is_dir());
        assert_eq!(std::fs::read_dir(&fresh).unwrap().count(), 0);
    }
}
