//! NIXL backends (feature `nixl`): host ↔ disk through NIXL's POSIX plugin,
//! and remote G2 → G2 pulls between kvbm instances over UCX.
//!
//! # Why NIXL, and why both halves live here
//! NIXL is the transfer library the inference engines we serve already ship
//! (Dynamo, vLLM's NIXL connector): one agent per process, memory and files
//! registered once, then descriptor lists moved by a plugin. Its POSIX
//! plugin gives us a second disk path to compare against our own io_uring
//! engine (io_uring stays the default; see [`NixlDiskBackend`] for how to
//! select NIXL), and its UCX plugin is how one instance reads another's G2
//! blocks (the G4 tier) without a copy through the CPU of either side.
//!
//! # The runtime is optional, and probed first
//! nixl-sys is built with `stub-api`: nothing of NIXL is linked; the first
//! call dlopens `libnixl_capi.so` (from the `nixl-cu13` wheel's
//! `.nixl_cu13.mesonpy.libs`, found through `LD_LIBRARY_PATH`). When that
//! library is missing, every NIXL call except `is_stub()` *aborts the
//! process*. So every entry point of this module calls [`runtime`] first and
//! turns a missing runtime into a typed [`NixlUnavailable`] — never an
//! abort.
//!
//! # Completion is polled, by NIXL's design
//! NIXL's C API reports completion only through `getXferStatus`; it has no
//! callback and no file descriptor to sleep on. One poller thread per
//! backend asks about every request in flight, backing off from a yield to
//! a short sleep while nothing finishes, and sleeps on a condition variable
//! when nothing is in flight — the only poll in kvbm, and it is NIXL's. Its
//! CPU cost per GiB is measured in `docs/benchmarks.md`, "Host, disk and
//! NIXL transfers (kvbm-transfer)".
//!
//! # Environment on CPU machines
//! UCX may crash at process exit in its InfiniBand module; set
//! `UCX_MODULES=^ib` where there is no InfiniBand. Loopback tests use
//! `UCX_TLS=tcp` and `UCX_NET_DEVICES=lo`.

mod desc;
mod error;
pub mod peer;
mod poller;
pub mod posix;
pub mod remote;

use std::sync::OnceLock;

pub use error::{NixlUnavailable, RemoteError};
pub use peer::{MAX_PEER_BYTES, PEER_FORMAT_VERSION, PeerRegion, RegionKind, RemotePeer};
pub use posix::{NixlDiskBackend, NixlDiskConfig, PosixIo};
pub use remote::{ConnectedPeer, NixlRemote, RemoteConfig};

/// The environment variable a CI machine sets so that a NIXL test which
/// would skip for lack of the runtime fails instead.
pub const REQUIRE_ENV: &str = "KVBM_REQUIRE_NIXL";

/// Checks that the NIXL runtime (`libnixl_capi.so`) can be loaded, once per
/// process. Every NIXL entry point in this crate calls it before any other
/// NIXL call, because in stub mode those calls abort the process.
pub fn runtime() -> Result<(), NixlUnavailable> {
    static PROBE: OnceLock<bool> = OnceLock::new();
    // `is_stub` is the one call that is safe without the runtime: it only
    // reports whether the dlopen of libnixl_capi.so succeeded.
    if *PROBE.get_or_init(|| !nixl_sys::is_stub()) {
        Ok(())
    } else {
        Err(NixlUnavailable::RuntimeMissing)
    }
}

/// Whether the NIXL runtime is loadable in this process.
pub fn runtime_available() -> bool {
    runtime().is_ok()
}

/// The skip rule of NIXL tests and benchmarks: true when `test` can use
/// NIXL; false, after printing `skipped: NIXL runtime not found (test)`,
/// when it should return early — unless [`REQUIRE_ENV`] is `1`, where a
/// missing runtime is a failure and this panics naming `test`. For test
/// harnesses only (the panic is the point there); nothing in the library
/// calls it.
pub fn runtime_or_skip(test: &str) -> bool {
    match runtime() {
        Ok(()) => true,
        Err(e) if std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1") => {
            panic!("{test}: {REQUIRE_ENV}=1 but {e}")
        }
        Err(_) => {
            println!("skipped: NIXL runtime not found ({test})");
            false
        }
    }
}
