//! One-hop routes out of a file, tried before a two-hop strategy.
//!
//! Onboarding from a buffered (page-cached) file to the GPU through bounce
//! slots costs a CPU copy (page cache → pinned slot) and a DMA (slot →
//! device), and the two share DRAM bandwidth so much that the pipeline
//! moves little more than the two hops run one after the other
//! (`docs/benchmarks.md`, "Disk to GPU: bounce pipeline and file-window
//! route"). The page cache is host memory already: a route can page-lock a
//! window of the file's mapping and let the device's DMA read it straight,
//! with no CPU copy at all.
//!
//! Whether such a route can take a job is only known per job (is the file
//! open with `O_DIRECT`? does the kernel let the driver pin its pages?), so
//! it is not a row of the strategy table but a [`FileRoute`] the executor
//! asks first, for the pairs it serves; a job it declines — with a
//! [`RouteRefusal`] saying why — goes through the table's two-hop row as
//! before. [`route_refusal`] is that choice, as a pure function of what
//! is known about the job, and [`plan_windows`] cuts a job into the file
//! windows the route registers one at a time.

use std::sync::Arc;

use kvbm_layout::CopyRun;

use crate::backend::{Side, TransferJob};
use crate::completion::Completion;
use crate::error::{Result, TransferError};
use crate::memory::{DiskFile, MemoryKind, MemoryRegion};

/// Page size that window bounds are rounded to.
pub const WINDOW_ALIGN: u64 = 4096;

/// Why a [`FileRoute`] declined a job (it then takes the two-hop path).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteRefusal {
    /// The route does not serve this (source, destination) pair, e.g. the
    /// direction device → file, or another device's memory.
    Pair {
        /// Source kind.
        src: MemoryKind,
        /// Destination kind.
        dst: MemoryKind,
    },
    /// The source file is open with `O_DIRECT`: its bytes are not in the
    /// page cache, and the disk must read them anyway.
    DirectFile,
    /// The driver or kernel refused to page-lock the file's pages (say, a
    /// kernel that refuses long-term pins of file pages, or a device
    /// without read-only registration).
    Registration(String),
}

impl std::fmt::Display for RouteRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouteRefusal::Pair { src, dst } => write!(f, "{src:?} -> {dst:?} is not served"),
            RouteRefusal::DirectFile => write!(f, "the source file is open with O_DIRECT"),
            RouteRefusal::Registration(m) => write!(f, "page-locking the file was refused: {m}"),
        }
    }
}

/// What decides whether a job can take a one-hop file route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteFacts<'a> {
    /// Source memory kind.
    pub src: MemoryKind,
    /// Destination memory kind.
    pub dst: MemoryKind,
    /// The destination kind the route writes (its device).
    pub serves_dst: MemoryKind,
    /// Whether any source file is open with `O_DIRECT`.
    pub direct_source: bool,
    /// The refusal the driver gave for one of the source files' file
    /// systems, if it did.
    pub registration: Option<&'a str>,
}

/// The choice: `None` when the job can take the route, else why not.
/// Checked in this order: the pair, `O_DIRECT` sources, refused
/// registration.
pub fn route_refusal(facts: RouteFacts<'_>) -> Option<RouteRefusal> {
    if facts.src != MemoryKind::Disk || facts.dst != facts.serves_dst {
        return Some(RouteRefusal::Pair {
            src: facts.src,
            dst: facts.dst,
        });
    }
    if facts.direct_source {
        return Some(RouteRefusal::DirectFile);
    }
    facts
        .registration
        .map(|m| RouteRefusal::Registration(m.to_string()))
}

/// A one-hop route from files to another kind of memory, asked before the
/// strategy table's two-hop row for the same pair.
pub trait FileRoute: Send + Sync + 'static {
    /// A short name for logs.
    fn name(&self) -> &'static str;

    /// `None` when the route takes `job`, else why not. May probe (and
    /// remember) whether the source's file system can be page-locked.
    fn refusal(&self, job: &TransferJob) -> Option<RouteRefusal>;

    /// Starts `job` (one the route did not refuse). Resolves like a
    /// backend's completion: `Ok` only when every byte landed; on failure or
    /// cancellation, once nothing of the job is in flight.
    fn submit(&self, job: TransferJob) -> Completion;
}

