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
//! test at the end of this file holds the ledger to them.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::mpsc::Receiver;

use kvbm_block::SequenceHash;
use parking_lot::Mutex;

use crate::config::{PoolConfig, Tier};
use crate::error::PoolError;
use crate::events::{KvEvent, KvEventBatch};
use crate::policy::{LruPolicy, ReuseScorePolicy, SharedHistory, UseHistory};
use crate::pool::{BlockPool, ImmutableBlock, MutableBlock};
use crate::tier::{TierEngineConfig, TierPolicy};

/// Where a key stands in a [`Ledger`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// Not held.
    Absent,
    /// A store into its slot is in flight: not loadable yet.
    Writing,
    /// Held and loadable.
    Ready,
}

/// What [`Ledger::reserve`] hands out.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The keys to write, each with the slot to write it into, in the
    /// order asked.
    pub slots: Vec<(SequenceHash, u32)>,
    /// Cached keys whose slots were taken for these (they are gone).
    pub evicted: Vec<SequenceHash>,
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
    /// Blocks held and loadable (those being read included).
    pub ready: usize,
    /// Slots being written.
    pub writing: usize,
    /// Blocks at least one load reads.
    pub reading: usize,
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

/// A block being read, and by how many loads.
struct Reading {
    block: ImmutableBlock,
    loads: u32,
}

#[derive(Default)]
struct Books {
    writing: HashMap<SequenceHash, (MutableBlock, Option<SequenceHash>)>,
    reading: HashMap<SequenceHash, Reading>,
    /// Blocks whose bytes failed a load: never loaded again, and not
    /// stored again until the pool evicted them.
    doomed: HashSet<SequenceHash>,
}

/// The books of one tier of `capacity` slots whose copies run elsewhere;
/// see the module docs.
pub struct Ledger {
    pool: BlockPool,
    policy: TierPolicy,
    history: SharedHistory,
    books: Mutex<Books>,
    events: Mutex<Receiver<KvEventBatch>>,
    /// Events taken out of the pool but not yet handed to the caller.
    unread: Mutex<Vec<KvEvent>>,
}

impl Ledger {
    /// Books for `capacity` slots ranked and admitted by `policy`, with
    /// the tier engine's defaults for the use history.
    pub fn new(capacity: usize, policy: TierPolicy) -> Result<Ledger, LedgerError> {
        if let TierPolicy::MinUses(0) = policy {
            return Err(LedgerError::Pool(PoolError::InvalidConfig(
                "min_uses needs at least 1",
            )));
        }
        let defaults = TierEngineConfig::new(1);
        let ghosts = (capacity as f64 * defaults.history_factor).ceil() as usize;
        let history = SharedHistory::new(
            UseHistory::new(capacity.saturating_add(ghosts).max(1))
                .with_model(defaults.reuse_model)
                .with_age_exponent(defaults.reuse_age_exponent)
                .with_hint_slack(defaults.hint_slack),
        );
        let ranking: Box<dyn crate::policy::EvictionPolicy> = match policy {
            TierPolicy::ReuseScore => {
                Box::new(ReuseScorePolicy::for_tier(history.clone(), Tier::G2))
            }
            TierPolicy::WriteThrough | TierPolicy::MinUses(_) => {
                Box::new(LruPolicy::with_capacity(capacity))
            }
        };
        let pool = BlockPool::with_policy(PoolConfig::new(capacity, 1, Tier::G2), ranking)?;
        let events = pool.subscribe();
        Ok(Ledger {
            pool,
            policy,
            history,
            books: Mutex::new(Books::default()),
            events: Mutex::new(events),
            unread: Mutex::new(Vec::new()),
        })
    }

    /// Slots in the tier.
    pub fn capacity(&self) -> usize {
        self.pool.capacity()
    }

    /// Where `key` stands.
    pub fn presence(&self, key: SequenceHash) -> Presence {
        let books = self.books.lock();
        if books.writing.contains_key(&key) {
            Presence::Writing
        } else if books.doomed.contains(&key) {
            Presence::Absent
        } else if self.pool.contains(key) {
            Presence::Ready
        } else {
            Presence::Absent
        }
    }

    /// Records that a request asked for `keys` (its blocks in prefix
    /// order): the reuse ranking and `min_uses` admission learn from it.
    /// Call it once per request.
    pub fn record_request(&self, keys: &[SequenceHash]) {
        if !matches!(self.policy, TierPolicy::WriteThrough) {
            self.history.lock().record_request(keys);
        }
    }

    /// Marks `keys` as just used (the ones held; the others are ignored).
    pub fn touch(&self, keys: &[SequenceHash]) {
        self.pool.touch(keys);
    }

    fn admitted(&self, key: SequenceHash) -> bool {
        match self.policy {
            TierPolicy::WriteThrough => true,
            TierPolicy::MinUses(n) => self.history.lock().uses(key) >= n,
            TierPolicy::ReuseScore => self.pool.admit(key),
        }
    }

