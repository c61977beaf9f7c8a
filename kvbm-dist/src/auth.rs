//! Who may speak to a leader: the instance secret and the `Hello` MAC.
//!
//! Every instance has a secret of [`SECRET_BYTES`] random bytes (from the
//! OS random source). The leader's owner hands it to the workers it starts
//! itself — through the environment of the child process
//! ([`InstanceSecret::pass_to`], read and removed again by
//! [`InstanceSecret::take_from_env`]) or through a file only its owner can
//! read ([`InstanceSecret::write_file`] / [`InstanceSecret::read_file`]) —
//! never on a command line and never in a log (its `Debug` form is
//! redacted).
//!
//! The secret itself never travels. A worker's `Hello` carries an
//! HMAC-SHA256, keyed by the secret, over the instance, its rank, the world
//! size and the worker's ZeroMQ identity ([`hello_mac`]); the leader
//! recomputes it for the identity the frame arrived from and compares in
//! constant time. A stranger cannot produce one, and one copied from
//! another connection names an identity that is already taken (or, for a
//! lost worker, burned).

use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::{DistError, Result};
use crate::proto::InstanceId;

/// The environment variable through which a worker process receives its
/// instance's secret (hex); the worker removes it once read.
pub const SECRET_ENV: &str = "KVBM_INSTANCE_SECRET";
/// Bytes of an instance secret (256 bits).
pub const SECRET_BYTES: usize = 32;
/// Bytes of a `Hello`'s MAC (HMAC-SHA256).
pub const MAC_BYTES: usize = 32;

/// What a `Hello`'s MAC covers, before the fields (separates it from any
/// other use of the key).
const HELLO_DOMAIN: &[u8] = b"kvbm-dist hello v2\0";
/// What the leader's CURVE secret key is derived under.
const CURVE_DOMAIN: &[u8] = b"kvbm-dist curve leader v1\0";
const BLOCK: usize = 64;

/// A per-instance secret: the key of every `Hello`'s MAC.
#[derive(Clone)]
pub struct InstanceSecret([u8; SECRET_BYTES]);

impl std::fmt::Debug for InstanceSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InstanceSecret(<redacted>)")
    }
}

impl InstanceSecret {
    /// A new secret from the OS random source.
    pub fn generate() -> Result<InstanceSecret> {
        let mut key = [0u8; SECRET_BYTES];
        random_bytes(&mut key)?;
        Ok(InstanceSecret(key))
    }

    /// A secret of the given bytes (tests; embedders that derive their own).
    pub fn from_bytes(key: [u8; SECRET_BYTES]) -> InstanceSecret {
        InstanceSecret(key)
    }

    /// Parses the hex form ([`SECRET_BYTES`] bytes, 64 hex digits).
    pub fn from_hex(text: &str) -> Result<InstanceSecret> {
        let text = text.trim();
        let bad = || {
            DistError::InvalidConfig(format!(
                "an instance secret is {} hex digits",
                2 * SECRET_BYTES
            ))
        };
        if text.len() != 2 * SECRET_BYTES {
            return Err(bad());
        }
        let mut key = [0u8; SECRET_BYTES];
        for (i, b) in key.iter_mut().enumerate() {
            *b = u8::from_str_radix(text.get(2 * i..2 * i + 2).ok_or_else(bad)?, 16)
                .map_err(|_| bad())?;
        }
        Ok(InstanceSecret(key))
    }

    fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Puts the secret into the environment of `command` (a worker process
    /// the caller starts itself), where neither its command line nor the
    /// caller's environment shows it.
    pub fn pass_to(&self, command: &mut std::process::Command) {
        command.env(SECRET_ENV, self.to_hex());
    }

    /// Reads the secret from [`SECRET_ENV`] and removes the variable, so
    /// processes this one starts do not inherit it.
    ///
    /// # Safety
    ///
    /// Removing an environment variable is only sound while no other thread
    /// reads or writes the environment: call it at the start of `main`,
    /// before any thread is started.
    pub unsafe fn take_from_env() -> Result<InstanceSecret> {
        let value = std::env::var(SECRET_ENV).map_err(|_| {
            DistError::InvalidConfig(format!(
                "no instance secret: {SECRET_ENV} is not set (the leader's owner passes it)"
            ))
        })?;
        // SAFETY: the caller guarantees no other thread touches the
        // environment during this call.
        unsafe { std::env::remove_var(SECRET_ENV) };
        InstanceSecret::from_hex(&value)
    }

    /// Writes the secret (hex) to a new file at `path` that only its owner
    /// may read (mode 0600); an existing file is an error.
    pub fn write_file(&self, path: &Path) -> Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|source| DistError::Io {
                what: "create the instance secret file",
                source,
            })?;
        f.write_all(self.to_hex().as_bytes())
            .map_err(|source| DistError::Io {
                what: "write the instance secret file",
                source,
            })
    }

    /// Reads a secret written by [`InstanceSecret::write_file`]. The file
    /// must belong to this process's user and be closed to everyone else
    /// (no group or other permission bits).
    pub fn read_file(path: &Path) -> Result<InstanceSecret> {
        use std::os::unix::fs::MetadataExt;
        let f = std::fs::File::open(path).map_err(|source| DistError::Io {
            what: "open the instance secret file",
            source,
        })?;
        let meta = f.metadata().map_err(|source| DistError::Io {
            what: "stat the instance secret file",
            source,
        })?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me || meta.mode() & 0o077 != 0 {
            return Err(DistError::InvalidConfig(format!(
                "the instance secret file {} must belong to uid {me} with mode 0600 (it has uid {} and mode {:o})",
                path.display(),
                meta.uid(),
                meta.mode() & 0o777
            )));
        }
        let mut text = String::new();
        f.take(4 * SECRET_BYTES as u64)
            .read_to_string(&mut text)
            .map_err(|source| DistError::Io {
                what: "read the instance secret file",
                source,
            })?;
        InstanceSecret::from_hex(&text)
    }
}

