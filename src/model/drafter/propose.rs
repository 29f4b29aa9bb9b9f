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
//!
//! Only a sequence's last pair needs the whole block (its output is the one drafted
//! from); the pairs before it need only their key and value, which the host backend
//! remembers from the sequence's previous proposal ([`super::packed`]). The products run
//! on packed host copies of the weights ([`rowmul`]), so what is left of a draft token's
//! cost is streaming the block's weights once (15 MB in f32 at `d_model` 512), a fraction of
//! the target's decode step (docs/benchmarks.md, "Drafter proposals").
//!
//! In a rollout the target's verification (100 MB at `d_model` 512) evicts the drafter from
//! the L3 between two proposals, so the first draft step streams the block from memory and
//! the other K−1 from the L3; the products are most of a proposal. Packing in half
//! precision ([`super::packed`]) halves both streams (`cargo bench --bench propose`;
//! figures in docs/benchmarks.md, "Drafter proposals").

use std::collections::BTreeMap;

use super::loss::argmax;
use super::packed::{KvMemo, PackedDrafter};
use super::{Drafter, Result};
use crate::data::SplitMix64;
use crate::model::ModelError;
use crate::model::config::Positions;
use crate::model::infer::attend::{Heads, attend};
use crate::model::infer::rowmul::{rowmul, side_by_side};
use crate::tensor::cpu::kernels;
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

/// Where a proposal's products run: the packed host copies and the memo of context
/// pairs, or the backend's GEMM (a device backend, or a test's reference).
pub(super) enum Products<'a> {
    Packed(&'a PackedDrafter, &'a mut KvMemo),
    Backend,
}

/// The drafter matrices a proposal multiplies by.
#[derive(Clone, Copy)]
pub(super) enum Mat {
    Fc,
    Q,
    /// `[wk | wv]`: a row's key and value side by side.
    Kv,
    O,
    W1,
    W2,
    /// The up projection of a gated (SwiGLU) MLP.
    W3,
    Head,
}

