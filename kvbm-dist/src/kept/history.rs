//! The engine's use history beside its kept tiers: written now and then
//! while it runs, read back when a restarted engine reopens them, so that
//! it ranks their blocks by their past uses, not as blocks used once.
//!
//! The file is a journal: a whole snapshot, then the changes taken since
//! (the blocks used since the last write), each a frame of its length and
//! its checksummed encoding. A write appends the changes, so it costs what
//! was used since, not what the history remembers, and the history can be
//! written every second. Once the changes outgrow the snapshot they follow,
//! a write replaces the file with one whole snapshot, through a temporary
//! file renamed over it. A crash leaves a torn last frame at worst, and
//! reading stops before it.
//!
//! Only a ranking depends on it: a missing, old or damaged file costs hits
//! until the history is learned again, never a byte.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use kvbm_pool::policy::{HistorySnapshot, HistorySource};

/// How often a [`HistoryKeeper`] writes the history by default.
pub const HISTORY_EVERY: Duration = Duration::from_secs(1);

/// Bytes of a frame's length, before its encoding.
const FRAME_HEAD: usize = 8;

/// Writes an engine's use history (its tier engine's, or its ledger's) to
/// one file, at most once per interval.
#[derive(Debug)]
pub struct HistoryKeeper {
    path: PathBuf,
    every: Duration,
    last: Option<Duration>,
    journal: Mutex<Journal>,
}

/// What the keeper wrote to its file.
#[derive(Debug, Default)]
struct Journal {
    /// The history's use stamp at the last frame written; `None` until a
    /// whole snapshot starts the file (and after a failed write).
    seq: Option<u64>,
    /// Bytes of that snapshot's frame.
    base: u64,
    /// Bytes of the changes appended after it.
    appended: u64,
}

impl HistoryKeeper {
    /// Keeps the history in `path`, written at most once per `every`.
    pub fn new(path: impl Into<PathBuf>, every: Duration) -> Self {
        HistoryKeeper {
            path: path.into(),
            every,
            last: None,
            journal: Mutex::new(Journal::default()),
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `engine`'s history if the last write is `every` old at
    /// `now` (or there was none); whether it wrote. `now` is on the
    /// caller's clock: the time since it started, or the time of a replayed
    /// trace, so that a replay writes as often per request as a live
    /// engine would. A failed write is logged, not returned: the history
    /// is advisory.
    pub fn maybe_save(&mut self, engine: &dyn HistorySource, now: Duration) -> bool {
        if self
            .last
            .is_some_and(|t| now.saturating_sub(t) < self.every)
        {
            return false;
        }
        self.last = Some(now);
        self.save(engine)
    }

    /// Writes what changed in `engine`'s history since the last write, or
    /// the whole history where the file must start again; whether it
    /// could.
    pub fn save(&self, engine: &dyn HistorySource) -> bool {
        let mut journal = self.journal.lock();
        let result = match journal.seq {
            Some(seq) if journal.appended <= journal.base && self.path.exists() => {
                let changes = engine.history_changes(seq);
                if changes.seq == seq {
                    return true;
                }
                let frame = frame(&changes);
                self.append(&frame).map(|()| {
                    journal.seq = Some(changes.seq);
                    journal.appended += frame.len() as u64;
                })
            }
            _ => {
                let whole = engine.history_snapshot();
                let frame = frame(&whole);
                self.replace(&frame).map(|()| {
                    *journal = Journal {
                        seq: Some(whole.seq),
                        base: frame.len() as u64,
                        appended: 0,
                    };
                })
            }
        };
        result
            .inspect_err(|e| {
                // A torn frame may be left: the next write starts over.
                journal.seq = None;
                tracing::warn!(path = %self.path.display(), "use history not written: {e}");
            })
            .is_ok()
    }

    fn append(&self, frame: &[u8]) -> std::io::Result<()> {
        std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)?
            .write_all(frame)
    }

    fn replace(&self, frame: &[u8]) -> std::io::Result<()> {
        let mut tmp = self.path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        std::fs::write(&tmp, frame)?;
        std::fs::rename(&tmp, &self.path)
    }

    /// Gives `engine` the history this file holds, before its kept blocks
    /// are registered; the blocks it remembers (0 for no file or one that
    /// is damaged, which is logged). A torn or damaged frame ends the
    /// file: what came before it counts.
    pub fn load(&self, engine: &dyn HistorySource) -> usize {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return 0,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), "use history not read: {e}");
                return 0;
            }
        };
        let (parts, rest) = frames(&bytes);
        if rest > 0 {
            tracing::debug!(path = %self.path.display(), "use history: {rest} bytes after the last whole frame ignored");
        }
        match HistorySnapshot::combine(parts) {
            Some(s) => {
                engine.restore_history(&s);
                s.blocks.len()
            }
            None => {
                tracing::warn!(path = %self.path.display(), "use history damaged: ignored");
                0
            }
        }
    }
}

