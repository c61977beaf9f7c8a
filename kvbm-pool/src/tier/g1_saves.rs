//! G1 write-back saves: which G1 blocks go to G2 when G1 evicts them, and
//! the G1 allocations that save them.
//!
//! In write-back mode G1's policy logs every block it evicts. An
//! allocation of G1 blocks (serialised, so that each saves exactly the
//! victims it made) hands the victims it made that are to be saved —
//! blocks registered by the engine, or loaded by kvbm — to the offload
//! worker and waits until their bytes are in G2 (or G3), since their slots
//! are about to be overwritten. The engine's own allocations then top G1's
//! free slots up to the reserve: the victims evicted for that are saved in
//! the background, their slots held until saved. In write-through mode
//! none of this happens: G1 allocates as a plain pool.

use std::collections::HashSet;

use kvbm_block::SequenceHash;
use parking_lot::Mutex;

use super::{Shared, TierError};
use crate::policy::{Evicted, VictimLog};
use crate::pool::MutableBlock;

/// The G1 blocks to save to G2 when evicted, and the serialised G1
/// allocations that save them.
pub(crate) struct G1Saves {
    /// G1's evictions; `None` in write-through mode (nothing is saved).
    victims: Option<VictimLog>,
    /// Serialises G1 allocations in write-back mode, so each allocation
    /// saves exactly the victims it made.
    serial: Mutex<()>,
    /// Hashes of the G1 blocks to save to G2 when G1 evicts them
    /// (registered through `register_g1`, or onboarded).
    saved: Mutex<HashSet<SequenceHash>>,
}

impl G1Saves {
    /// Saves for a G1 whose policy logs its victims into `victims`
    /// (write-back mode), or none (`None`, write-through mode).
    pub(crate) fn new(victims: Option<VictimLog>) -> Self {
        Self {
            victims,
            serial: Mutex::new(()),
            saved: Mutex::new(HashSet::new()),
        }
    }

    /// Whether G1's victims are saved (write-back mode).
    pub(crate) fn writes_back(&self) -> bool {
        self.victims.is_some()
    }

    /// Marks G1 blocks to be saved to G2 when G1 evicts them.
    pub(crate) fn save_when_evicted(&self, hashes: impl IntoIterator<Item = SequenceHash>) {
        self.saved.lock().extend(hashes);
    }

    /// Allocates `n` G1 blocks, saving G1's victims to G2 first in
    /// write-back mode; then, with `top_up`, tops G1's free slots up to
    /// the reserve (see [`super::TierEngineBuilder::g1_free_reserve`]). An
    /// onboard allocates without: the saves would compete with its copies,
    /// and run before or after its loaded blocks' G2 and G3 copies lose
    /// their rank depending on timing; the engine's next allocation tops
    /// up.
    pub(crate) fn allocate(
        &self,
        shared: &Shared,
        n: usize,
        top_up: bool,
    ) -> Result<Vec<MutableBlock>, TierError> {
        let g1 = &shared.books.g1().pool;
        let Some(log) = &self.victims else {
            return Ok(g1.allocate(n)?);
        };
        let _serial = self.serial.lock();
        if g1.counts().free < n {
            // Slots being cleaned are about to be free: take them rather
            // than evict more (and so the victims do not depend on timing).
            shared.offload.wait_cleaned();
        }
        let blocks = g1.allocate(n)?;
        let victims = self.take_victims(shared, log);
        if !victims.is_empty() {
            shared.offload.write_back(victims);
        }
        if top_up {
            self.clean_ahead(shared, log);
        }
        Ok(blocks)
    }

    /// G1's victims logged since the last call that the engine registered
    /// for offload (or kvbm loaded); a partial block stays in G1 only.
    /// Copies G2 or G3 still hold rank by their scores again.
    fn take_victims(&self, shared: &Shared, log: &VictimLog) -> Vec<Evicted> {
        let mut victims = std::mem::take(&mut *log.lock());
        if !victims.is_empty() {
            shared.books.undemote(&victims);
            let mut saved = self.saved.lock();
            victims.retain(|v| saved.remove(&v.hash));
        }
        victims
    }

    /// Evicts G1's next victims until the reserve of free slots is reached
    /// and hands them, with their slots held until their bytes are in G2,
    /// to the offload worker. Called with `serial` held.
    fn clean_ahead(&self, shared: &Shared, log: &VictimLog) {
        let g1 = &shared.books.g1().pool;
        let counts = g1.counts();
        let reserve = shared.config.g1_reserve_for(counts.capacity);
        if reserve == 0 {
            return;
        }
        // Slots still held by earlier saves count as free: the victims
        // chosen then do not depend on how far the worker has got.
        let pending = shared.offload.cleaning_slots();
        let k = reserve
            .saturating_sub(counts.free + pending)
            .min(counts.inactive);
        if k == 0 {
            return;
        }
        let slots = g1.evict_to_allocated(k);
        if slots.is_empty() {
            return;
        }
        // Victims another thread evicted straight from the G1 pool
        // meanwhile are on the free list, not held here: those are saved
        // now.
        let held: HashSet<u32> = slots.iter().map(MutableBlock::block_id).collect();
        let (behind, now): (Vec<_>, Vec<_>) = self
            .take_victims(shared, log)
            .into_iter()
            .partition(|v| held.contains(&v.id));
        if !now.is_empty() {
            shared.offload.write_back(now);
        }
        if behind.is_empty() {
            // Nothing to save (partial blocks stay in G1 only): free at
            // once.
            return;
        }
        shared.offload.clean(behind, slots);
    }

    /// Drops every cached block of every tier from the books without
    /// saving any, and forgets G1's logged victims; returns how many
    /// blocks were dropped. Serialised with G1 allocations.
    pub(crate) fn drop_cached(&self, shared: &Shared) -> usize {
        let _serial = self.serial.lock();
        // Background saves of G1's reserve end first (what they copy is
        // dropped below with the rest).
        shared.offload.wait_cleaned();
        let g1 = &shared.books.g1().pool;
        let mut n = g1.evict(g1.capacity());
        if let Some(log) = &self.victims {
            let victims = std::mem::take(&mut *log.lock());
            let mut saved = self.saved.lock();
            for v in &victims {
                saved.remove(&v.hash);
            }
        }
        n += shared.books.drop_cached_g2_g3();
        n
    }
}
