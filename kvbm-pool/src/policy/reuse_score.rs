//! Reuse-score admission and eviction: the policy study's winner, ported
//! from the simulator to a pool policy.
//!
//! Every block kvbm has seen has a *use count* `k` (requests that carried
//! it) and a *last use* (the index of the last such request). Blocks that
//! came back often come back again far more often: in the Mooncake
//! conversation trace a block seen once returns about a quarter of the
//! time, one seen four times or more three times in four. A block's score
//! is
//!
//! `score = w[min(k, 4)] / (now - last + 1)`
//!
//! where `w[k]` is the probability, learned online, that a block used `k`
//! times is used again (made non-decreasing in `k`), or, with
//! [`ReuseModel::ReturnWithin`](super::ReuseModel::ReturnWithin), the
//! learned probability that a block of its use-count class and age is used
//! within the next `horizon` requests ([`ReturnTable`](super::return_within::ReturnTable)).
//! The lowest score is evicted, and a block is admitted unless it scores
//! below the block it would evict. A prompt's blocks form a chain, so a
//! parent is used at least as often and as recently as its children and
//! never scores lower: eviction takes leaves first. Within one request
//! blocks are stamped deepest first, which breaks ties toward the leaf.
//!
//! The use counts live in a [`UseHistory`] (module `use_history`) shared
//! by the engine, which records every request when it is matched, and by
//! the policies of G2 and G3.
//!
//! Within a use-count class the score order never changes as time passes,
//! so each class keeps its entries ordered by last use and the victim is
//! the lowest-scored of at most four class heads. Entries are validated
//! lazily: one whose block was reused since it was queued is re-keyed when
//! it comes up.

use std::collections::BTreeSet;

use kvbm_block::SequenceHash;

use super::shared_history::SharedHistory;
use super::use_history::{DONE_SCORE, Retained, Seen, USE_CLASSES, UseHistory, class_of};
use super::{BlockRef, BlockView, EvictionPolicy, Victim};
use crate::config::Tier;

/// The pseudo-class of demoted blocks (evicted before any other).
const DEMOTED: usize = USE_CLASSES;
/// The pseudo-class of blocks a hint keeps (ordered by lapse, latest
/// first).
const KEPT: usize = USE_CLASSES + 1;
/// The pseudo-class of blocks a hint marked done (evicted right after the
/// demoted ones).
const DONE: usize = USE_CLASSES + 2;
/// Pseudo-classes and use-count classes together.
const ALL_CLASSES: usize = USE_CLASSES + 3;

/// A queued candidate: ordered by last use, then sequence number.
type Key = (u64, u64, u32, u64);

/// Where an entry goes: `(class, key, lapse time)` (the lapse time of a
/// kept entry; 0 otherwise).
type Placed = (usize, Key, u64);

/// The queued entries: one ordered set per class, and the kept entries
/// again by the time their protection lapses.
#[derive(Debug, Default)]
struct Queues {
    sets: [BTreeSet<Key>; ALL_CLASSES],
    lapses: BTreeSet<(u64, Key)>,
}

impl Queues {
    fn insert(&mut self, (class, key, until): Placed) {
        if class == KEPT {
            self.lapses.insert((until, key));
        }
        self.sets[class].insert(key);
    }
}

/// Eviction by lowest reuse score, admission by comparison with the
/// victim. Reads use counts from a [`SharedHistory`] the tier engine feeds.
/// Blocks a retention hint keeps or marks done rank in classes of their
/// own (see [`crate::policy::retention`]).
#[derive(Debug)]
pub struct ReuseScorePolicy {
    history: SharedHistory,
    /// One ordered set per use-count class, then the demoted, kept and
    /// done blocks.
    classes: Queues,
    /// The entry the last peek named: `(class, key, hash)`.
    peeked: Option<(usize, Key, SequenceHash)>,
    /// The tier this policy ranks (for demotions).
    tier: Tier,
}

impl ReuseScorePolicy {
    /// A policy reading `history`.
    pub fn new(history: SharedHistory) -> Self {
        Self::for_tier(history, Tier::G2)
    }

