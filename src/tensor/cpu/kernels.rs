//! The CPU kernels, on plain `f32` slices: one function per backend operation that is not a
//! matrix product. Shapes are checked by the caller ([`super::CpuBackend`]); these functions
//! only compute, so they are also the readable definition of each operation.
//!
//! Row-independent kernels take a `par` flag: when set they split rows over the current rayon
//! pool (the backend installs its own pool first), otherwise they stay on the caller's thread.
//! The attention kernels live in [`attention`].

use rayon::prelude::*;

use crate::tensor::{Activation, AdamWStep, IGNORE_TARGET};

mod attention;
pub(super) use attention::{attention_bwd, attention_fwd};

/// Runs `f(row_index, row)` over the `width`-wide rows of `data`, in parallel when `par`.
fn for_rows(par: bool, data: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    if width == 0 {
        return;
    }
    // Below ~32k elements a rayon split costs more than it saves.
    if par && data.len() >= 1 << 15 {
        // A pool thread may come from one of faer's products: each task clears (upper.rs).
        data.par_chunks_mut(width)
            .enumerate()
            .for_each_init(super::upper::clear, |(), (r, row)| f(r, row));
    } else {
        data.chunks_mut(width)
            .enumerate()
            .for_each(|(r, row)| f(r, row));
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

/// `tanh` as a rational function (the odd 13/6 minimax fit used by Eigen's
/// `generic_fast_tanh_float`), within a few ulp of `f32::tanh` and much faster than libm
/// because it inlines and vectorises; GELU calls it once per MLP hidden unit.
#[inline]
fn fast_tanh(x: f32) -> f32 {
    const CLAMP: f32 = 7.905_311;
    const A: [f32; 7] = [
        4.893_524_6e-3,
        6.372_619_3e-4,
        1.485_722_4e-5,
        5.122_297e-8,
        -8.604_672e-11,
        2.000_188e-13,
        -2.760_768_5e-16,
    ];
    const B: [f32; 4] = [4.893_525e-3, 2.268_434_6e-3, 1.185_347_1e-4, 1.198_258_4e-6];
    let x = x.clamp(-CLAMP, CLAMP);
    let x2 = x * x;
    // Plain multiply-adds: `mul_add` is a libm call without a target FMA feature.
    let p = ((A[6] * x2 + A[5]) * x2 + A[4]) * x2 + A[3];
    let p = (((p * x2 + A[2]) * x2 + A[1]) * x2 + A[0]) * x;
    let q = ((B[3] * x2 + B[2]) * x2 + B[1]) * x2 + B[0];
    p / q
}

fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + fast_tanh(SQRT_2_OVER_PI * (x + GELU_C * x * x * x)))
}

fn gelu_grad(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_C * x * x * x);
    let t = fast_tanh(u);
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn activation_fwd(act: Activation, x: &[f32], out: &mut [f32]) {
    match act {
        Activation::Gelu => out.iter_mut().zip(x).for_each(|(o, &x)| *o = gelu(x)),
        Activation::Silu | Activation::Swiglu => out
            .iter_mut()
            .zip(x)
            .for_each(|(o, &x)| *o = x * sigmoid(x)),
    }
}

pub fn activation_bwd(act: Activation, x: &[f32], dy: &[f32], dx: &mut [f32]) {
    // One loop per activation (not a function pointer) so each inlines and vectorises.
    let it = dx.iter_mut().zip(x).zip(dy);
    match act {
        Activation::Gelu => it.for_each(|((d, &x), &g)| *d = g * gelu_grad(x)),
        Activation::Silu | Activation::Swiglu => it.for_each(|((d, &x), &g)| {
            let s = sigmoid(x);
            *d = g * s * (1.0 + x * (1.0 - s));
        }),
    }
}

