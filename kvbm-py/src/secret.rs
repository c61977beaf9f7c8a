//! The instance secret both sides of an engine share.
//!
//! kvbm-dist's workers prove to the leader that they belong to the
//! instance with a MAC keyed by a per-instance secret. In an engine the
//! workers start before the scheduler (vLLM registers its KV tensors before
//! it builds the scheduler), so no side can hand the secret to the other:
//! the first process to need it draws one and publishes it in a file only
//! its user can read (mode 0600), created under a temporary name and linked
//! into place, so a reader never sees half of it; every other process of
//! the instance reads it from there. `KVBM_INSTANCE_SECRET` (hex), when
//! set, is used instead.

use std::path::Path;
use std::time::{Duration, Instant};

use kvbm_dist::auth::{InstanceSecret, SECRET_ENV};

use crate::error::{PyKvbmError, Result};

/// The instance secret: from [`SECRET_ENV`] if set, else the one published
/// at `path` (drawing and publishing it if nobody has).
pub fn shared_secret(path: &Path) -> Result<InstanceSecret> {
    if let Ok(hex) = std::env::var(SECRET_ENV) {
        return Ok(InstanceSecret::from_hex(&hex)?);
    }
    if !path.exists() {
        let secret = InstanceSecret::generate()?;
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        secret.write_file(&tmp)?;
        let linked = std::fs::hard_link(&tmp, path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => return Ok(secret),
            // Another process of the instance published first: use theirs.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(PyKvbmError::Invalid(format!(
                    "cannot publish the instance secret at {}: {e}",
                    path.display()
                )));
            }
        }
    }
    // The file appears whole (linked into place), but give a slow file
    // system a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match InstanceSecret::read_file(path) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e.into()),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_process_publishes_and_the_others_read() {
        if std::env::var(SECRET_ENV).is_ok() {
            return; // the environment decides; nothing to publish
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("instance.secret");
        let a = shared_secret(&path).unwrap();
        let b = shared_secret(&path).unwrap();
        let mac = |s: &InstanceSecret| kvbm_dist::auth::hello_mac(s, 1, 0, 1, b"peer");
        assert_eq!(mac(&a), mac(&b));
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        // Nothing else is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
