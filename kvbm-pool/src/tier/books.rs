//! The books of the tiers: what G1, G2 and G3 hold, the blocks G2 evicted
//! and not saved yet, and the use history their policies rank by.
//!
//! Each tier's [`BlockPool`] is its own owner (with its own lock); this
//! part hands out the pools and owns the rest: the G2 victim log (which
//! G2's policy fills as it evicts, and the offload worker empties to save
//! the victims to G3) and every use of the shared use history. What G2
//! evicts is decided by G2's eviction policy, chosen in
//! [`super::assemble`] ([`crate::policy::ReuseScorePolicy`] by default,
//! `kvbm-pool/src/policy/reuse_score.rs`); where those victims go is
//! decided in [`super::victims`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvbm_block::SequenceHash;

use super::config::{OffloadMode, TierEngineConfig, TierPolicy};
use crate::config::Tier;
use crate::policy::{
    Evicted, HintClock, HistorySnapshot, Retained, RetentionHint, SharedHistory, VictimLog,
};
use crate::pool::BlockPool;

/// One tier's books; its bytes are the mover's.
#[derive(Debug)]
pub(crate) struct TierSlot {
    /// The tier's blocks: which prefix each holds, what may be evicted.
    pub(crate) pool: BlockPool,
    /// Which tier this is.
    pub(crate) tier: Tier,
    /// Bytes of one block in this tier's memory.
    pub(crate) block_bytes: u64,
}

/// The books of every tier and the use history they rank by.
pub(crate) struct Books {
    g1: TierSlot,
    g2: Option<TierSlot>,
    g3: Option<TierSlot>,
    /// G2's evictions not saved yet (filled by G2's policy).
    g2_victims: VictimLog,
    history: SharedHistory,
    /// Set once a retention hint was given (G1's policy forwards until
    /// then).
    hinted: Arc<AtomicBool>,
}

impl Books {
    /// The books of `g1`, `g2` and `g3`; `g2_victims` is the log G2's
    /// policy writes its victims to, `history` and `hinted` what the
    /// tiers' policies read.
    pub(crate) fn new(
        g1: TierSlot,
        g2: Option<TierSlot>,
        g3: Option<TierSlot>,
        g2_victims: VictimLog,
        history: SharedHistory,
        hinted: Arc<AtomicBool>,
    ) -> Self {
        Self {
            g1,
            g2,
            g3,
            g2_victims,
            history,
            hinted,
        }
    }

    /// G1's books.
    pub(crate) fn g1(&self) -> &TierSlot {
        &self.g1
    }

    /// G2's books, if the engine has a G2.
    pub(crate) fn g2(&self) -> Option<&TierSlot> {
        self.g2.as_ref()
    }

    /// G3's books, if the engine has a G3.
    pub(crate) fn g3(&self) -> Option<&TierSlot> {
        self.g3.as_ref()
    }

    /// The books of `tier`, if the engine has it.
    pub(crate) fn slot(&self, tier: Tier) -> Option<&TierSlot> {
        match tier {
            Tier::G1 => Some(&self.g1),
            Tier::G2 => self.g2(),
            Tier::G3 => self.g3(),
            Tier::G4 => None,
        }
    }

    /// Every tier the engine has, G1 first.
    pub(crate) fn slots(&self) -> impl Iterator<Item = &TierSlot> {
        [Some(&self.g1), self.g2(), self.g3()].into_iter().flatten()
    }

    /// The blocks G2 evicted since the last call: their bytes are still in
    /// their slots until those are written again.
    pub(crate) fn take_g2_victims(&self) -> Vec<Evicted> {
        std::mem::take(&mut *self.g2_victims.lock())
    }

    /// Drops every cached block of G2 and G3 (and G2's unsaved victims)
    /// without saving any; returns how many blocks were dropped.
    pub(crate) fn drop_cached_g2_g3(&self) -> usize {
        let mut n = 0;
        for slot in [self.g2(), self.g3()].into_iter().flatten() {
            n += slot.pool.evict(slot.pool.capacity());
        }
        self.g2_victims.lock().clear();
        n
    }

    /// Gives a retention hint for `hashes` and restamps the evictable ones
    /// in the tiers that rank by hints (G1 in write-back mode, G2 and G3
    /// with the reuse-score policy), so they are queued by it.
    pub(crate) fn retain(
        &self,
        config: &TierEngineConfig,
        hashes: &[SequenceHash],
        hint: RetentionHint,
    ) {
        self.hinted.store(true, Ordering::Relaxed);
        self.history.lock().retain(hashes, hint);
        if config.offload_mode == OffloadMode::WriteBack {
            self.g1.pool.touch(hashes);
        }
        for (tier, policy) in [(self.g2(), config.g2_policy), (self.g3(), config.g3_policy)] {
            if let Some(t) = tier
                && policy == TierPolicy::ReuseScore
            {
                t.pool.touch(hashes);
            }
        }
    }

    /// Where retention hints put `hash` now.
    pub(crate) fn retained(&self, hash: SequenceHash) -> Retained {
        self.history.lock().retained(hash)
    }

    /// Sets the hint clock.
    pub(crate) fn set_clock(&self, clock: HintClock) {
        self.history.lock().set_clock(clock);
    }

    /// How many requests used `hash`.
    pub(crate) fn uses(&self, hash: SequenceHash) -> u32 {
        self.history.lock().uses(hash)
    }

    /// Queues a request's prompt blocks as one use (applied before the
    /// next read of the history); returns the blocks queued now (see
    /// [`SharedHistory::record_later`]).
    pub(crate) fn record_use_later(&self, hashes: &[SequenceHash]) -> usize {
        self.history.record_later(hashes)
    }

    /// Blocks recorded as used and not applied to the history yet.
    pub(crate) fn pending_uses(&self) -> usize {
        self.history.pending_blocks()
    }

    /// Applies the uses recorded so far to the history.
    pub(crate) fn apply_uses(&self) {
        self.history.apply_pending();
    }

    /// What changed in the history since change `seq`, every recorded use
    /// applied first.
    pub(crate) fn history_changes(&self, seq: u64) -> HistorySnapshot {
        self.history.apply_pending();
        self.history.lock().changes_since(seq)
    }

    /// Takes up a history written before a restart.
    pub(crate) fn restore_history(&self, snapshot: &HistorySnapshot) {
        self.history.lock().restore(snapshot);
    }

    /// Blocks G1 loaded and gives back to G2 when it evicts them: their
    /// copies in G2 (`from_g2`) and G3 (`from_g3`) go first meanwhile.
    pub(crate) fn demote_loaded(
        &self,
        from_g2: impl IntoIterator<Item = SequenceHash>,
        from_g3: impl IntoIterator<Item = SequenceHash>,
    ) {
        let mut history = self.history.lock();
        history.demote(Tier::G2, from_g2);
        history.demote(Tier::G3, from_g3);
    }

    /// Blocks G1 evicted: their G2 and G3 copies rank by their scores
    /// again.
    pub(crate) fn undemote(&self, victims: &[Evicted]) {
        let mut history = self.history.lock();
        for v in victims {
            history.undemote(v.hash);
        }
    }

    /// Blocks on their way to G3: a G3 copy an onboard left there is this
    /// block again and ranks by its score once more.
    pub(crate) fn clear_demoted_g3(&self, victims: &[Evicted]) {
        let mut history = self.history.lock();
        for v in victims {
            history.clear_demoted(Tier::G3, v.hash);
        }
    }
}