/// Numerically stable softmax of one row, in place.
fn softmax_in_place(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

pub fn softmax_rows(par: bool, x: &[f32], out: &mut [f32], cols: usize) {
    for_rows(par, out, cols, |r, row| {
        row.copy_from_slice(&x[r * cols..(r + 1) * cols]);
        softmax_in_place(row);
    });
}

pub fn rmsnorm_fwd(par: bool, x: &[f32], w: &[f32], out: &mut [f32], rstd: &mut [f32], eps: f32) {
    let dim = w.len();
    for (r, s) in rstd.iter_mut().enumerate() {
        let xr = &x[r * dim..(r + 1) * dim];
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        *s = 1.0 / (ms + eps).sqrt();
    }
    let rstd = &*rstd;
    for_rows(par, out, dim, |r, row| {
        let xr = &x[r * dim..(r + 1) * dim];
        for ((o, &xv), &wv) in row.iter_mut().zip(xr).zip(w) {
            *o = xv * rstd[r] * wv;
        }
    });
}

pub fn rmsnorm_bwd_input(
    par: bool,
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
) {
    let dim = w.len();
    for_rows(par, dx, dim, |r, row| {
        let xr = &x[r * dim..(r + 1) * dim];
        let dyr = &dy[r * dim..(r + 1) * dim];
        let s = rstd[r];
        // mean(g·n) with g = dy·w, n = x·rstd
        let dot = xr
            .iter()
            .zip(dyr)
            .zip(w)
            .map(|((&xv, &d), &wv)| d * wv * xv * s)
            .sum::<f32>()
            / dim as f32;
        for (((o, &xv), &d), &wv) in row.iter_mut().zip(xr).zip(dyr).zip(w) {
            *o = s * (d * wv - xv * s * dot);
        }
    });
}

pub fn rmsnorm_bwd_weight(x: &[f32], rstd: &[f32], dy: &[f32], dw: &mut [f32]) {
    let dim = dw.len();
    for (r, &s) in rstd.iter().enumerate() {
        let xr = &x[r * dim..(r + 1) * dim];
        let dyr = &dy[r * dim..(r + 1) * dim];
        for ((g, &xv), &d) in dw.iter_mut().zip(xr).zip(dyr) {
            *g += d * xv * s;
        }
    }
}

/// Returns `(Σ loss, counted rows)`; targets were checked by the caller.
pub fn cross_entropy_fwd(
    par: bool,
    logits: &[f32],
    targets: &[u32],
    probs: &mut [f32],
    vocab: usize,
) -> (f32, usize) {
    softmax_rows(par, logits, probs, vocab);
    let mut sum = 0.0f64;
    let mut count = 0;
    for (r, &t) in targets.iter().enumerate() {
        if t == IGNORE_TARGET {
            continue;
        }
        // log-softmax from the logits, for accuracy when the probability underflows.
        let row = &logits[r * vocab..(r + 1) * vocab];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln() + max;
        sum += f64::from(lse - row[t as usize]);
        count += 1;
    }
    (sum as f32, count)
}

/// [`crate::tensor::Backend::cross_entropy_grad`]: per row one pass for the maximum, one
/// for the exponentials (kept in place) and one for the scaled gradient; the rows' losses
/// are summed in `f64` in row order, so the result does not depend on `par`.
pub fn cross_entropy_grad(
    par: bool,
    logits: &mut [f32],
    targets: &[u32],
    vocab: usize,
    scale: f32,
) -> (f32, usize) {
    if vocab == 0 {
        return (0.0, targets.iter().filter(|&&t| t != IGNORE_TARGET).count());
    }
    let mut losses = vec![0.0f32; targets.len()];
    let row = |((row, loss), &t): ((&mut [f32], &mut f32), &u32)| {
        *loss = cross_entropy_grad_row(row, t, scale);
    };
    if par && logits.len() >= 1 << 15 {
        (logits.par_chunks_mut(vocab))
            .zip(losses.par_iter_mut())
            .zip(targets.par_iter())
            .for_each_init(super::upper::clear, |(), r| row(r));
    } else {
        (logits.chunks_mut(vocab))
            .zip(losses.iter_mut())
            .zip(targets)
            .for_each(row);
    }
    let counted = targets
        .iter()
        .zip(&losses)
        .filter(|&(&t, _)| t != IGNORE_TARGET);
    let (sum, count) = counted.fold((0.0f64, 0), |(s, c), (_, &l)| (s + f64::from(l), c + 1));
    (sum as f32, count)
}

/// One row of [`cross_entropy_grad`]: its loss `lse − row[t]` (0 when ignored).
fn cross_entropy_grad_row(row: &mut [f32], t: u32, scale: f32) -> f32 {
    if t == IGNORE_TARGET {
        row.fill(0.0);
        return 0.0;
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let target = row[t as usize];
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let per_prob = scale / sum;
    row.iter_mut().for_each(|v| *v *= per_prob);
    row[t as usize] -= scale;
    sum.ln() + max - target
}

pub fn cross_entropy_bwd(
    probs: &[f32],
    targets: &[u32],
    dlogits: &mut [f32],
    vocab: usize,
    scale: f32,
) {
    for (r, &t) in targets.iter().enumerate() {
        let out = &mut dlogits[r * vocab..(r + 1) * vocab];
        if t == IGNORE_TARGET {
            out.fill(0.0);
            continue;
        }
        let p = &probs[r * vocab..(r + 1) * vocab];
        out.iter_mut().zip(p).for_each(|(o, &p)| *o = scale * p);
        out[t as usize] -= scale;
    }
}

/// Elements per block of the optimizer's kernels ([`adamw`], [`sum_squares`]): the unit the
/// pool splits them by, and [`sum_squares`]' unit of summation, so that its result does not
/// depend on the number of threads.
const OPTIMIZER_BLOCK: usize = 1 << 16;

/// AdamW on `f32` slices: updates `p` (the master copy when one exists), `m` and `v`;
/// with `par`, blocks of elements on the pool's threads (each element's arithmetic is the
/// same either way).
pub fn adamw(par: bool, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], hp: &AdamWStep) {
    let t = hp.step.max(1) as i32;
    let bc1 = 1.0 - hp.beta1.powi(t);
    let bc2 = 1.0 - hp.beta2.powi(t);
    let block = |p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]| {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
            let gi = g * hp.grad_scale;
            *m = hp.beta1 * *m + (1.0 - hp.beta1) * gi;
            *v = hp.beta2 * *v + (1.0 - hp.beta2) * gi * gi;
            let mhat = *m / bc1;
            let vhat = *v / bc2;
            *p -= hp.lr * (mhat / (vhat.sqrt() + hp.eps) + hp.weight_decay * *p);
        }
    };
    if par {
        let n = OPTIMIZER_BLOCK;
        p.par_chunks_mut(n)
            .zip(g.par_chunks(n))
            .zip(m.par_chunks_mut(n))
            .zip(v.par_chunks_mut(n))
            .for_each(|(((p, g), m), v)| block(p, g, m, v));
    } else {
        block(p, g, m, v);
    }
}