/// The MAC a worker's `Hello` carries: HMAC-SHA256 keyed by the instance
/// secret over the instance, rank, world size and the worker's ZeroMQ
/// identity (the one the leader sees the frame arrive from).
pub fn hello_mac(
    secret: &InstanceSecret,
    instance: InstanceId,
    rank: u32,
    world_size: u32,
    identity: &[u8],
) -> [u8; MAC_BYTES] {
    hmac_sha256(
        &secret.0,
        &[
            HELLO_DOMAIN,
            &instance.to_le_bytes(),
            &rank.to_le_bytes(),
            &world_size.to_le_bytes(),
            &(identity.len() as u64).to_le_bytes(),
            identity,
        ],
    )
}

/// True when `mac` is the [`hello_mac`] of these fields (compared in
/// constant time).
pub(crate) fn hello_mac_ok(
    secret: &InstanceSecret,
    instance: InstanceId,
    rank: u32,
    world_size: u32,
    identity: &[u8],
    mac: &[u8; MAC_BYTES],
) -> bool {
    let want = hello_mac(secret, instance, rank, world_size, identity);
    want.iter().zip(mac).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// The leader's CURVE secret key: HMAC-SHA256 keyed by the instance
/// secret over a label of its own (see [`crate::curve`]).
pub(crate) fn curve_seed(secret: &InstanceSecret) -> [u8; 32] {
    hmac_sha256(&secret.0, &[CURVE_DOMAIN])
}

/// HMAC-SHA256 (RFC 2104) of the concatenation of `parts`, with a key of
/// at most one block.
fn hmac_sha256(key: &[u8; SECRET_BYTES], parts: &[&[u8]]) -> [u8; MAC_BYTES] {
    let mut ipad = [0x36u8; BLOCK];
    let mut opad = [0x5cu8; BLOCK];
    for (i, k) in key.iter().enumerate() {
        ipad[i] ^= k;
        opad[i] ^= k;
    }
    let mut inner = Sha256::new();
    inner.update(ipad);
    for p in parts {
        inner.update(p);
    }
    let mut outer = Sha256::new();
    outer.update(opad);
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// Fills `buf` from the OS random source.
pub(crate) fn random_bytes(buf: &mut [u8]) -> Result<()> {
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .map_err(|source| DistError::Io {
            what: "read /dev/urandom",
            source,
        })
}

/// A random `u64` from the OS random source.
pub(crate) fn random_u64() -> Result<u64> {
    let mut b = [0u8; 8];
    random_bytes(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231_case_1() {
        // Case 1's key is 20 bytes of 0x0b; HMAC pads every short key with
        // zeros to the block, so the same key zero-padded to 32 bytes gives
        // the same MAC.
        let mut key = [0u8; SECRET_BYTES];
        key[..20].fill(0x0b);
        let mac = hmac_sha256(&key, &[b"Hi ", b"There"]);
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
    }

    #[test]
    fn macs_bind_every_field_and_the_secret() {
        let s = InstanceSecret::from_bytes([7; SECRET_BYTES]);
        let other = InstanceSecret::from_bytes([8; SECRET_BYTES]);
        let m = hello_mac(&s, 1, 0, 2, b"id");
        assert!(hello_mac_ok(&s, 1, 0, 2, b"id", &m));
        assert!(!hello_mac_ok(&other, 1, 0, 2, b"id", &m));
        assert!(!hello_mac_ok(&s, 2, 0, 2, b"id", &m));
        assert!(!hello_mac_ok(&s, 1, 1, 2, b"id", &m));
        assert!(!hello_mac_ok(&s, 1, 0, 3, b"id", &m));
        assert!(!hello_mac_ok(&s, 1, 0, 2, b"id2", &m));
    }

    #[test]
    fn secrets_round_trip_and_stay_out_of_debug() {
        let s = InstanceSecret::generate().unwrap();
        let t = InstanceSecret::from_hex(&s.to_hex()).unwrap();
        assert_eq!(s.0, t.0);
        assert!(!format!("{s:?}").contains(&s.to_hex()[..8]));
        assert!(InstanceSecret::from_hex("abc").is_err());
        assert!(InstanceSecret::from_hex(&"zz".repeat(SECRET_BYTES)).is_err());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        s.write_file(&path).unwrap();
        assert_eq!(InstanceSecret::read_file(&path).unwrap().0, s.0);
        assert!(s.write_file(&path).is_err(), "an existing file is kept");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(InstanceSecret::read_file(&path).is_err());
    }
}
