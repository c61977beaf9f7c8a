//! Invariants of token sequences and their hashes, for both schemes.

use kvbm_block::hash::{BlockHash, SequenceDigest, VllmMmFeature};
use kvbm_block::{
    DynamoXxh3, PageSize, SequenceHash, SequenceHasher, Token, TokenBlock, TokenBlockSequence,
    TokenError, VllmSha256,
};
use proptest::prelude::*;
use std::collections::HashSet;

fn page_size() -> impl Strategy<Value = PageSize> {
    (0u32..=6).prop_map(|shift| PageSize::new(1 << shift).unwrap())
}

fn tokens() -> impl Strategy<Value = Vec<Token>> {
    prop::collection::vec(any::<Token>(), 0..200)
}

/// One block's hashes: block hash, digest, parent digest.
type BlockHashes<D> = (BlockHash, D, Option<D>);

/// Everything observable about a sequence, for comparing two of them.
fn snapshot<H: SequenceHasher>(
    s: &TokenBlockSequence<H>,
) -> (Vec<Token>, Vec<BlockHashes<H::Digest>>) {
    let blocks = s
        .blocks()
        .map(|b| (b.block_hash(), *b.digest(), b.parent_digest().copied()))
        .collect();
    (s.tokens().to_vec(), blocks)
}

fn extend_then_truncate_is_prefix<H: SequenceHasher>(
    hasher: H,
    page: PageSize,
    prefix: &[Token],
    more: &[Token],
) {
    let mut s = TokenBlockSequence::from_tokens(hasher.clone(), page, prefix);
    s.extend(more);
    s.truncate(prefix.len()).unwrap();
    let fresh = TokenBlockSequence::from_tokens(hasher.clone(), page, prefix);
    assert_eq!(snapshot(&s), snapshot(&fresh));
    let owned = TokenBlockSequence::from_vec(hasher, page, prefix.to_vec());
    assert_eq!(snapshot(&owned), snapshot(&fresh));
    assert_eq!(
        s.tail(),
        &prefix[prefix.len() / page.as_usize() * page.as_usize()..]
    );
}

fn pop_and_extend_are_inverse<H: SequenceHasher>(
    hasher: H,
    page: PageSize,
    all: &[Token],
    pops: usize,
) {
    let mut s = TokenBlockSequence::from_tokens(hasher, page, all);
    let before = snapshot(&s);
    let pops = pops.min(all.len());
    let mut popped: Vec<Token> = (0..pops).map(|_| s.pop().unwrap()).collect();
    assert_eq!(s.len(), all.len() - pops);
    assert_eq!(s.num_blocks(), (all.len() - pops) / page.as_usize());
    popped.reverse();
    assert_eq!(&popped[..], &all[all.len() - pops..]);
    let completed = s.extend(&popped);
    assert_eq!(completed.end, s.num_blocks());
    assert_eq!(snapshot(&s), before);
}

/// Block i's hashes are a function of tokens[..(i+1)*page] and the salt:
/// whatever follows, and however the tokens arrived, they are the same.
fn hashes_depend_only_on_prefix<H: SequenceHasher>(
    hasher: H,
    page: PageSize,
    common: &[Token],
    tail_a: &[Token],
    tail_b: &[Token],
) {
    let mut a = TokenBlockSequence::new(hasher.clone(), page);
    for &t in common.iter().chain(tail_a) {
        a.push(t);
    }
    let mut b = TokenBlockSequence::from_tokens(hasher, page, common);
    b.extend(tail_b);
    let shared = common.len() / page.as_usize();
    let a_blocks: Vec<_> = a
        .blocks()
        .take(shared)
        .map(|x| (x.block_hash(), *x.digest()))
        .collect();
    let b_blocks: Vec<_> = b
        .blocks()
        .take(shared)
        .map(|x| (x.block_hash(), *x.digest()))
        .collect();
    assert_eq!(a_blocks, b_blocks);
}