    /// A policy of `tier` (G2 or G3) reading `history`: blocks the history
    /// demotes in that tier are evicted first.
    pub fn for_tier(history: SharedHistory, tier: Tier) -> Self {
        Self {
            history,
            classes: Queues::default(),
            peeked: None,
            tier,
        }
    }

    fn key_for(history: &UseHistory, hash: SequenceHash) -> (usize, Seen) {
        let seen = history.get(hash).unwrap_or(Seen {
            count: 1,
            last: history.now(),
            seq: 0,
        });
        (class_of(seen.count), seen)
    }

    /// Where a block belongs now, outside the demoted class: its hint's
    /// class, or its use-count class (`None` when the history forgot it:
    /// its queued key stands).
    fn place(history: &UseHistory, hash: SequenceHash, id: u32, stamp: u64) -> Option<Placed> {
        let seen = history.get(hash);
        // Ties go to the deeper block (smaller sequence number): a chain
        // loses its tail first, never a block in its middle.
        let seq = seen.map_or(0, |s| s.seq);
        match history.retained(hash) {
            Retained::Done => return Some((DONE, (0, seq, id, stamp), 0)),
            Retained::Kept { due, until } => {
                return Some((KEPT, (u64::MAX - due, seq, id, stamp), until));
            }
            Retained::No => {}
        }
        let s = seen?;
        Some((class_of(s.count), (s.last, s.seq, id, stamp), 0))
    }

    /// Moves kept entries whose protection lapsed back to their classes.
    fn lapse(q: &mut Queues, history: &UseHistory) {
        let now = history.now_ms();
        while let Some(&(until, key)) = q.lapses.first() {
            if until > now {
                break;
            }
            q.lapses.remove(&(until, key));
            if q.sets[KEPT].remove(&key) {
                let (_, _, id, stamp) = key;
                // Its hash is looked up when it comes up; until then it
                // waits in the oldest slot of its class.
                q.sets[USE_CLASSES - 1].insert((0, 0, id, stamp));
            }
        }
    }

    /// The valid head of class `c`, re-keying entries whose block was used
    /// (or hinted) since they were queued; `(key, score)`.
    fn head(
        classes: &mut Queues,
        c: usize,
        tier: Tier,
        history: &UseHistory,
        view: &BlockView<'_>,
    ) -> Option<(Key, f64, SequenceHash)> {
        loop {
            let key = *classes.sets[c].first()?;
            let (last, seq, id, stamp) = key;
            let Some(info) = view.evictable(id, stamp) else {
                classes.sets[c].remove(&key);
                continue;
            };
            let hash = info.hash();
            if c == DEMOTED {
                if history.is_demoted(tier, hash) {
                    return Some((key, f64::NEG_INFINITY, hash));
                }
                // Given back by the faster tier: ranked by its score again.
                classes.sets[c].remove(&key);
                match Self::place(history, hash, id, stamp) {
                    Some(placed) => classes.insert(placed),
                    None => {
                        let (k, s) = Self::key_for(history, hash);
                        classes.insert((k, (s.last, s.seq, id, stamp), 0));
                    }
                };
                continue;
            }
            if history.is_demoted(tier, hash) {
                classes.sets[c].remove(&key);
                classes.sets[DEMOTED].insert((0, 0, id, stamp));
                continue;
            }
            match Self::place(history, hash, id, stamp) {
                Some((k, new, until)) if k != c || (k != DONE && new != key) => {
                    classes.sets[c].remove(&key);
                    classes.insert((k, new, until));
                }
                Some(_) => {
                    let score = match c {
                        DONE => DONE_SCORE,
                        KEPT => history.kept_score(u64::MAX - last),
                        _ => history.score_of(history.get(hash).unwrap_or(Seen {
                            count: c as u32 + 1,
                            last,
                            seq,
                        })),
                    };
                    return Some((key, score, hash));
                }
                // Forgotten by the history: its queued key stands (a
                // lapsed entry parked without a key takes the oldest).
                None => {
                    let c = c.min(USE_CLASSES - 1);
                    let s = Seen {
                        count: c as u32 + 1,
                        last,
                        seq,
                    };
                    return Some((key, history.score_of(s), hash));
                }
            }
        }
    }

