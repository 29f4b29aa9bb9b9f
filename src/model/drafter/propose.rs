//! [`Drafter::propose`]: draft chains for speculative decoding.
//!
//! A proposal runs the drafter's one block incrementally: the sequence's last `window`
//! target pairs go through it once (a prefill that fills a small per-proposal key/value
//! cache on the host), then each draft step runs only the one new pair against that cache
//! ([`crate::model::infer::attend`], the attention of the KV-cache inference path). The
//! training layers have only a whole-sequence causal attention; re-running the window for
//! every draft step cost `k·(window + k)` rows instead of `window + k`, several target
//! decode steps at `d_model` 256. The arithmetic is the training forward's (same weights,
//! same norms, same causal softmax), so the first draft matches it. Sequences are batched
//! by context length, so a batch of live sequences costs one block step per draft token.

use std::collections::BTreeMap;

use super::loss::argmax;
use super::{Drafter, DrafterError, Result};
use crate::data::SplitMix64;
use crate::model::infer::attend::attend;
use crate::tensor::{Backend, DType, Gemm};

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
        // Per sequence: the fc inputs of its last `window` pairs, `[rows, 2d]`.
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
            let batch = members.len();
            let mut caches = vec![(Vec::new(), Vec::new()); batch];
            let mut x = Vec::with_capacity(batch * n * 2 * d);
            members
                .iter()
                .for_each(|&i| x.extend_from_slice(&inputs[i]));
            let mut last = self.block_step(&x, n, &mut caches)?;
            for j in 0..k {
                let logits = self.be.to_host(
                    &self.logits(&self.be.from_host(&last, self.be.storage_dtype())?, batch)?,
                )?;
                x.clear();
                for (m, &i) in members.iter().enumerate() {
                    let z = &logits[m * v..(m + 1) * v];
                    let (token, q) = draw(z, temperature, rng);
                    chains[i].tokens.push(token);
                    chains[i].probs.extend_from_slice(&q);
                    self.push_pair(&mut x, token, &last[m * d..(m + 1) * d]);
                }
                if j + 1 < k {
                    last = self.block_step(&x, 1, &mut caches)?;
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

    /// Runs `new` fc input rows per member (`x: [members·new, 2d]`) through `fc` and the
    /// block, attending over each member's cache (extended by these rows); returns the
    /// block output at each member's last row, `[members, d]`.
    fn block_step(
        &self,
        x: &[f32],
        new: usize,
        caches: &mut [(Vec<f32>, Vec<f32>)],
    ) -> Result<Vec<f32>> {
        let be = &self.be;
        let dt = be.storage_dtype();
        let (d, heads, eps) = (self.target.d_model, self.target.heads, self.target.norm_eps);
        let hidden = self.target.mlp_hidden();
        let rows = caches.len() * new;
        let linear = |x: &B::Buf, w: &B::Buf, din: usize, dout: usize| -> Result<B::Buf> {
            let mut y = be.zeros(rows * dout, dt)?;
            be.matmul(x, w, &mut y, Gemm::nn(rows, din, dout))?;
            Ok(y)
        };
        let rmsnorm = |x: &B::Buf, w: &B::Buf| -> Result<B::Buf> {
            let mut y = be.zeros(rows * d, dt)?;
            let mut rstd = be.zeros(rows, DType::F32)?;
            be.rmsnorm_fwd(x, w, &mut y, &mut rstd, rows, d, eps)?;
            Ok(y)
        };
        let blk = &self.block;
        let z = linear(&be.from_host(x, dt)?, &self.fc.w.value, 2 * d, d)?;
        let a = rmsnorm(&z, &blk.norm1.weight.value)?;
        let [q, k, v] = [&blk.attn.wq, &blk.attn.wk, &blk.attn.wv]
            .map(|w| linear(&a, &w.value, d, d).and_then(|y| Ok(be.to_host(&y)?)));
        let (q, k, v) = (q?, k?, v?);
        let mut o = vec![0.0f32; rows * d];
        let mut scores = Vec::new();
        for (b, (kc, vc)) in caches.iter_mut().enumerate() {
            let past = kc.len() / d;
            kc.extend_from_slice(&k[b * new * d..(b + 1) * new * d]);
            vc.extend_from_slice(&v[b * new * d..(b + 1) * new * d]);
            for r in 0..new {
                let row = (b * new + r) * d;
                let out = &mut o[row..row + d];
                attend(
                    &q[row..row + d],
                    kc,
                    vc,
                    past + r + 1,
                    heads,
                    &mut scores,
                    out,
                );
            }
        }
        let y = linear(&be.from_host(&o, dt)?, &blk.attn.wo.value, d, d)?;
        let mut h = be.zeros(rows * d, dt)?;
        be.add(&z, &y, &mut h)?;
        let c = rmsnorm(&h, &blk.norm2.weight.value)?;
        let u = linear(&c, &blk.mlp.w1.value, d, hidden)?;
        let mut g = be.zeros(rows * hidden, dt)?;
        be.activation_fwd(self.target.activation, &u, &mut g)?;
        let m = linear(&g, &blk.mlp.w2.value, hidden, d)?;
        let mut out = be.zeros(rows * d, dt)?;
        be.add(&h, &m, &mut out)?;
        let f = be.to_host(&out)?;
        let mut last = Vec::with_capacity(caches.len() * d);
        for b in 0..caches.len() {
            let row = b * new + new - 1;
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
