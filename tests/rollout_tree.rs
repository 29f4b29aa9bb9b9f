//! Draft-tree speculation through the rollout engine: greedy output is token for token
//! plain decoding's whatever the tree holds (random trees, an untrained and a trained
//! drafter, decoy branches that force the caches' compaction), and bad shapes are errors.

mod common;

use common::rollouts::{config, engine, gpt, requests};
use pipefill::data::SplitMix64;
use pipefill::model::drafter::{
    DraftBufferHandle, DraftChain, DraftContext, DraftTree, Drafter, DrafterConfig, DrafterTrainer,
    TreeShape,
};
use pipefill::rl::RlError;
use pipefill::rl::rollout::{
    AdaptiveConfig, RolloutConfig, RolloutEngine, RolloutOutput, Speculation,
};
use pipefill::rl::speculative::{OracleProposer, Proposer, RandomProposer};
use pipefill::tensor::CpuBackend;

fn run(
    e: &mut RolloutEngine<CpuBackend>,
    spec: Speculation,
    temperature: f32,
    p: Option<&mut dyn Proposer>,
) -> Result<RolloutOutput, RlError> {
    let cfg = RolloutConfig {
        groups: 2,
        temperature,
        speculation: spec,
        record_rows: true,
        ..RolloutConfig::default()
    };
    e.run(&requests(10), &cfg, p)
}

const SHAPE: TreeShape = TreeShape {
    depth: 3,
    branch: 3,
    width: 2,
    nodes: 8,
};

/// The known continuation, each of its tokens preceded by a wrong sibling: the accepted
/// path is never the tree's first rows, so every verification compacts the caches.
struct Decoys(OracleProposer, usize);

