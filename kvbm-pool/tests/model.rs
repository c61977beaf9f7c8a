//! Model-based test: random operation sequences run against the pool and a
//! small reference model that predicts every eviction exactly.

use std::collections::{BTreeMap, BTreeSet};

use kvbm_block::SequenceHash;
use kvbm_pool::{
    BlockPool, CompleteBlock, EvictionKind, ImmutableBlock, ImmutableBlocks, KvEvent, MutableBlock,
    PoolConfig, PoolError, Tier, WeakBlock,
};
use proptest::prelude::*;

const CAPACITY: usize = 10;
const CHAINS: u64 = 3;
const DEPTH: u64 = 6;
const PRIORITIES: [u8; 3] = [0, 35, 80];

/// Block `pos` of chain `chain`: its hash and its parent's.
fn name(chain: u64, pos: u64) -> (SequenceHash, Option<SequenceHash>) {
    let h = |p: u64| SequenceHash(chain * 1000 + p + 1);
    (h(pos), (pos > 0).then(|| h(pos - 1)))
}

fn chain_hashes(chain: u64, len: u64) -> Vec<SequenceHash> {
    (0..len).map(|p| name(chain, p).0).collect()
}

#[derive(Clone, Debug)]
enum Op {
    Allocate(usize),
    Complete {
        idx: usize,
        chain: u64,
        pos: u64,
        prio: usize,
    },
    Register(usize),
    DropMutable(usize),
    DropComplete(usize),
    DropHeld(usize),
    DropBatch(usize),
    Match {
        chain: u64,
        len: u64,
    },
    SplitBatch(usize),
    CloneHeld(usize),
    Downgrade(usize),
    Upgrade(usize),
    Evict(usize),
    Touch {
        chain: u64,
        len: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..4).prop_map(Op::Allocate),
        4 => (any::<prop::sample::Index>().prop_map(|i| i.index(64)), 0..CHAINS, 0..DEPTH, 0usize..3)
            .prop_map(|(idx, chain, pos, prio)| Op::Complete { idx, chain, pos, prio }),
        3 => (1usize..4).prop_map(Op::Register),
        1 => (0usize..8).prop_map(Op::DropMutable),
        1 => (0usize..8).prop_map(Op::DropComplete),
        2 => (0usize..8).prop_map(Op::DropHeld),
        2 => (0usize..8).prop_map(Op::DropBatch),
        3 => (0..CHAINS, 0..=DEPTH).prop_map(|(chain, len)| Op::Match { chain, len }),
        1 => (0usize..8).prop_map(Op::SplitBatch),
        1 => (0usize..8).prop_map(Op::CloneHeld),
        1 => (0usize..8).prop_map(Op::Downgrade),
        1 => (0usize..8).prop_map(Op::Upgrade),
        1 => (0usize..4).prop_map(Op::Evict),
        1 => (0..CHAINS, 0..=DEPTH).prop_map(|(chain, len)| Op::Touch { chain, len }),
    ]
}

/// A cached block as the model sees it.
#[derive(Clone, Debug)]
struct Cached {
    id: u32,
    holders: usize,
    stamp: u64,
    parent: Option<SequenceHash>,
    priority: u8,
}

/// The reference model.
struct Model {
    leaf_first: bool,
    priorities: bool,
    free: usize,
    allocated: usize,
    cached: BTreeMap<SequenceHash, Cached>,
    clock: u64,
}

impl Model {
    fn inactive(&self) -> usize {
        self.cached.values().filter(|c| c.holders == 0).count()
    }

    fn has_cached_child(&self, h: SequenceHash) -> bool {
        self.cached.values().any(|c| c.parent == Some(h))
    }

    /// The block the policy must evict next.
    fn victim(&self) -> Option<SequenceHash> {
        self.cached
            .iter()
            .filter(|(h, c)| c.holders == 0 && (!self.leaf_first || !self.has_cached_child(**h)))
            .min_by_key(|(_, c)| (if self.priorities { c.priority } else { 0 }, c.stamp))
            .map(|(h, _)| *h)
    }

    fn evict(&mut self, n: usize) -> usize {
        let mut done = 0;
        while done < n {
            let Some(h) = self.victim() else { break };
            self.cached.remove(&h);
            self.free += 1;
            done += 1;
        }
        done
    }

    /// Expected outcome of allocating `n`: Ok, or Err after evicting some.
    fn allocate(&mut self, n: usize) -> bool {
        if n > CAPACITY {
            return false;
        }
        if self.free < n {
            let need = n - self.free;
            if self.inactive() < need {
                return false;
            }
            self.evict(need);
            if self.free < n {
                return false;
            }
        }
        self.free -= n;
        self.allocated += n;
        true
    }