/// One window of a source file: the page-aligned byte range
/// `[start, start + len)` to page-lock, and the runs of the job that read
/// from it, their source offsets relative to `start` (region 0).
#[derive(Debug, Clone)]
pub struct FileWindow {
    /// The file.
    pub file: Arc<DiskFile>,
    /// First byte of the window in the file (a multiple of [`WINDOW_ALIGN`]).
    pub start: u64,
    /// Bytes in the window (a multiple of [`WINDOW_ALIGN`]).
    pub len: u64,
    /// The runs, `src_region` 0 and `src_offset` from `start`; destination
    /// fields as in the job.
    pub runs: Vec<CopyRun>,
}

/// Cuts `job` (file source regions) into windows over its source files, in
/// file order: the page-rounded byte ranges the runs read are merged where
/// less than `max_gap` apart (pinning the gap costs less than a second
/// registration), and each merged range is cut into windows of at most
/// `window_bytes` (rounded up to a page). Windows never share a page, even
/// where runs read the same bytes twice; runs are split at window edges.
/// Bounds are checked first.
pub fn plan_windows(job: &TransferJob, window_bytes: u64, max_gap: u64) -> Result<Vec<FileWindow>> {
    job.validate_bounds()?;
    let w = align_up(window_bytes.max(WINDOW_ALIGN));
    let regions = job.regions(Side::Source);
    // Per file: its runs as (absolute offset, run).
    type FileRuns = (Arc<DiskFile>, Vec<(u64, CopyRun)>);
    let mut files: Vec<FileRuns> = Vec::new();
    for run in job.runs.iter().filter(|r| r.len > 0) {
        let (file, base) = source_file(regions, run)?;
        let at = base + run.src_offset;
        match files.iter_mut().find(|(f, _)| f.id() == file.id()) {
            Some((_, list)) => list.push((at, *run)),
            None => files.push((Arc::clone(file), vec![(at, *run)])),
        }
    }
    files.sort_by_key(|(f, _)| f.id());
    let mut out = Vec::new();
    for (file, mut pieces) in files {
        pieces.sort_by_key(|&(at, _)| at);
        // Merged page-rounded ranges.
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for &(at, run) in &pieces {
            let (a, b) = (align_down(at), align_up(at + run.len));
            match ranges.last_mut() {
                Some(last) if a <= last.1.saturating_add(max_gap) => last.1 = last.1.max(b),
                _ => ranges.push((a, b)),
            }
        }
        // Windows of at most `w` bytes over them.
        let first = out.len();
        for (a, b) in ranges {
            let mut at = a;
            while at < b {
                let len = w.min(b - at);
                out.push(FileWindow {
                    file: Arc::clone(&file),
                    start: at,
                    len,
                    runs: Vec::new(),
                });
                at += len;
            }
        }
        // Each run into the windows it reads, split at their edges.
        let windows = &mut out[first..];
        for (at, run) in pieces {
            let mut done = 0;
            while done < run.len {
                let pos = at + done;
                let i = windows.partition_point(|x| x.start + x.len <= pos);
                let win = &mut windows[i];
                let len = (run.len - done).min(win.start + win.len - pos);
                win.runs.push(CopyRun {
                    src_region: 0,
                    src_offset: pos - win.start,
                    dst_region: run.dst_region,
                    dst_offset: run.dst_offset + done,
                    len,
                });
                done += len;
            }
        }
    }
    out.retain(|x| !x.runs.is_empty());
    Ok(out)
}

/// Cuts `job` into the fixed windows `[k × window_bytes, (k + 1) ×
/// window_bytes)` of its source files that its runs touch (each clamped to
/// the file's page-rounded end), runs split at window edges — stable
/// windows, so a route can keep them registered between jobs. Bounds are
/// checked first; `window_bytes` is rounded up to a page.
pub fn plan_fixed_windows(job: &TransferJob, window_bytes: u64) -> Result<Vec<FileWindow>> {
    job.validate_bounds()?;
    let w = align_up(window_bytes.max(WINDOW_ALIGN));
    let regions = job.regions(Side::Source);
    let mut windows: Vec<FileWindow> = Vec::new();
    let mut index: std::collections::HashMap<(u64, u64), usize> = Default::default();
    for run in job.runs.iter().filter(|r| r.len > 0) {
        let (file, base) = source_file(regions, run)?;
        let mut done = 0;
        while done < run.len {
            let at = base + run.src_offset + done;
            let slot = at / w;
            let len = (run.len - done).min((slot + 1) * w - at);
            let i = *index.entry((file.id(), slot)).or_insert_with(|| {
                let start = slot * w;
                windows.push(FileWindow {
                    file: Arc::clone(file),
                    start,
                    len: w.min(align_up(file.len()).saturating_sub(start)),
                    runs: Vec::new(),
                });
                windows.len() - 1
            });
            windows[i].runs.push(CopyRun {
                src_region: 0,
                src_offset: at - slot * w,
                dst_region: run.dst_region,
                dst_offset: run.dst_offset + done,
                len,
            });
            done += len;
        }
    }
    windows.sort_by_key(|x| (x.file.id(), x.start));
    Ok(windows)
}

