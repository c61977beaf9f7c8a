//! A full consistency check of a pool, for tests and debugging.

use std::sync::atomic::Ordering::{Acquire, Relaxed};

use crate::core::PoolState;
use crate::pool::PoolCounts;
use crate::slab::{Entry, NO_PARENT, State};

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

/// Checks every invariant that ties the slab, the free list, the registry,
/// the inactive counter and the lineage links together, with every lock
/// held; returns the counts the check found.
pub(crate) fn audit(core: &PoolState) -> Result<PoolCounts, AuditError> {
    let _gate = core.gate.write();
    let registry = &core.registry;
    let _policies = core.lock_all();
    let free = core.free.lock();
    let capacity = core.slab.len();

    let on_free_list = free_list_membership(&free, capacity)?;
    let tally = tally_states(core, &on_free_list)?;
    ensure!(
        registry.len() == tally.registered,
        "registry holds {} hashes but {} blocks are registered",
        registry.len(),
        tally.registered
    );
    ensure!(
        core.inactive_raw() == tally.inactive as i64,
        "inactive counter {} but {} blocks are inactive",
        core.inactive_raw(),
        tally.inactive
    );
    check_lineage(core, &tally.children)?;
    let Tally {
        free: n_free,
        active,
        inactive,
        ..
    } = tally;
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

/// `result[i]` says whether block `i` is on the free list; errors when the
/// list holds an out-of-range id or one id twice.
fn free_list_membership(free: &[u32], capacity: usize) -> Result<Vec<bool>, AuditError> {
    let mut on_free_list = vec![false; capacity];
    for &id in free.iter() {
        let i = id as usize;
        ensure!(i < capacity, "free list holds out-of-range id {id}");
        ensure!(!on_free_list[i], "block {id} is on the free list twice");
        on_free_list[i] = true;
    }
    Ok(on_free_list)
}

/// How many blocks the slab holds in each state, and how many live children
/// link to each block.
struct Tally {
    /// Free blocks.
    free: usize,
    /// Blocks someone holds.
    active: usize,
    /// Registered blocks nobody holds.
    inactive: usize,
    /// Registered blocks, held or not.
    registered: usize,
    /// `children[i]` counts the registered blocks that link to block `i`.
    children: Vec<u32>,
}

/// Walks the slab once, checking each block's state against the free list
/// and the registry, and counts the states and the parent links.
fn tally_states(core: &PoolState, on_free_list: &[bool]) -> Result<Tally, AuditError> {
    let registry = &core.registry;
    let mut children = vec![0u32; on_free_list.len()];
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
                count_parent_link(core, id, &e, &mut children)?;
            }
        }
    }
    Ok(Tally {
        free: n_free,
        active,
        inactive,
        registered,
        children,
    })
}

/// Counts registered block `id`'s link in `children` when its parent is
/// still the registered block it linked to; errors when that parent holds
/// another hash than the one the block names.
fn count_parent_link(
    core: &PoolState,
    id: u32,
    e: &Entry<'_>,
    children: &mut [u32],
) -> Result<(), AuditError> {
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
    Ok(())
}

/// Checks that each registered block's child count matches the links
/// `children` counted, and that every orphan waits for a parent that is not
/// registered and names it.
fn check_lineage(core: &PoolState, children: &[u32]) -> Result<(), AuditError> {
    let registry = &core.registry;
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
    Ok(())
}
