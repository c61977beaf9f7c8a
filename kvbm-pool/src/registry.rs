//! The registry: sequence hash → block id, as a flat open-addressing table.
//!
//! Each slot is one `u64`: a 32-bit fingerprint of the hash and the 32-bit
//! block id. The full hash lives in the block's slab entry, which a match
//! reads anyway (to take a holder), so the table itself stays at 8 bytes a
//! slot — the table of a 65,536-block pool is 1 MiB and fits in L2 — and a
//! lookup for an absent hash never leaves the table. Linear probing at a
//! load factor of at most ½ (the table has twice the pool's capacity in
//! slots, so it never grows); deletion shifts later entries back instead of
//! leaving tombstones, so probe lengths stay short under churn.
//!
//! Slots are atomics so that a lookup whose answer is "absent" can run
//! without the pool's gate (see [`Registry::surely_absent`]): removals bump
//! a sequence counter around their slot moves, and a lock-free probe that
//! saw no change in it and no matching fingerprint proves the hash absent.
//! Everything else runs under the pool's gate (shared for lookups,
//! exclusive for changes), which is what orders the relaxed accesses.
//!
//! Sequence hashes are already uniform, so the fingerprint is a fold and
//! one multiplication away (multiplicative hashing), and the home slot is
//! the fingerprint's top bits; the fold keeps structured keys (counters,
//! multiples of a constant) from clustering.

use std::collections::HashMap;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicU64, AtomicUsize, fence};

use parking_lot::Mutex;

use kvbm_block::SequenceHash;

use crate::core::Padded;
use crate::slab::Slab;

const EMPTY: u64 = u64::MAX;
const SPREAD: u64 = 0xD6E8_FEB8_6659_FD93;

/// 32 well-mixed bits of the hash: the slot's fingerprint, whose top bits
/// are also the home slot, so moving entries around never needs the full
/// hash (no slab access while deleting).
fn fingerprint(h: SequenceHash) -> u64 {
    (h.0 ^ (h.0 >> 32)).wrapping_mul(SPREAD) >> 32
}

fn pack(h: SequenceHash, id: u32) -> u64 {
    (fingerprint(h) << 32) | u64::from(id)
}

fn id_of(slot: u64) -> u32 {
    slot as u32
}

/// The registry table.
///
/// Methods that change it take `&self` (the slots are atomics) but must
/// only be called with the pool's gate held exclusively.
pub(crate) struct Registry {
    slots: Box<[AtomicU64]>,
    /// Home slot = fingerprint >> `shift`.
    shift: u32,
    mask: usize,
    /// Padded: registering writes it, matching reads the fields around it.
    len: Padded<AtomicUsize>,
    /// Odd while removals move slots around; lock-free probes that see it
    /// change retry under the gate.
    moves: AtomicU64,
    /// Blocks registered while their parent was not: parent hash → ids.
    /// The parent adopts them when it is registered, so lineage (and
    /// leaf-first eviction) holds whatever order blocks arrive in. Only
    /// touched under the exclusive gate, so its lock is never contended.
    orphans: Mutex<HashMap<SequenceHash, Vec<u32>>>,
}

impl Registry {
    /// An empty table for a pool of `capacity` blocks.
    pub(crate) fn new(capacity: usize) -> Self {
        // At most 2^31 slots: homes come from the 32-bit fingerprint.
        let size = capacity
            .saturating_mul(2)
            .clamp(16, 1 << 31)
            .next_power_of_two();
        Self {
            slots: (0..size).map(|_| AtomicU64::new(EMPTY)).collect(),
            shift: 32 - size.trailing_zeros(),
            mask: size - 1,
            len: Padded(AtomicUsize::new(0)),
            moves: AtomicU64::new(0),
            orphans: Mutex::new(HashMap::new()),
        }
    }