    /// The lowest-scored evictable block: `(class, key, score, hash)`.
    fn lowest(&mut self, view: &BlockView<'_>) -> Option<(usize, Key, f64, SequenceHash)> {
        let history = self.history.lock();
        if !self.classes.lapses.is_empty() {
            Self::lapse(&mut self.classes, &history);
        }
        let mut best: Option<(usize, Key, f64, SequenceHash)> = None;
        for c in 0..ALL_CLASSES {
            if let Some((key, score, hash)) =
                Self::head(&mut self.classes, c, self.tier, &history, view)
            {
                let better = match best {
                    None => true,
                    Some((_, bk, bs, _)) => {
                        score < bs || (score == bs && (key.0, key.1) < (bk.0, bk.1))
                    }
                };
                if better {
                    best = Some((c, key, score, hash));
                }
            }
        }
        best
    }
}

impl EvictionPolicy for ReuseScorePolicy {
    fn name(&self) -> &'static str {
        "reuse-score"
    }

    fn on_release(&mut self, block: BlockRef<'_>) {
        let (id, stamp) = (block.id(), block.stamp());
        let placed = {
            let history = self.history.lock();
            if history.is_demoted(self.tier, block.hash()) {
                (DEMOTED, (0, history.seq(), id, stamp), 0)
            } else {
                Self::place(&history, block.hash(), id, stamp).unwrap_or_else(|| {
                    let (c, s) = Self::key_for(&history, block.hash());
                    (c, (s.last, s.seq, id, stamp), 0)
                })
            }
        };
        self.classes.insert(placed);
    }

    fn peek_victim(&mut self, view: &BlockView<'_>) -> Option<Victim> {
        let (c, key, score, hash) = self.lowest(view)?;
        self.peeked = Some((c, key, hash));
        // Clamped to non-negative, scores' bit patterns order like them;
        // the last use breaks ties (older first).
        let key128 = (u128::from(score.max(0.0).to_bits()) << 64) | u128::from(key.0);
        Some(Victim {
            id: key.2,
            key: key128,
        })
    }

    fn pop_victim(&mut self) {
        if let Some((c, key, hash)) = self.peeked.take() {
            self.classes.sets[c].remove(&key);
            if c == DEMOTED {
                // The redundant copy is gone: nothing left to demote here.
                self.history.lock().clear_demoted(self.tier, hash);
            }
        }
    }

    fn admit(&mut self, candidate: SequenceHash, view: &BlockView<'_>) -> bool {
        match self.lowest(view) {
            // As the simulator: a tie admits the newcomer (but a block
            // marked done never displaces another).
            Some((class, key, low, _)) => {
                let history = self.history.lock();
                let score = history.score(candidate);
                if score == low
                    && class == KEPT
                    && let Retained::Kept { due, .. } = history.retained(candidate)
                {
                    // Kept both: the one that returns sooner stays.
                    return due <= u64::MAX - key.0;
                }
                score >= low && score > DONE_SCORE
            }
            None => false,
        }
    }

    fn compact(&mut self, view: &BlockView<'_>) {
        let live = |&(_, _, id, stamp): &Key| view.evictable(id, stamp).is_some();
        for class in &mut self.classes.sets {
            class.retain(live);
        }
        self.classes.lapses.retain(|(_, key)| live(key));
    }

    fn queued(&self) -> usize {
        self.classes.sets.iter().map(BTreeSet::len).sum::<usize>() + self.classes.lapses.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::use_history::ReuseModel;
    use super::*;
    use crate::{BlockPool, PoolConfig, Tier};

    fn h(x: u64) -> SequenceHash {
        SequenceHash(x)
    }

    fn pool(history: &SharedHistory, capacity: usize) -> BlockPool {
        let policy = Box::new(ReuseScorePolicy::new(history.clone()));
        BlockPool::with_policy(PoolConfig::new(capacity, 4, Tier::G2), policy).unwrap()
    }

    fn store(pool: &BlockPool, hashes: &[u64]) {
        let blocks = pool.allocate(hashes.len()).unwrap();
        let complete = blocks
            .into_iter()
            .zip(hashes)
            .map(|(b, &x)| b.complete(h(x), None).unwrap())
            .collect();
        drop(pool.register(complete).unwrap());
    }

    #[test]
    fn popular_blocks_outlive_recent_one_offs() {
        let history = UseHistory::shared(1000);
        // Block 1 carried by five requests, block 2 by one, later.
        for _ in 0..5 {
            history.lock().record_request(&[h(1)]);
        }
        history.lock().record_request(&[h(2)]);
        let pool = pool(&history, 2);
        store(&pool, &[1, 2]);
        // A third block needs room: the one-off goes, the popular one stays.
        history.lock().record_request(&[h(3)]);
        store(&pool, &[3]);
        assert!(pool.contains(h(1)));
        assert!(!pool.contains(h(2)));
        assert!(pool.contains(h(3)));
    }

    #[test]
    fn admission_refuses_blocks_that_score_lower_than_the_victim() {
        let history = UseHistory::shared(1000);
        for _ in 0..4 {
            history.lock().record_request(&[h(1), h(2)]);
        }
        let pool = pool(&history, 2);
        store(&pool, &[1, 2]);
        // An old one-off (seen once, long ago) is not worth a popular block.
        history.lock().record_request(&[h(9)]);
        for _ in 0..20 {
            history.lock().record_request(&[h(1), h(2)]);
        }
        assert!(!pool.admit(h(9)));
        // A block carried by many recent requests is.
        for _ in 0..30 {
            history.lock().record_request(&[h(7)]);
        }
        assert!(pool.admit(h(7)));
    }

    #[test]
    fn demoted_copies_go_first_until_given_back() {
        let history = UseHistory::shared(1000);
        for _ in 0..5 {
            history.lock().record_request(&[h(1)]);
        }
        history.lock().record_request(&[h(2)]);
        let pool = pool(&history, 2);
        store(&pool, &[1, 2]);
        // Block 1 (the popular one) was loaded into G1: its copy goes first.
        history.lock().demote(Tier::G2, [h(1)]);
        assert!(!history.lock().is_demoted(Tier::G3, h(1)));
        history.lock().record_request(&[h(3)]);
        store(&pool, &[3]);
        assert!(!pool.contains(h(1)));
        assert!(pool.contains(h(2)));
        // Given back, a demoted copy ranks by its score again.
        history.lock().demote(Tier::G2, [h(3)]);
        history.lock().undemote(h(3));
        history.lock().record_request(&[h(4)]);
        store(&pool, &[4]);
        assert!(pool.contains(h(3)), "the given-back block outranks 2");
        assert!(!pool.contains(h(2)));
    }

    #[test]
    fn return_within_model_ranks_popular_blocks_higher() {
        let history = SharedHistory::new(
            UseHistory::new(1000).with_model(ReuseModel::ReturnWithin { horizon: 250 }),
        );
        for _ in 0..5 {
            history.lock().record_request(&[h(1)]);
        }
        history.lock().record_request(&[h(2)]);
        let u = history.lock();
        assert_eq!(u.model(), ReuseModel::ReturnWithin { horizon: 250 });
        assert!(u.score(h(1)) > u.score(h(2)));
    }

    #[test]
    fn history_forgets_least_recent_first_and_learns_weights() {
        let mut u = UseHistory::new(3);
        u.record_request(&[h(1), h(2)]);
        u.record_request(&[h(3)]);
        u.record_request(&[h(4)]);
        assert_eq!(u.uses(h(1)) + u.uses(h(2)), 1, "one of the oldest is gone");
        assert_eq!(u.uses(h(4)), 1);
        let w = u.weights().weights();
        assert!(
            w.windows(2).all(|p| p[0] <= p[1]),
            "weights {w:?} must not decrease"
        );
    }
}
