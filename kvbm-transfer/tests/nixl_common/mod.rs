//! The skip rule of the NIXL tests: without the runtime a test prints
//! `skipped: NIXL runtime not found` and passes, unless `KVBM_REQUIRE_NIXL=1`
//! (set by `cargo xtask ci`, which installs the runtime) makes it fail.
#![allow(dead_code)]

use kvbm_transfer::nixl::{REQUIRE_ENV, runtime};

/// True when the test can use NIXL; false (after printing the skip line)
/// when it should return early. Panics when the runtime is required.
pub fn nixl_or_skip(test: &str) -> bool {
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