    fn release(&mut self, h: SequenceHash) {
        let c = self.cached.get_mut(&h).expect("released block is cached");
        c.holders -= 1;
        if c.holders == 0 {
            self.clock += 1;
            c.stamp = self.clock;
        }
    }

    fn hold(&mut self, h: SequenceHash) {
        self.cached
            .get_mut(&h)
            .expect("held block is cached")
            .holders += 1;
    }
}

struct Harness {
    pool: BlockPool,
    model: Model,
    mutables: Vec<MutableBlock>,
    completes: Vec<CompleteBlock>,
    held: Vec<ImmutableBlock>,
    batches: Vec<(Vec<SequenceHash>, ImmutableBlocks)>,
    weaks: Vec<WeakBlock>,
    events: std::sync::mpsc::Receiver<kvbm_pool::KvEventBatch>,
    replayed: BTreeMap<SequenceHash, Option<SequenceHash>>,
}

impl Harness {
    fn new(eviction: EvictionKind, priorities: bool) -> Self {
        let config = PoolConfig::new(CAPACITY, 4, Tier::G2)
            .eviction(eviction)
            .priorities(priorities);
        let pool = BlockPool::new(config).unwrap();
        let events = pool.subscribe();
        Self {
            model: Model {
                leaf_first: eviction == EvictionKind::LeafFirst,
                priorities,
                free: CAPACITY,
                allocated: 0,
                cached: BTreeMap::new(),
                clock: 0,
            },
            pool,
            mutables: Vec::new(),
            completes: Vec::new(),
            held: Vec::new(),
            batches: Vec::new(),
            weaks: Vec::new(),
            events,
            replayed: BTreeMap::new(),
        }
    }

