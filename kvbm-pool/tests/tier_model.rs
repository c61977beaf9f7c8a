//! Model-based test of the slot API over the tier engine: random streams
//! of arrive / allocate+onboard / compute / finish / evict-G1 against a
//! reference model of what kvbm must find.
//!
//! The tiers are sized so nothing is ever pushed out of G2, which admits
//! every block: then the model is exact — after every computed block has
//! been offloaded, a request's match must cover exactly the longest prefix
//! of its hashes that any earlier request computed (less one block when
//! that covers the whole prompt), and every block in a slot's G1 table must
//! hold the bytes of its hash. Both offload modes run: write-through, and
//! write-back with a G1 small enough to evict, where allocations keep G1's
//! free reserve and save its victims behind them.

mod tier_support;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvbm_block::SequenceHash;
use kvbm_pool::slot::{OnboardState, SlotManager};
use kvbm_pool::tier::{OffloadMode, TierPolicy};
use kvbm_pool::{Tier, TierError};
use proptest::prelude::*;
use tier_support::*;

#[derive(Debug, Clone)]
enum Op {
    Arrive {
        id: u64,
        seed: u64,
        len: usize,
        extra: usize,
    },
    Allocate {
        id: u64,
    },
    Compute {
        id: u64,
    },
    Finish {
        id: u64,
    },
    EvictG1,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..5u64, 0..12u64, 1..10usize, prop_oneof![Just(0usize), 1..17usize])
            .prop_map(|(id, seed, len, extra)| Op::Arrive { id, seed, len, extra }),
        3 => (0..5u64).prop_map(|id| Op::Allocate { id }),
        3 => (0..5u64).prop_map(|id| Op::Compute { id }),
        2 => (0..5u64).prop_map(|id| Op::Finish { id }),
        1 => Just(Op::EvictG1),
    ]
}

struct Live {
    hashes: Vec<SequenceHash>,
    prompt_tokens: usize,
    allocated: bool,
}

fn known_prefix(known: &HashSet<SequenceHash>, hashes: &[SequenceHash]) -> usize {
    hashes.iter().take_while(|h| known.contains(h)).count()
}

fn check_table(slots: &SlotManager, id: u64, hashes: &[SequenceHash]) {
    let engine = slots.engine();
    let g1 = engine.layout(Tier::G1).unwrap();
    let computed = slots.computed_tokens(id).unwrap() / BLOCK_TOKENS;
    let table = slots.block_ids(id).unwrap();
    for (k, &block) in table.iter().take(computed).enumerate() {
        assert!(
            holds(g1, block, hashes[k]),
            "slot {id} block {k} has wrong bytes"
        );
    }
}

fn run(ops: Vec<Op>, mode: OffloadMode) {
    let dir = tempdir();
    // Write-back: 12 chains of up to 9 blocks overflow 64 G1 blocks, whose
    // reserve is 1 (a sixty-fourth).
    let g1 = match mode {
        OffloadMode::WriteThrough => 160,
        OffloadMode::WriteBack => 64,
    };
    let engine = tiers(g1, 256, 0, dir.path())
        .offload_mode(mode)
        .g2_policy(TierPolicy::WriteThrough)
        .g3_policy(TierPolicy::WriteThrough)
        .build()
        .unwrap();
    let slots = SlotManager::new(Arc::new(engine));
    let mut known: HashSet<SequenceHash> = HashSet::new();
    let mut live: HashMap<u64, Live> = HashMap::new();

    for op in ops {
        match op {
            Op::Arrive {
                id,
                seed,
                len,
                extra,
            } => {
                let hashes = chain(seed, len);
                // Background saves of G1's reserve land before the match.
                slots.engine().flush();
                // A partial last block when extra > 0.
                let prompt_tokens = len * BLOCK_TOKENS + extra;
                let m = slots
                    .create_slot(id, hashes.clone(), prompt_tokens)
                    .unwrap();
                let mut want = known_prefix(&known, &hashes);
                if want > 0 && want * BLOCK_TOKENS >= prompt_tokens {
                    want -= 1;
                }
                assert_eq!(
                    m.g1_tokens + m.external_tokens,
                    want * BLOCK_TOKENS,
                    "match of {hashes:?}"
                );
                live.insert(
                    id,
                    Live {
                        hashes,
                        prompt_tokens,
                        allocated: false,
                    },
                );
            }
            Op::Allocate { id } => match live.get_mut(&id) {
                None => {
                    let e = slots.allocate_slots(id, 16).unwrap_err();
                    assert!(matches!(e, TierError::UnknownRequest(_)));
                }
                Some(l) => {
                    slots.allocate_slots(id, l.prompt_tokens).unwrap();
                    l.allocated = true;
                    match slots.wait_onboard(id).unwrap() {
                        OnboardState::Ready => {}
                        other => panic!("onboard of {id}: {other:?}"),
                    }
                    check_table(&slots, id, &l.hashes);
                }
            },
            Op::Compute { id } => match live.get(&id) {
                Some(l) if l.allocated => {
                    let engine = slots.engine();
                    let g1 = engine.layout(Tier::G1).unwrap();
                    let computed = slots.computed_tokens(id).unwrap() / BLOCK_TOKENS;
                    let table = slots.block_ids(id).unwrap();
                    let todo = &l.hashes[computed..];
                    for (k, h) in todo.iter().enumerate() {
                        fill(g1, table[computed + k], *h);
                    }
                    slots.commit_blocks(id, todo).unwrap();
                    known.extend(todo.iter().copied());
                    engine.flush();
                    check_table(&slots, id, &l.hashes);
                }
                Some(l) => {
                    // Nothing allocated yet: committing anything must fail.
                    let c = slots.computed_tokens(id).unwrap() / BLOCK_TOKENS;
                    if c < l.hashes.len() {
                        let e = slots.commit_blocks(id, &l.hashes[c..]).unwrap_err();
                        assert!(matches!(
                            e,
                            TierError::NotAllocated { .. } | TierError::StillOnboarding(_)
                        ));
                    }
                }
                None => {}
            },
            Op::Finish { id } => {
                assert_eq!(slots.free(id), live.remove(&id).is_some());
            }
            Op::EvictG1 => {
                slots.engine().g1().evict(usize::MAX >> 1);
                if mode == OffloadMode::WriteBack {
                    // The engine's next allocation saves what G1 evicted.
                    slots.engine().allocate_g1(0).unwrap();
                }
            }
        }
        let engine = slots.engine();
        engine.g1().audit().unwrap();
        engine.pool(Tier::G2).unwrap().audit().unwrap();
    }
    for id in live.keys() {
        assert!(slots.free(*id));
    }
    let engine = slots.engine();
    engine.flush();
    assert_eq!(engine.live_requests(), 0);
    assert_eq!(engine.g1().audit().unwrap().active, 0, "G1 blocks leaked");
    assert_eq!(
        engine.pool(Tier::G2).unwrap().audit().unwrap().active,
        0,
        "G2 blocks leaked"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn slots_match_the_model(ops in proptest::collection::vec(op(), 1..40)) {
        run(ops, OffloadMode::WriteThrough);
    }

    #[test]
    fn slots_match_the_model_in_write_back(ops in proptest::collection::vec(op(), 40..120)) {
        run(ops, OffloadMode::WriteBack);
    }
}
