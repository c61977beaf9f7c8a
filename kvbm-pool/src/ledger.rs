//! The books of one tier whose bytes somebody else moves.
//!
//! An engine with an offloading interface of its own (vLLM's
//! `OffloadingConnector` and its pluggable spec) asks its backend, in the
//! scheduler, which blocks it holds, where to write new ones and where to
//! read old ones, and then carries those addresses to its workers, which
//! copy. A [`Ledger`] is those books for kvbm: one [`BlockPool`] whose
//! block `i` is slot `i` of every worker's host tier, ranked and admitted
//! by the same policy as the tier engine's G2 (the reuse score by
//! default), with the two states an outside copy adds:
//!
//! - **writing**: a slot handed out for a store and not yet confirmed. It
//!   is neither loadable nor evictable; a failed store frees it.
//! - **reading**: a cached block a load reads from. It cannot be evicted
//!   (its slot cannot be reused) until every load of it completed.
//!
//! A block becomes loadable only when its store is confirmed
//! ([`Ledger::commit`]), so a load never reads a slot that is still being
//! written, and a slot is only reused after every load of its old block
//! completed. Those two rules are what keep bytes right; the model-based
//! tests hold the ledger to them.
//!
//! **A disk tier behind.** Built with [`Ledger::with_disk`], the ledger
//! also keeps the books of a G3 of its own slots, exclusive of G2: a
//! block the G2 policy evicts, and that G3's policy admits, is *demoted*
//! (its bytes copied from its G2 slot to a G3 slot) by the very store
//! that takes its G2 slot, before that store writes the slot; the
//! [`Reservation`] names each such [`Move`]. The demoted block becomes
//! loadable from G3 when that store is confirmed, and is gone if it
//! fails. A load reads each block from the tier that holds it
//! ([`Ledger::pin`] says which), and a G3 slot being read is not reused
//! either.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::mpsc::Receiver;

use kvbm_block::SequenceHash;
use parking_lot::Mutex;

use crate::config::{PoolConfig, Tier};
use crate::error::PoolError;
use crate::events::{KvEvent, KvEventBatch};
use crate::policy::{
    EvictionPolicy, HintClock, HistorySnapshot, HistorySource, LruPolicy, RetentionHint,
    ReuseScorePolicy, SharedHistory, UseHistory,
};
use crate::pool::{BlockPool, ImmutableBlock, MutableBlock};
use crate::tier::{TierEngineConfig, TierPolicy};

/// Where a key stands in a [`Ledger`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// Not held.
    Absent,
    /// A store (or a demotion) into its slot is in flight: not loadable
    /// yet.
    Writing,
    /// Held and loadable, in G2 or G3.
    Ready,
}

/// A block copied from one tier's slot to another's before a job's own
/// copies run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    /// The block.
    pub key: SequenceHash,
    /// Its slot in the tier it leaves (G2).
    pub from: u32,
    /// Its slot in the tier it enters (G3).
    pub to: u32,
}

/// Where a load reads one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Source {
    /// The tier that holds it: [`Tier::G2`] or [`Tier::G3`].
    pub tier: Tier,
    /// Its slot in that tier.
    pub slot: u32,
}

/// What [`Ledger::reserve`] hands out.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The keys to write, each with the G2 slot to write it into, in the
    /// order asked.
    pub slots: Vec<(SequenceHash, u32)>,
    /// Blocks whose G2 slots were taken for these and that move to G3:
    /// the worker copies each `from` its G2 slot `to` its G3 slot before
    /// it writes any of `slots`. Each ends with the store that took its
    /// slot: loadable from G3 once that store is confirmed, gone if it is
    /// abandoned.
    pub demote: Vec<Move>,
    /// Keys no tier holds any more (evicted from G2 and not demoted, or
    /// evicted from G3).
    pub evicted: Vec<SequenceHash>,
    /// Every block that left G2 for these slots (demoted or not; not one
    /// marked damaged), with the G2 slot it held: its bytes are there until
    /// the new block is written, for a caller that publishes what G2
    /// evicts.
    pub vacated: Vec<(SequenceHash, u32)>,
    /// Keys already held or being written (nothing to do for them).
    pub present: usize,
    /// Keys the admission policy turned away.
    pub refused: usize,
    /// Keys left out because every slot is written or read right now.
    pub full: usize,
}

