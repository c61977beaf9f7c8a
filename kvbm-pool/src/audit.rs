//! A full consistency check of a pool, for tests and debugging.

use std::sync::atomic::Ordering::{Acquire, Relaxed};

use crate::core::PoolState;
use crate::pool::PoolCounts;
use crate::slab::{NO_PARENT, State};

/// An invariant that does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pool invariant broken: {0}")]
pub struct AuditError(pub String);

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(AuditError(format!($($fmt)+)));
        }
    };
}

pub(crate) fn audit(core: &PoolState) -> Result<PoolCounts, AuditError> {
    let _gate = core.gate.write();
    let registry = &core.registry;
    let _policies = core.lock_all();
    let free = core.free.lock();
    let capacity = core.slab.len();

    let mut on_free_list = vec![false; capacity];
    for &id in free.iter() {
        let i = id as usize;
        ensure!(i < capacity, "free list holds out-of-range id {id}");
        ensure!(!on_free_list[i], "block {id} is on the free list twice");
        on_free_list[i] = true;
    }

    let mut children = vec![0u32; capacity];
    let (mut n_free, mut active, mut inactive, mut registered) = (0, 0, 0, 0);
    for (i, e) in core.slab.iter().enumerate() {
        let id = i as u32;
        let state = e.state();
        ensure!(
            (state == State::Free) == on_free_list[i],
            "block {id} is {state:?} but free-list membership is {}",
            on_free_list[i]
        );
        match state {
            State::Free => n_free += 1,
            State::Allocated => active += 1,
            State::Duplicate => {
                ensure!(
                    e.hot.holders.load(Acquire) > 0,
                    "duplicate block {id} has no holder"
                );
                ensure!(
                    registry.get(&core.slab, e.hash()) != Some(id),
                    "duplicate block {id} is in the registry"
                );
                active += 1;
            }
            State::Registered => {
                registered += 1;
                ensure!(
                    registry.get(&core.slab, e.hash()) == Some(id),
                    "registered block {id} is not the registry's primary for its hash"
                );
                if e.hot.holders.load(Acquire) == 0 {
                    inactive += 1;
                } else {
                    active += 1;
                }
                let pid = e.cold.parent_id.load(Relaxed);
                if pid != NO_PARENT {
                    let p = core.slab.entry(pid);
                    if p.state() == State::Registered
                        && p.cold.generation.load(Relaxed) == e.cold.parent_gen.load(Relaxed)
                    {
                        ensure!(
                            Some(p.hash()) == e.parent(),
                            "block {id} links to parent {pid} of another hash"
                        );
                        children[pid as usize] += 1;
                    }
                }
            }
        }
    }
    ensure!(
        registry.len() == registered,
        "registry holds {} hashes but {registered} blocks are registered",
        registry.len()
    );
    ensure!(
        core.inactive_raw() == inactive as i64,
        "inactive counter {} but {inactive} blocks are inactive",
        core.inactive_raw()
    );
    for (i, e) in core.slab.iter().enumerate() {
        if e.state() == State::Registered {
            ensure!(
                e.cold.children.load(Relaxed) == children[i],
                "block {i} counts {} children, {} link to it",
                e.cold.children.load(Relaxed),
                children[i]
            );
        }
    }
    for (parent, id) in registry.orphans() {
        let e = core.slab.get(id);
        ensure!(
            e.is_some_and(|e| e.state() == State::Registered && e.parent() == Some(parent)),
            "orphan {id} of {parent:?} is not a registered child of it"
        );
        ensure!(
            registry.get(&core.slab, parent).is_none(),
            "orphan {id} waits for {parent:?}, which is registered"
        );
    }
    ensure!(
        n_free + active + inactive == capacity,
        "counts do not add up"
    );
    Ok(PoolCounts {
        capacity,
        free: n_free,
        active,
        inactive,
    })
}
