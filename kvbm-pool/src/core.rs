//! The shared state of one pool and every operation on it.
//!
//! Locks, always taken in this order:
//! 1. `gate` (a per-thread-sharded reader-writer lock, see the `gate`
//!    module) over the registry: shared for matching, presence checks and
//!    upgrades; exclusive for registering and evicting — the only
//!    operations that change which hashes are cached.
//! 2. `policies` (one `Mutex` per shard): a thread releasing blocks takes
//!    its own shard once per released batch, and that is the only lock a
//!    release takes; eviction takes all of them (in order) and evicts the
//!    smallest key among the shards' candidates.
//! 3. `free` (`Mutex`): the free list; taken alone on the allocation fast
//!    path.
//!
//! Holder counts are atomics in the slab, so a match of `L` blocks takes the
//! shared gate once and does `L` atomic increments; two threads matching
//! different prefixes lock different gate and policy shards and share no
//! cache line on the way: release stamps come from the CPU's counter (see
//! the `clock` module), not from a shared counter in memory. Eviction needs
//! the exclusive gate, so it never races a match: a block a matcher found
//! cannot disappear under it; and it holds every policy shard, so it never
//! races a release either (a block whose last holder is leaving is queued
//! before any evictor looks).
//! A match whose first hash is absent takes no lock at all: the registry
//! proves absence with a lock-free probe (see `Registry::surely_absent`).
//!
//! Reactivating an inactive block does not touch the policy (see the
//! `policy` module): its queue entry just goes stale, which is what keeps
//! the policy lock off the match path.

use std::sync::Arc;
use std::sync::atomic::AtomicI64;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};

use kvbm_block::SequenceHash;
use kvbm_block::lifecycle::{BlockStore, CompleteParts};
use parking_lot::{Mutex, MutexGuard};

use crate::clock::{CallStamps, ReleaseClock};
use crate::config::{DuplicatePolicy, PoolConfig, Tier};
use crate::error::PoolError;
use crate::events::{EventHub, KvEvent};
use crate::gate::Gate;
use crate::policy::{BlockView, EvictionPolicy, Victim, block_ref};
use crate::registry::Registry;
use crate::slab::{Entry, NO_PARENT, Slab, State};

/// One shard of the eviction policy, with the latest stamp it handed out.
pub(crate) struct PolicyState {
    pub(crate) policy: Box<dyn EvictionPolicy>,
    last_stamp: u64,
}

/// Evictions whose candidates are loaded into cache together.
const WARM_BATCH: usize = 32;

/// Keeps a value on its own cache lines (and off its neighbours'): for
/// each shard's lock and counter, and for fields written on hot paths next
/// to fields every thread reads.
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

/// Which policy shard the calling thread releases into: threads are
/// numbered once, round robin, so concurrent threads use different shards.
pub(crate) fn thread_shard(shards: usize) -> usize {
    use std::cell::Cell;
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    let index = INDEX.with(|i| {
        if i.get() == usize::MAX {
            i.set(NEXT.fetch_add(1, Relaxed));
        }
        i.get()
    });
    index % shards
}

/// The state of one pool, shared by the pool and every handle on it
/// (through a [`PoolCore`]).
pub(crate) struct PoolState {
    pub(crate) slab: Slab,
    /// Shared access to `registry` for lookups, exclusive for changes.
    pub(crate) gate: Gate,
    pub(crate) registry: Registry,
    /// The eviction policy, one instance per shard: releases go to the
    /// releasing thread's shard, eviction takes the smallest key over all
    /// shards (all locked: it holds the registry exclusively anyway).
    pub(crate) policies: Box<[Padded<Mutex<PolicyState>>]>,
    /// Where release stamps come from (see the `clock` module): read, never
    /// written, by releasing threads.
    clock: ReleaseClock,
    pub(crate) free: Padded<Mutex<Vec<u32>>>,
    /// Registered blocks without holders. Exact whenever the registry is
    /// held exclusively; may lag by in-flight batches otherwise.
    /// Per shard (the thread's own, like the policy shard) so that threads
    /// do not bounce one counter's cache line; the sum is the count.
    inactive: Box<[Padded<AtomicI64>]>,
    pub(crate) events: EventHub,
    pub(crate) tier: Tier,
    pub(crate) block_size: usize,
    pub(crate) duplicates: DuplicatePolicy,
    compact_above: usize,
    /// The policy counts accesses (fixed at construction), so matches and
    /// registrations must tell it; otherwise they skip its lock.
    tracks_access: bool,
}

