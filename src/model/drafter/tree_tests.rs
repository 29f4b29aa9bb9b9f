//! [`Drafter::propose_tree`]: a one-wide tree is the greedy chain, trees are well formed and
//! follow the drafter's ranking, and bad shapes are errors.

use super::*;
use crate::data::SplitMix64;
use crate::model::GptConfig;
use crate::model::drafter::DrafterConfig;
use crate::model::drafter::tests::propose::{self as propose_tests, pairs};
use crate::tensor::CpuBackend;

fn target() -> GptConfig {
    GptConfig {
        layers: 2,
        d_model: 32,
        heads: 4,
        vocab: 40,
        seq_len: 32,
        ..GptConfig::default()
    }
}

/// The proposal tests' random drafter (weights at scale 0.3, logits far apart), with the
/// default window.
fn drafter(cfg: &GptConfig, seed: u64) -> Drafter<CpuBackend> {
    propose_tests::drafter(cfg, DrafterConfig::default().window, seed)
}

#[test]
fn a_one_wide_tree_is_the_greedy_chain() {
    let cfg = target();
    let mut d = drafter(&cfg, 1);
    let data = [pairs(&cfg, 5, 1), pairs(&cfg, 9, 2), pairs(&cfg, 5, 3)];
    let ctx: Vec<DraftContext<'_>> = data
        .iter()
        .map(|(hidden, tokens)| DraftContext { hidden, tokens })
        .collect();
    let k = 4;
    let chains = d.propose(&ctx, k, 0.0, &mut SplitMix64::new(0)).unwrap();
    let shape = TreeShape {
        depth: k,
        branch: 1,
        width: 1,
        nodes: k,
    };
    let trees = d.propose_tree(&ctx, &shape, 0.0).unwrap();
    for (c, t) in chains.iter().zip(&trees) {
        assert_eq!(*t, DraftTree::chain(&c.tokens));
    }
}

#[test]
fn trees_are_well_formed_and_rank_by_the_drafter() {
    let cfg = target();
    let mut d = drafter(&cfg, 4);
    let data = [pairs(&cfg, 6, 5), pairs(&cfg, 3, 6)];
    let ctx: Vec<DraftContext<'_>> = data
        .iter()
        .map(|(hidden, tokens)| DraftContext { hidden, tokens })
        .collect();
    let shape = TreeShape {
        depth: 4,
        branch: 3,
        width: 2,
        nodes: 9,
    };
    let chains = d
        .propose(&ctx, shape.depth, 0.0, &mut SplitMix64::new(0))
        .unwrap();
    for temperature in [0.0, 0.7] {
        let trees = d.propose_tree(&ctx, &shape, temperature).unwrap();
        for (t, c) in trees.iter().zip(&chains) {
            assert_eq!(t.check(cfg.vocab), None);
            assert_eq!(t.len(), shape.nodes);
            assert!(t.depths().iter().all(|&x| x <= shape.depth));
            let first: Vec<usize> = t.children(None).collect();
            assert!(!first.is_empty() && first.len() <= shape.branch);
            // The root's first child is the drafter's greedy token.
            assert_eq!(t.tokens[first[0]], c.tokens[0]);
            // The greedy chain of the tree's depth is one of its paths.
            let mut at = None;
            for &tok in &c.tokens {
                at = t.children(at).find(|&n| t.tokens[n] == tok);
                assert!(at.is_some(), "chain {:?} not in {t:?}", c.tokens);
            }
            for i in 0..t.len() {
                assert!(t.children(Some(i)).count() <= shape.branch);
            }
        }
        // Deterministic: no draw is involved.
        assert_eq!(trees, d.propose_tree(&ctx, &shape, temperature).unwrap());
    }
}

#[test]
fn bad_shapes_and_inputs_are_errors() {
    let cfg = target();
    let mut d = drafter(&cfg, 2);
    let (hidden, tokens) = pairs(&cfg, 4, 1);
    let ctx = [DraftContext {
        hidden: &hidden,
        tokens: &tokens,
    }];
    let zero = TreeShape {
        width: 0,
        ..TreeShape::default()
    };
    let err = d.propose_tree(&ctx, &zero, 0.0).unwrap_err().to_string();
    assert!(err.contains("width"), "{err}");
    let big = TreeShape {
        nodes: MAX_TREE_NODES + 1,
        ..TreeShape::default()
    };
    assert!(d.propose_tree(&ctx, &big, 0.0).is_err());
    assert!(d.propose_tree(&ctx, &TreeShape::default(), -1.0).is_err());
    let short = [DraftContext {
        hidden: &hidden[..3],
        tokens: &tokens,
    }];
    let err = d.propose_tree(&short, &TreeShape::default(), 0.0);
    assert!(err.unwrap_err().to_string().contains("context 0"));
}