    /// Registered hashes.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Relaxed)
    }

    fn slot(&self, i: usize) -> u64 {
        self.slots[i].load(Relaxed)
    }

    /// Whether `h` is certainly not registered, checked without the gate.
    /// `false` means "maybe": ask [`get`](Self::get) under the gate.
    ///
    /// A probe walks the run from `h`'s home slot to the first empty slot
    /// looking for `h`'s fingerprint. Insertions only fill empty slots, so a
    /// probe racing one at worst misses a hash that is being registered
    /// right now (the lookup then simply happened first). Removals shift
    /// entries backwards, which could carry an entry past the probe; they
    /// run between two bumps of `moves` (a sequence lock), and a probe that
    /// saw `moves` odd or changed answers "maybe".
    pub(crate) fn surely_absent(&self, h: SequenceHash) -> bool {
        let before = self.moves.load(Acquire);
        if before & 1 == 1 {
            return false;
        }
        let fp = fingerprint(h);
        let mut i = self.home(h);
        loop {
            let s = self.slot(i);
            if s == EMPTY {
                break;
            }
            if s >> 32 == fp {
                return false;
            }
            i = (i + 1) & self.mask;
        }
        // Orders the slot loads above before the check below (the reader
        // half of a sequence lock).
        fence(Acquire);
        self.moves.load(Relaxed) == before
    }

    /// Starts a batch of removals (gate held exclusively).
    pub(crate) fn begin_moves(&self) {
        self.moves.fetch_add(1, Relaxed);
        // Orders the odd count before the slot stores that follow (the
        // writer half of a sequence lock).
        fence(Release);
    }

    /// Ends a batch of removals.
    pub(crate) fn end_moves(&self) {
        self.moves.fetch_add(1, Release);
    }

    /// The home slot of `h`.
    pub(crate) fn home(&self, h: SequenceHash) -> usize {
        (fingerprint(h) >> self.shift) as usize
    }

    fn home_of_slot(&self, slot: u64) -> usize {
        ((slot >> 32) >> self.shift) as usize
    }

    /// Reads `h`'s home slot, for callers that load slots ahead of use (the
    /// loads of a batch then overlap instead of waiting one after another).
    pub(crate) fn peek(&self, h: SequenceHash) -> u64 {
        self.slot(self.home(h))
    }

    /// The block registered under `h`.
    pub(crate) fn get(&self, slab: &Slab, h: SequenceHash) -> Option<u32> {
        let fp = fingerprint(h);
        let mut i = self.home(h);
        loop {
            let s = self.slot(i);
            if s == EMPTY {
                return None;
            }
            if s >> 32 == fp && slab.entry(id_of(s)).hash() == h {
                return Some(id_of(s));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The block registered under `h`, or, when there is none, registers
    /// `id` under it (one probe walk for both).
    pub(crate) fn get_or_insert(&self, slab: &Slab, h: SequenceHash, id: u32) -> Option<u32> {
        let fp = fingerprint(h);
        let mut i = self.home(h);
        loop {
            let s = self.slot(i);
            if s == EMPTY {
                self.slots[i].store(pack(h, id), Relaxed);
                self.len.fetch_add(1, Relaxed);
                return None;
            }
            if s >> 32 == fp && slab.entry(id_of(s)).hash() == h {
                return Some(id_of(s));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Removes block `id`, registered under `h`; `false` if it was not.
    /// Call it between [`begin_moves`](Self::begin_moves) and
    /// [`end_moves`](Self::end_moves).
    pub(crate) fn remove(&self, h: SequenceHash, id: u32) -> bool {
        let target = pack(h, id);
        let mut i = self.home(h);
        loop {
            let s = self.slot(i);
            if s == EMPTY {
                return false;
            }
            if s == target {
                break;
            }
            i = (i + 1) & self.mask;
        }
        // Shift back every later entry of the probe run that may move into
        // the hole without passing its home slot.
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let s = self.slot(j);
            if s == EMPTY {
                break;
            }
            let home = self.home_of_slot(s);
            // `s` may fill hole `i` if its home is not in (i, j] cyclically.
            let between = if i <= j {
                i < home && home <= j
            } else {
                i < home || home <= j
            };
            if !between {
                self.slots[i].store(s, Relaxed);
                i = j;
            }
        }
        self.slots[i].store(EMPTY, Relaxed);
        self.len.fetch_sub(1, Relaxed);
        true
    }

    /// Records `id` as waiting for its parent `parent`.
    pub(crate) fn add_orphan(&self, parent: SequenceHash, id: u32) {
        self.orphans.lock().entry(parent).or_default().push(id);
    }

    /// The blocks waiting for `parent`, which is being registered.
    pub(crate) fn take_orphans(&self, parent: SequenceHash) -> Option<Vec<u32>> {
        let mut orphans = self.orphans.lock();
        if orphans.is_empty() {
            return None;
        }
        orphans.remove(&parent)
    }

    /// Forgets orphan `id` (it is leaving the registry).
    pub(crate) fn remove_orphan(&self, parent: SequenceHash, id: u32) {
        let mut orphans = self.orphans.lock();
        if let Some(kids) = orphans.get_mut(&parent) {
            kids.retain(|&k| k != id);
            if kids.is_empty() {
                orphans.remove(&parent);
            }
        }
    }

    /// Every orphan: (parent hash, id).
    pub(crate) fn orphans(&self) -> Vec<(SequenceHash, u32)> {
        self.orphans
            .lock()
            .iter()
            .flat_map(|(&p, kids)| kids.iter().map(move |&k| (p, k)))
            .collect()
    }

    /// The ids of every registered block.
    pub(crate) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.slots
            .iter()
            .map(|s| s.load(Relaxed))
            .filter(|&s| s != EMPTY)
            .map(id_of)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Inserts and removes against a map; small hash ranges force long
        /// probe runs and wrap-around.
        #[test]
        fn behaves_like_a_map(ops in prop::collection::vec((any::<bool>(), 0u64..40), 1..300)) {
            const CAP: usize = 24;
            let slab = Slab::new(CAP);
            let reg = Registry::new(CAP);
            let mut model: BTreeMap<u64, u32> = BTreeMap::new();
            let mut free: Vec<u32> = (0..CAP as u32).collect();
            for (insert, k) in ops {
                // Few distinct fingerprints and homes: collisions everywhere.
                let h = SequenceHash(k.wrapping_mul(0x1_0000_0001) >> 3);
                if insert {
                    if model.contains_key(&h.0) { continue; }
                    let Some(id) = free.pop() else { continue };
                    slab.entry(id).set_names(h, None);
                    prop_assert_eq!(reg.get_or_insert(&slab, h, id), None);
                    model.insert(h.0, id);
                } else if let Some(id) = model.remove(&h.0) {
                    prop_assert!(reg.remove(h, id));
                    free.push(id);
                }
                prop_assert_eq!(reg.len(), model.len());
                for k2 in 0u64..40 {
                    let h2 = SequenceHash(k2.wrapping_mul(0x1_0000_0001) >> 3);
                    prop_assert_eq!(reg.get(&slab, h2), model.get(&h2.0).copied());
                    // "Surely absent" is never said of a present hash.
                    if model.contains_key(&h2.0) {
                        prop_assert!(!reg.surely_absent(h2));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod probe_tests {
    use super::*;

    /// Mean displacement from the home slot: linear probing at load ½
    /// expects about 0.5; structured keys must not cluster either.
    fn mean_displacement(keys: impl Iterator<Item = u64>, cap: usize) -> f64 {
        let slab = Slab::new(cap);
        let reg = Registry::new(cap);
        for (id, k) in keys.take(cap).enumerate() {
            let h = SequenceHash(k);
            slab.entry(id as u32).set_names(h, None);
            reg.get_or_insert(&slab, h, id as u32);
        }
        let mut total = 0usize;
        for (i, s) in reg.slots.iter().enumerate() {
            let s = s.load(Relaxed);
            if s != EMPTY {
                let home = reg.home(slab.entry(id_of(s)).hash());
                total += (i + reg.slots.len() - home) & reg.mask;
            }
        }
        total as f64 / cap as f64
    }

    #[test]
    fn probe_runs_stay_short() {
        let cap = 1 << 14;
        let sequential = mean_displacement(1u64.., cap);
        let multiplied =
            mean_displacement((1u64..).map(|c| c.wrapping_mul(0x9E37_79B9_7F4A_7C15)), cap);
        let mut x = 1u64;
        let random = mean_displacement(
            std::iter::from_fn(|| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                Some(x)
            }),
            cap,
        );
        eprintln!(
            "displacement: sequential {sequential}, multiplied {multiplied}, random {random}"
        );
        for d in [sequential, multiplied, random] {
            assert!(d < 2.0, "mean displacement {d}");
        }
    }
}
