//! A small real file system for tests that need a disk to fill up.
//!
//! [`SmallFs::ext2`] makes an ext2 image of a few MiB, mounts it through a
//! loop device and unmounts and deletes it on drop. ext2 has no
//! `fallocate`, so it also shows what happens where space cannot be
//! reserved the fast way. Mounting needs root and loop devices; where
//! either is missing (an ordinary user, a container without `/dev/loop*`)
//! the constructor says why and the test skips.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A mounted ext2 file system backed by an image file.
#[derive(Debug)]
pub struct SmallFs {
    _root: tempfile::TempDir,
    mount: PathBuf,
    image: PathBuf,
}

impl SmallFs {
    /// Makes and mounts an ext2 file system of `bytes` bytes; `Err` says
    /// why it cannot be done here (then the caller skips its test).
    pub fn ext2(bytes: u64) -> Result<SmallFs, String> {
        // SAFETY: `geteuid` has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("mounting a loop device needs root".into());
        }
        if !Path::new("/dev/loop-control").exists() {
            return Err("no loop devices (/dev/loop-control is missing)".into());
        }
        let root = tempfile::Builder::new()
            .prefix("kvbm-smallfs-")
            .tempdir()
            .map_err(|e| format!("scratch directory: {e}"))?;
        let image = root.path().join("fs.img");
        let mount = root.path().join("mnt");
        std::fs::create_dir(&mount).map_err(|e| format!("mkdir {}: {e}", mount.display()))?;
        let file = std::fs::File::create(&image).map_err(|e| format!("create image: {e}"))?;
        file.set_len(bytes)
            .map_err(|e| format!("size image: {e}"))?;
        drop(file);
        run(Command::new("mkfs.ext2")
            .args(["-q", "-F", "-m", "0"])
            .arg(&image))?;
        run(Command::new("mount")
            .args(["-t", "ext2", "-o", "loop"])
            .arg(&image)
            .arg(&mount))?;
        Ok(SmallFs {
            _root: root,
            mount,
            image,
        })
    }

    /// The mount point: files created under it live on the small file
    /// system.
    pub fn path(&self) -> &Path {
        &self.mount
    }

    /// The image file backing the file system.
    pub fn image(&self) -> &Path {
        &self.image
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        // A lazy unmount cannot fail on files still open; the loop device
        // goes when the last of them is closed.
        if run(Command::new("umount").arg(&self.mount)).is_err() {
            let _ = run(Command::new("umount").arg("-l").arg(&self.mount));
        }
        // `_root` (image and mount point) is removed after this.
    }
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let what = format!("{cmd:?}");
    match cmd.output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "{what} failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("{what}: {e}")),
    }
}
