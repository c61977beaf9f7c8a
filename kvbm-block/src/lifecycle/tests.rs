//! The handles against a recording store: every drop and transition must
//! hand each block back exactly once, to the right place.

use std::sync::Arc;

use recorder::Recorder;

use super::*;
use crate::SequenceHash;

mod recorder {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use super::super::BlockStore;
    use crate::SequenceHash;

    /// Counts holders per id and records where blocks went.
    #[derive(Default)]
    pub(super) struct Recorder {
        pub(super) freed: Mutex<Vec<u32>>,
        pub(super) holders: Mutex<BTreeMap<u32, i64>>,
        pub(super) hashes: Mutex<BTreeMap<u32, SequenceHash>>,
    }

    impl Recorder {
        pub(super) fn holders(&self, id: u32) -> i64 {
            self.holders.lock().unwrap().get(&id).copied().unwrap_or(0)
        }
    }

    impl BlockStore for Recorder {
        fn block_size(&self) -> usize {
            4
        }
        fn release_unregistered(&self, ids: &[u32]) {
            self.freed.lock().unwrap().extend_from_slice(ids);
        }
        fn retain(&self, id: u32) {
            *self.holders.lock().unwrap().entry(id).or_default() += 1;
        }
        fn release(&self, ids: &[u32]) {
            let mut h = self.holders.lock().unwrap();
            for id in ids {
                *h.entry(*id).or_default() -= 1;
            }
        }
        fn try_upgrade(&self, id: u32, hash: SequenceHash) -> bool {
            let ok = self.hashes.lock().unwrap().get(&id) == Some(&hash);
            if ok {
                self.retain(id);
            }
            ok
        }
        fn sequence_hash(&self, id: u32) -> SequenceHash {
            self.hashes.lock().unwrap()[&id]
        }
    }
}

fn store() -> Arc<Recorder> {
    Arc::new(Recorder::default())
}

#[test]
fn mutable_tokens_respect_block_size() {
    let s = store();
    let mut b = MutableBlock::from_store(Arc::clone(&s), 7);
    assert_eq!(b.block_id(), 7);
    assert_eq!(b.extend_tokens(&[1, 2, 3]), 3);
    assert_eq!(b.push_token(4), Ok(()));
    assert_eq!(b.push_token(5), Err(5), "a full block refuses tokens");
    assert_eq!(b.extend_tokens(&[6]), 0);
    assert_eq!(b.pop_token(), Some(4));
    assert_eq!(b.remaining(), 1);
    assert_eq!(b.tokens(), &[1, 2, 3]);
    b.reset();
    assert!(b.tokens().is_empty());
    drop(b);
    assert_eq!(
        *s.freed.lock().unwrap(),
        vec![7],
        "dropped mutable goes to the free list"
    );
}

#[test]
fn partial_block_does_not_complete_and_comes_back() {
    let s = store();
    let mut b = MutableBlock::from_store(Arc::clone(&s), 3);
    b.extend_tokens(&[1, 2]);
    let err = b.complete(SequenceHash(9), None).unwrap_err();
    assert_eq!(
        err.kind,
        CompleteErrorKind::Partial {
            tokens: 2,
            block_size: 4
        }
    );
    assert!(err.to_string().contains("2 of 4"));
    let mut b = err.into_block();
    assert!(
        s.freed.lock().unwrap().is_empty(),
        "the error holds the block"
    );
    assert_eq!(b.tokens(), &[1, 2]);
    b.extend_tokens(&[3, 4]);
    let c = b.complete(SequenceHash(9), Some(SequenceHash(8))).unwrap();
    assert_eq!(c.tokens(), &[1, 2, 3, 4]);
    assert_eq!(c.parent(), Some(SequenceHash(8)));
    assert!(
        s.freed.lock().unwrap().is_empty(),
        "completing consumed, not freed"
    );
    drop(c);
    assert_eq!(
        *s.freed.lock().unwrap(),
        vec![3],
        "dropped complete goes to the free list"
    );
}

#[test]
fn complete_parts_take_ownership() {
    let s = store();
    let c = MutableBlock::from_store(Arc::clone(&s), 5)
        .complete(SequenceHash(1), None)
        .unwrap()
        .with_priority(250);
    assert_eq!(c.priority(), 100, "priorities clamp to 100");
    assert!(c.belongs_to(&s));
    assert!(!c.belongs_to(&store()));
    let parts = c.into_parts().unwrap();
    assert_eq!(
        (parts.id, parts.hash, parts.priority),
        (5, SequenceHash(1), 100)
    );
    drop(parts);
    assert!(s.freed.lock().unwrap().is_empty(), "the pool owns it now");
}

#[test]
fn immutable_clone_and_drop_balance() {
    let s = store();
    s.hashes.lock().unwrap().insert(2, SequenceHash(20));
    s.retain(2); // the pool counted the first holder
    let a = ImmutableBlock::from_store(Arc::clone(&s), 2, SequenceHash(20));
    let b = a.clone();
    assert_eq!(s.holders(2), 2);
    let w = a.downgrade();
    drop(a);
    drop(b);
    assert_eq!(s.holders(2), 0);
    let up = w.upgrade().expect("still registered under the hash");
    assert_eq!(s.holders(2), 1);
    drop(up);
    s.hashes.lock().unwrap().insert(2, SequenceHash(21));
    assert!(w.upgrade().is_none(), "the block now holds another hash");
    drop(s);
    assert_eq!(w.block_id(), 2);
}

#[test]
fn weak_upgrade_fails_once_the_store_is_gone() {
    let s = store();
    s.hashes.lock().unwrap().insert(1, SequenceHash(10));
    s.retain(1);
    let a = ImmutableBlock::from_store(Arc::clone(&s), 1, SequenceHash(10));
    let w = a.downgrade();
    drop(a);
    drop(s);
    assert!(w.upgrade().is_none());
}

#[test]
fn batch_releases_once_and_splits() {
    let s = store();
    for id in 0..4 {
        s.hashes
            .lock()
            .unwrap()
            .insert(id, SequenceHash(100 + u64::from(id)));
        s.retain(id);
    }
    let mut batch = ImmutableBlocks::from_store(Arc::clone(&s), vec![0, 1, 2, 3]);
    assert_eq!(batch.len(), 4);
    assert_eq!(batch.sequence_hash(2), Some(SequenceHash(102)));
    let one = batch.get(1).unwrap();
    assert_eq!(s.holders(1), 2);
    batch.truncate(2);
    assert_eq!(
        (s.holders(2), s.holders(3)),
        (0, 0),
        "truncate releases the tail"
    );
    assert!(batch.push(one).is_ok());
    assert_eq!(s.holders(1), 2, "push moves the holder into the batch");
    assert_eq!(batch.block_ids(), &[0, 1, 1]);
    let foreign = {
        let t = store();
        t.hashes.lock().unwrap().insert(0, SequenceHash(1));
        t.retain(0);
        ImmutableBlock::from_store(t, 0, SequenceHash(1))
    };
    assert!(
        batch.push(foreign).is_err(),
        "another store's block is refused"
    );
    let blocks = batch.into_blocks();
    assert_eq!(blocks.len(), 3);
    assert_eq!(blocks[2].sequence_hash(), SequenceHash(101));
    drop(blocks);
    assert_eq!((s.holders(0), s.holders(1)), (0, 0));
    let empty = ImmutableBlocks::<Recorder>::from_store(Arc::clone(&s), Vec::new());
    assert!(empty.is_empty() && empty.get(0).is_none());
}