/// The file under `run`'s source and the offset of its region in it.
fn source_file<'a>(regions: &'a [MemoryRegion], run: &CopyRun) -> Result<(&'a Arc<DiskFile>, u64)> {
    regions[run.src_region as usize]
        .file_location()
        .ok_or_else(|| TransferError::InvalidRequest("a file route's source is not a file".into()))
}

fn align_down(x: u64) -> u64 {
    x / WINDOW_ALIGN * WINDOW_ALIGN
}

fn align_up(x: u64) -> u64 {
    x.div_ceil(WINDOW_ALIGN) * WINDOW_ALIGN
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::CancelToken;
    use crate::memory::{DiskAllocator, DiskOptions, IoMode, MemoryRegion};
    use proptest::prelude::*;

    fn facts(src: MemoryKind, dst: MemoryKind) -> RouteFacts<'static> {
        RouteFacts {
            src,
            dst,
            serves_dst: MemoryKind::Device(0),
            direct_source: false,
            registration: None,
        }
    }

    #[test]
    fn choice_takes_buffered_files_to_its_device_only() {
        let dev = MemoryKind::Device(0);
        assert_eq!(route_refusal(facts(MemoryKind::Disk, dev)), None);
        for (s, d) in [
            (dev, MemoryKind::Disk),
            (MemoryKind::Disk, MemoryKind::Device(1)),
            (MemoryKind::Disk, MemoryKind::Pinned),
            (MemoryKind::Pinned, dev),
        ] {
            assert_eq!(
                route_refusal(facts(s, d)),
                Some(RouteRefusal::Pair { src: s, dst: d })
            );
        }
        let direct = RouteFacts {
            direct_source: true,
            registration: Some("refused"),
            ..facts(MemoryKind::Disk, dev)
        };
        assert_eq!(route_refusal(direct), Some(RouteRefusal::DirectFile));
        let refused = RouteFacts {
            registration: Some("CUDA_ERROR_NOT_PERMITTED"),
            ..facts(MemoryKind::Disk, dev)
        };
        assert_eq!(
            route_refusal(refused),
            Some(RouteRefusal::Registration(
                "CUDA_ERROR_NOT_PERMITTED".into()
            ))
        );
    }

    fn file_job(file_len: u64, runs: Vec<CopyRun>) -> (TransferJob, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let alloc = DiskAllocator::new(
            dir.path(),
            DiskOptions {
                io_mode: IoMode::Buffered,
                ..Default::default()
            },
        )
        .unwrap();
        let file = alloc.allocate(file_len).unwrap();
        let src = vec![
            MemoryRegion::file(file.clone(), 0, file_len / 2).unwrap(),
            MemoryRegion::file(file, file_len / 2, file_len / 2).unwrap(),
        ];
        let dst_buf = crate::memory::SystemAllocator::new()
            .allocate(file_len)
            .unwrap();
        let job = TransferJob::new(
            src.into(),
            vec![dst_buf.region()].into(),
            runs.into(),
            CancelToken::new(),
        );
        (job, dir)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn windows_cover_every_run_once_within_bounds(
            raw in proptest::collection::vec((0u32..2, 0u64..60_000, 1u64..6_000), 1..24),
            window in 4096u64..20_000,
            gap in 0u64..10_000,
            aligned in any::<bool>(),
        ) {
            let half = 1u64 << 20;
            let page = |x: u64| if aligned { x.div_ceil(WINDOW_ALIGN) * WINDOW_ALIGN } else { x };
            let mut dst = 0;
            let runs: Vec<CopyRun> = raw.iter().map(|&(r, off, len)| {
                let run = CopyRun { src_region: r, src_offset: page(off), dst_region: 0, dst_offset: dst, len: page(len) };
                dst += page(len);
                run
            }).collect();
            let (job, _dir) = file_job(2 * half, runs.clone());
            let windows = plan_windows(&job, window, gap).unwrap();
            if aligned {
                // Page-aligned runs: no two windows share a page (they
                // could not both be registered).
                let mut spans: Vec<(u64, u64)> = windows.iter().map(|w| (w.start, w.start + w.len)).collect();
                spans.sort_unstable();
                for pair in spans.windows(2) {
                    prop_assert!(pair[0].1 <= pair[1].0, "{:?}", pair);
                }
            }
            let mut got = Vec::new();
            for w in &windows {
                prop_assert_eq!(w.start % WINDOW_ALIGN, 0);
                prop_assert_eq!(w.len % WINDOW_ALIGN, 0);
                prop_assert!(w.len <= window.div_ceil(WINDOW_ALIGN) * WINDOW_ALIGN + 2 * WINDOW_ALIGN);
                for r in &w.runs {
                    prop_assert_eq!(r.src_region, 0);
                    prop_assert!(r.src_offset + r.len <= w.len);
                    got.push((w.start + r.src_offset, r.dst_offset, r.len));
                }
            }
            // Every destination byte is written once, from the right file byte.
            let mut want: Vec<(u64, u64, u64)> = runs.iter().map(|r| (r.src_region as u64 * half + r.src_offset, r.dst_offset, r.len)).collect();
            let split = |v: &mut Vec<(u64, u64, u64)>| {
                let mut bytes: Vec<(u64, u64)> = v.iter().flat_map(|&(s, d, l)| (0..l).map(move |i| (d + i, s + i))).collect();
                bytes.sort_unstable();
                bytes
            };
            prop_assert_eq!(split(&mut got), split(&mut want));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn fixed_windows_are_stable_and_cover_every_run_once(
            raw in proptest::collection::vec((0u32..2, 0u64..60_000, 1u64..6_000), 1..24),
            window in 4096u64..20_000,
        ) {
            let half = 1u64 << 20;
            let mut dst = 0;
            let runs: Vec<CopyRun> = raw.iter().map(|&(r, off, len)| {
                let run = CopyRun { src_region: r, src_offset: off, dst_region: 0, dst_offset: dst, len };
                dst += len;
                run
            }).collect();
            let (job, _dir) = file_job(2 * half, runs.clone());
            let w = window.div_ceil(WINDOW_ALIGN) * WINDOW_ALIGN;
            let windows = plan_fixed_windows(&job, window).unwrap();
            let mut got = Vec::new();
            for win in &windows {
                prop_assert_eq!(win.start % w, 0);
                prop_assert!(win.len <= w);
                for r in &win.runs {
                    prop_assert!(r.src_offset + r.len <= win.len);
                    got.push((win.start + r.src_offset, r.dst_offset, r.len));
                }
            }
            for pair in windows.windows(2) {
                prop_assert!(pair[0].start < pair[1].start);
            }
            let mut want: Vec<(u64, u64, u64)> = runs.iter().map(|r| (r.src_region as u64 * half + r.src_offset, r.dst_offset, r.len)).collect();
            let bytes = |v: &mut Vec<(u64, u64, u64)>| {
                let mut b: Vec<(u64, u64)> = v.iter().flat_map(|&(s, d, l)| (0..l).map(move |i| (d + i, s + i))).collect();
                b.sort_unstable();
                b
            };
            prop_assert_eq!(bytes(&mut got), bytes(&mut want));
        }
    }

    #[test]
    fn contiguous_job_makes_full_windows_in_file_order() {
        let mib = 1u64 << 20;
        // Two regions of 4 MiB, runs given back to front.
        let runs: Vec<CopyRun> = (0..8u64)
            .rev()
            .map(|i| CopyRun {
                src_region: (i / 4) as u32,
                src_offset: (i % 4) * mib,
                dst_region: 0,
                dst_offset: i * mib,
                len: mib,
            })
            .collect();
        let (job, _dir) = file_job(8 * mib, runs);
        let w = plan_windows(&job, 2 * mib, 0).unwrap();
        assert_eq!(w.len(), 4);
        for (i, win) in w.iter().enumerate() {
            assert_eq!((win.start, win.len), (i as u64 * 2 * mib, 2 * mib));
        }
    }
}