/// `Σ x²` in `f64`: each block of [`OPTIMIZER_BLOCK`] values summed in eight lanes (added
/// pairwise at the end, then its tail in order), the blocks' sums added in order. It was one
/// dependent `f64` add per value, on the caller's thread while the pool waited (2.9% of a
/// SmolLM-shape reference step's samples, docs/benchmarks.md); the blocks also make the
/// result independent of `par` (blocks on the pool's threads).
pub fn sum_squares(par: bool, x: &[f32]) -> f64 {
    let block = |b: &[f32]| {
        let mut acc = [0.0f64; 8];
        let chunks = b.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += f64::from(v) * f64::from(v);
            }
        }
        let mut s =
            ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for &v in tail {
            s += f64::from(v) * f64::from(v);
        }
        s
    };
    if par {
        let sums: Vec<f64> = x.par_chunks(OPTIMIZER_BLOCK).map(block).collect();
        sums.into_iter().sum()
    } else {
        x.chunks(OPTIMIZER_BLOCK).map(block).sum()
    }
}

/// Rotary embedding of `x: [positions.len(), heads, head_dim]` into `out` (Llama's
/// `rotate_half` convention): for `i < head_dim/2`, with `a = positions[r]·inv_freq[i]`,
/// `out[i] = x[i]·cos a − x[i+h/2]·sin a` and `out[i+h/2] = x[i+h/2]·cos a + x[i]·sin a`.
/// `inverse` rotates by `−a`: the transpose of the rotation, i.e. its input gradient.
pub fn rope(
    x: &[f32],
    out: &mut [f32],
    positions: &[u32],
    head_dim: usize,
    inv_freq: &[f32],
    inverse: bool,
) {
    let half = head_dim / 2;
    if half == 0 {
        return;
    }
    let width = x.len() / positions.len().max(1);
    let sign = if inverse { -1.0 } else { 1.0 };
    let mut cos = vec![0.0f32; half];
    let mut sin = vec![0.0f32; half];
    for ((xr, or), &p) in x.chunks(width).zip(out.chunks_mut(width)).zip(positions) {
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
            let a = p as f32 * f;
            *c = a.cos();
            *s = sign * a.sin();
        }
        for (xh, oh) in xr.chunks(head_dim).zip(or.chunks_mut(head_dim)) {
            let (x1, x2) = xh.split_at(half);
            let (o1, o2) = oh.split_at_mut(half);
            let outs = o1.iter_mut().zip(o2.iter_mut());
            let ins = x1.iter().zip(x2).zip(cos.iter().zip(&sin));
            for ((o1, o2), ((&x1, &x2), (&c, &s))) in outs.zip(ins) {
                *o1 = x1 * c - x2 * s;
                *o2 = x2 * c + x1 * s;
            }
        }
    }
}