impl std::fmt::Debug for PoolState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolState")
            .field("capacity", &self.slab.len())
            .field("tier", &self.tier)
            .finish_non_exhaustive()
    }
}

/// The store a pool's handles point at: one of several per pool, each
/// with its own reference count on its own cache lines, all sharing the
/// pool's state.
///
/// Every handle holds an `Arc` of its store, and a match or a release
/// clones or drops one; with a single store per pool, threads matching at
/// once would bounce that count's cache line on every call. A
/// [`BlockPool`](crate::BlockPool) gives each thread one of its stores
/// (the same thread numbering as the policy shards), and handles compare
/// stores by the state they share, so blocks move freely between threads.
///
/// It has no public constructor: it exists only inside a
/// [`BlockPool`](crate::BlockPool), and handles are generic over it.
#[repr(align(128))]
pub struct PoolCore {
    pub(crate) state: Arc<PoolState>,
}

impl std::fmt::Debug for PoolCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.state.fmt(f)
    }
}

impl BlockStore for PoolCore {
    fn block_size(&self) -> usize {
        self.state.block_size
    }

    fn release_unregistered(&self, ids: &[u32]) {
        self.state.release_unregistered(ids);
    }

    fn retain(&self, id: u32) {
        self.state.retain(id);
    }

    fn release(&self, ids: &[u32]) {
        self.state.release(ids);
    }

    fn try_upgrade(&self, id: u32, hash: SequenceHash) -> bool {
        self.state.try_upgrade(id, hash)
    }

    fn sequence_hash(&self, id: u32) -> SequenceHash {
        self.state.sequence_hash(id)
    }

    fn same_store(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }
}

/// Blocks pulled off the free list.
pub(crate) type Taken = Vec<u32>;

impl PoolState {
    pub(crate) fn new(
        config: &PoolConfig,
        policies: Vec<Box<dyn EvictionPolicy>>,
    ) -> Result<Self, PoolError> {
        if policies.is_empty() {
            return Err(PoolError::InvalidConfig("at least one policy shard"));
        }
        if config.capacity == 0 {
            return Err(PoolError::InvalidConfig("capacity must be at least 1"));
        }
        if config.capacity >= u32::MAX as usize {
            return Err(PoolError::InvalidConfig("capacity must be below u32::MAX"));
        }
        if config.block_size == 0 {
            return Err(PoolError::InvalidConfig("block_size must be at least 1"));
        }
        let capacity = config.capacity;
        // Allocation takes the tail in order: ascending ids.
        let free: Vec<u32> = (0..capacity as u32).collect();
        let tracks_access = policies.iter().any(|p| p.tracks_access());
        let shards = policies.len();
        Ok(Self {
            tracks_access,
            slab: Slab::new(capacity),
            gate: Gate::new(),
            registry: Registry::new(capacity),
            policies: policies
                .into_iter()
                .map(|policy| {
                    Padded(Mutex::new(PolicyState {
                        policy,
                        last_stamp: 0,
                    }))
                })
                .collect(),
            clock: ReleaseClock::new(),
            free: Padded(Mutex::new(free)),
            inactive: (0..shards).map(|_| Padded(AtomicI64::new(0))).collect(),
            events: EventHub::default(),
            tier: config.tier,
            block_size: config.block_size,
            duplicates: config.duplicates,
            compact_above: capacity.saturating_mul(2).saturating_add(64),
        })
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slab.len()
    }