/// Slot counts of a [`Ledger`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LedgerCounts {
    /// Blocks held and loadable in G2 (those being read included).
    pub ready: usize,
    /// G2 slots being written.
    pub writing: usize,
    /// Blocks at least one load reads (in either tier).
    pub reading: usize,
    /// Blocks held and loadable in G3.
    pub on_disk: usize,
    /// G3 slots a demotion is writing.
    pub demoting: usize,
}

/// What a ledger refuses.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LedgerError {
    /// A load asked for a key that is not loadable.
    #[error("block {0:?} is not held ready to load")]
    NotReady(SequenceHash),
    /// The pool could not be built.
    #[error(transparent)]
    Pool(#[from] PoolError),
}

/// A G2 slot handed to a store, and the demotion that rides on it.
struct Write {
    block: MutableBlock,
    parent: Option<SequenceHash>,
    /// The block that held the slot before and moves to G3 first.
    demotes: Option<SequenceHash>,
}

/// A block being read, from which tier, and by how many loads.
struct Reading {
    block: ImmutableBlock,
    tier: Tier,
    loads: u32,
}

#[derive(Default)]
struct Books {
    writing: HashMap<SequenceHash, Write>,
    /// G3 slots receiving a demoted block, by that block's key.
    demoting: HashMap<SequenceHash, MutableBlock>,
    reading: HashMap<SequenceHash, Reading>,
    /// The G2 slot of every block G2 holds (a demotion's source).
    g2_slots: HashMap<SequenceHash, u32>,
    /// Blocks whose bytes failed a load: never loaded again, and not
    /// stored again until their tier evicted them.
    doomed: HashSet<SequenceHash>,
}

/// A block a pool removed, with the G2 slot it left (for a G2 block).
struct Removed {
    key: SequenceHash,
    g2_slot: Option<u32>,
}

/// One tier's pool and the events its evictions raise.
struct SlotTier {
    pool: BlockPool,
    events: Mutex<Receiver<KvEventBatch>>,
}

impl SlotTier {
    fn new(
        capacity: usize,
        tier: Tier,
        ranking: Box<dyn EvictionPolicy>,
    ) -> Result<Self, LedgerError> {
        let pool = BlockPool::with_policy(PoolConfig::new(capacity, 1, tier), ranking)?;
        let events = Mutex::new(pool.subscribe());
        Ok(SlotTier { pool, events })
    }
}

/// The books of a host tier of slots, and optionally a disk tier behind
/// it, whose copies run elsewhere; see the module docs.
pub struct Ledger {
    g2: SlotTier,
    g3: Option<SlotTier>,
    policy: TierPolicy,
    history: SharedHistory,
    books: Mutex<Books>,
    /// Events taken out of the pools but not yet handed to the caller.
    unread: Mutex<Vec<(Tier, KvEvent)>>,
}

impl Ledger {
    /// Books for `capacity` G2 slots ranked and admitted by `policy`, with
    /// the tier engine's defaults for the use history.
    pub fn new(capacity: usize, policy: TierPolicy) -> Result<Ledger, LedgerError> {
        Ledger::with_disk(capacity, 0, policy)
    }

    /// Books for `capacity` G2 slots and `disk` G3 slots behind them (none
    /// when 0), both ranked and admitted by `policy`.
    pub fn with_disk(
        capacity: usize,
        disk: usize,
        policy: TierPolicy,
    ) -> Result<Ledger, LedgerError> {
        if let TierPolicy::MinUses(0) = policy {
            return Err(LedgerError::Pool(PoolError::InvalidConfig(
                "min_uses needs at least 1",
            )));
        }
        let defaults = TierEngineConfig::new(1);
        let remembered = capacity.saturating_add(disk);
        let ghosts = (remembered as f64 * defaults.history_factor).ceil() as usize;
        let history = SharedHistory::new(
            UseHistory::new(remembered.saturating_add(ghosts).max(1))
                .with_model(defaults.reuse_model)
                .with_age_exponent(defaults.reuse_age_exponent)
                .with_hint_slack(defaults.hint_slack),
        );
        let ranking = |tier: Tier, slots: usize| -> Box<dyn EvictionPolicy> {
            match policy {
                TierPolicy::ReuseScore => {
                    Box::new(ReuseScorePolicy::for_tier(history.clone(), tier))
                }
                TierPolicy::WriteThrough | TierPolicy::MinUses(_) => {
                    Box::new(LruPolicy::with_capacity(slots))
                }
            }
        };
        let g2 = SlotTier::new(capacity, Tier::G2, ranking(Tier::G2, capacity))?;
        let g3 = match disk {
            0 => None,
            n => Some(SlotTier::new(n, Tier::G3, ranking(Tier::G3, n))?),
        };
        Ok(Ledger {
            g2,
            g3,
            policy,
            history,
            books: Mutex::new(Books::default()),
            unread: Mutex::new(Vec::new()),
        })
    }