/// `snapshot` as a frame of the journal: its encoding's length, then the
/// encoding.
fn frame(snapshot: &HistorySnapshot) -> Vec<u8> {
    let body = snapshot.to_bytes();
    let mut out = Vec::with_capacity(FRAME_HEAD + body.len());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// The whole frames at the start of `bytes`, and how many bytes follow
/// them (a torn or damaged frame and whatever comes after it).
fn frames(mut bytes: &[u8]) -> (Vec<HistorySnapshot>, usize) {
    let mut parts = Vec::new();
    while let Some((head, rest)) = bytes.split_first_chunk::<FRAME_HEAD>() {
        let Some((body, after)) = usize::try_from(u64::from_le_bytes(*head))
            .ok()
            .and_then(|n| rest.split_at_checked(n))
        else {
            break;
        };
        let Some(part) = HistorySnapshot::from_bytes(body) else {
            break;
        };
        parts.push(part);
        bytes = after;
    }
    (parts, bytes.len())
}

impl HistoryKeeper {
    /// Writes `engine`'s history every interval on a thread of its own,
    /// and once more when the writer is dropped (while the engine lives).
    pub fn spawn<E: HistorySource + 'static>(
        self,
        engine: &Arc<E>,
    ) -> std::io::Result<HistoryWriter> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let keeper = Arc::new(self);
        let engine: Arc<dyn HistorySource> = Arc::<E>::clone(engine);
        let engine = Arc::downgrade(&engine);
        let (flag, k, e) = (Arc::clone(&stop), Arc::clone(&keeper), engine.clone());
        let thread = std::thread::Builder::new()
            .name("kvbm-history".into())
            .spawn(move || write_loop(&k, &e, &flag))?;
        Ok(HistoryWriter {
            keeper,
            engine,
            stop,
            thread: Some(thread),
        })
    }
}

fn write_loop(
    keeper: &HistoryKeeper,
    engine: &Weak<dyn HistorySource>,
    stop: &(Mutex<bool>, Condvar),
) {
    loop {
        let stopping = {
            let mut s = stop.0.lock();
            if !*s {
                stop.1.wait_for(&mut s, keeper.every);
            }
            *s
        };
        let Some(engine) = engine.upgrade() else {
            return;
        };
        keeper.save(&*engine);
        if stopping {
            return;
        }
    }
}

