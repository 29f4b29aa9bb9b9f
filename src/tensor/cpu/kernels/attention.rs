//! Causal attention on the CPU, one (sequence, head) pair per task: the probabilities
//! `softmax(Q·Kᵀ/√dh)` and the output in the forward, the three input gradients in the
//! backward. Each pair's `[seq, seq]` block of probabilities is widened from bf16 only
//! while its task works on it (`CpuBuf::blocks`).

use gemm::Parallelism;
use rayon::prelude::*;

use super::softmax_in_place;
use crate::tensor::AttnShape;
use crate::tensor::cpu::buf::{Block, BlockMut, View, gemm_strided};

/// Inside a pair of a parallel loop each product stays on its thread.
const NO_PAR: Parallelism = Parallelism::None;

/// Offset of head `h` of sequence `b` in a `[batch, seq, heads, head_dim]` tensor; from
/// there the head is a `[seq, head_dim]` matrix with row stride `heads·head_dim`.
fn head_offset(s: &AttnShape, b: usize, h: usize) -> usize {
    (b * s.seq * s.heads + h) * s.head_dim
}

/// Runs `f` for each (batch, head) pair with that pair's `[seq, seq]` block of `probs`
/// (in parallel when `par`), and returns the per-pair results in pair order.
fn per_pair<P: Send, T: Send>(
    par: bool,
    blocks: Vec<P>,
    f: impl Fn(usize, P) -> T + Sync,
) -> Vec<T> {
    if par {
        blocks
            .into_par_iter()
            .enumerate()
            .map_init(crate::tensor::cpu::upper::clear, |(), (i, p)| f(i, p))
            .collect()
    } else {
        blocks
            .into_iter()
            .enumerate()
            .map(|(i, p)| f(i, p))
            .collect()
    }
}

/// Copies a contiguous `[seq, head_dim]` result into head `h` of sequence `b`.
fn scatter_head(s: &AttnShape, b: usize, h: usize, src: &[f32], dst: &mut [f32]) {
    let (dh, d) = (s.head_dim, s.heads * s.head_dim);
    let off = head_offset(s, b, h);
    for (i, row) in src.chunks(dh).enumerate() {
        dst[off + i * d..][..dh].copy_from_slice(row);
    }
}

pub(in crate::tensor::cpu) fn attention_fwd(
    par: bool,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    probs: Vec<BlockMut<'_>>,
    s: AttnShape,
) {
    let outs = per_pair(par, probs, |bh, p| {
        p.write(|p| attention_fwd_pair(q, k, v, p, &s, bh))
    });
    for (bh, o) in outs.iter().enumerate() {
        scatter_head(&s, bh / s.heads, bh % s.heads, o, out);
    }
}

/// [`attention_fwd`] of pair `bh` (sequence `bh / heads`, head `bh % heads`): its
/// probabilities into `p` (`[seq, seq]`), its output returned (`[seq, head_dim]`).
fn attention_fwd_pair(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    p: &mut [f32],
    s: &AttnShape,
    bh: usize,
) -> Vec<f32> {
    let (t, dh) = (s.seq, s.head_dim);
    let scale = 1.0 / (dh as f32).sqrt();
    let head = View::rows(s.heads * dh); // one head's [seq, head_dim] inside a row of d
    let head_t = View::transposed(s.heads * dh);
    let off = head_offset(s, bh / s.heads, bh % s.heads);
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

#[allow(clippy::too_many_arguments)]
pub(in crate::tensor::cpu) fn attention_bwd(
    par: bool,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: Vec<Block<'_>>,
    d_out: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    s: AttnShape,
) {
    let (t, dh) = (s.seq, s.head_dim);
    let scale = 1.0 / (dh as f32).sqrt();
    let head = View::rows(s.heads * dh);
    let head_t = View::transposed(s.heads * dh);
    let (sq, sq_t, local) = (View::rows(t), View::transposed(t), View::rows(dh));
    let grads = per_pair(par, probs, |bh, p| {
        let wide = p.read();
        let p: &[f32] = &wide;
        let off = head_offset(&s, bh / s.heads, bh % s.heads);
        let d_o = &d_out[off..];
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
    });
    for (bh, [gq, gk, gv]) in grads.iter().enumerate() {
        let (b, h) = (bh / s.heads, bh % s.heads);
        scatter_head(&s, b, h, gq, dq);
        scatter_head(&s, b, h, gk, dk);
        scatter_head(&s, b, h, gv, dv);
    }
}
