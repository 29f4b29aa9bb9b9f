//! The draft side of speculative decoding: the [`Proposer`] seam, and the proposers the
//! engine and its tests use.
//!
//! A proposer sees each live sequence as the drafter API does
//! ([`DraftContext`]: the target's final hidden states `h_i` paired with the token `x_{i+1}`
//! that followed each, the last token being the one just emitted and not yet run through
//! the target) and returns a chain of K tokens with the distributions `q` they were drawn
//! from ([`DraftChain`]). Temperature 0 means greedy drafting.
//! - [`Drafter`]: the trained EAGLE-style drafter;
//! - [`RandomProposer`]: random chains (acceptance must stay lossless even then);
//! - [`OracleProposer`]: replays known continuations (every draft right), for tests.
//!
//! The engine verifies a chain with one multi-position pass and applies [`super::accept`].
//! A proposer may also draft a [`DraftTree`] ([`Proposer::propose_tree`]), which the engine
//! verifies in one pass with tree attention and accepts with [`super::tree`].

use crate::data::SplitMix64;
use crate::model::drafter::{DraftChain, DraftContext, DraftTree, Drafter, TreeShape};
use crate::rl::RlError;
use crate::tensor::Backend;

/// Drafts chains of `k` tokens for a batch of sequences.
pub trait Proposer {
    /// One chain per context, each of exactly `k` tokens with `k·vocab` probabilities.
    fn propose(
        &mut self,
        contexts: &[DraftContext<'_>],
        k: usize,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftChain>, RlError>;

    /// One tree per context, of at most `shape.nodes` nodes and `shape.depth` levels,
    /// siblings distinct; its tokens must not be draws correlated with the target (the
    /// tree's sampling acceptance needs no `q` because of that). By default a proposer
    /// drafts no trees.
    fn propose_tree(
        &mut self,
        _contexts: &[DraftContext<'_>],
        _shape: &TreeShape,
        _temperature: f32,
        _rng: &mut SplitMix64,
    ) -> Result<Vec<DraftTree>, RlError> {
        Err(RlError::proposer("does not draft trees"))
    }
}

impl<B: Backend> Proposer for Drafter<B> {
    fn propose(
        &mut self,
        contexts: &[DraftContext<'_>],
        k: usize,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftChain>, RlError> {
        Ok(Drafter::propose(self, contexts, k, temperature, rng)?)
    }

    fn propose_tree(
        &mut self,
        contexts: &[DraftContext<'_>],
        shape: &TreeShape,
        temperature: f32,
        _rng: &mut SplitMix64,
    ) -> Result<Vec<DraftTree>, RlError> {
        Ok(Drafter::propose_tree(self, contexts, shape, temperature)?)
    }
}

/// Random chains: each position's `q` is a random distribution over the vocabulary, and
/// the token is drawn from it (or its argmax when greedy).
#[derive(Clone, Debug)]
pub struct RandomProposer {
    vocab: usize,
}

impl RandomProposer {
    pub fn new(vocab: usize) -> Self {
        RandomProposer { vocab }
    }
}

impl Proposer for RandomProposer {
    fn propose(
        &mut self,
        contexts: &[DraftContext<'_>],
        k: usize,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftChain>, RlError> {
        let v = self.vocab;
        Ok(contexts
            .iter()
            .map(|_| {
                let mut chain = DraftChain {
                    tokens: Vec::with_capacity(k),
                    probs: Vec::with_capacity(k * v),
                };
                for _ in 0..k {
                    let w: Vec<f32> = (0..v).map(|_| rng.next_f64() as f32 + 1e-3).collect();
                    let sum: f32 = w.iter().sum();
                    let q: Vec<f32> = w.iter().map(|x| x / sum).collect();
                    let t = if temperature == 0.0 {
                        super::accept::argmax(&q)
                    } else {
                        super::accept::sample(&q, rng)
                    };
                    chain.tokens.push(t);
                    chain.probs.extend_from_slice(&q);
                }
                chain
            })
            .collect())
    }

    /// Random trees of the full shape: every expanded node (the first `width` of each
    /// level) gets `branch` distinct random children, until `nodes`.
    fn propose_tree(
        &mut self,
        contexts: &[DraftContext<'_>],
        shape: &TreeShape,
        _temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftTree>, RlError> {
        let v = self.vocab as u64;
        let branch = shape.branch.min(self.vocab);
        Ok(contexts
            .iter()
            .map(|_| {
                let mut tree = DraftTree::default();
                let mut level: Vec<Option<usize>> = vec![None];
                for _ in 0..shape.depth {
                    let mut next = Vec::new();
                    for &parent in level.iter().take(shape.width) {
                        let mut seen = Vec::with_capacity(branch);
                        while seen.len() < branch && tree.len() < shape.nodes {
                            let t = rng.below(v) as u32;
                            if !seen.contains(&t) {
                                seen.push(t);
                                next.push(Some(tree.len()));
                                tree.parents.push(parent);
                                tree.tokens.push(t);
                            }
                        }
                    }
                    level = next;
                }
                tree
            })
            .collect())
    }
}

/// Replays known sequences: after a prefix that matches one of them, proposes its next
/// tokens with `q` one-hot (a deterministic drafter). Past the end of the known sequence,
/// or when none matches, it proposes token 0.
#[derive(Clone, Debug, Default)]
pub struct OracleProposer {
    vocab: usize,
    known: Vec<Vec<u32>>,
}

impl OracleProposer {
    /// An oracle over whole `sequences` (prompt + continuation).
    pub fn new(vocab: usize, sequences: &[Vec<u32>]) -> Self {
        OracleProposer {
            vocab,
            known: sequences.to_vec(),
        }
    }
}

impl Proposer for OracleProposer {
    fn propose(
        &mut self,
        contexts: &[DraftContext<'_>],
        k: usize,
        _temperature: f32,
        _rng: &mut SplitMix64,
    ) -> Result<Vec<DraftChain>, RlError> {
        let v = self.vocab;
        Ok(contexts
            .iter()
            .map(|c| {
                // A context holds the sequence's positions 1..=n (see `DraftContext`).
                let n = c.tokens.len();
                let found = self
                    .known
                    .iter()
                    .find(|s| s.len() > n && s[1..=n] == *c.tokens);
                let mut chain = DraftChain {
                    tokens: Vec::with_capacity(k),
                    probs: vec![0.0; k * v],
                };
                for j in 0..k {
                    let t = found.and_then(|s| s.get(n + 1 + j).copied()).unwrap_or(0);
                    chain.tokens.push(t);
                    chain.probs[j * v + t as usize] = 1.0;
                }
                chain
            })
            .collect())
    }

    /// The known continuation as a chain of `shape.depth` nodes (at most `shape.nodes`).
    fn propose_tree(
        &mut self,
        contexts: &[DraftContext<'_>],
        shape: &TreeShape,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftTree>, RlError> {
        let k = shape.depth.min(shape.nodes);
        let chains = self.propose(contexts, k, temperature, rng)?;
        Ok(chains.iter().map(|c| DraftTree::chain(&c.tokens)).collect())
    }
}