impl Proposer for Decoys {
    fn propose(
        &mut self,
        contexts: &[DraftContext<'_>],
        k: usize,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftChain>, RlError> {
        self.0.propose(contexts, k, temperature, rng)
    }

    fn propose_tree(
        &mut self,
        contexts: &[DraftContext<'_>],
        shape: &TreeShape,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftTree>, RlError> {
        let vocab = self.1 as u32;
        let chains = self.0.propose(contexts, shape.depth, temperature, rng)?;
        Ok(chains
            .iter()
            .map(|c| {
                let mut t = DraftTree::default();
                let mut parent = None;
                for &right in &c.tokens {
                    t.parents.extend([parent, parent]);
                    t.tokens.extend([(right + 1) % vocab, right]);
                    parent = Some(t.len() - 1);
                }
                t
            })
            .collect())
    }
}

#[test]
fn greedy_tree_speculation_is_plain_decoding() {
    let model = gpt();
    let mut e = engine(&model);
    let plain = run(&mut e, Speculation::Off, 0.0, None).unwrap();
    let mut random = RandomProposer::new(50);
    let out = run(&mut e, Speculation::Tree(SHAPE), 0.0, Some(&mut random)).unwrap();
    assert_eq!(out.sequences, plain.sequences, "random trees");
    assert!(out.stats.verifications > 0);
    assert!(
        out.stats.drafted > 4 * out.stats.verifications,
        "trees, not chains"
    );
    // Right tokens behind decoys: all accepted, the caches compacted every step.
    let mut decoys = Decoys(OracleProposer::new(50, &plain.sequences), 50);
    let exact = run(&mut e, Speculation::Tree(SHAPE), 0.0, Some(&mut decoys)).unwrap();
    assert_eq!(exact.sequences, plain.sequences, "decoy branches");
    assert!(
        exact.stats.acceptance_length() > 3.0,
        "the right path is always there: {}",
        exact.stats.acceptance_length()
    );
    // The drafter's rows see the accepted path's hidden states, as plain decoding's do.
    for (a, b) in exact.rows.iter().zip(&plain.rows) {
        assert_eq!(a.targets, b.targets);
        assert_eq!(a.hidden, b.hidden);
    }
    // The adaptive engine with trees.
    let adaptive = Speculation::Adaptive(AdaptiveConfig {
        threshold: 10,
        ks: vec![1, 3],
        tree: Some(SHAPE),
        ..AdaptiveConfig::default()
    });
    let out = run(&mut e, adaptive, 0.0, Some(&mut random)).unwrap();
    assert_eq!(out.sequences, plain.sequences, "adaptive trees");
}

#[test]
fn greedy_tree_speculation_with_the_drafter_untrained_and_trained() {
    let model = gpt();
    let mut e = engine(&model);
    let plain = run(&mut e, Speculation::Off, 0.0, None).unwrap();
    let dc = DrafterConfig {
        window: 8,
        batch_rows: 4,
        max_positions: 32,
        ..DrafterConfig::default()
    };
    let mut drafter = Drafter::new(&config(), &dc, CpuBackend::new(1).unwrap()).unwrap();
    drafter.refresh_from_gpt(&model, 0).unwrap();
    let untrained = run(&mut e, Speculation::Tree(SHAPE), 0.0, Some(&mut drafter)).unwrap();
    assert_eq!(untrained.sequences, plain.sequences, "untrained drafter");
    let buffer = DraftBufferHandle::new(&config(), &dc);
    buffer.begin_step(0);
    for row in plain.rows.iter().cloned() {
        buffer.lock().push(row).unwrap();
    }
    let mut trainer = DrafterTrainer::new(drafter, buffer, 0, 1).unwrap();
    for _ in 0..60 {
        trainer.slice().unwrap();
    }
    let d = trainer.drafter_mut();
    let tree = run(&mut e, Speculation::Tree(SHAPE), 0.0, Some(&mut *d)).unwrap();
    assert_eq!(tree.sequences, plain.sequences, "trained drafter");
    assert!(
        tree.stats.acceptance_length() > untrained.stats.acceptance_length(),
        "training raises the tree's acceptance: {} vs {}",
        tree.stats.acceptance_length(),
        untrained.stats.acceptance_length()
    );
    let chain = run(&mut e, Speculation::Fixed { k: 3 }, 0.0, Some(d)).unwrap();
    eprintln!(
        "acceptance length at depth 3: tree {:.3}, chain {:.3}",
        tree.stats.acceptance_length(),
        chain.stats.acceptance_length()
    );
}

#[test]
fn sampled_tree_rollouts_are_reproducible() {
    let model = gpt();
    let mut e = engine(&model);
    let mut random = RandomProposer::new(50);
    let a = run(&mut e, Speculation::Tree(SHAPE), 0.8, Some(&mut random)).unwrap();
    let b = run(&mut e, Speculation::Tree(SHAPE), 0.8, Some(&mut random)).unwrap();
    assert_eq!(a.sequences, b.sequences);
    assert!(a.stats.verifications > 0);
}

#[test]
fn bad_tree_configs_are_errors() {
    let model = gpt();
    let mut e = engine(&model);
    let mut random = RandomProposer::new(50);
    let zero = TreeShape { branch: 0, ..SHAPE };
    let err = run(&mut e, Speculation::Tree(zero), 0.0, Some(&mut random)).unwrap_err();
    assert!(err.to_string().contains("speculation.tree.branch"), "{err}");
    let big = AdaptiveConfig {
        tree: Some(TreeShape { nodes: 99, ..SHAPE }),
        ..AdaptiveConfig::default()
    };
    let err = run(&mut e, Speculation::Adaptive(big), 0.0, Some(&mut random)).unwrap_err();
    assert!(err.to_string().contains("speculation.tree.nodes"), "{err}");
    // A proposer without trees says so.
    struct Chains(RandomProposer);
    impl Proposer for Chains {
        fn propose(
            &mut self,
            c: &[DraftContext<'_>],
            k: usize,
            t: f32,
            rng: &mut SplitMix64,
        ) -> Result<Vec<DraftChain>, RlError> {
            self.0.propose(c, k, t, rng)
        }
    }
    let mut chains = Chains(RandomProposer::new(50));
    let err = run(&mut e, Speculation::Tree(SHAPE), 0.0, Some(&mut chains)).unwrap_err();
    assert!(err.to_string().contains("does not draft trees"), "{err}");
}
