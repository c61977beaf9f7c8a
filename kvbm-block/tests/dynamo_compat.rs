//! The dynamo-xxh3 scheme must give exactly the hashes of `dynamo-tokens`
//! 1.6.1, the crate Dynamo's KV router and engines hash with; otherwise a
//! router would never find our blocks.

use dynamo_tokens::{
    TokenBlockMmInfo, TokenBlockSequence as DynamoSequence, compute_salt_hash_from_bytes,
};
use kvbm_block::hash::MmRun;
use kvbm_block::{DynamoXxh3, PageSize, SequenceHash, Token, TokenBlockSequence};
use proptest::prelude::*;

/// A page size (power of two up to 1024) and up to ~4 pages of tokens,
/// capped so big pages stay cheap.
fn page_and_tokens() -> impl Strategy<Value = (u32, Vec<Token>)> {
    (0u32..=10).prop_flat_map(|shift| {
        let page = 1u32 << shift;
        let max_len = (page as usize * 4 + 3).min(2100);
        (
            Just(page),
            prop::collection::vec(any::<Token>(), 0..max_len),
        )
    })
}

fn assert_same_blocks(ours: &TokenBlockSequence<DynamoXxh3>, theirs: &DynamoSequence) {
    assert_eq!(ours.num_blocks(), theirs.blocks().len());
    for (a, b) in ours.blocks().zip(theirs.blocks()) {
        assert_eq!(a.tokens(), &b.tokens()[..]);
        assert_eq!(a.block_hash().0, b.block_hash());
        assert_eq!(a.sequence_hash(), SequenceHash(b.sequence_hash()));
        assert_eq!(
            a.parent_sequence_hash(),
            b.parent_sequence_hash().map(SequenceHash)
        );
    }
    assert_eq!(ours.tail(), &theirs.current_block().tokens()[..]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn salted_sequences_match_dynamo_tokens(
        (page, tokens) in page_and_tokens(),
        salt in prop::collection::vec(any::<u8>(), 0..40),
        split in any::<prop::sample::Index>(),
    ) {
        let salt_hash = compute_salt_hash_from_bytes(&salt);
        let theirs = DynamoSequence::new(tokens.clone().into(), page, Some(salt_hash));

        let hasher = DynamoXxh3::new(&salt);
        prop_assert_eq!(hasher.salt_hash(), salt_hash);
        let page_size = PageSize::new(page).unwrap();
        let ours = TokenBlockSequence::from_tokens(hasher.clone(), page_size, &tokens);
        assert_same_blocks(&ours, &theirs);

        // Built incrementally, in two pieces, the result is the same.
        let cut = split.index(tokens.len() + 1);
        let mut grown = TokenBlockSequence::new(hasher, page_size);
        grown.extend(&tokens[..cut]);
        grown.extend(&tokens[cut..]);
        assert_same_blocks(&grown, &theirs);
    }

    #[test]
    fn unsalted_sequences_match_dynamo_tokens((page, tokens) in page_and_tokens()) {
        let theirs = DynamoSequence::new(tokens.clone().into(), page, None);
        let ours = TokenBlockSequence::from_tokens(
            DynamoXxh3::default(),
            PageSize::new(page).unwrap(),
            &tokens,
        );
        assert_same_blocks(&ours, &theirs);
    }

    #[test]
    fn multimodal_sequences_match_dynamo_tokens(
        shift in 0u32..=6,
        len in 1usize..300,
        tokens_seed in prop::collection::vec(any::<Token>(), 300),
        gaps in prop::collection::vec((0usize..40, 1usize..60, any::<u64>()), 0..5),
        salt in any::<u64>(),
    ) {
        let page = 1u32 << shift;
        let tokens = &tokens_seed[..len];
        // Lay runs out left to right, dropping any that would not fit.
        let mut runs = Vec::new();
        let mut at = 0usize;
        for (gap, length, mm_hash) in gaps {
            let offset = at + gap;
            if offset + length > len {
                break;
            }
            runs.push(MmRun { mm_hash, offset, length });
            at = offset + length;
        }
        let infos: Vec<TokenBlockMmInfo> = runs
            .iter()
            .map(|r| TokenBlockMmInfo { mm_hash: r.mm_hash, offset: r.offset, length: r.length })
            .collect();
        let theirs = DynamoSequence::new_with_mm(tokens.to_vec().into(), &infos, page, Some(salt))
            .unwrap();
        // Runs given in reverse order are sorted by the hasher.
        runs.reverse();
        let hasher = DynamoXxh3::from_salt_hash(salt).with_mm_runs(&runs).unwrap();
        let ours = TokenBlockSequence::from_tokens(hasher, PageSize::new(page).unwrap(), tokens);
        assert_same_blocks(&ours, &theirs);
    }
}
