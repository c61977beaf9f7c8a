//! Engine-given priorities on top of any policy.

use kvbm_block::SequenceHash;

use super::{BlockRef, BlockView, EvictionPolicy, Victim};

/// Factory of the per-priority inner policies.
pub(crate) type PolicyFactory = Box<dyn Fn() -> Box<dyn EvictionPolicy> + Send>;

const LEVELS: usize = 101;

/// Lower priority goes first; within one priority level, the inner policy
/// decides. Victim keys are `(priority, inner key)`, so shards compare
/// priorities first. One inner policy per level in use (created on first use), and a
/// bitmap of levels that may hold candidates, so finding the lowest one is
/// a couple of bit scans.
// Aligned to its own cache lines: the shards of a sharded policy are
// written by different threads and must not share a line.
#[repr(align(128))]
pub struct Prioritized {
    levels: Vec<Option<Box<dyn EvictionPolicy>>>,
    occupied: u128,
    factory: PolicyFactory,
    name: &'static str,
    tracks_access: bool,
    peeked_level: usize,
}

impl Prioritized {
    /// Priorities over policies made by `factory`.
    pub fn new(factory: PolicyFactory) -> Self {
        let probe = factory();
        Self {
            levels: (0..LEVELS).map(|_| None).collect(),
            occupied: 0,
            name: probe.name(),
            tracks_access: probe.tracks_access(),
            peeked_level: 0,
            factory,
        }
    }

    fn level(&mut self, priority: u8) -> &mut Box<dyn EvictionPolicy> {
        let p = usize::from(priority).min(LEVELS - 1);
        self.occupied |= 1u128 << p;
        let factory = &self.factory;
        self.levels[p].get_or_insert_with(|| factory())
    }
}

impl std::fmt::Debug for Prioritized {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prioritized")
            .field("inner", &self.name)
            .field("occupied", &self.occupied)
            .finish()
    }
}

impl EvictionPolicy for Prioritized {
    fn name(&self) -> &'static str {
        self.name
    }

    fn on_release(&mut self, block: BlockRef<'_>) {
        self.level(block.priority()).on_release(block);
    }

    fn on_became_leaf(&mut self, block: BlockRef<'_>) {
        self.level(block.priority()).on_became_leaf(block);
    }

    fn peek_victim(&mut self, view: &BlockView<'_>) -> Option<Victim> {
        while self.occupied != 0 {
            let p = self.occupied.trailing_zeros() as usize;
            if let Some(level) = self.levels[p].as_mut() {
                // A candidate queued here may have changed priority since:
                // it was re-queued in its new level and is stale here.
                while let Some(v) = level.peek_victim(view) {
                    if view
                        .block(v.id)
                        .is_some_and(|b| usize::from(b.priority()) == p)
                    {
                        self.peeked_level = p;
                        return Some(Victim {
                            id: v.id,
                            key: ((p as u128) << 64) | (v.key & u128::from(u64::MAX)),
                        });
                    }
                    level.pop_victim();
                }
            }
            self.occupied &= !(1u128 << p);
        }
        None
    }

    fn warm(&self, view: &BlockView<'_>, n: usize) {
        if self.occupied != 0 {
            let p = self.occupied.trailing_zeros() as usize;
            if let Some(level) = self.levels[p].as_ref() {
                level.warm(view, n);
            }
        }
    }

    fn pop_victim(&mut self) {
        if let Some(level) = self.levels[self.peeked_level].as_mut() {
            level.pop_victim();
        }
    }

    fn tracks_access(&self) -> bool {
        self.tracks_access
    }

    fn on_access(&mut self, hash: SequenceHash) {
        for level in self.levels.iter_mut().flatten() {
            level.on_access(hash);
        }
    }

    fn admit(&mut self, candidate: SequenceHash, view: &BlockView<'_>) -> bool {
        let mut occupied = self.occupied;
        while occupied != 0 {
            let p = occupied.trailing_zeros() as usize;
            if let Some(level) = self.levels[p].as_mut() {
                return level.admit(candidate, view);
            }
            occupied &= !(1u128 << p);
        }
        true
    }

    fn compact(&mut self, view: &BlockView<'_>) {
        for level in self.levels.iter_mut().flatten() {
            level.compact(view);
        }
    }

    fn queued(&self) -> usize {
        self.levels.iter().flatten().map(|l| l.queued()).sum()
    }
}
