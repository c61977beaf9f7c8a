//! Encryption of leader/worker traffic on TCP: ZeroMQ's CURVE.
//!
//! On a TCP endpoint both ends speak CURVE (elliptic-curve key exchange,
//! then every frame encrypted and authenticated) whenever this build's
//! ZeroMQ has it ([`available`]; it does where libsodium was installed at
//! build time). The leader is the CURVE server. Its key pair is derived
//! from the instance secret ([`LeaderKey::derive`]), so every process that
//! holds the secret knows the leader's public key without a second thing to
//! hand out, and a worker only completes the handshake with a leader that
//! holds the secret too: nobody in between can read, change or replay a
//! frame, nor pose as the leader. Each worker's own key pair is fresh per
//! connection. Who the worker is stays the business of the `Hello` MAC
//! ([`crate::auth`]): knowing the leader's public key lets a stranger open
//! a connection, never join.
//!
//! IPC endpoints stay plain (they live in a directory only this user can
//! enter), and so does loopback TCP in a build without CURVE. A leader
//! refuses to bind a non-loopback TCP endpoint without CURVE
//! ([`check_endpoint`]): frames there would cross a network in clear.

use std::ffi::{CStr, CString, c_char, c_int};

use crate::auth::{InstanceSecret, curve_seed};
use crate::error::{DistError, Result};

/// Bytes of a CURVE key.
pub const KEY_BYTES: usize = 32;

/// True when this build's ZeroMQ supports CURVE.
pub fn available() -> bool {
    zmq::has("curve") == Some(true)
}

/// True when sockets on `endpoint` speak CURVE in this build: TCP
/// endpoints, where CURVE is [`available`].
pub fn used_on(endpoint: &str) -> bool {
    uses_curve(endpoint, available())
}

fn uses_curve(endpoint: &str, curve_built: bool) -> bool {
    curve_built && endpoint.starts_with("tcp://")
}

/// Refuses a leader endpoint whose frames would cross a network in clear:
/// a TCP endpoint whose host is not a loopback address, in a build whose
/// ZeroMQ has no CURVE.
pub fn check_endpoint(endpoint: &str) -> Result<()> {
    check(endpoint, available())
}

fn check(endpoint: &str, curve_built: bool) -> Result<()> {
    if crate::transport::is_remote_tcp(endpoint) && !curve_built {
        return Err(DistError::InvalidConfig(format!(
            "{endpoint}: frames on a network endpoint must be encrypted, and this build's \
             ZeroMQ has no CURVE (build kvbm with libsodium-dev installed), or bind \
             127.0.0.1 / an ipc:// endpoint"
        )));
    }
    Ok(())
}

/// The leader's CURVE key pair, derived from the instance secret.
#[derive(Clone)]
pub struct LeaderKey {
    secret: [u8; KEY_BYTES],
    public: LeaderPublicKey,
}

impl std::fmt::Debug for LeaderKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderKey")
            .field("public", &self.public)
            .finish_non_exhaustive()
    }
}

impl LeaderKey {
    /// The key pair of the leader of the instance holding `secret` (the
    /// same on every process that holds it).
    pub fn derive(secret: &InstanceSecret) -> Result<LeaderKey> {
        let seed = curve_seed(secret);
        let public = public_of(&seed)?;
        Ok(LeaderKey {
            secret: seed,
            public,
        })
    }

    /// The public half, which workers connect with.
    pub fn public(&self) -> &LeaderPublicKey {
        &self.public
    }

    /// Makes `socket` (not yet bound) a CURVE server with this key.
    pub(crate) fn serve(&self, socket: &zmq::Socket) -> Result<()> {
        socket
            .set_curve_server(true)
            .map_err(DistError::zmq("curve server"))?;
        socket
            .set_curve_secretkey(&self.secret)
            .map_err(DistError::zmq("curve secret key"))
    }
}

/// A leader's CURVE public key (printed in ZeroMQ's Z85 text form).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LeaderPublicKey([u8; KEY_BYTES]);

impl std::fmt::Debug for LeaderPublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LeaderPublicKey({self})")
    }
}

impl std::fmt::Display for LeaderPublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match zmq::z85_encode(&self.0) {
            Ok(text) => f.write_str(&text),
            Err(_) => Err(std::fmt::Error),
        }
    }
}

