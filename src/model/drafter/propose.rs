//! [`Drafter::propose`]: draft chains for speculative decoding.
//!
//! Each draft step re-runs the drafter's one block over the sequence's last `window` target
//! pairs plus the tokens drafted so far, instead of keeping a KV cache: the
//! [`crate::tensor::Backend`] has only a whole-sequence causal attention (no incremental
//! one), and with one layer over at most `window + k` positions the recompute is
//! `O(k·(window + k))` rows of one block, small next to one target forward. Sequences are
//! batched by context length, so a batch of live sequences costs one block forward per
//! draft step.

use std::collections::BTreeMap;

use super::loss::argmax;
use super::{Drafter, DrafterError, Result};
use crate::data::SplitMix64;
use crate::tensor::Backend;

/// The micro-batch id of a proposal forward (discarded right after).
const PROPOSE_MB: usize = usize::MAX - 1;

/// One live sequence as the target left it: its last `n ≥ 1` pairs `(h_i, x_{i+1})`:
/// `hidden: [n, d_model]` final hidden states and, for each, the token that followed it
/// (the last one is the token the target just emitted, not yet run through the target).
#[derive(Clone, Copy, Debug)]
pub struct DraftContext<'a> {
    pub hidden: &'a [f32],
    pub tokens: &'a [u32],
}

/// A drafted chain: `tokens[j]` was drawn from `probs[j·vocab..(j+1)·vocab]` (the draft
/// distribution `q` that lossless acceptance compares with the target's `p`).
#[derive(Clone, Debug, PartialEq)]
pub struct DraftChain {
    pub tokens: Vec<u32>,
    pub probs: Vec<f32>,
}

impl<B: Backend> Drafter<B> {
    /// Drafts `k` tokens for each context. `temperature = 0` drafts greedily (argmax, `q` is
    /// the softmax of the logits); otherwise tokens are sampled from
    /// `q = softmax(logits / temperature)` with `rng`. Contexts longer than `window` pairs
    /// are cut to their last `window`.
    pub fn propose(
        &mut self,
        contexts: &[DraftContext<'_>],
        k: usize,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftChain>> {
        let (d, v) = (self.target.d_model, self.target.vocab);
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(DrafterError::Input {
                what: "proposal",
                reason: format!("temperature {temperature} is not a finite number ≥ 0"),
            });
        }
        // Per sequence: the fc inputs of its pairs, `[rows, 2d]`, growing by one per draft.
        let mut inputs = Vec::with_capacity(contexts.len());
        let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, c) in contexts.iter().enumerate() {
            let n = c.tokens.len();
            let bad = |reason: String| DrafterError::Input {
                what: "proposal",
                reason: format!("context {i}: {reason}"),
            };
            if n == 0 || c.hidden.len() != n * d {
                let got = c.hidden.len();
                return Err(bad(format!(
                    "{n} tokens and {got} hidden values (width {d})"
                )));
            }
            if let Some(&t) = c.tokens.iter().find(|&&t| t as usize >= v) {
                return Err(bad(format!("token {t} is outside the vocabulary {v}")));
            }
            let from = n.saturating_sub(self.config.window);
            let mut x = Vec::with_capacity((n - from + k) * 2 * d);
            for t in from..n {
                self.push_pair(&mut x, c.tokens[t], &c.hidden[t * d..(t + 1) * d]);
            }
            groups.entry(n - from).or_default().push(i);
            inputs.push(x);
        }
        let mut chains = vec![
            DraftChain {
                tokens: Vec::with_capacity(k),
                probs: Vec::with_capacity(k * v),
            };
            contexts.len()
        ];
        for (&n, members) in &groups {
            for j in 0..k {
                let last = self.last_hidden(&inputs, members, n + j)?;
                let logits = self.be.to_host(&self.logits(
                    &self.be.from_host(&last, self.be.storage_dtype())?,
                    members.len(),
                )?)?;
                for (m, &i) in members.iter().enumerate() {
                    let z = &logits[m * v..(m + 1) * v];
                    let (token, q) = draw(z, temperature, rng);
                    chains[i].tokens.push(token);
                    chains[i].probs.extend_from_slice(&q);
                    let f = &last[m * d..(m + 1) * d];
                    let mut x = std::mem::take(&mut inputs[i]);
                    self.push_pair(&mut x, token, f);
                    inputs[i] = x;
                }
            }
        }
        Ok(chains)
    }

    /// Appends one fc input row: the frozen embedding of `token`, then `hidden`.
    fn push_pair(&self, x: &mut Vec<f32>, token: u32, hidden: &[f32]) {
        let d = self.target.d_model;
        let id = token as usize;
        x.extend_from_slice(&self.tok[id * d..(id + 1) * d]);
        x.extend_from_slice(hidden);
    }

    /// The block's output at the last of `seq` positions of each member, `[members, d]`.
    fn last_hidden(
        &mut self,
        inputs: &[Vec<f32>],
        members: &[usize],
        seq: usize,
    ) -> Result<Vec<f32>> {
        let be = self.be.clone();
        let d = self.target.d_model;
        let batch = members.len();
        let mut x = Vec::with_capacity(batch * seq * 2 * d);
        members
            .iter()
            .for_each(|&i| x.extend_from_slice(&inputs[i]));
        let x = be.from_host(&x, be.storage_dtype())?;
        let out = (|| {
            let z = self.fc.forward(&be, PROPOSE_MB, &x, batch * seq)?;
            self.block.forward(&be, PROPOSE_MB, &z, batch, seq)
        })();
        self.discard(PROPOSE_MB);
        let f = be.to_host(&out?)?;
        let mut last = Vec::with_capacity(batch * d);
        for b in 0..batch {
            let row = b * seq + seq - 1;
            last.extend_from_slice(&f[row * d..(row + 1) * d]);
        }
        Ok(last)
    }
}

/// The drafted token and its distribution `q` (see [`Drafter::propose`]).
fn draw(z: &[f32], temperature: f32, rng: &mut SplitMix64) -> (u32, Vec<f32>) {
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = z.iter().map(|&x| f64::from((x - max) / t).exp()).collect();
    let sum: f64 = e.iter().sum();
    let q: Vec<f32> = e.iter().map(|&x| (x / sum) as f32).collect();
    let token = if temperature > 0.0 {
        let u = rng.next_f64() * sum;
        let mut acc = 0.0;
        e.iter()
            .position(|&x| {
                acc += x;
                u < acc
            })
            .unwrap_or(e.len() - 1)
    } else {
        argmax(z).unwrap_or(0)
    };
    (token as u32, q)
}