    fn apply(&mut self, op: &Op) {
        let m = &mut self.model;
        match *op {
            Op::Allocate(n) => {
                let expect = m.allocate(n);
                match self.pool.allocate(n) {
                    Ok(blocks) => {
                        assert!(expect, "pool allocated {n} where the model could not");
                        assert_eq!(blocks.len(), n);
                        self.mutables.extend(blocks);
                    }
                    Err(PoolError::Exhausted { .. }) => assert!(!expect, "pool refused {n}"),
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Op::Complete {
                idx,
                chain,
                pos,
                prio,
            } => {
                if self.mutables.is_empty() {
                    return;
                }
                let b = self.mutables.swap_remove(idx % self.mutables.len());
                let (h, p) = name(chain, pos);
                let c = b.complete(h, p).unwrap().with_priority(PRIORITIES[prio]);
                self.completes.push(c);
            }
            Op::Register(k) => {
                let k = k.min(self.completes.len());
                if k == 0 {
                    return;
                }
                let blocks: Vec<_> = self.completes.drain(..k).collect();
                let names: Vec<_> = blocks
                    .iter()
                    .map(|b| (b.sequence_hash(), b.parent(), b.block_id(), b.priority()))
                    .collect();
                let held = self.pool.register(blocks).unwrap();
                assert_eq!(held.len(), k);
                for (i, (h, parent, id, priority)) in names.iter().copied().enumerate() {
                    m.allocated -= 1;
                    if let Some(c) = m.cached.get_mut(&h) {
                        c.holders += 1;
                        m.free += 1;
                        assert_eq!(held.block_ids()[i], c.id, "dedup returns the primary");
                    } else {
                        m.cached.insert(
                            h,
                            Cached {
                                id,
                                holders: 1,
                                stamp: 0,
                                parent,
                                priority,
                            },
                        );
                        assert_eq!(held.block_ids()[i], id);
                    }
                    assert_eq!(held.sequence_hash(i), Some(h));
                }
                let hashes = names.iter().map(|n| n.0).collect();
                self.batches.push((hashes, held));
            }
            Op::DropMutable(i) => {
                if !self.mutables.is_empty() {
                    self.mutables.swap_remove(i % self.mutables.len());
                    m.allocated -= 1;
                    m.free += 1;
                }
            }
            Op::DropComplete(i) => {
                if !self.completes.is_empty() {
                    self.completes.remove(i % self.completes.len());
                    m.allocated -= 1;
                    m.free += 1;
                }
            }
            Op::DropHeld(i) => {
                if !self.held.is_empty() {
                    let b = self.held.swap_remove(i % self.held.len());
                    let h = b.sequence_hash();
                    drop(b);
                    m.release(h);
                }
            }
            Op::DropBatch(i) => {
                if !self.batches.is_empty() {
                    let (hashes, b) = self.batches.swap_remove(i % self.batches.len());
                    drop(b);
                    for h in hashes {
                        m.release(h);
                    }
                }
            }
            Op::Match { chain, len } => {
                let hashes = chain_hashes(chain, len);
                let expect = hashes
                    .iter()
                    .take_while(|h| m.cached.contains_key(h))
                    .count();
                assert_eq!(self.pool.cached_prefix_len(&hashes), expect);
                let got = self.pool.match_prefix(&hashes);
                assert_eq!(got.len(), expect, "match length");
                for (i, h) in hashes[..expect].iter().enumerate() {
                    assert_eq!(got.block_ids()[i], m.cached[h].id);
                    m.hold(*h);
                }
                self.batches.push((hashes[..expect].to_vec(), got));
            }
            Op::SplitBatch(i) => {
                if !self.batches.is_empty() {
                    let (_, b) = self.batches.swap_remove(i % self.batches.len());
                    self.held.extend(b.into_blocks());
                }
            }
            Op::CloneHeld(i) => {
                if !self.held.is_empty() {
                    let b = self.held[i % self.held.len()].clone();
                    m.hold(b.sequence_hash());
                    self.held.push(b);
                }
            }
            Op::Downgrade(i) => {
                if !self.held.is_empty() {
                    let w = self.held[i % self.held.len()].downgrade();
                    self.weaks.push(w);
                }
            }
            Op::Upgrade(i) => {
                if !self.weaks.is_empty() {
                    let w = &self.weaks[i % self.weaks.len()];
                    let h = w.sequence_hash();
                    let expect = m.cached.get(&h).is_some_and(|c| c.id == w.block_id());
                    let got = w.upgrade();
                    assert_eq!(got.is_some(), expect, "upgrade of {h:?}");
                    if let Some(b) = got {
                        m.hold(h);
                        self.held.push(b);
                    }
                }
            }
            Op::Evict(n) => {
                let expect = m.evict(n);
                assert_eq!(self.pool.evict(n), expect);
            }
            Op::Touch { chain, len } => {
                let hashes = chain_hashes(chain, len);
                let mut expect = 0;
                for h in &hashes {
                    if let Some(c) = m.cached.get_mut(h) {
                        expect += 1;
                        if c.holders == 0 {
                            m.clock += 1;
                            c.stamp = m.clock;
                        }
                    }
                }
                assert_eq!(self.pool.touch(&hashes), expect);
            }
        }
    }

    fn check(&mut self) {
        let m = &self.model;
        let counts = self.pool.audit().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(counts.free + counts.active + counts.inactive, CAPACITY);
        assert_eq!(counts.free, m.free, "free");
        assert_eq!(counts.inactive, m.inactive(), "inactive");
        assert_eq!(self.pool.counts(), counts);
        for chain in 0..CHAINS {
            for pos in 0..DEPTH {
                let h = name(chain, pos).0;
                assert_eq!(self.pool.contains(h), m.cached.contains_key(&h), "{h:?}");
            }
        }
        while let Ok(batch) = self.events.try_recv() {
            for ev in batch.iter() {
                match *ev {
                    KvEvent::Stored { hash, parent, tier } => {
                        assert_eq!(tier, Tier::G2);
                        assert!(self.replayed.insert(hash, parent).is_none(), "stored twice");
                    }
                    KvEvent::Removed { hash, tier } => {
                        assert_eq!(tier, Tier::G2);
                        assert!(self.replayed.remove(&hash).is_some(), "removed unknown");
                        if m.leaf_first {
                            assert!(
                                !self.replayed.values().any(|p| *p == Some(hash)),
                                "leaf-first evicted {hash:?} before its cached child"
                            );
                        }
                    }
                }
            }
        }
        let replayed: BTreeSet<_> = self.replayed.keys().copied().collect();
        let cached: BTreeSet<_> = m.cached.keys().copied().collect();
        assert_eq!(replayed, cached, "events replayed give the cached set");
    }
}

fn run(eviction: EvictionKind, priorities: bool, ops: &[Op]) {
    let mut h = Harness::new(eviction, priorities);
    for op in ops {
        h.apply(op);
        h.check();
    }
    // Dropping every handle leaves nothing active.
    h.mutables.clear();
    h.completes.clear();
    h.held.clear();
    h.batches.clear();
    let counts = h.pool.audit().unwrap();
    assert_eq!(counts.active, 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn lru_matches_model(ops in prop::collection::vec(op(), 1..80)) {
        run(EvictionKind::Lru, false, &ops);
    }

    #[test]
    fn leaf_first_matches_model(ops in prop::collection::vec(op(), 1..80)) {
        run(EvictionKind::LeafFirst, false, &ops);
    }

    #[test]
    fn prioritized_lru_matches_model(ops in prop::collection::vec(op(), 1..80)) {
        run(EvictionKind::Lru, true, &ops);
    }

    #[test]
    fn prioritized_leaf_first_matches_model(ops in prop::collection::vec(op(), 1..80)) {
        run(EvictionKind::LeafFirst, true, &ops);
    }
}