    /// Slots in G2.
    pub fn capacity(&self) -> usize {
        self.g2.pool.capacity()
    }

    /// Slots in G3 (0 without one).
    pub fn disk_capacity(&self) -> usize {
        self.g3.as_ref().map_or(0, |t| t.pool.capacity())
    }

    fn on_disk(&self, key: SequenceHash) -> bool {
        self.g3.as_ref().is_some_and(|t| t.pool.contains(key))
    }

    /// Where `key` stands.
    pub fn presence(&self, key: SequenceHash) -> Presence {
        let books = self.books.lock();
        if books.writing.contains_key(&key) || books.demoting.contains_key(&key) {
            Presence::Writing
        } else if books.doomed.contains(&key) {
            Presence::Absent
        } else if self.g2.pool.contains(key) || self.on_disk(key) {
            Presence::Ready
        } else {
            Presence::Absent
        }
    }

    /// How many of `keys`, from the first, are [`Presence::Ready`]: what
    /// asking [`Ledger::presence`] key by key up to the first that is not
    /// would count, with one look at the books and at each tier's pool for
    /// a run of keys it holds.
    pub fn ready_prefix(&self, keys: &[SequenceHash]) -> usize {
        let books = self.books.lock();
        let mut held = 0;
        loop {
            held += self.g2.pool.cached_prefix_len(&keys[held..]);
            if held < keys.len() && self.on_disk(keys[held]) {
                held += 1;
            } else {
                break;
            }
        }
        keys[..held]
            .iter()
            .position(|k| {
                books.writing.contains_key(k)
                    || books.demoting.contains_key(k)
                    || books.doomed.contains(k)
            })
            .unwrap_or(held)
    }

    /// Records that a request asked for `keys` (its blocks in prefix
    /// order): the reuse ranking and `min_uses` admission learn from it.
    /// Call it once per request.
    pub fn record_request(&self, keys: &[SequenceHash]) {
        if !matches!(self.policy, TierPolicy::WriteThrough) {
            self.history.lock().record_request(keys);
        }
    }

    /// Gives a retention hint for `keys` (a request's blocks, in prompt
    /// order), as of now: with the reuse-score policy both tiers rank and
    /// admit them by it (see [`crate::policy::retention`]); any later
    /// request carrying a block spends its hint. Other policies ignore
    /// hints.
    pub fn retain(&self, keys: &[SequenceHash], hint: RetentionHint) {
        if self.policy != TierPolicy::ReuseScore {
            return;
        }
        self.history.lock().retain(keys, hint);
        // Blocks already evictable are queued by their old rank: restamp
        // them so they are queued again.
        self.touch(keys);
    }

    /// Sets the hint clock to `now` (e.g. a replay's trace time, from its
    /// start): from the first call on, hints count time by these calls
    /// instead of the wall clock. A hint's weight depends on how many
    /// requests arrive before it is due, so it is measured on this clock.
    pub fn set_time(&self, now: std::time::Duration) {
        let ms = now.as_millis().min(u128::from(u64::MAX)) as u64;
        self.history.lock().set_clock(HintClock::Manual(ms));
    }

    /// Marks `keys` as just used (the ones held; the others are ignored).
    pub fn touch(&self, keys: &[SequenceHash]) {
        self.g2.pool.touch(keys);
        if let Some(g3) = &self.g3 {
            g3.pool.touch(keys);
        }
    }

    fn admitted(&self, tier: &SlotTier, key: SequenceHash) -> bool {
        match self.policy {
            TierPolicy::WriteThrough => true,
            TierPolicy::MinUses(n) => self.history.lock().uses(key) >= n,
            TierPolicy::ReuseScore => tier.pool.admit(key),
        }
    }

    fn held(&self, books: &Books, key: SequenceHash) -> bool {
        books.writing.contains_key(&key)
            || books.demoting.contains_key(&key)
            || self.g2.pool.contains(key)
            || self.on_disk(key)
    }