/// The thread of [`HistoryKeeper::spawn`]; dropping it writes once more
/// and stops it.
#[derive(Debug)]
pub struct HistoryWriter {
    keeper: Arc<HistoryKeeper>,
    engine: Weak<dyn HistorySource>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl HistoryWriter {
    /// Writes the history now (a process about to exit); whether it could
    /// (not once the engine is gone).
    pub fn save_now(&self) -> bool {
        self.engine
            .upgrade()
            .is_some_and(|engine| self.keeper.save(&*engine))
    }
}

impl Drop for HistoryWriter {
    fn drop(&mut self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_block::SequenceHash;
    use kvbm_pool::TierEngine;
    use kvbm_pool::tier::{G1Lookup, KvShape};
    use std::time::Instant;

    fn engine() -> TierEngine {
        let shape = KvShape::mha(2, 1, 128);
        TierEngine::builder(shape)
            .g1_host(4)
            .g2_host_bytes(4 * shape.block_bytes())
            .build()
            .unwrap()
    }

    #[test]
    fn the_history_survives_in_its_file_and_a_damaged_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        // An engine that saw blocks 7 and 8 in three requests.
        let mut seen = kvbm_pool::policy::UseHistory::new(64);
        for _ in 0..3 {
            seen.record_request(&[SequenceHash(7), SequenceHash(8)]);
        }
        let old = engine();
        old.restore_history(&seen.snapshot());
        assert_eq!(old.uses(SequenceHash(7)), 3);
        let mut keeper = HistoryKeeper::new(dir.path().join("uses"), Duration::from_secs(3600));
        assert!(keeper.maybe_save(&old, Duration::ZERO));
        let later = Duration::from_secs(3599);
        assert!(!keeper.maybe_save(&old, later), "written once per interval");
        assert!(keeper.maybe_save(&old, Duration::from_secs(3600)));
        let new = engine();
        assert_eq!(keeper.load(&new), 2);
        assert_eq!(new.uses(SequenceHash(7)), 3);
        std::fs::write(keeper.path(), b"garbage").unwrap();
        let cold = engine();
        assert_eq!(keeper.load(&cold), 0);
        assert_eq!(cold.uses(SequenceHash(7)), 0);
        let nothing = HistoryKeeper::new(dir.path().join("none"), HISTORY_EVERY);
        assert_eq!(nothing.load(&engine()), 0);
    }

    /// Requests `id` for `blocks` (their uses go to the history).
    fn request(engine: &TierEngine, id: u64, blocks: &[u64]) {
        let hashes: Vec<_> = blocks.iter().map(|&b| SequenceHash(b)).collect();
        engine
            .match_request(id, &hashes, 128 * hashes.len() + 1, G1Lookup::Pool)
            .unwrap();
        engine.release(id);
    }

    fn len(path: &Path) -> u64 {
        std::fs::metadata(path).unwrap().len()
    }

    #[test]
    fn changes_are_appended_until_they_outgrow_the_snapshot_and_a_torn_end_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("uses");
        let live = engine();
        let keeper = HistoryKeeper::new(&path, HISTORY_EVERY);
        let all: Vec<u64> = (0..32).collect();
        request(&live, 0, &all);
        assert!(keeper.save(&live));
        let base = len(&path);
        // One block used since: one small frame appended.
        request(&live, 1, &[3]);
        assert!(keeper.save(&live));
        assert!(len(&path) > base && len(&path) - base < base / 4);
        // Nothing used since: nothing written.
        let before = len(&path);
        assert!(keeper.save(&live));
        assert_eq!(len(&path), before);
        // The changes outgrow the snapshot: the file starts again, whole.
        let mut shrank = false;
        for i in 0..64 {
            request(&live, 2 + i, &[i % 32]);
            let before = len(&path);
            assert!(keeper.save(&live));
            shrank |= len(&path) < before;
            assert!(len(&path) <= 2 * base + base / 4, "{} bytes", len(&path));
        }
        assert!(shrank, "never compacted");
        request(&live, 100, &[5]);
        assert!(keeper.save(&live));
        // A crash in the middle of the next append leaves part of a frame.
        let mut torn = frame(&live.history_snapshot());
        torn.truncate(torn.len() / 2);
        keeper.append(&torn).unwrap();
        let back = engine();
        assert_eq!(keeper.load(&back), 32);
        for b in all {
            let h = SequenceHash(b);
            assert_eq!(back.uses(h), live.uses(h), "block {b}");
        }
        assert_eq!(back.uses(SequenceHash(5)), 4);
    }

    #[test]
    fn the_writer_writes_on_its_own_and_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("uses");
        let mut seen = kvbm_pool::policy::UseHistory::new(64);
        seen.record_request(&[SequenceHash(5)]);
        let live = Arc::new(engine());
        live.restore_history(&seen.snapshot());
        let writer = HistoryKeeper::new(&path, Duration::from_millis(20))
            .spawn(&live)
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !path.exists() {
            assert!(Instant::now() < deadline, "never written");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::remove_file(&path).unwrap();
        drop(writer);
        let back = engine();
        assert_eq!(HistoryKeeper::new(&path, HISTORY_EVERY).load(&back), 1);
        assert_eq!(back.uses(SequenceHash(5)), 1);
    }
}
