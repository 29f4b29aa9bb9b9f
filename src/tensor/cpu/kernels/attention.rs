//! Causal attention on the CPU, one sequence at a time and within it one head per task: the
//! probabilities `softmax(Q·Kᵀ/√dh)` and the output in the forward, the three input
//! gradients in the backward. A bf16 operand is widened only while it is worked on: a
//! sequence's `q`, `k`, `v` and output (`[seq, d]` each) while its heads run, a head's
//! `[seq, seq]` block of probabilities while its task does (`CpuBuf::blocks`). Sequences go
//! one after another so that a layer's transient is one sequence's, whatever the threads
//! (the memory estimate counts it so); the heads give the threads their tasks.

use gemm::Parallelism;
use rayon::prelude::*;

use super::softmax_in_place;
use crate::tensor::AttnShape;
use crate::tensor::cpu::buf::{Block, BlockMut, View, gemm_strided};

/// Inside a task of a parallel loop each product stays on its thread.
const NO_PAR: Parallelism = Parallelism::None;

/// Runs `f` on each of a sequence's heads (in parallel when `par`) and returns the results
/// in head order.
fn each<P: Send, T: Send>(par: bool, items: Vec<P>, f: impl Fn(usize, P) -> T + Sync) -> Vec<T> {
    if par {
        items
            .into_par_iter()
            .enumerate()
            .map_init(crate::tensor::cpu::upper::clear, |(), (i, p)| f(i, p))
            .collect()
    } else {
        items
            .into_iter()
            .enumerate()
            .map(|(i, p)| f(i, p))
            .collect()
    }
}