    /// G2 slots for the `keys` to write (each with its parent, `None`
    /// when unknown), in order: a key already held or being written is
    /// skipped, one the admission policy refuses is left out, and cached
    /// blocks are evicted for the rest while any are evictable (demoted
    /// to G3 where it admits them). Each handed-out slot stays `Writing`
    /// until [`commit`](Self::commit).
    pub fn reserve(&self, keys: &[(SequenceHash, Option<SequenceHash>)]) -> Reservation {
        self.reserve_admitting(keys, true)
    }

    /// G2 slots for blocks a load brings in from outside the ledger's
    /// tiers (a store that other engines share): as [`reserve`](Self::reserve),
    /// but without asking the admission policy, since a request is about
    /// to use these blocks. The slots stay `Writing` until
    /// [`commit`](Self::commit), which the caller sends once the bytes
    /// arrived and were checked (or failed).
    pub fn reserve_fetched(&self, keys: &[(SequenceHash, Option<SequenceHash>)]) -> Reservation {
        self.reserve_admitting(keys, false)
    }

    fn reserve_admitting(
        &self,
        keys: &[(SequenceHash, Option<SequenceHash>)],
        admit: bool,
    ) -> Reservation {
        let mut out = Reservation::default();
        let mut books = self.books.lock();
        // Earlier removals are not this call's evictions.
        self.drain(&mut books);
        for &(key, parent) in keys {
            if books.doomed.contains(&key) && !self.g2.pool.contains(key) && !self.on_disk(key) {
                books.doomed.remove(&key);
            }
            if self.held(&books, key) {
                out.present += 1;
                continue;
            }
            if admit && !self.admitted(&self.g2, key) {
                out.refused += 1;
                continue;
            }
            let Some(block) = self.g2.pool.allocate(1).ok().and_then(|mut b| b.pop()) else {
                out.full += 1;
                continue;
            };
            let slot = block.block_id();
            let mut demotes = None;
            for gone in self.drain(&mut books) {
                // The block G2 evicted for this slot moves to G3 where it
                // may; a block still on disk was not evicted at all.
                let from = gone.g2_slot.filter(|&s| s == slot);
                // A damaged block is not worth publishing.
                if let Some(s) = from
                    && !books.doomed.contains(&gone.key)
                {
                    out.vacated.push((gone.key, s));
                }
                match from.and_then(|s| self.demote(&mut books, gone.key, s, &mut out)) {
                    Some(m) => {
                        out.demote.push(m);
                        demotes = Some(gone.key);
                    }
                    None if self.on_disk(gone.key) => {}
                    None => out.evicted.push(gone.key),
                }
            }
            out.slots.push((key, slot));
            books.writing.insert(
                key,
                Write {
                    block,
                    parent,
                    demotes,
                },
            );
        }
        out
    }

    /// A G3 slot for `key`, which G2 just evicted from slot `from`, when
    /// G3 admits it; blocks G3 evicts for it are added to `out.evicted`.
    fn demote(
        &self,
        books: &mut Books,
        key: SequenceHash,
        from: u32,
        out: &mut Reservation,
    ) -> Option<Move> {
        let g3 = self.g3.as_ref()?;
        if books.doomed.remove(&key) || g3.pool.contains(key) || !self.admitted(g3, key) {
            return None;
        }
        let block = g3.pool.allocate(1).ok()?.pop()?;
        let to = block.block_id();
        out.evicted
            .extend(self.drain(books).into_iter().map(|g| g.key));
        books.demoting.insert(key, block);
        Some(Move { key, from, to })
    }

    /// Confirms (or, with `ok` false, abandons) the stores of `keys`, and
    /// the demotions that rode on them: a confirmed block becomes
    /// loadable, an abandoned slot is freed and its demoted block is gone.
    /// Keys not being written are ignored.
    pub fn commit(&self, keys: &[SequenceHash], ok: bool) {
        let mut books = self.books.lock();
        for key in keys {
            let Some(w) = books.writing.remove(key) else {
                continue;
            };
            let demoted = w
                .demotes
                .and_then(|d| books.demoting.remove(&d).map(|b| (d, b)));
            if !ok {
                continue; // dropping the mutable handles frees the slots
            }
            let slot = w.block.block_id();
            // A fresh slot completes under any hash; should it not, the
            // slot goes back free and the block is simply not held.
            if let Ok(complete) = w.block.complete(*key, w.parent)
                && self.g2.pool.register_block(complete).is_ok()
            {
                books.g2_slots.insert(*key, slot);
            }
            if let (Some((d, block)), Some(g3)) = (demoted, &self.g3)
                && let Ok(complete) = block.complete(d, None)
            {
                let _ = g3.pool.register_block(complete);
            }
        }
    }