/// Each block links to its predecessor, and the owned copy agrees.
fn chain_links<H: SequenceHasher>(hasher: H, page: PageSize, all: &[Token]) {
    let s = TokenBlockSequence::from_tokens(hasher.clone(), page, all);
    let mut parent: Option<H::Digest> = None;
    for block in s.blocks() {
        assert_eq!(block.parent_digest().copied(), parent);
        assert_eq!(
            block.parent_sequence_hash(),
            parent.map(|p| p.sequence_hash())
        );
        let owned = TokenBlock::new(
            &hasher,
            page,
            block.position(),
            parent.as_ref(),
            block.tokens(),
        )
        .unwrap();
        assert_eq!(owned, block.to_token_block());
        assert_eq!(owned.sequence_hash(), block.sequence_hash());
        parent = Some(*block.digest());
    }
    assert_eq!(s.last_digest().copied(), parent);
    assert_eq!(s.sequence_hashes().len(), s.num_blocks());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn extend_then_truncate_gives_the_prefix(
        page in page_size(), prefix in tokens(), more in tokens(), salt in any::<u64>()
    ) {
        extend_then_truncate_is_prefix(DynamoXxh3::from_salt_hash(salt), page, &prefix, &more);
        extend_then_truncate_is_prefix(
            VllmSha256::with_seed(&salt.to_string()).with_cache_salt("c"), page, &prefix, &more);
    }

    #[test]
    fn pop_then_extend_restores_the_sequence(
        page in page_size(), all in tokens(), pops in 0usize..80
    ) {
        pop_and_extend_are_inverse(DynamoXxh3::new(b"salt"), page, &all, pops);
        pop_and_extend_are_inverse(VllmSha256::default().with_lora("l", "/p"), page, &all, pops);
    }

    #[test]
    fn block_hashes_depend_only_on_prefix_and_salt(
        page in page_size(), common in tokens(), a in tokens(), b in tokens()
    ) {
        hashes_depend_only_on_prefix(DynamoXxh3::new(b"x"), page, &common, &a, &b);
        let mm = [VllmMmFeature { identifier: "img".into(), offset: 5, length: 20 }];
        let vllm = VllmSha256::default().with_mm_features(&mm).unwrap();
        hashes_depend_only_on_prefix(vllm, page, &common, &a, &b);
    }

    #[test]
    fn blocks_chain_to_their_parents(page in page_size(), all in tokens()) {
        chain_links(DynamoXxh3::default(), page, &all);
        chain_links(VllmSha256::with_seed("s").with_cache_salt("t"), page, &all);
        // The xxh3 chain step is the documented one.
        let s = TokenBlockSequence::from_tokens(DynamoXxh3::default(), page, &all);
        for pair in s.blocks().collect::<Vec<_>>().windows(2) {
            prop_assert_eq!(
                pair[1].sequence_hash(),
                DynamoXxh3::chain(pair[0].sequence_hash(), pair[1].block_hash())
            );
        }
        if let Some(first) = s.block(0) {
            prop_assert_eq!(first.sequence_hash(), SequenceHash(first.block_hash().0));
        }
    }

    /// Two requests with the same tokens and different salts never share a
    /// block: no sequence hash of one appears in the other.
    #[test]
    fn different_salts_never_share_blocks(
        page in page_size(),
        all in prop::collection::vec(any::<Token>(), 1..200),
        salt_a in prop::collection::vec(any::<u8>(), 0..16),
        salt_b in prop::collection::vec(any::<u8>(), 0..16),
    ) {
        prop_assume!(salt_a != salt_b);
        let keys = |h: DynamoXxh3| -> HashSet<SequenceHash> {
            TokenBlockSequence::from_tokens(h, page, &all).sequence_hashes().collect()
        };
        let a = keys(DynamoXxh3::new(&salt_a));
        let b = keys(DynamoXxh3::new(&salt_b));
        prop_assert!(a.is_disjoint(&b));

        let text = |s: &[u8]| s.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let vkeys = |h: VllmSha256| -> HashSet<SequenceHash> {
            TokenBlockSequence::from_tokens(h, page, &all).sequence_hashes().collect()
        };
        // Cache salt, LoRA and seed each isolate (non-empty salts only: vLLM
        // treats an empty cache salt as none).
        let (ta, tb) = (format!("a{}", text(&salt_a)), format!("a{}", text(&salt_b)));
        prop_assert!(vkeys(VllmSha256::default().with_cache_salt(&ta))
            .is_disjoint(&vkeys(VllmSha256::default().with_cache_salt(&tb))));
        prop_assert!(vkeys(VllmSha256::default().with_lora(&ta, "/p"))
            .is_disjoint(&vkeys(VllmSha256::default().with_lora(&tb, "/p"))));
        prop_assert!(vkeys(VllmSha256::with_seed(&ta)).is_disjoint(&vkeys(VllmSha256::with_seed(&tb))));
    }

    /// Different multimodal objects behind the same placeholder tokens give
    /// different names from the first block they touch on.
    #[test]
    fn multimodal_identity_enters_the_hash(
        page in page_size(),
        all in prop::collection::vec(0u32..4, 64..128),
        offset in 0usize..40,
        length in 1usize..24,
        h1 in any::<u64>(),
        h2 in any::<u64>(),
    ) {
        prop_assume!(h1 != h2);
        let first_touched = offset / page.as_usize();
        let run = |mm_hash| kvbm_block::hash::MmRun { mm_hash, offset, length };
        let keys = |h: u64| -> Vec<SequenceHash> {
            let hasher = DynamoXxh3::default().with_mm_runs(&[run(h)]).unwrap();
            TokenBlockSequence::from_tokens(hasher, page, &all).sequence_hashes().collect()
        };
        let (a, b) = (keys(h1), keys(h2));
        prop_assert_eq!(&a[..first_touched], &b[..first_touched]);
        for i in first_touched..a.len() {
            prop_assert_ne!(a[i], b[i]);
        }
        let feature = |id: u64| VllmMmFeature { identifier: id.to_string(), offset, length };
        let vkeys = |h: u64| -> Vec<SequenceHash> {
            let hasher = VllmSha256::default().with_mm_features(&[feature(h)]).unwrap();
            TokenBlockSequence::from_tokens(hasher, page, &all).sequence_hashes().collect()
        };
        let (a, b) = (vkeys(h1), vkeys(h2));
        prop_assert_eq!(&a[..first_touched], &b[..first_touched]);
        for i in first_touched..a.len() {
            prop_assert_ne!(a[i], b[i]);
        }
    }
}