    fn entry(&self, id: u32) -> Entry<'_> {
        self.slab.entry(id)
    }

    /// Registered blocks without holders. Exact whenever the registry is
    /// held exclusively; may lag by in-flight batches otherwise.
    pub(crate) fn inactive_count(&self) -> usize {
        usize::try_from(self.inactive_raw()).unwrap_or(0)
    }

    pub(crate) fn inactive_raw(&self) -> i64 {
        self.inactive.iter().map(|c| c.0.load(Relaxed)).sum()
    }

    /// Adds `delta` to the calling thread's inactive counter.
    fn add_inactive(&self, delta: i64) {
        self.inactive[thread_shard(self.inactive.len())]
            .0
            .fetch_add(delta, Relaxed);
    }

    /// The calling thread's policy shard.
    pub(crate) fn shard(&self) -> &Mutex<PolicyState> {
        &self.policies[thread_shard(self.policies.len())].0
    }

    /// Every shard, locked in order.
    pub(crate) fn lock_all(&self) -> Vec<MutexGuard<'_, PolicyState>> {
        self.policies.iter().map(|p| p.0.lock()).collect()
    }

    /// Takes `n` blocks off the free list, evicting inactive blocks when
    /// there are not enough. All or nothing: on error no block is taken
    /// (blocks evicted along the way stay on the free list).
    pub(crate) fn take(&self, n: usize) -> Result<Taken, PoolError> {
        {
            let mut free = self.free.lock();
            if free.len() >= n {
                return Ok(self.pop_free(&mut free, n));
            }
        }
        let _gate = self.gate.write();
        let mut policies = self.lock_all();
        let mut free = self.free.lock();
        if free.len() < n {
            let need = n - free.len();
            if self.inactive_count() < need {
                return Err(PoolError::Exhausted {
                    requested: n,
                    free: free.len(),
                    evictable: self.inactive_count(),
                });
            }
            self.evict_locked(&mut policies, &mut free, need);
            if free.len() < n {
                return Err(PoolError::Exhausted {
                    requested: n,
                    free: free.len(),
                    evictable: 0,
                });
            }
        }
        Ok(self.pop_free(&mut free, n))
    }

    /// Takes those of `ids` that are on the free list (in `ids`' order,
    /// each once).
    pub(crate) fn take_ids(&self, ids: &[u32]) -> Taken {
        let _gate = self.gate.write();
        let mut free = self.free.lock();
        let on_list: std::collections::HashSet<u32> = free.iter().copied().collect();
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        let taken: Taken = ids
            .iter()
            .copied()
            .filter(|id| on_list.contains(id) && seen.insert(*id))
            .collect();
        free.retain(|id| !seen.contains(id));
        for &id in &taken {
            self.entry(id).set_state(State::Allocated);
        }
        taken
    }

    fn pop_free(&self, free: &mut MutexGuard<'_, Vec<u32>>, n: usize) -> Taken {
        let at = free.len() - n;
        let taken: Taken = free.split_off(at);
        for &id in &taken {
            self.entry(id).set_state(State::Allocated);
        }
        taken
    }

    /// Evicts up to `n` inactive blocks onto the free list; returns how many.
    pub(crate) fn evict(&self, n: usize) -> usize {
        let _gate = self.gate.write();
        let mut policies = self.lock_all();
        let mut free = self.free.lock();
        self.evict_locked(&mut policies, &mut free, n)
    }

    /// Evicts up to `n` inactive blocks and takes exactly their slots (not
    /// other free ones), allocated.
    pub(crate) fn evict_taken(&self, n: usize) -> Taken {
        let _gate = self.gate.write();
        let mut policies = self.lock_all();
        let mut free = self.free.lock();
        // The victims are pushed onto the free list's end, and the list is
        // locked throughout: the last `evicted` entries are exactly theirs.
        let evicted = self.evict_locked(&mut policies, &mut free, n);
        self.pop_free(&mut free, evicted)
    }

    /// Evicts with the gate held exclusively and every policy shard locked.
    fn evict_locked(
        &self,
        policies: &mut [MutexGuard<'_, PolicyState>],
        free: &mut Vec<u32>,
        n: usize,
    ) -> usize {
        let mut events = self.events.active().then(Vec::new);
        let mut evicted = 0;
        // Each shard's current candidate; only the shard that just gave a
        // victim (and was told about a new leaf) needs asking again.
        let mut heads: Vec<Option<Victim>> = vec![None; policies.len()];
        let mut stale: Vec<bool> = vec![true; policies.len()];
        let registry = &self.registry;
        registry.begin_moves();
        while evicted < n {
            let view = BlockView::with_registry(&self.slab, registry);
            if evicted % WARM_BATCH == 0 {
                for p in policies.iter() {
                    p.policy.warm(&view, WARM_BATCH.min(n - evicted));
                }
            }
            for (i, p) in policies.iter_mut().enumerate() {
                if stale[i] {
                    heads[i] = p.policy.peek_victim(&view);
                    stale[i] = false;
                }
            }
            let Some((shard, id)) = heads
                .iter()
                .enumerate()
                .filter_map(|(i, h)| h.map(|v| (v.key, i, v.id)))
                .min()
                .map(|(_, i, id)| (i, id))
            else {
                break;
            };
            policies[shard].policy.pop_victim();
            stale[shard] = true;
            let e = self.entry(id);
            let hash = e.hash();
            registry.remove(hash, id);
            self.unlink_parent(registry, id, e, &mut policies[shard]);
            e.cold.generation.fetch_add(1, Relaxed);
            e.cold.children.store(0, Relaxed);
            e.set_state(State::Free);
            free.push(id);
            evicted += 1;
            if let Some(ev) = events.as_mut() {
                ev.push(KvEvent::Removed {
                    hash,
                    tier: self.tier,
                });
            }
        }
        registry.end_moves();
        self.add_inactive(-(evicted as i64));
        if let Some(ev) = events {
            self.events.publish(ev);
        }
        evicted
    }

    /// Drops a leaving block's count in its parent, telling the policy when
    /// an inactive parent becomes a leaf.
    fn unlink_parent(&self, registry: &Registry, id: u32, e: Entry<'_>, policy: &mut PolicyState) {
        let pid = e.cold.parent_id.load(Relaxed);
        if pid == NO_PARENT {
            if let Some(parent) = e.parent() {
                registry.remove_orphan(parent, id);
            }
            return;
        }
        e.cold.parent_id.store(NO_PARENT, Relaxed);
        let p = self.entry(pid);
        if p.state() != State::Registered
            || p.cold.generation.load(Relaxed) != e.cold.parent_gen.load(Relaxed)
        {
            return;
        }
        let left = p.cold.children.load(Relaxed).saturating_sub(1);
        p.cold.children.store(left, Relaxed);
        if left == 0 && p.hot.holders.load(Acquire) == 0 {
            policy.policy.on_became_leaf(block_ref(pid, p));
            // The parent keeps its release stamp: it is as old as it was.
        }
    }

    /// For a batch of more than two, loads every registry slot and entry
    /// `parts` will touch before registering any: independent loads whose
    /// cache misses overlap.
    fn prefetch(&self, parts: &[CompleteParts<PoolCore>]) {
        if parts.len() > 2 {
            let mut sink = 0u64;
            for part in parts {
                sink ^= self.registry.peek(part.hash);
                sink ^= self.entry(part.id).cold.parent.load(Relaxed);
            }
            std::hint::black_box(sink);
        }
    }

    /// Registers complete blocks in order; returns one held id per block
    /// (the existing block for a deduplicated hash).
    pub(crate) fn register(&self, parts: &[CompleteParts<PoolCore>]) -> Vec<u32> {
        let mut out = Vec::with_capacity(parts.len());
        let mut freed: Vec<u32> = Vec::new();
        let mut events = self
            .events
            .active()
            .then(|| Vec::with_capacity(parts.len()));
        let gate = self.gate.write();
        let registry = &self.registry;
        let mut policy = self.policy_if_tracking();
        let mut reactivated = 0i64;
        self.prefetch(parts);
        // The previous block's primary: usually the parent of the next one,
        // which then needs no registry lookup.
        let mut previous: Option<(SequenceHash, u32)> = None;
        for part in parts {
            let e = self.entry(part.id);
            // Named first, so the slot inserted below never points at a
            // stale hash.
            e.set_names(part.hash, part.parent);
            if let Some(existing) = registry.get_or_insert(&self.slab, part.hash, part.id) {
                previous = Some((part.hash, existing));
                match self.duplicates {
                    DuplicatePolicy::ReuseExisting => {
                        if self.entry(existing).hot.holders.fetch_add(1, AcqRel) == 0 {
                            reactivated += 1;
                        }
                        e.set_state(State::Free);
                        freed.push(part.id);
                        out.push(existing);
                    }
                    DuplicatePolicy::KeepDuplicate => {
                        e.hot.priority.store(part.priority, Relaxed);
                        e.cold.parent_id.store(NO_PARENT, Relaxed);
                        e.hot.holders.store(1, Release);
                        e.set_state(State::Duplicate);
                        out.push(part.id);
                    }
                }
            } else {
                e.hot.priority.store(part.priority, Relaxed);
                e.cold.children.store(0, Relaxed);
                self.link_lineage(registry, part.id, e, previous);
                previous = Some((part.hash, part.id));
                e.hot.holders.store(1, Release);
                e.set_state(State::Registered);
                out.push(part.id);
                if let Some(ev) = events.as_mut() {
                    ev.push(KvEvent::Stored {
                        hash: part.hash,
                        parent: part.parent,
                        tier: self.tier,
                    });
                }
            }
            if let Some(p) = policy.as_mut() {
                p.policy.on_access(part.hash);
            }
        }
        if reactivated != 0 {
            self.add_inactive(-reactivated);
        }
        if let Some(ev) = events {
            self.events.publish(ev);
        }
        drop(policy);
        if !freed.is_empty() {
            self.free.lock().extend_from_slice(&freed);
        }
        drop(gate);
        out
    }

    /// Links a newly registered block to its cached parent, or records it
    /// as an orphan the parent adopts when it is registered later; then
    /// adopts the block's own orphans (children registered before it).
    fn link_lineage(
        &self,
        registry: &Registry,
        id: u32,
        e: Entry<'_>,
        previous: Option<(SequenceHash, u32)>,
    ) {
        e.cold.parent_id.store(NO_PARENT, Relaxed);
        if let Some(parent) = e.parent() {
            let pid = match previous {
                Some((hash, pid)) if hash == parent => Some(pid),
                _ => registry.get(&self.slab, parent),
            };
            match pid {
                Some(pid) => self.link(e, pid),
                None => registry.add_orphan(parent, id),
            }
        }
        if let Some(kids) = registry.take_orphans(e.hash()) {
            for kid in kids {
                self.link(self.entry(kid), id);
            }
        }
    }

    fn link(&self, child: Entry<'_>, pid: u32) {
        let p = self.entry(pid);
        child.cold.parent_id.store(pid, Relaxed);
        child
            .cold
            .parent_gen
            .store(p.cold.generation.load(Relaxed), Relaxed);
        p.cold.children.fetch_add(1, Relaxed);
    }

    fn policy_if_tracking(&self) -> Option<MutexGuard<'_, PolicyState>> {
        self.tracks_access.then(|| self.shard().lock())
    }

    /// Takes a holder on each block of the longest cached prefix of
    /// `hashes`; returns their ids.
    ///
    /// Blocks of one sequence are usually allocated together and so have
    /// consecutive ids: the block after `id` is first looked for at
    /// `id + 1` and `id - 1`, in the slab, whose hot entries sit next to each other. A
    /// registered entry with the right hash *is* the registry's primary for
    /// that hash (there is one registered block per hash), so the guess
    /// needs no table access when it is right. Otherwise the table is asked,
    /// with the slots of the next few hashes loaded together first so that
    /// their cache misses overlap. Holders are taken in order and the walk
    /// stops at the first miss, so later blocks are never touched.
    pub(crate) fn match_prefix(&self, hashes: &[SequenceHash]) -> Vec<u32> {
        const AHEAD: usize = 16;
        let Some(&first) = hashes.first() else {
            return Vec::new();
        };
        if self.registry.surely_absent(first) {
            return Vec::new();
        }
        let gate = self.gate.read();
        let registry = &self.registry;
        let Some(first_id) = registry.get(&self.slab, first) else {
            return Vec::new();
        };
        let mut ids = Vec::with_capacity(hashes.len());
        let mut reactivated = 0i64;
        let mut take = |id: u32, ids: &mut Vec<u32>| {
            if self.slab.hot(id).holders.fetch_add(1, AcqRel) == 0 {
                reactivated += 1;
            }
            ids.push(id);
        };
        take(first_id, &mut ids);
        let mut prev = first_id;
        let mut loaded_until = 1;
        for (i, &h) in hashes.iter().enumerate().skip(1) {
            let (up, down) = (prev.wrapping_add(1), prev.wrapping_sub(1));
            let id = if self.slab.is_registered_as(up, h) {
                up
            } else if self.slab.is_registered_as(down, h) {
                down
            } else {
                if i >= loaded_until && hashes.len() - i > 2 {
                    loaded_until = (i + AHEAD).min(hashes.len());
                    let mut sink = 0u64;
                    for &ahead in &hashes[i..loaded_until] {
                        sink ^= registry.peek(ahead);
                    }
                    std::hint::black_box(sink);
                }
                match registry.get(&self.slab, h) {
                    Some(id) => id,
                    None => break,
                }
            };
            take(id, &mut ids);
            prev = id;
        }
        if reactivated != 0 {
            self.add_inactive(-reactivated);
        }
        if self.tracks_access {
            let mut policy = self.shard().lock();
            for hash in &hashes[..ids.len()] {
                policy.policy.on_access(*hash);
            }
        }
        drop(gate);
        ids
    }

    /// Length of the longest cached prefix, without taking holders.
    pub(crate) fn cached_prefix_len(&self, hashes: &[SequenceHash]) -> usize {
        let _gate = self.gate.read();
        let registry = &self.registry;
        hashes
            .iter()
            .take_while(|&&h| registry.get(&self.slab, h).is_some())
            .count()
    }

    /// Marks inactive blocks among `hashes` as just used; returns how many
    /// of them are cached.
    pub(crate) fn touch(&self, hashes: &[SequenceHash]) -> usize {
        let _gate = self.gate.read();
        let registry = &self.registry;
        let mut guard = self.shard().lock();
        let PolicyState { policy, last_stamp } = &mut *guard;
        let mut stamps = self.clock.call(last_stamp);
        let mut found = 0;
        for hash in hashes {
            if let Some(id) = registry.get(&self.slab, *hash) {
                found += 1;
                let e = self.entry(id);
                if e.hot.holders.load(Acquire) == 0 {
                    restamp(policy.as_mut(), &mut stamps, id, e);
                }
                if policy.tracks_access() {
                    policy.on_access(*hash);
                }
            }
        }
        found
    }

    /// Changes a cached block's priority; `false` if the hash is not cached.
    pub(crate) fn set_priority(&self, hash: SequenceHash, priority: u8) -> bool {
        let _gate = self.gate.read();
        let Some(id) = self.registry.get(&self.slab, hash) else {
            return false;
        };
        let mut guard = self.shard().lock();
        let PolicyState { policy, last_stamp } = &mut *guard;
        let e = self.entry(id);
        e.hot.priority.store(priority.min(100), Relaxed);
        if e.hot.holders.load(Acquire) == 0 {
            restamp(policy.as_mut(), &mut self.clock.call(last_stamp), id, e);
        }
        true
    }

    /// Whether `hash` should be cached, asking the policy only when caching
    /// it would mean evicting.
    pub(crate) fn admit(&self, hash: SequenceHash) -> bool {
        if !self.free.lock().is_empty() {
            return true;
        }
        let _gate = self.gate.read();
        let mut policy = self.shard().lock();
        policy.policy.admit(hash, &BlockView::new(&self.slab))
    }

    fn maybe_compact(&self, policy: &mut dyn EvictionPolicy) {
        if policy.queued() > self.compact_above {
            policy.compact(&BlockView::new(&self.slab));
        }
    }
}