    /// Pins `keys` for a load and says where each is read, in order. All
    /// or nothing: a key that is not `Ready` refuses the call.
    pub fn pin(&self, keys: &[SequenceHash]) -> Result<Vec<Source>, LedgerError> {
        let mut books = self.books.lock();
        let mut taken: Vec<(SequenceHash, Reading)> = Vec::with_capacity(keys.len());
        for &key in keys {
            if books.doomed.contains(&key) || books.writing.contains_key(&key) {
                return Err(LedgerError::NotReady(key));
            }
            if books.reading.contains_key(&key) || taken.iter().any(|(k, _)| *k == key) {
                continue;
            }
            let found = [(&self.g2, Tier::G2)]
                .into_iter()
                .chain(self.g3.as_ref().map(|t| (t, Tier::G3)))
                .find_map(|(t, tier)| {
                    t.pool
                        .match_prefix(&[key])
                        .into_blocks()
                        .pop()
                        .map(|b| (b, tier))
                });
            match found {
                Some((block, tier)) => taken.push((
                    key,
                    Reading {
                        block,
                        tier,
                        loads: 0,
                    },
                )),
                None => return Err(LedgerError::NotReady(key)),
            }
        }
        books.reading.extend(taken);
        let mut sources = Vec::with_capacity(keys.len());
        for key in keys {
            let r = books
                .reading
                .get_mut(key)
                .ok_or(LedgerError::NotReady(*key))?;
            r.loads += 1;
            sources.push(Source {
                tier: r.tier,
                slot: r.block.block_id(),
            });
        }
        Ok(sources)
    }

    /// Ends one load of each of `keys`; a block no load reads any more is
    /// evictable again.
    pub fn unpin(&self, keys: &[SequenceHash]) {
        let mut books = self.books.lock();
        for key in keys {
            if let Entry::Occupied(mut e) = books.reading.entry(*key) {
                e.get_mut().loads -= 1;
                if e.get().loads == 0 {
                    e.remove();
                }
            }
        }
    }

    /// Takes up the blocks a G2 kept across a restart holds, each in the
    /// slot that holds its bytes: `(G2 slot, key)`; skips and returns as
    /// [`Self::restore_disk`]. Call it before that: a key both kept tiers
    /// hold (moved to G3 just before the restart, its G2 slot not yet
    /// written again) is then served from G2, and G3's copy left out.
    pub fn restore_host(&self, blocks: &[(u32, SequenceHash)]) -> Vec<(u32, SequenceHash)> {
        self.restore_in(&self.g2.pool, Tier::G2, blocks)
    }

    /// Takes up the blocks a G3 kept across a restart holds, each in the
    /// slot that holds its bytes: `(G3 slot, key)`. A slot beyond G3, one
    /// listed twice or already held, and a key listed twice or already
    /// held (in G2 or G3), are skipped. Returns the blocks that became
    /// loadable. Call it before the first store.
    pub fn restore_disk(&self, blocks: &[(u32, SequenceHash)]) -> Vec<(u32, SequenceHash)> {
        match &self.g3 {
            Some(g3) => self.restore_in(&g3.pool, Tier::G3, blocks),
            None => Vec::new(),
        }
    }

    /// Registers kept `(slot, key)` blocks in `pool` (tier `tier`); G2 and
    /// G3 stay exclusive: a key either holds is not taken up again.
    fn restore_in(
        &self,
        pool: &BlockPool,
        tier: Tier,
        blocks: &[(u32, SequenceHash)],
    ) -> Vec<(u32, SequenceHash)> {
        let held = |key| {
            self.g2.pool.contains(key) || self.g3.as_ref().is_some_and(|g| g.pool.contains(key))
        };
        let labels: Vec<(u32, (SequenceHash, Option<SequenceHash>))> = blocks
            .iter()
            .filter(|&&(_, key)| !held(key))
            .map(|&(slot, key)| (slot, (key, None)))
            .collect();
        crate::tier::kept::register_in_slots(pool, tier, &labels);
        // Which took: the first listing of each slot and key, as
        // registration keeps them.
        let (mut slots, mut keys) = (HashSet::new(), HashSet::new());
        labels
            .into_iter()
            .filter(|&(slot, (key, _))| slots.insert(slot) && keys.insert(key))
            .map(|(slot, (key, _))| (slot, key))
            .filter(|&(_, key)| pool.contains(key))
            .collect()
    }