/// Grouped-query heads: `dst: [rows, kv_heads·rep, head_dim]` from `src: [rows, kv_heads,
/// head_dim]`, query head `h` getting key/value head `h / rep`.
pub fn repeat_kv(src: &[f32], dst: &mut [f32], kv_heads: usize, rep: usize, head_dim: usize) {
    let (sw, dw) = (kv_heads * head_dim, kv_heads * rep * head_dim);
    for (s, d) in src.chunks(sw.max(1)).zip(dst.chunks_mut(dw.max(1))) {
        for (g, sh) in s.chunks(head_dim).enumerate() {
            for r in 0..rep {
                d[(g * rep + r) * head_dim..][..head_dim].copy_from_slice(sh);
            }
        }
    }
}

/// The gradient of [`repeat_kv`]: `dst[g] = Σ_{r < rep} src[g·rep + r]`, summed in order of `r`.
pub fn repeat_kv_bwd(src: &[f32], dst: &mut [f32], kv_heads: usize, rep: usize, head_dim: usize) {
    let (sw, dw) = (kv_heads * rep * head_dim, kv_heads * head_dim);
    for (s, d) in src.chunks(sw.max(1)).zip(dst.chunks_mut(dw.max(1))) {
        for (g, dh) in d.chunks_mut(head_dim).enumerate() {
            dh.copy_from_slice(&s[g * rep * head_dim..][..head_dim]);
            for r in 1..rep {
                let sh = &s[(g * rep + r) * head_dim..][..head_dim];
                dh.iter_mut().zip(sh).for_each(|(d, &v)| *d += v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn fast_tanh_is_accurate_everywhere() {
        let mut worst = 0.0f64;
        for i in -20_000..=20_000 {
            let x = i as f32 * 1e-3;
            let err = (f64::from(super::fast_tanh(x)) - f64::from(x).tanh()).abs();
            worst = worst.max(err);
        }
        assert!(worst < 5e-7, "max error {worst:e}"); // a few ulp near ±1
        assert_eq!(super::fast_tanh(1e4), super::fast_tanh(8.0));
    }
}