/// Queues an inactive block again with the call's next stamp (its old
/// entries become stale).
fn restamp(policy: &mut dyn EvictionPolicy, stamps: &mut CallStamps<'_>, id: u32, e: Entry<'_>) {
    e.hot.stamp.store(stamps.next(), Relaxed);
    policy.on_release(block_ref(id, e));
}

impl BlockStore for PoolState {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn release_unregistered(&self, ids: &[u32]) {
        let mut free = self.free.lock();
        for &id in ids {
            self.entry(id).set_state(State::Free);
            free.push(id);
        }
    }

    fn retain(&self, id: u32) {
        // The caller holds the block already, so it cannot change state.
        self.entry(id).hot.holders.fetch_add(1, Relaxed);
    }

    fn release(&self, ids: &[u32]) {
        if ids.is_empty() {
            return;
        }
        // The thread's policy shard is the only lock: eviction holds every
        // shard, so it never sees a block between its last holder leaving
        // and its queue entry; registration and matching may run alongside
        // (they only ever add holders).
        let mut guard = self.shard().lock();
        let PolicyState { policy, last_stamp } = &mut *guard;
        let mut stamps = self.clock.call(last_stamp);
        let mut inactive = 0i64;
        for &id in ids {
            let e = self.entry(id);
            if e.hot.holders.fetch_sub(1, AcqRel) != 1 {
                continue;
            }
            match e.state() {
                State::Registered => {
                    restamp(policy.as_mut(), &mut stamps, id, e);
                    inactive += 1;
                }
                State::Duplicate => {
                    e.set_state(State::Free);
                    self.free.lock().push(id);
                }
                State::Free | State::Allocated => {}
            }
        }
        if inactive != 0 {
            self.add_inactive(inactive);
            self.maybe_compact(policy.as_mut());
        }
    }

    fn try_upgrade(&self, id: u32, hash: SequenceHash) -> bool {
        let Some(e) = self.slab.get(id) else {
            return false;
        };
        let _gate = self.gate.read();
        if e.hash() != hash {
            return false;
        }
        match e.state() {
            State::Registered => {
                if e.hot.holders.fetch_add(1, AcqRel) == 0 {
                    self.add_inactive(-1);
                }
                true
            }
            State::Duplicate => e
                .hot
                .holders
                .fetch_update(AcqRel, Acquire, |h| (h > 0).then_some(h + 1))
                .is_ok(),
            State::Free | State::Allocated => false,
        }
    }

    fn sequence_hash(&self, id: u32) -> SequenceHash {
        self.slab.get(id).map_or(SequenceHash(0), |e| e.hash())
    }
}
