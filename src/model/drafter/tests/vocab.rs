//! The reduced draft vocabulary: which tokens it keeps, and that proposals through it draft
//! only those, with a `q` that is still a distribution over the whole vocabulary, equal to
//! the full head's chain wherever the full head's tokens are in it, on both product paths
//! and after a refresh of the head.

use super::propose::{drafter, pairs};
use super::*;
use crate::model::drafter::frequent_tokens;
use crate::model::infer::rowmul::Precision;

/// A target whose vocabulary is wider than a few chains' tokens.
fn wide() -> GptConfig {
    GptConfig {
        vocab: 64,
        ..tiny()
    }
}

fn row_of(targets: &[u32]) -> DraftRow {
    DraftRow {
        hidden: vec![0.0; targets.len()],
        targets: targets.to_vec(),
        step: 0,
    }
}

#[test]
fn frequent_tokens_are_counted_ranked_and_topped_up() {
    let rows = [row_of(&[5, 3, 5, IGNORE_TARGET]), row_of(&[3, 5, 7, 2])];
    // 5 ×3, 3 ×2, then 2 and 7 once each (the lower id first).
    assert_eq!(frequent_tokens(&rows, 10, 3), [2, 3, 5]);
    assert_eq!(frequent_tokens(&rows, 10, 2), [3, 5]);
    // Fewer distinct tokens than asked: the lowest unseen ids fill up; at most the vocabulary.
    assert_eq!(frequent_tokens(&rows, 10, 6), [0, 1, 2, 3, 5, 7]);
    assert_eq!(frequent_tokens(&rows, 8, 99).len(), 8);
}

#[test]
fn a_bad_draft_vocabulary_is_refused_and_none_restores_the_full_head() {
    let cfg = tiny();
    let mut d = drafter(&cfg, 8, 1);
    for (ids, what) in [
        (vec![], "no token"),
        (vec![1, 1], "twice"),
        (vec![cfg.vocab as u32], "outside"),
    ] {
        let err = d.set_draft_vocab(Some(&ids)).unwrap_err();
        assert!(err.to_string().contains(what), "{err}");
        assert!(d.draft_vocab().is_none());
    }
    d.set_draft_vocab(Some(&[4, 2])).unwrap();
    assert_eq!(d.draft_vocab(), Some(&[2, 4][..]));
    d.set_draft_vocab(None).unwrap();
    assert!(d.draft_vocab().is_none());
}

#[test]
fn reduced_proposals_draft_only_its_tokens_with_a_whole_vocabulary_q() {
    let cfg = wide();
    let v = cfg.vocab;
    let data: Vec<_> = (0..3).map(|i| pairs(&cfg, 5 + i, i as u64)).collect();
    let ctx: Vec<DraftContext> = data
        .iter()
        .map(|(hidden, tokens)| DraftContext { hidden, tokens })
        .collect();
    let k = 4;
    for gemm_only in [false, true] {
        let mut full = drafter(&cfg, 8, 3);
        full.set_proposal_precision(Precision::F32);
        full.packs.gemm_only = gemm_only;
        let reference = full.propose(&ctx, k, 0.0, &mut SplitMix64::new(0)).unwrap();
        // The full head's tokens and a few others: the greedy chains are the same.
        let mut ids: Vec<u32> = reference.iter().flat_map(|c| c.tokens.clone()).collect();
        ids.extend([0, 1]);
        ids.sort_unstable();
        ids.dedup();
        assert!(
            ids.len() < v,
            "the test needs a vocabulary larger than the chains"
        );
        let mut reduced = drafter(&cfg, 8, 3);
        reduced.set_proposal_precision(Precision::F32);
        reduced.packs.gemm_only = gemm_only;
        reduced.set_draft_vocab(Some(&ids)).unwrap();
        let greedy = reduced
            .propose(&ctx, k, 0.0, &mut SplitMix64::new(0))
            .unwrap();
        let sampled = reduced
            .propose(&ctx, k, 0.8, &mut SplitMix64::new(5))
            .unwrap();
        for (g, r) in greedy.iter().zip(&reference) {
            assert_eq!(g.tokens, r.tokens, "gemm_only {gemm_only}");
        }
        for chain in greedy.iter().chain(&sampled) {
            assert_eq!(chain.probs.len(), k * v);
            for (j, q) in chain.probs.chunks(v).enumerate() {
                let sum: f32 = q.iter().sum();
                assert!((sum - 1.0).abs() < 1e-5, "q sums to {sum}");
                for (t, &p) in q.iter().enumerate() {
                    assert!(ids.contains(&(t as u32)) || p == 0.0, "q({t}) = {p}");
                }
                assert!(ids.contains(&chain.tokens[j]));
                assert!(q[chain.tokens[j] as usize] > 0.0);
            }
        }
    }
}

#[test]
fn a_refreshed_head_is_gathered_again() {
    let cfg = wide();
    let (hidden, tokens) = pairs(&cfg, 6, 2);
    let ctx = [DraftContext {
        hidden: &hidden,
        tokens: &tokens,
    }];
    let ids = [0, 3, 5, 6, 9, 40];
    let new_head = normal(77, "head", cfg.vocab * cfg.d_model, 0.3);
    // Set, then refreshed; against refreshed, then set.
    let mut before = drafter(&cfg, 8, 4);
    before.set_draft_vocab(Some(&ids)).unwrap();
    before
        .propose(&ctx, 3, 0.0, &mut SplitMix64::new(0))
        .unwrap();
    before.refresh("head.w", &new_head, 1).unwrap();
    let mut after = drafter(&cfg, 8, 4);
    after.refresh("head.w", &new_head, 1).unwrap();
    after.set_draft_vocab(Some(&ids)).unwrap();
    let a = before
        .propose(&ctx, 3, 0.0, &mut SplitMix64::new(0))
        .unwrap();
    let b = after
        .propose(&ctx, 3, 0.0, &mut SplitMix64::new(0))
        .unwrap();
    assert_eq!(a, b);
}

#[test]
fn a_tree_over_a_draft_vocabulary_holds_only_its_tokens() {
    let cfg = wide();
    let (hidden, tokens) = pairs(&cfg, 6, 3);
    let ctx = [DraftContext {
        hidden: &hidden,
        tokens: &tokens,
    }];
    // Fewer tokens than one node's children: the tree is cut, never filled with others.
    let ids = [2, 7, 11];
    let shape = crate::model::drafter::TreeShape {
        depth: 3,
        branch: 4,
        width: 2,
        nodes: 12,
    };
    let mut d = drafter(&cfg, 8, 6);
    d.set_draft_vocab(Some(&ids)).unwrap();
    let tree = d.propose_tree(&ctx, &shape, 0.0).unwrap().remove(0);
    assert!(!tree.tokens.is_empty());
    assert!(tree.tokens.iter().all(|t| ids.contains(t)), "{tree:?}");
    assert!(tree.parents.iter().filter(|p| p.is_none()).count() <= ids.len());
}