#[test]
fn page_sizes_must_be_powers_of_two_up_to_1024() {
    for bad in [0, 3, 6, 12, 1000, 2048, u32::MAX] {
        assert_eq!(PageSize::new(bad), Err(TokenError::InvalidPageSize(bad)));
        assert_eq!(
            PageSize::try_from(bad),
            Err(TokenError::InvalidPageSize(bad))
        );
    }
    for shift in 0..=10 {
        assert_eq!(PageSize::new(1 << shift).unwrap().get(), 1 << shift);
    }
}

#[test]
fn truncating_past_the_end_is_an_error() {
    let page = PageSize::new(4).unwrap();
    let mut s = TokenBlockSequence::from_tokens(DynamoXxh3::default(), page, &[1, 2, 3, 4, 5]);
    assert_eq!(
        s.truncate(6),
        Err(TokenError::TruncatePastEnd { len: 6, total: 5 })
    );
    assert_eq!(s.len(), 5, "a failed truncate changes nothing");
    assert_eq!(s.truncate(5), Ok(()));
    assert_eq!(s.truncate(3), Ok(()));
    assert_eq!(s.num_blocks(), 0);
}

#[test]
fn unwinding_past_the_start_is_an_error() {
    let page = PageSize::new(2).unwrap();
    let mut s = TokenBlockSequence::from_tokens(VllmSha256::default(), page, &[1, 2, 3]);
    assert_eq!(
        s.unwind(4),
        Err(TokenError::UnwindPastStart { count: 4, total: 3 })
    );
    assert_eq!(s.len(), 3);
    assert_eq!(s.unwind(3), Ok(()));
    assert!(s.is_empty());
    assert_eq!(s.pop(), None);
}