    /// Slots for the `keys` to write (each with its parent, `None` when
    /// unknown), in order: a key already held or being written is
    /// skipped, one the admission policy refuses is left out, and cached
    /// blocks are evicted for the rest while any are evictable. Each
    /// handed-out slot stays `Writing` until [`commit`](Self::commit).
    pub fn reserve(&self, keys: &[(SequenceHash, Option<SequenceHash>)]) -> Reservation {
        let mut out = Reservation::default();
        // Earlier removals are not this call's evictions.
        let _ = self.drain_events(|_| None::<()>);
        let mut books = self.books.lock();
        for &(key, parent) in keys {
            if books.doomed.contains(&key) && !self.pool.contains(key) {
                books.doomed.remove(&key);
            }
            if books.writing.contains_key(&key) || self.pool.contains(key) {
                out.present += 1;
                continue;
            }
            if !self.admitted(key) {
                out.refused += 1;
                continue;
            }
            match self.pool.allocate(1) {
                Ok(mut blocks) => {
                    let Some(block) = blocks.pop() else { break };
                    out.slots.push((key, block.block_id()));
                    books.writing.insert(key, (block, parent));
                }
                Err(_) => out.full += 1,
            }
        }
        drop(books);
        out.evicted = self.drain_events(|e| match e {
            KvEvent::Removed { hash, .. } => Some(hash),
            KvEvent::Stored { .. } => None,
        });
        out
    }

    /// Confirms (or, with `ok` false, abandons) the stores of `keys`: a
    /// confirmed block becomes loadable, an abandoned slot is freed. Keys
    /// not being written are ignored.
    pub fn commit(&self, keys: &[SequenceHash], ok: bool) {
        let blocks: Vec<_> = {
            let mut books = self.books.lock();
            keys.iter()
                .filter_map(|k| books.writing.remove(k).map(|b| (*k, b)))
                .collect()
        };
        if !ok {
            return; // dropping the mutable handles frees the slots
        }
        for (key, (block, parent)) in blocks {
            // A fresh slot completes under any hash; should it not, the
            // slot goes back free and the block is simply not held.
            if let Ok(complete) = block.complete(key, parent) {
                let _ = self.pool.register_block(complete);
            }
        }
    }

    /// Pins `keys` for a load and returns their slots, in order. All or
    /// nothing: a key that is not `Ready` refuses the call.
    pub fn pin(&self, keys: &[SequenceHash]) -> Result<Vec<u32>, LedgerError> {
        let mut books = self.books.lock();
        let mut taken: Vec<(SequenceHash, ImmutableBlock)> = Vec::with_capacity(keys.len());
        for &key in keys {
            if books.doomed.contains(&key) {
                return Err(LedgerError::NotReady(key));
            }
            if books.reading.contains_key(&key) || taken.iter().any(|(k, _)| *k == key) {
                continue;
            }
            let mut held = self.pool.match_prefix(&[key]).into_blocks();
            match held.pop() {
                Some(block) => taken.push((key, block)),
                None => return Err(LedgerError::NotReady(key)),
            }
        }
        for (key, block) in taken {
            books.reading.insert(key, Reading { block, loads: 0 });
        }
        let mut slots = Vec::with_capacity(keys.len());
        for key in keys {
            let r = books
                .reading
                .get_mut(key)
                .ok_or(LedgerError::NotReady(*key))?;
            r.loads += 1;
            slots.push(r.block.block_id());
        }
        Ok(slots)
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

    /// Marks `keys` as damaged (a load of them failed): they are never
    /// loaded again and read as absent; their slots come back when the
    /// policy evicts them.
    pub fn doom(&self, keys: &[SequenceHash]) {
        let mut books = self.books.lock();
        books
            .doomed
            .extend(keys.iter().filter(|k| self.pool.contains(**k)));
    }

    /// Forgets every store and load in flight and drops every block: for
    /// an engine that reset its offloading state and waits for the copies
    /// in flight before it sends new ones. Returns the blocks dropped.
    pub fn clear(&self) -> usize {
        {
            let mut books = self.books.lock();
            books.writing.clear();
            books.reading.clear();
            books.doomed.clear();
        }
        self.reset()
    }

    /// Drops every cached block that no load reads and no store writes;
    /// returns how many.
    pub fn reset(&self) -> usize {
        let n = self.pool.evict(self.pool.capacity());
        let _ = self.drain_events(|_| None::<()>);
        n
    }

    /// How many slots are held ready, being written, and being read.
    pub fn counts(&self) -> LedgerCounts {
        let books = self.books.lock();
        let c = self.pool.counts();
        LedgerCounts {
            ready: (c.active + c.inactive).saturating_sub(books.writing.len()),
            writing: books.writing.len(),
            reading: books.reading.len(),
        }
    }

    /// The blocks stored and removed since the last call, in order:
    /// `(stored, key)`.
    pub fn take_events(&self) -> Vec<(bool, SequenceHash)> {
        let _ = self.drain_events(|_| None::<()>);
        std::mem::take(&mut *self.unread.lock())
            .into_iter()
            .map(|e| match e {
                KvEvent::Stored { hash, .. } => (true, hash),
                KvEvent::Removed { hash, .. } => (false, hash),
            })
            .collect()
    }

    /// Moves pending pool events into `unread`, returning what `pick`
    /// selects of them.
    fn drain_events<T>(&self, pick: impl Fn(KvEvent) -> Option<T>) -> Vec<T> {
        let mut unread = self.unread.lock();
        let mut picked = Vec::new();
        let events = self.events.lock();
        while let Ok(batch) = events.try_recv() {
            for &e in batch.iter() {
                picked.extend(pick(e));
                unread.push(e);
            }
        }
        // Bound what nobody reads: a caller that never takes events keeps
        // only the newest.
        const KEEP: usize = 1 << 16;
        if unread.len() > KEEP {
            let cut = unread.len() - KEEP;
            unread.drain(..cut);
        }
        picked
    }
}

#[cfg(test)]
mod tests;
