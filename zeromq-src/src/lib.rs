//! Builds libzmq for `zmq-sys` with CURVE whenever libsodium is installed.
//!
//! `zmq-sys` builds its vendored libzmq through a crate of this name and
//! always asks for a build without libsodium, which leaves ZeroMQ's CURVE
//! security mechanism out. The workspace patches this crate in its place:
//! it keeps the builder's interface, finds the system's libsodium with
//! `pkg-config` (Debian and Ubuntu: `libsodium-dev`) and links it
//! statically, so the resulting binaries need no libsodium at run time.
//! Where no static libsodium is found, libzmq is built without CURVE, as
//! before; `zmq::has("curve")` tells the two apart at run time.
//!
//! Set `KVBM_ZMQ_CURVE=off` to build without CURVE even where libsodium is
//! installed, or `KVBM_ZMQ_CURVE=require` to fail the build without it.

use std::path::{Path, PathBuf};

pub use upstream::LibLocation;

/// The environment variable that turns CURVE off (`off`) or makes it
/// mandatory (`require`); unset, CURVE is built where libsodium is found.
pub const CURVE_ENV: &str = "KVBM_ZMQ_CURVE";

/// The settings for building libzmq (the interface `zmq-sys` calls).
#[derive(Debug, Clone)]
pub struct Build {
    inner: upstream::Build,
    libsodium: Option<LibLocation>,
}

impl Default for Build {
    fn default() -> Self {
        Self::new()
    }
}

impl Build {
    /// A build with CURVE linked to the system libsodium where one is
    /// found.
    pub fn new() -> Self {
        Build {
            inner: upstream::Build::new(),
            libsodium: None,
        }
    }

    /// Builds the debug version of the library.
    pub fn build_debug(&mut self, enabled: bool) -> &mut Self {
        self.inner.build_debug(enabled);
        self
    }

    /// Enables libzmq's DRAFT API.
    pub fn enable_draft(&mut self, enabled: bool) -> &mut Self {
        self.inner.enable_draft(enabled);
        self
    }

    /// Links CURVE against the libsodium at `maybe`; `None` (what `zmq-sys`
    /// passes) means "the system's, if installed".
    pub fn with_libsodium(&mut self, maybe: Option<LibLocation>) -> &mut Self {
        self.libsodium = maybe;
        self
    }

    /// Compiles libzmq and prints the link directives for the calling build
    /// script.
    ///
    /// # Panics
    ///
    /// Build scripts report failure by panicking: this panics when
    /// `KVBM_ZMQ_CURVE=require` is set and no static libsodium is found.
    pub fn build(&mut self) {
        println!("cargo:rerun-if-env-changed={CURVE_ENV}");
        println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
        let mode = std::env::var(CURVE_ENV).unwrap_or_default();
        let sodium = match mode.as_str() {
            "off" => None,
            _ => self.libsodium.clone().or_else(system_libsodium),
        };
        if mode == "require" && sodium.is_none() {
            panic!(
                "{CURVE_ENV}=require, but no static libsodium was found through pkg-config \
                 (install libsodium-dev)"
            );
        }
        if sodium.is_none() && mode != "off" {
            println!(
                "cargo:warning=libsodium not found: ZeroMQ is built without CURVE \
                 (install libsodium-dev to encrypt leader/worker traffic across hosts)"
            );
        }
        self.inner.with_libsodium(sodium).build();
    }
}

/// The system's libsodium, when `pkg-config` knows it and its static
/// library is installed: its headers and archive copied under `OUT_DIR`,
/// so the compiler searches no system directory ahead of its own (a
/// cross toolchain, e.g. one targeting an older glibc, keeps its headers).
fn system_libsodium() -> Option<LibLocation> {
    let lib = pkg_config::Config::new()
        .cargo_metadata(false)
        .statik(true)
        .probe("libsodium")
        .ok()?;
    let var = |name: &str| pkg_config::get_variable("libsodium", name).ok();
    let archive = lib
        .link_paths
        .iter()
        .cloned()
        .chain(var("libdir").map(PathBuf::from))
        .map(|dir| dir.join("libsodium.a"))
        .find(|a| a.is_file())?;
    let include = lib
        .include_paths
        .iter()
        .cloned()
        .chain(var("includedir").map(PathBuf::from))
        .find(|dir| dir.join("sodium.h").is_file())?;
    let out = PathBuf::from(std::env::var_os("OUT_DIR")?).join("libsodium");
    let (inc, libdir) = (out.join("include"), out.join("lib"));
    copy_tree(&include.join("sodium"), &inc.join("sodium")).ok()?;
    std::fs::copy(include.join("sodium.h"), inc.join("sodium.h")).ok()?;
    std::fs::create_dir_all(&libdir).ok()?;
    std::fs::copy(&archive, libdir.join("libsodium.a")).ok()?;
    println!("cargo:rerun-if-changed={}", archive.display());
    Some(LibLocation::new(libdir, inc))
}

/// Copies the directory `from` (files and subdirectories) to `to`.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}