impl<B: Backend> Drafter<B> {
    /// Drafts `k` tokens for each context. `temperature = 0` drafts greedily (argmax, `q` is
    /// the softmax of the logits); otherwise tokens are sampled from
    /// `q = softmax(logits / temperature)` with `rng`. With a draft vocabulary
    /// ([`Drafter::set_draft_vocab`]) the logits are its tokens' alone (`q` is 0 elsewhere).
    /// Contexts longer than `window` pairs are cut to their last `window`. On the host backend the first proposal after a
    /// weight change packs the weights (see `super::packed`).
    pub fn propose(
        &mut self,
        contexts: &[DraftContext<'_>],
        k: usize,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftChain>> {
        self.with_products("proposal", temperature, |drafter, products| {
            drafter.propose_with(products, contexts, k, temperature, rng)
        })
    }

    /// Runs `f` on this drafter's products after checking `temperature` (errors say
    /// `what`). On the host backend the pack cache is taken out for the call, so that the
    /// weights it packs from and the backend stay borrowed shared; it goes back whatever
    /// the outcome.
    pub(super) fn with_products<T>(
        &mut self,
        what: &'static str,
        temperature: f32,
        f: impl FnOnce(&Self, &mut Products<'_>) -> Result<T>,
    ) -> Result<T> {
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(ModelError::DrafterInput {
                what,
                reason: format!("temperature {temperature} is not a finite number ≥ 0"),
            });
        }
        let host = self.host_products();
        let mut cache = std::mem::take(&mut self.packs);
        let result = (|| {
            let mut products = if host {
                let (packed, memo) = cache.ensure(self)?;
                Products::Packed(packed, memo)
            } else {
                Products::Backend
            };
            f(self, &mut products)
        })();
        self.packs = cache;
        result
    }

    /// Checks each context and groups them by how many context pairs they bring (their
    /// last `window`): per group, each member's index and its first pair.
    pub(super) fn context_groups(
        &self,
        contexts: &[DraftContext<'_>],
        what: &'static str,
    ) -> Result<BTreeMap<usize, Vec<(usize, usize)>>> {
        let (d, v) = (self.target.d_model, self.target.vocab);
        let mut groups: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
        for (i, c) in contexts.iter().enumerate() {
            let n = c.tokens.len();
            let bad = |reason: String| ModelError::DrafterInput {
                what,
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
            groups.entry(n - from).or_default().push((i, from));
        }
        Ok(groups)
    }

    fn propose_with(
        &self,
        products: &mut Products<'_>,
        contexts: &[DraftContext<'_>],
        k: usize,
        temperature: f32,
        rng: &mut SplitMix64,
    ) -> Result<Vec<DraftChain>> {
        let (d, v) = (self.target.d_model, self.target.vocab);
        let groups = self.context_groups(contexts, "proposal")?;
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
            let mut tokens = Vec::with_capacity(batch * n);
            let mut hidden = Vec::with_capacity(batch * n * d);
            for &(i, from) in members {
                tokens.extend_from_slice(&contexts[i].tokens[from..]);
                hidden.extend_from_slice(&contexts[i].hidden[from * d..]);
            }
            let mut last = self.block_step(products, &tokens, &hidden, n, &mut caches, true)?;
            for j in 0..k {
                let logits = self.product(products, Mat::Head, &last, batch)?;
                tokens.clear();
                for (m, &(i, _)) in members.iter().enumerate() {
                    let (token, q) = draw(&logits[m * v..(m + 1) * v], temperature, rng);
                    chains[i].tokens.push(token);
                    chains[i].probs.extend_from_slice(&q);
                    tokens.push(token);
                }
                if j + 1 < k {
                    // The next pair of each sequence: its predicted hidden state and the
                    // token just drafted from it.
                    last = self.block_step(products, &tokens, &last, 1, &mut caches, false)?;
                }
            }
        }
        Ok(chains)
    }

    /// Runs `new` pairs per member (`tokens: [members·new]`, `hidden: [members·new, d]`)
    /// through `fc` and the block, attending over each member's cache (extended by these
    /// pairs); returns the block output at each member's last pair, `[members, d]`.
    ///
    /// Rows are independent but for attention, so the pairs before a member's last one
    /// need only their key and value (taken from the memo when `remember` and known, and
    /// remembered when computed); the query, the attention and the rest of the block run
    /// on the last pair alone.
    ///
    /// The block is the target's family: q/k/v biases, grouped-query heads (the caches hold
    /// `kv_heads` heads), a gated MLP, and with rotary positions each new pair's key (and
    /// the last one's query) rotated at its place in the member's cache, the first
    /// context pair at 0, as the training forward places a window's pairs. The memo keeps
    /// keys before the rotation, so a remembered pair serves any position.
    pub(super) fn block_step(
        &self,
        products: &mut Products<'_>,
        tokens: &[u32],
        hidden: &[f32],
        new: usize,
        caches: &mut [(Vec<f32>, Vec<f32>)],
        remember: bool,
    ) -> Result<Vec<f32>> {
        let (d, kvd) = (self.target.d_model, self.target.kv_dim());
        let heads = Heads {
            q: self.target.heads,
            kv: self.target.kv_heads(),
        };
        let (members, rows) = (caches.len(), caches.len() * new);
        let pair = |i: usize| &hidden[i * d..(i + 1) * d];
        let is_last = |i: usize| i % new == new - 1;
        let mut kv = vec![0.0f32; rows * 2 * kvd];
        let mut todo = Vec::with_capacity(rows);
        for i in 0..rows {
            let known = match products {
                Products::Packed(_, memo) if remember && !is_last(i) => {
                    memo.get(tokens[i], pair(i))
                }
                _ => None,
            };
            match known {
                Some(row) => kv[i * 2 * kvd..(i + 1) * 2 * kvd].copy_from_slice(row),
                None => todo.push(i),
            }
        }
        // fc's input rows: each pair's frozen embedding, then its hidden state.
        let ids: Vec<u32> = todo.iter().map(|&i| tokens[i]).collect();
        let embedded = self.embed_rows(&ids)?;
        let mut x = Vec::with_capacity(todo.len() * 2 * d);
        for (&i, e) in todo.iter().zip(embedded.chunks_exact(d)) {
            x.extend_from_slice(e);
            x.extend_from_slice(pair(i));
        }
        let blk = &self.block;
        let z = self.product(products, Mat::Fc, &x, todo.len())?;
        let a = self.norm(&z, &blk.norm1.weight.value, todo.len())?;
        let mut computed = self.product(products, Mat::Kv, &a, todo.len())?;
        if let Some([_, bk, bv]) = &blk.attn.bias {
            let b = [self.be.to_host(&bk.value)?, self.be.to_host(&bv.value)?].concat();
            for row in computed.chunks_exact_mut(2 * kvd) {
                row.iter_mut().zip(&b).for_each(|(x, &b)| *x += b);
            }
        }
        let (mut z_last, mut a_last) = (Vec::with_capacity(members * d), Vec::new());
        for (t, &i) in todo.iter().enumerate() {
            let row = &computed[t * 2 * kvd..(t + 1) * 2 * kvd];
            kv[i * 2 * kvd..(i + 1) * 2 * kvd].copy_from_slice(row);
            if let (true, Products::Packed(_, memo)) = (remember, &mut *products) {
                memo.insert(tokens[i], pair(i), row);
            }
            if is_last(i) {
                z_last.extend_from_slice(&z[t * d..(t + 1) * d]);
                a_last.extend_from_slice(&a[t * d..(t + 1) * d]);
            }
        }
        let mut q = self.product(products, Mat::Q, &a_last, members)?;
        if let Some([bq, _, _]) = &blk.attn.bias {
            let b = self.be.to_host(&bq.value)?;
            for row in q.chunks_exact_mut(d) {
                row.iter_mut().zip(&b).for_each(|(x, &b)| *x += b);
            }
        }
        let rope = self.rope();
        let hd = self.target.head_dim();
        let mut rotated = vec![0.0f32; d];
        let mut o = vec![0.0f32; members * d];
        let mut scores = Vec::new();
        for (b, (kc, vc)) in caches.iter_mut().enumerate() {
            for row in kv[b * new * 2 * kvd..(b + 1) * new * 2 * kvd].chunks_exact(2 * kvd) {
                let (k, v) = row.split_at(kvd);
                match &rope {
                    Some(freq) => {
                        let pos = [(kc.len() / kvd) as u32];
                        kernels::rope(k, &mut rotated[..kvd], &pos, hd, freq, false);
                        kc.extend_from_slice(&rotated[..kvd]);
                    }
                    None => kc.extend_from_slice(k),
                }
                vc.extend_from_slice(v);
            }
            let qb = &mut q[b * d..(b + 1) * d];
            if let Some(freq) = &rope {
                // The last pair's query, at the position of its own key.
                let pos = [(kc.len() / kvd - 1) as u32];
                kernels::rope(qb, &mut rotated, &pos, hd, freq, false);
                qb.copy_from_slice(&rotated);
            }
            let out = &mut o[b * d..(b + 1) * d];
            attend(qb, kc, vc, kc.len() / kvd, heads, &mut scores, out);
        }
        let y = self.product(products, Mat::O, &o, members)?;
        let h: Vec<f32> = z_last.iter().zip(&y).map(|(a, b)| a + b).collect();
        let c = self.norm(&h, &blk.norm2.weight.value, members)?;
        let u = self.product(products, Mat::W1, &c, members)?;
        let mut g = self.activate(&u)?;
        if blk.mlp.w3.is_some() {
            // SwiGLU: silu(c·W1) ∘ (c·W3), the training MLP's order.
            let up = self.product(products, Mat::W3, &c, members)?;
            g.iter_mut().zip(&up).for_each(|(g, &u)| *g *= u);
        }
        let m = self.product(products, Mat::W2, &g, members)?;
        Ok(h.iter().zip(&m).map(|(a, b)| a + b).collect())
    }

    /// `x·W` for `x: [rows, din]` on the host, `W` being matrix `which`.
    pub(super) fn product(
        &self,
        products: &Products<'_>,
        which: Mat,
        x: &[f32],
        rows: usize,
    ) -> Result<Vec<f32>> {
        let (d, v, hidden) = (
            self.target.d_model,
            self.target.vocab,
            self.target.mlp_hidden(),
        );
        if rows == 0 {
            return Ok(Vec::new());
        }
        if let Products::Packed(p, _) = products {
            let w = match which {
                Mat::Fc => &p.fc,
                Mat::Q => &p.wq,
                Mat::Kv => &p.wkv,
                Mat::O => &p.wo,
                Mat::W1 => &p.w1,
                Mat::W2 => &p.w2,
                Mat::W3 => p.w3.as_ref().ok_or_else(no_w3)?,
                Mat::Head => &p.head,
            };
            let y = rowmul(x, w, rows);
            return Ok(match (which, &self.draft) {
                (Mat::Head, Some(draft)) => self.scatter_draft(&draft.ids, &y, rows),
                _ => y,
            });
        }
        let be = &self.be;
        let dt = be.storage_dtype();
        let xb = be.from_host(x, dt)?;
        let mm_as = |w: &B::Buf, g: Gemm| -> Result<Vec<f32>> {
            let mut y = be.zeros(rows * g.n, dt)?;
            be.matmul(&xb, w, &mut y, g)?;
            Ok(be.to_host(&y)?)
        };
        let mm = |w: &B::Buf, din: usize, dout: usize| mm_as(w, Gemm::nn(rows, din, dout));
        let (blk, attn) = (&self.block, &self.block.attn);
        let kvd = self.target.kv_dim();
        match which {
            Mat::Fc => mm(&self.fc.w.value, 2 * d, d),
            Mat::Q => mm(&attn.wq.value, d, d),
            Mat::Kv => {
                let (k, v) = (mm(&attn.wk.value, d, kvd)?, mm(&attn.wv.value, d, kvd)?);
                Ok(side_by_side(&[&k, &v], rows, kvd))
            }
            Mat::O => mm(&attn.wo.value, d, d),
            Mat::W1 => mm(&blk.mlp.w1.value, d, hidden),
            Mat::W2 => mm(&blk.mlp.w2.value, hidden, d),
            Mat::W3 => mm(&blk.mlp.w3.as_ref().ok_or_else(no_w3)?.value, d, hidden),
            Mat::Head => match &self.draft {
                Some(draft) => {
                    let y = mm(&draft.head, d, draft.ids.len())?;
                    Ok(self.scatter_draft(&draft.ids, &y, rows))
                }
                None => mm_as(&self.frozen.head, self.frozen.by_head(Gemm::nn(rows, d, v))),
            },
        }
    }

    /// The block's RoPE frequencies, when the target's positions are rotary.
    fn rope(&self) -> Option<Vec<f32>> {
        (self.target.positions == Positions::Rope).then(|| self.target.rope_inv_freq())
    }

    /// RMSNorm of `x: [rows, d]` with gain `w`, through the backend (the training kernel).
    fn norm(&self, x: &[f32], w: &B::Buf, rows: usize) -> Result<Vec<f32>> {
        let be = &self.be;
        let (d, eps) = (self.target.d_model, self.target.norm_eps);
        if rows == 0 {
            return Ok(Vec::new());
        }
        let mut y = be.zeros(rows * d, be.storage_dtype())?;
        let mut rstd = be.zeros(rows, DType::F32)?;
        be.rmsnorm_fwd(
            &be.from_host(x, be.storage_dtype())?,
            w,
            &mut y,
            &mut rstd,
            rows,
            d,
            eps,
        )?;
        Ok(be.to_host(&y)?)
    }

    /// The MLP's activation of `x`, through the backend (the training kernel).
    fn activate(&self, x: &[f32]) -> Result<Vec<f32>> {
        let be = &self.be;
        let mut y = be.zeros(x.len(), be.storage_dtype())?;
        be.activation_fwd(
            self.target.activation,
            &be.from_host(x, be.storage_dtype())?,
            &mut y,
        )?;
        Ok(be.to_host(&y)?)
    }
}

/// The error of a product by `W3` in a drafter whose MLP is not gated.
fn no_w3() -> ModelError {
    ModelError::DrafterInput {
        what: "proposal",
        reason: "the drafter's MLP has no up projection (w3): it is not gated".into(),
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