#[test]
fn a_token_block_must_hold_exactly_page_size_tokens() {
    let page = PageSize::new(8).unwrap();
    let hasher = DynamoXxh3::default();
    for len in [0, 7, 9] {
        let tokens = vec![1; len];
        assert_eq!(
            TokenBlock::new(&hasher, page, 0, None, &tokens),
            Err(TokenError::WrongBlockLength { page_size: 8, len })
        );
    }
    assert!(TokenBlock::new(&hasher, page, 0, None, &[0; 8]).is_ok());
}

#[test]
fn push_reports_the_block_it_completes() {
    let page = PageSize::new(2).unwrap();
    // dynamo-xxh3 is the default scheme.
    let mut s: TokenBlockSequence = TokenBlockSequence::new(DynamoXxh3::default(), page);
    assert_eq!(s.push(1), None);
    assert_eq!(s.push(2), Some(0));
    assert_eq!(s.push(3), None);
    assert_eq!(s.extend(&[4, 5, 6, 7]), 1..3);
    assert_eq!(s.extend(&[]), 3..3);
    assert_eq!(s.tail(), &[7]);
    assert!(s.block(3).is_none());
}

/// One edit of a sequence, for the model-based test.
#[derive(Clone, Debug)]
enum Op {
    Extend(Vec<Token>),
    Push(Token),
    Pop,
    Truncate(usize),
    Unwind(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        prop::collection::vec(any::<Token>(), 0..40).prop_map(Op::Extend),
        any::<Token>().prop_map(Op::Push),
        Just(Op::Pop),
        (0usize..120).prop_map(Op::Truncate),
        (0usize..50).prop_map(Op::Unwind),
    ]
}

/// Applies `ops` to a sequence and to a plain token vector (the model);
/// after every step the sequence equals one built from scratch from the
/// model's tokens, and errors happen exactly when the model says so.
fn follows_the_model<H: SequenceHasher>(hasher: H, page: PageSize, ops: &[Op]) {
    let mut s = TokenBlockSequence::new(hasher.clone(), page);
    let mut model: Vec<Token> = Vec::new();
    for op in ops {
        let blocks_before = s.num_blocks();
        match op {
            Op::Extend(tokens) => {
                model.extend_from_slice(tokens);
                let completed = s.extend(tokens);
                assert_eq!(completed, blocks_before..model.len() / page.as_usize());
            }
            Op::Push(t) => {
                model.push(*t);
                let completed = s.push(*t);
                let expect = model
                    .len()
                    .is_multiple_of(page.as_usize())
                    .then_some(blocks_before);
                assert_eq!(completed, expect);
            }
            Op::Pop => assert_eq!(s.pop(), model.pop()),
            Op::Truncate(len) => {
                let result = s.truncate(*len);
                if *len <= model.len() {
                    assert_eq!(result, Ok(()));
                    model.truncate(*len);
                } else {
                    assert_eq!(
                        result,
                        Err(TokenError::TruncatePastEnd {
                            len: *len,
                            total: model.len()
                        })
                    );
                }
            }
            Op::Unwind(count) => {
                let result = s.unwind(*count);
                if *count <= model.len() {
                    assert_eq!(result, Ok(()));
                    model.truncate(model.len() - count);
                } else {
                    assert_eq!(
                        result,
                        Err(TokenError::UnwindPastStart {
                            count: *count,
                            total: model.len()
                        })
                    );
                }
            }
        }
        let fresh = TokenBlockSequence::from_tokens(hasher.clone(), page, &model);
        assert_eq!(snapshot(&s), snapshot(&fresh));
        assert_eq!(s.num_blocks(), model.len() / page.as_usize());
        assert_eq!(s.tail().len(), model.len() % page.as_usize());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn sequences_follow_the_token_vector_model(
        page in page_size(), ops in prop::collection::vec(op(), 1..40)
    ) {
        follows_the_model(DynamoXxh3::new(b"model"), page, &ops);
        follows_the_model(VllmSha256::default().with_cache_salt("m"), page, &ops);
    }
}
