//! [`Drafter::propose_tree`]: a one-wide tree is the greedy chain, trees are well formed and
//! follow the drafter's ranking, and bad shapes are errors.

use super::*;
use crate::data::SplitMix64;
use crate::model::GptConfig;
use crate::model::drafter::DrafterConfig;
use crate::model::init::normal;
use crate::tensor::{CpuBackend, DType};

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

/// A drafter with weights at scale 0.3 (norm gains around 1): logits far apart, so the
/// greedy choices are not decided by rounding.
fn drafter(cfg: &GptConfig, seed: u64) -> Drafter<CpuBackend> {
    let be = CpuBackend::new(1).unwrap();
    let mut d = Drafter::new(cfg, &DrafterConfig::default(), be.clone()).unwrap();
    for p in d.params_mut() {
        let mut v = normal(seed, &p.name, p.numel(), 0.3);
        if p.name.contains("norm") {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        p.value = be.from_host(&v, DType::F32).unwrap();
    }
    let n = cfg.vocab * cfg.d_model;
    d.refresh("head.w", &normal(seed, "head", n, 0.3), 0)
        .unwrap();
    d.refresh("embed.tok", &normal(seed, "tok", n, 0.3), 0)
        .unwrap();
    d
}

fn context(cfg: &GptConfig, n: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let hidden = normal(seed, "hidden", n * cfg.d_model, 1.0);
    let tokens = (0..n)
        .map(|i| ((i as u64 * 7 + seed * 3) % cfg.vocab as u64) as u32)
        .collect();
    (hidden, tokens)
}

#[test]
fn a_one_wide_tree_is_the_greedy_chain() {
    let cfg = target();
    let mut d = drafter(&cfg, 1);
    let data = [
        context(&cfg, 5, 1),
        context(&cfg, 9, 2),
        context(&cfg, 5, 3),
    ];
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
    let data = [context(&cfg, 6, 5), context(&cfg, 3, 6)];
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
    let (hidden, tokens) = context(&cfg, 4, 1);
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