    /// Marks `keys` as damaged (a load of them failed): they are never
    /// loaded again and read as absent; their slots come back when the
    /// policy evicts them.
    pub fn doom(&self, keys: &[SequenceHash]) {
        let mut books = self.books.lock();
        let held: Vec<_> = keys
            .iter()
            .copied()
            .filter(|k| self.g2.pool.contains(*k) || self.on_disk(*k))
            .collect();
        books.doomed.extend(held);
    }

    /// Forgets every store, demotion and load in flight and drops every
    /// block: for an engine that reset its offloading state and waits for
    /// the copies in flight before it sends new ones. Returns the blocks
    /// dropped.
    pub fn clear(&self) -> usize {
        {
            let mut books = self.books.lock();
            books.writing.clear();
            books.demoting.clear();
            books.reading.clear();
            books.doomed.clear();
        }
        self.reset()
    }

    /// Drops every cached block that no load reads and no store writes;
    /// returns how many.
    pub fn reset(&self) -> usize {
        let mut n = self.g2.pool.evict(self.g2.pool.capacity());
        if let Some(g3) = &self.g3 {
            n += g3.pool.evict(g3.pool.capacity());
        }
        self.drain(&mut self.books.lock());
        n
    }

    /// How many slots are held ready, being written, and being read.
    pub fn counts(&self) -> LedgerCounts {
        let books = self.books.lock();
        let held = |t: &SlotTier| {
            let c = t.pool.counts();
            c.active + c.inactive
        };
        LedgerCounts {
            ready: held(&self.g2).saturating_sub(books.writing.len()),
            writing: books.writing.len(),
            reading: books.reading.len(),
            on_disk: self
                .g3
                .as_ref()
                .map_or(0, |t| held(t).saturating_sub(books.demoting.len())),
            demoting: books.demoting.len(),
        }
    }

    /// The blocks stored and removed since the last call, in order: the
    /// tier, whether it was stored (else removed), and the key.
    pub fn take_events(&self) -> Vec<(Tier, bool, SequenceHash)> {
        self.drain(&mut self.books.lock());
        std::mem::take(&mut *self.unread.lock())
            .into_iter()
            .map(|(tier, e)| match e {
                KvEvent::Stored { hash, .. } => (tier, true, hash),
                KvEvent::Removed { hash, .. } => (tier, false, hash),
            })
            .collect()
    }

    /// Moves pending pool events into `unread` and forgets the G2 slots
    /// of removed blocks; returns the removed blocks.
    fn drain(&self, books: &mut Books) -> Vec<Removed> {
        let mut unread = self.unread.lock();
        let mut removed = Vec::new();
        let tiers = [(&self.g2, Tier::G2)]
            .into_iter()
            .chain(self.g3.as_ref().map(|t| (t, Tier::G3)));
        for (t, tier) in tiers {
            let events = t.events.lock();
            while let Ok(batch) = events.try_recv() {
                for &e in batch.iter() {
                    if let KvEvent::Removed { hash, .. } = e {
                        let g2_slot = match tier {
                            Tier::G2 => books.g2_slots.remove(&hash),
                            _ => None,
                        };
                        removed.push(Removed { key: hash, g2_slot });
                    }
                    unread.push((tier, e));
                }
            }
        }
        // Bound what nobody reads: a caller that never takes events keeps
        // only the newest.
        const KEEP: usize = 1 << 16;
        if unread.len() > KEEP {
            let cut = unread.len() - KEEP;
            unread.drain(..cut);
        }
        removed
    }
}

/// The ledger's use history, written beside a kept disk tier and taken up
/// by a restarted engine before the kept blocks are registered.
impl HistorySource for Ledger {
    fn history_changes(&self, seq: u64) -> HistorySnapshot {
        // Requests recorded but not applied yet count too.
        self.history.apply_pending();
        self.history.lock().changes_since(seq)
    }

    fn restore_history(&self, snapshot: &HistorySnapshot) {
        self.history.lock().restore(snapshot);
    }
}

#[cfg(test)]
mod tests;
