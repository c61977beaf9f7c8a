//! What a kept G2 or G3 directory holds, read without opening it for an
//! engine: for an operator's listing (`python -m kvbm_py.cache`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use kvbm_layout::Layout;
use kvbm_transfer::PhysicalLayout;
use kvbm_transfer::memory::{DiskFile, IoMode};

use super::{
    BLOCKS_FILE, FORMAT_VERSION, HEADER_BYTES, IDENTITY_FILE, RECORD_BYTES, SLOTS_FILE, decode,
    header, io_err, is_unused_store, lock_dir,
};
use crate::error::DistError;

/// What a kept G2 or G3 directory holds ([`inspect`]).
#[derive(Debug, Clone, Default)]
pub struct Inspection {
    /// The identity its bytes were written under.
    pub identity: String,
    /// Block slots it has room for.
    pub slots: u32,
    /// Slots whose records name a block.
    pub blocks: u64,
    /// Bytes of those blocks.
    pub block_bytes: u64,
    /// Bytes its files take on disk.
    pub disk_bytes: u64,
    /// Records neither empty nor sound (torn or damaged).
    pub bad_records: u64,
    /// With verification: slots whose bytes do not match their checksum.
    pub bad_blocks: Vec<u32>,
    /// Whether the bytes were read and checked.
    pub verified: bool,
    /// Whether an engine has it open (then its bytes are not read).
    pub in_use: bool,
}

/// The value of `key` in an identity's `key: value` lines.
fn identity_field<T: std::str::FromStr>(identity: &str, key: &str) -> Option<T> {
    identity
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(": "))
        .and_then(|v| v.trim().parse().ok())
}

/// The G3 layout an identity was written for.
fn layout_of(identity: &str) -> Result<Layout, DistError> {
    let field = |key: &str| {
        identity_field::<usize>(identity, key)
            .ok_or_else(|| DistError::InvalidConfig(format!("the identity has no valid `{key}`")))
    };
    if identity_field::<u32>(identity, "kvbm-kept-format") != Some(FORMAT_VERSION) {
        return Err(DistError::InvalidConfig(format!(
            "not written in format {FORMAT_VERSION}"
        )));
    }
    let config = kvbm_layout::LayoutConfig::new(
        field("blocks")?,
        field("layers")?,
        field("outer")?,
        field("page_size")?,
        field("inner")?,
        field("dtype_bytes")?,
    )?
    .with_alignment(field("alignment")? as u64)?;
    Ok(Layout::new(
        config,
        kvbm_layout::LayoutKind::FullyContiguous,
    )?)
}

/// Lists what the kept G3 in `dir` holds: its identity, blocks and bytes,
/// and its damaged records; with `verify`, reads every block and checks
/// it against its record's checksum (only while no engine has it open:
/// the directory is locked meanwhile, so none can start).
pub fn inspect(dir: &Path, verify: bool) -> Result<Inspection, DistError> {
    let identity = std::fs::read_to_string(dir.join(IDENTITY_FILE)).map_err(io_err(format!(
        "read {}",
        dir.join(IDENTITY_FILE).display()
    )))?;
    let layout = layout_of(&identity)?;
    let slots = u32::try_from(layout.config().num_blocks())
        .map_err(|_| DistError::InvalidConfig("too many blocks".into()))?;
    let path = dir.join(SLOTS_FILE);
    let mut all = vec![0u8; (HEADER_BYTES + u64::from(slots) * RECORD_BYTES) as usize];
    File::open(&path)
        .and_then(|f| f.read_exact_at(&mut all, 0))
        .map_err(io_err(format!("read {}", path.display())))?;
    if all[..HEADER_BYTES as usize] != header(slots)[..] {
        return Err(DistError::InvalidConfig(format!(
            "{} has another format or size",
            path.display()
        )));
    }
    let mut found = Vec::new();
    let mut bad_records = 0;
    for (slot, r) in all[HEADER_BYTES as usize..]
        .chunks_exact(RECORD_BYTES as usize)
        .enumerate()
    {
        match decode(slot as u32, r) {
            Ok(Some((_, sum))) => found.push((slot as u32, sum)),
            Ok(None) => {}
            Err(()) => bad_records += 1,
        }
    }
    let disk_bytes = std::fs::read_dir(dir)
        .map_err(io_err(format!("list {}", dir.display())))?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
        .sum();
    let mut out = Inspection {
        slots,
        blocks: found.len() as u64,
        block_bytes: found.len() as u64 * layout.config().block_bytes(),
        disk_bytes,
        bad_records,
        in_use: !is_unused_store(dir),
        ..Inspection::default()
    };
    if verify && !out.in_use {
        let _lock = lock_dir(dir)?;
        let data = DiskFile::open(dir.join(BLOCKS_FILE), IoMode::Buffered)?;
        let g3 = PhysicalLayout::on_disk_file(layout, data)?;
        for (slot, sum) in found {
            if crate::verify::block_sum(&g3, slot as usize).ok() != Some(sum) {
                out.bad_blocks.push(slot);
            }
        }
        out.verified = true;
    }
    out.identity = identity;
    Ok(out)
}