impl LeaderPublicKey {
    /// The key's 32 bytes.
    pub fn as_bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }

    /// Makes `socket` (not yet connected) a CURVE client of the leader
    /// holding this key, with a fresh key pair of its own.
    pub(crate) fn connect_as_client(&self, socket: &zmq::Socket) -> Result<()> {
        let mine = zmq::CurveKeyPair::new().map_err(DistError::zmq("curve key pair"))?;
        socket
            .set_curve_serverkey(&self.0)
            .map_err(DistError::zmq("curve server key"))?;
        socket
            .set_curve_publickey(&mine.public_key)
            .map_err(DistError::zmq("curve public key"))?;
        socket
            .set_curve_secretkey(&mine.secret_key)
            .map_err(DistError::zmq("curve secret key"))
    }
}

unsafe extern "C" {
    /// libzmq's X25519 public key of a Z85 secret key (both 40 characters
    /// plus a NUL); 0 on success.
    fn zmq_curve_public(z85_public_key: *mut c_char, z85_secret_key: *const c_char) -> c_int;
}

/// The public key of the CURVE secret key `secret`.
fn public_of(secret: &[u8; KEY_BYTES]) -> Result<LeaderPublicKey> {
    if !available() {
        return Err(no_curve());
    }
    let z85 = zmq::z85_encode(secret)
        .map_err(|e| DistError::InvalidConfig(format!("Z85-encode a CURVE key: {e:?}")))?;
    let z85 = CString::new(z85)
        .map_err(|_| DistError::InvalidConfig("a Z85 key has no NUL".to_string()))?;
    let mut out = [0 as c_char; 41];
    // SAFETY: `out` has room for a 40-character key and its NUL, `z85` is a
    // NUL-terminated 40-character Z85 key, and libzmq (linked through
    // zmq-sys) writes nothing beyond those 41 bytes.
    let rc = unsafe { zmq_curve_public(out.as_mut_ptr(), z85.as_ptr()) };
    if rc != 0 {
        return Err(no_curve());
    }
    // SAFETY: on success libzmq wrote a NUL-terminated string into `out`.
    let text = unsafe { CStr::from_ptr(out.as_ptr()) }
        .to_str()
        .map_err(|_| DistError::InvalidConfig("libzmq returned a non-Z85 key".to_string()))?;
    let bytes = zmq::z85_decode(text)
        .map_err(|e| DistError::InvalidConfig(format!("decode a Z85 key: {e:?}")))?;
    let key: [u8; KEY_BYTES] = bytes
        .try_into()
        .map_err(|_| DistError::InvalidConfig("a CURVE key is 32 bytes".to_string()))?;
    Ok(LeaderPublicKey(key))
}

fn no_curve() -> DistError {
    DistError::InvalidConfig(
        "this build's ZeroMQ has no CURVE (build kvbm with libsodium-dev installed)".to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_tcp_speaks_curve_and_only_where_built() {
        assert!(uses_curve("tcp://127.0.0.1:5555", true));
        assert!(uses_curve("tcp://10.0.0.2:5555", true));
        assert!(!uses_curve("ipc:///tmp/x/leader.sock", true));
        assert!(!uses_curve("tcp://10.0.0.2:5555", false));
    }

    #[test]
    fn a_network_endpoint_without_curve_is_refused() {
        let e = check("tcp://10.0.0.2:5555", false).unwrap_err();
        assert!(e.to_string().contains("libsodium"), "{e}");
        assert!(check("tcp://0.0.0.0:*", false).is_err());
        assert!(check("tcp://10.0.0.2:5555", true).is_ok());
        assert!(check("tcp://127.0.0.1:*", false).is_ok());
        assert!(check("tcp://[::1]:5555", false).is_ok());
        assert!(check("ipc:///tmp/x/leader.sock", false).is_ok());
    }

    #[test]
    fn leader_keys_follow_the_secret() {
        if !available() {
            assert!(
                std::env::var("KVBM_REQUIRE_CURVE").as_deref() != Ok("1"),
                "KVBM_REQUIRE_CURVE=1 but this build's ZeroMQ has no CURVE"
            );
            eprintln!("skipped: no CURVE in this build");
            return;
        }
        let a = InstanceSecret::from_bytes([1; 32]);
        let b = InstanceSecret::from_bytes([2; 32]);
        let ka = LeaderKey::derive(&a).unwrap();
        assert_eq!(ka.public(), LeaderKey::derive(&a).unwrap().public());
        assert_ne!(ka.public(), LeaderKey::derive(&b).unwrap().public());
        assert_ne!(ka.public().as_bytes(), &ka.secret, "public ≠ secret");
        assert_eq!(ka.public().to_string().len(), 40);
        let debug = format!("{ka:?}");
        assert!(!debug.contains(&zmq::z85_encode(&ka.secret).unwrap()));
    }
}