/// One sequence's operands at a time: its rows of `q`, `k`, `v` and its heads' blocks of
/// probabilities, in sequence order.
fn per_sequence<'a, P>(
    s: &AttnShape,
    [q, k, v]: [Vec<Block<'a>>; 3],
    probs: Vec<P>,
) -> impl Iterator<Item = ([Block<'a>; 3], Vec<P>)> {
    let (heads, mut probs) = (s.heads, probs.into_iter());
    q.into_iter()
        .zip(k)
        .zip(v)
        .map(move |((q, k), v)| ([q, k, v], probs.by_ref().take(heads).collect()))
}

/// Copies a contiguous `[seq, head_dim]` result into head `h` of a sequence's `[seq, d]`
/// rows.
fn scatter_head(s: &AttnShape, h: usize, src: &[f32], dst: &mut [f32]) {
    let (dh, d) = (s.head_dim, s.heads * s.head_dim);
    for (i, row) in src.chunks(dh).enumerate() {
        dst[h * dh + i * d..][..dh].copy_from_slice(row);
    }
}

/// Forward of a micro-batch: `q`, `k`, `v` and `out` in blocks of one sequence (`[seq,
/// d]`), `probs` in blocks of one (sequence, head) pair (`[seq, seq]`).
pub(in crate::tensor::cpu) fn attention_fwd(
    par: bool,
    qkv: [Vec<Block<'_>>; 3],
    out: Vec<BlockMut<'_>>,
    probs: Vec<BlockMut<'_>>,
    s: AttnShape,
) {
    for (([q, k, v], probs), out) in per_sequence(&s, qkv, probs).zip(out) {
        let (q, k, v) = (q.read(), k.read(), v.read());
        let heads = each(par, probs, |h, p| {
            p.write(|p| attention_fwd_head(&q, &k, &v, p, &s, h))
        });
        out.write(|o| {
            for (h, oh) in heads.iter().enumerate() {
                scatter_head(&s, h, oh, o);
            }
        });
    }
}

/// [`attention_fwd`] of head `h` of one sequence (`q`, `k`, `v` its `[seq, d]` rows): its
/// probabilities into `p` (`[seq, seq]`), its output returned (`[seq, head_dim]`).
fn attention_fwd_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    p: &mut [f32],
    s: &AttnShape,
    h: usize,
) -> Vec<f32> {
    let (t, dh) = (s.seq, s.head_dim);
    let scale = 1.0 / (dh as f32).sqrt();
    let head = View::rows(s.heads * dh); // one head's [seq, head_dim] inside a row of d
    let head_t = View::transposed(s.heads * dh);
    let off = h * dh;
    // P = softmax(Q·Kᵀ/√dh) row by row, over the causal prefix only.
    let sq = View::rows(t);
    gemm_strided(
        (t, dh, t),
        p,
        sq,
        &q[off..],
        head,
        &k[off..],
        head_t,
        scale,
        false,
        NO_PAR,
    );
    for (i, row) in p.chunks_mut(t).enumerate() {
        softmax_in_place(&mut row[..=i]);
        row[i + 1..].fill(0.0);
    }
    let mut o = vec![0.0f32; t * dh];
    gemm_strided(
        (t, t, dh),
        &mut o,
        View::rows(dh),
        p,
        sq,
        &v[off..],
        head,
        1.0,
        false,
        NO_PAR,
    );
    o
}

/// Backward of a micro-batch, its operands in the blocks of [`attention_fwd`] (`d_out`,
/// `dq`, `dk` and `dv` by sequence too).
pub(in crate::tensor::cpu) fn attention_bwd(
    par: bool,
    qkv: [Vec<Block<'_>>; 3],
    probs: Vec<Block<'_>>,
    d_out: Vec<Block<'_>>,
    [dq, dk, dv]: [Vec<BlockMut<'_>>; 3],
    s: AttnShape,
) {
    let grads = dq.into_iter().zip(dk).zip(dv).map(|((q, k), v)| [q, k, v]);
    let seqs = per_sequence(&s, qkv, probs).zip(d_out).zip(grads);
    for ((([q, k, v], probs), d_out), [dq, dk, dv]) in seqs {
        let (q, k, v, d_o) = (q.read(), k.read(), v.read(), d_out.read());
        let heads = each(par, probs, |h, p| {
            attention_bwd_head(&q, &k, &v, &p.read(), &d_o, &s, h)
        });
        for (i, g) in [dq, dk, dv].into_iter().enumerate() {
            g.write(|g| {
                for (h, grads) in heads.iter().enumerate() {
                    scatter_head(&s, h, &grads[i], g);
                }
            });
        }
    }
}

/// [`attention_bwd`] of head `h` of one sequence (`q`, `k`, `v` and `d_o` its `[seq, d]`
/// rows, `p` the head's probabilities): its `[dq, dk, dv]`, `[seq, head_dim]` each.
fn attention_bwd_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    p: &[f32],
    d_o: &[f32],
    s: &AttnShape,
    h: usize,
) -> [Vec<f32>; 3] {
    let (t, dh) = (s.seq, s.head_dim);
    let scale = 1.0 / (dh as f32).sqrt();
    let head = View::rows(s.heads * dh);
    let head_t = View::transposed(s.heads * dh);
    let (sq, sq_t, local) = (View::rows(t), View::transposed(t), View::rows(dh));
    let off = h * dh;
    let d_o = &d_o[off..];
    // dV = Pᵀ·dO
    let mut gv = vec![0.0f32; t * dh];
    gemm_strided(
        (t, t, dh),
        &mut gv,
        local,
        p,
        sq_t,
        d_o,
        head,
        1.0,
        false,
        NO_PAR,
    );
    // dP = dO·Vᵀ, then dS = P∘(dP − rowsum(dP∘P))/√dh (zero above the diagonal, as P).
    let mut ds = vec![0.0f32; t * t];
    gemm_strided(
        (t, dh, t),
        &mut ds,
        sq,
        d_o,
        head,
        &v[off..],
        head_t,
        1.0,
        false,
        NO_PAR,
    );
    for (i, (dr, pr)) in ds.chunks_mut(t).zip(p.chunks(t)).enumerate() {
        let dot: f32 = dr[..=i].iter().zip(&pr[..=i]).map(|(a, b)| a * b).sum();
        dr.iter_mut()
            .zip(pr)
            .for_each(|(d, &p)| *d = p * (*d - dot) * scale);
    }
    // dQ = dS·K, dK = dSᵀ·Q
    let mut gq = vec![0.0f32; t * dh];
    gemm_strided(
        (t, t, dh),
        &mut gq,
        local,
        &ds,
        sq,
        &k[off..],
        head,
        1.0,
        false,
        NO_PAR,
    );
    let mut gk = vec![0.0f32; t * dh];
    gemm_strided(
        (t, t, dh),
        &mut gk,
        local,
        &ds,
        sq_t,
        &q[off..],
        head,
        1.0,
        false,
        NO_PAR,
    );
    [gq, gk, gv]
}
