//! [`ChainAttention`]: the attention of an unrolled slice with each query's exact proposal
//! context, on the host (forward and backward).
//!
//! Why its own: the backends' attention is causal over one sequence, while a query of an
//! unrolled step attends across steps. Step `s` (0-based; step 0 is the one-step slice) of a
//! slice is the batch [`super::unroll::Unroller`] rewrote `s` times: its pair at position `t`
//! is the `s`-th prediction of a chain that a proposal starts from the real pair `r = t − s`.
//! That proposal attends to the real pairs `0..=r` and to its own chain's pairs, which are
//! the pairs at `(step j, position r + j)` for `j = 1..=s` (see [`chain_keys`]); so does the
//! query here. The drafter is one block and a slice a few short rows, so a plain host loop
//! costs little next to the block's products, and every step's keys and values stay
//! resident until the slice's backward, which runs the steps last to first (a chain step's
//! keys get gradients from its own queries and from every later step's).
//!
//! The real pairs' keys and values (step 0's) take gradients from step 0's queries only: to
//! a later step they are constants, as its fed-back features are. With the whole gradient
//! the later steps' losses pulled them away from what the first draft needs, and on the
//! rollout bench's `d_model` 512 target (100 steps; `cargo bench --bench chain`, 3000
//! slices, `unroll = 2`) the first draft collapsed: acceptance length at K=4 1.96, first
//! draft 0.37, against 4.04 and 0.86 with the gradient stopped (held-out rows 2.14 → 4.04;
//! `unroll_decay = 0.5` with the whole gradient: 3.92); on the `d_model` 256 SFT target
//! 2.20 → 2.37 (held-out 1.97 → 2.24).

use std::ops::Range;
use std::rc::Rc;

/// A query of [`ChainAttention::queries`].
type Query = (usize, usize, Range<usize>, Rc<[(usize, usize)]>);

/// The keys query `(step, t)` attends to, as `(step, position)`: the real pairs up to the
/// chain's start `t − step`, then the chain's pairs, one per step `1..=step` (the last is
/// the query's own pair). Positions before 0 do not exist (a chain that would start before
/// the row: such a query is never counted, but attends to what there is).
pub(super) fn chain_keys(step: usize, t: usize) -> impl Iterator<Item = (usize, usize)> {
    let real = (t + 1).saturating_sub(step);
    let first_chain = step.saturating_sub(t).max(1);
    (0..real)
        .map(|p| (0, p))
        .chain((first_chain..=step).map(move |j| (j, t + j - step)))
}

/// Multi-head attention over the steps of one unrolled slice (see the module docs): rows of
/// `[batch · seq, heads · head_dim]`, per step.
pub(super) struct ChainAttention {
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    q: Vec<Vec<f32>>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Per step, per (row, head), the weights over [`chain_keys`] in their order.
    probs: Vec<Vec<Vec<f32>>>,
    dk: Vec<Vec<f32>>,
    dv: Vec<Vec<f32>>,
}

impl ChainAttention {
    pub(super) fn new(batch: usize, seq: usize, heads: usize, head_dim: usize) -> Self {
        ChainAttention {
            batch,
            seq,
            heads,
            head_dim,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            probs: Vec::new(),
            dk: Vec::new(),
            dv: Vec::new(),
        }
    }

    /// Steps run so far.
    pub(super) fn steps(&self) -> usize {
        self.q.len()
    }

    fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Step `s`'s queries as `(row, head, the head's columns, keys)`, the keys those of
    /// [`chain_keys`] as `(step, row)` (shared by a row's heads); by row then head, the order
    /// of `probs`. It borrows nothing of `self`, so the backward can add into the key and
    /// value gradients as it walks.
    fn queries(&self, s: usize) -> impl Iterator<Item = Query> + use<> {
        let (batch, seq, heads, hd) = (self.batch, self.seq, self.heads, self.head_dim);
        (0..batch * seq).flat_map(move |row| {
            let (b, t) = (row / seq, row % seq);
            let keys: Rc<[_]> = chain_keys(s, t).map(|(j, p)| (j, b * seq + p)).collect();
            (0..heads).map(move |h| (row, h, h * hd..(h + 1) * hd, keys.clone()))
        })
    }

    /// The next step's attention output `[rows, width]` for its `q, k, v` (each
    /// `[rows, width]`), which are kept for the later steps and the backward.
    pub(super) fn forward(&mut self, q: Vec<f32>, k: Vec<f32>, v: Vec<f32>) -> Vec<f32> {
        let (w, hd, s) = (self.width(), self.head_dim, self.steps());
        let rows = self.batch * self.seq;
        debug_assert!(q.len() == rows * w && k.len() == q.len() && v.len() == q.len());
        self.q.push(q);
        self.k.push(k);
        self.v.push(v);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0.0; rows * w];
        let mut probs = Vec::with_capacity(rows * self.heads);
        for (row, _, cols, keys) in self.queries(s) {
            let qv = &self.q[s][row * w..][cols.clone()];
            let mut p: Vec<f32> = keys
                .iter()
                .map(|&(j, r)| scale * dot(qv, &self.k[j][r * w..][cols.clone()]))
                .collect();
            softmax(&mut p);
            let o = &mut out[row * w..][cols.clone()];
            for (&pk, &(j, r)) in p.iter().zip(keys.iter()) {
                let vv = &self.v[j][r * w..][cols.clone()];
                o.iter_mut().zip(vv).for_each(|(o, &x)| *o += pk * x);
            }
            probs.push(p);
        }
        self.probs.push(probs);
        self.dk.push(vec![0.0; rows * w]);
        self.dv.push(vec![0.0; rows * w]);
        out
    }

    /// The gradient w.r.t. step `s`'s queries of its output's gradient `d_out`; adds its
    /// share of the gradients of the keys and values it attended to, those of the chain's
    /// steps `1..=s` (the real pairs' of step 0 are constants to a later step, see the
    /// module docs). Run the steps last to first, so that [`ChainAttention::kv_grads`] of
    /// step `s` is complete.
    pub(super) fn backward(&mut self, s: usize, d_out: &[f32]) -> Vec<f32> {
        let (w, hd) = (self.width(), self.head_dim);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut dq = vec![0.0; self.batch * self.seq * w];
        for (row, h, cols, keys) in self.queries(s) {
            let p = &self.probs[s][row * self.heads + h];
            let g = &d_out[row * w..][cols.clone()];
            let dp: Vec<f32> = keys
                .iter()
                .map(|&(j, r)| dot(g, &self.v[j][r * w..][cols.clone()]))
                .collect();
            let mean: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
            let qv = &self.q[s][row * w..][cols.clone()];
            let dqv = &mut dq[row * w..][cols.clone()];
            for ((&pk, &dpk), &(j, r)) in p.iter().zip(&dp).zip(keys.iter()) {
                let at = r * w + h * hd;
                let ds = pk * (dpk - mean) * scale;
                let kv = &self.k[j][at..at + hd];
                dqv.iter_mut().zip(kv).for_each(|(d, &x)| *d += ds * x);
                // The real pairs' keys and values learn from step 0's queries only: a
                // later step's loss pulling on them collapsed the first draft at d512
                // (see the module docs).
                if j == 0 && s > 0 {
                    continue;
                }
                let dk = &mut self.dk[j][at..at + hd];
                dk.iter_mut().zip(qv).for_each(|(d, &x)| *d += ds * x);
                let dv = &mut self.dv[j][at..at + hd];
                dv.iter_mut().zip(g).for_each(|(d, &x)| *d += pk * x);
            }
        }
        dq
    }

    /// The gradients of step `s`'s keys and values, taken (complete once the backward of
    /// every step from `s` on has run).
    pub(super) fn kv_grads(&mut self, s: usize) -> (Vec<f32>, Vec<f32>) {
        (
            std::mem::take(&mut self.dk[s]),
            std::mem::take(&mut self.dv[s]),
        )
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::SplitMix64;

    #[test]
    fn each_query_sees_the_real_pairs_before_its_chain_and_its_chain() {
        let keys = |s, t| chain_keys(s, t).collect::<Vec<_>>();
        // Step 0 is causal.
        assert_eq!(keys(0, 2), [(0, 0), (0, 1), (0, 2)]);
        // Step 1 at 3: the chain starts at real pair 2; its one prediction is itself.
        assert_eq!(keys(1, 3), [(0, 0), (0, 1), (0, 2), (1, 3)]);
        // Step 2 at 3: real 0..=1, then step 1 at 2 and itself; not step 1 at 3, nor step 2 at 2.
        assert_eq!(keys(2, 3), [(0, 0), (0, 1), (1, 2), (2, 3)]);
        // A chain that would start before the row: what exists of it.
        assert_eq!(keys(2, 0), [(2, 0)]);
        assert_eq!(keys(3, 1), [(2, 0), (3, 1)]);
    }

    /// `Σ c·out` over every step, for the finite differences.
    fn objective(qkv: &[Vec<f32>], c: &[Vec<f32>], shape: (usize, usize, usize, usize)) -> f64 {
        let (batch, seq, heads, hd) = shape;
        let mut a = ChainAttention::new(batch, seq, heads, hd);
        let mut total = 0.0;
        for (s, cs) in c.iter().enumerate() {
            let o = a.forward(
                qkv[3 * s].clone(),
                qkv[3 * s + 1].clone(),
                qkv[3 * s + 2].clone(),
            );
            total += o
                .iter()
                .zip(cs)
                .map(|(&x, &y)| f64::from(x) * f64::from(y))
                .sum::<f64>();
        }
        total
    }

    #[test]
    fn gradients_match_finite_differences() {
        let shape @ (batch, seq, heads, hd) = (2, 4, 2, 3);
        let (steps, n) = (3, batch * seq * heads * hd);
        let mut rng = SplitMix64::new(7);
        let mut rand =
            |n| -> Vec<f32> { (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect() };
        let qkv: Vec<Vec<f32>> = (0..3 * steps).map(|_| rand(n)).collect();
        let c: Vec<Vec<f32>> = (0..steps).map(|_| rand(n)).collect();
        let mut a = ChainAttention::new(batch, seq, heads, hd);
        for s in 0..steps {
            a.forward(
                qkv[3 * s].clone(),
                qkv[3 * s + 1].clone(),
                qkv[3 * s + 2].clone(),
            );
        }
        // Analytic: steps last to first, as the slice's backward runs them.
        let mut grads = vec![Vec::new(); 3 * steps];
        for s in (0..steps).rev() {
            grads[3 * s] = a.backward(s, &c[s]);
            let (dk, dv) = a.kv_grads(s);
            grads[3 * s + 1] = dk;
            grads[3 * s + 2] = dv;
        }
        let eps = 1e-2;
        let mut worst = 0.0f64;
        // The real pairs' keys and values (step 0's) are constants to the later steps: their
        // gradient is that of step 0's term alone.
        let mut step0 = c.clone();
        step0[1..].iter_mut().for_each(|cs| cs.fill(0.0));
        for (i, g) in grads.iter().enumerate() {
            let c = if i == 1 || i == 2 { &step0 } else { &c };
            for e in 0..n {
                let mut plus = qkv.clone();
                plus[i][e] += eps;
                let mut minus = qkv.clone();
                minus[i][e] -= eps;
                let fd = (objective(&plus, c, shape) - objective(&minus, c, shape))
                    / (2.0 * f64::from(eps));
                let err = (fd - f64::from(g[e])).abs() / (1.0 + fd.abs());
                worst = worst.max(err);
            }
        }
        assert!(worst < 2e-3, "worst relative error {worst}");
        // Keys of a later step's own pair get gradients only from that step on: the last
        // step's keys and values are seen by its own queries only, and every key is seen.
        assert!(grads.iter().all(|g| g.iter().any(|&x| x != 0.0)));
    }

    #[test]
    fn step_zero_is_causal_attention() {
        use crate::tensor::{AttnShape, Backend, CpuBackend, DType};
        let (batch, seq, heads, hd) = (2, 5, 2, 4);
        let n = batch * seq * heads * hd;
        let mut rng = SplitMix64::new(3);
        let mut rand = |n| -> Vec<f32> { (0..n).map(|_| rng.next_f64() as f32 - 0.5).collect() };
        let (q, k, v) = (rand(n), rand(n), rand(n));
        let mut a = ChainAttention::new(batch, seq, heads, hd);
        let ours = a.forward(q.clone(), k.clone(), v.clone());
        let be = CpuBackend::new(1).unwrap();
        let buf = |x: &[f32]| be.from_host(x, DType::F32).unwrap();
        let shape = AttnShape {
            batch,
            seq,
            heads,
            head_dim: hd,
        };
        let mut out = be.zeros(n, DType::F32).unwrap();
        let mut probs = be.zeros(shape.probs_len(), DType::F32).unwrap();
        be.attention_fwd(&buf(&q), &buf(&k), &buf(&v), &mut out, &mut probs, shape)
            .unwrap();
        for (x, y) in ours.iter().zip(be.to_host(&out).unwrap()) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }
}
