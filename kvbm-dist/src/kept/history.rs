//! The engine's use history beside its kept tiers: written now and then
//! while it runs, read back when a restarted engine reopens them, so that
//! it ranks their blocks by their past uses, not as blocks used once.
//!
//! Only a ranking depends on it: a missing, old or damaged file costs hits
//! until the history is learned again, never a byte. Each write goes to a
//! temporary file renamed over the last one, so a crash leaves the old
//! snapshot or the new one.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use kvbm_pool::TierEngine;
use kvbm_pool::policy::HistorySnapshot;

/// How often a [`HistoryKeeper`] writes the history by default.
pub const HISTORY_EVERY: Duration = Duration::from_secs(10);

/// Writes an engine's use history to one file, at most once per interval.
#[derive(Debug)]
pub struct HistoryKeeper {
    path: PathBuf,
    every: Duration,
    last: Option<Instant>,
}

impl HistoryKeeper {
    /// Keeps the history in `path`, written at most once per `every`.
    pub fn new(path: impl Into<PathBuf>, every: Duration) -> Self {
        HistoryKeeper {
            path: path.into(),
            every,
            last: None,
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `engine`'s history if the last write is `every` old (or
    /// there was none); whether it wrote. A failed write is logged, not
    /// returned: the history is advisory.
    pub fn maybe_save(&mut self, engine: &TierEngine) -> bool {
        if self.last.is_some_and(|t| t.elapsed() < self.every) {
            return false;
        }
        self.last = Some(Instant::now());
        self.save(engine)
    }

    /// Writes `engine`'s history now; whether it could.
    pub fn save(&self, engine: &TierEngine) -> bool {
        let bytes = engine.history_snapshot().to_bytes();
        let mut tmp = self.path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        match std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, &self.path)) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), "use history not written: {e}");
                false
            }
        }
    }

    /// Gives `engine` the history this file holds, before its kept blocks
    /// are registered; the blocks it remembers (0 for no file or one that
    /// is damaged, which is logged).
    pub fn load(&self, engine: &TierEngine) -> usize {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return 0,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), "use history not read: {e}");
                return 0;
            }
        };
        match HistorySnapshot::from_bytes(&bytes) {
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

impl HistoryKeeper {
    /// Writes `engine`'s history every interval on a thread of its own,
    /// and once more when the writer is dropped (while the engine lives).
    pub fn spawn(self, engine: &Arc<TierEngine>) -> std::io::Result<HistoryWriter> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let keeper = Arc::new(self);
        let engine = Arc::downgrade(engine);
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

fn write_loop(keeper: &HistoryKeeper, engine: &Weak<TierEngine>, stop: &(Mutex<bool>, Condvar)) {
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
        keeper.save(&engine);
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
    engine: Weak<TierEngine>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl HistoryWriter {
    /// Writes the history now (a process about to exit); whether it could
    /// (not once the engine is gone).
    pub fn save_now(&self) -> bool {
        self.engine
            .upgrade()
            .is_some_and(|engine| self.keeper.save(&engine))
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
    use kvbm_pool::tier::KvShape;

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
        assert!(keeper.maybe_save(&old));
        assert!(!keeper.maybe_save(&old), "written once per interval");
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
