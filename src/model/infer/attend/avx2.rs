//! [`attend_span`](super::attend_span) on AVX2: the plain loops' arithmetic, lane for lane.
//!
//! A score is [`dot`](super::dot): eight partial sums (one register), each adding `q·k` of
//! its lane chunk by chunk, summed pairwise, then the tail in order. The cached rows are
//! walked in order, a few at a time, and each block serves every new position and head
//! before the next is read: the cache of a sequence is read once per step rather than once
//! per new position and head (a verification's K+1 positions at a long context were
//! bound by re-reading it, a head's 256 bytes at a time 2 KiB apart). A head's output adds
//! `w·v` per cached row in order, each element kept in a register across a block of rows.
//! Multiplies and adds stay separate instructions (no FMA), as in the plain code.

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps, _mm256_setzero_ps,
    _mm256_storeu_ps,
};

use super::{Heads, LANES, Visible};

/// Cached rows scored together: four dot products in flight per query head.
const KEY_BLOCK: usize = 4;
/// Cached rows whose values are added to a head's output while it stays in registers.
const VALUE_BLOCK: usize = 16;

/// [`attend_span`](super::attend_span) on AVX2.
///
/// # Safety
/// Needs AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn attend_span(
    qs: &[f32],
    keys: &[f32],
    values: &[f32],
    visible: &[Visible<'_>],
    heads: Heads,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let n = visible.len();
    let qw = qs.len() / n.max(1);
    let hd = qw / heads.q;
    let (width, rep) = (heads.kv * hd, heads.rep());
    let scale = 1.0 / (hd as f32).sqrt();
    // The cached rows every new position sees, read once for all of them.
    let shared = visible.iter().map(|v| v.0).min().unwrap_or(0);
    // Each row's own rows after the shared ones: the rest of its prefix, then its extras.
    let own = |r: usize| (shared..visible[r].0).chain(visible[r].1.iter().copied());
    let count = |r: usize| visible[r].0 + visible[r].1.len();
    let stride = (0..n).map(count).max().unwrap_or(0);
    scores.clear();
    scores.resize(n * heads.q * stride, 0.0);
    let at = |r: usize, h: usize| (r * heads.q + h) * stride;
    let q = |r: usize, h: usize| &qs[r * qw + h * hd..][..hd];
    let key = |j: usize, g: usize| &keys[j * width + g * hd..][..hd];

    // Scores over the shared rows, a block of cached rows for every row and head.
    let mut j = 0;
    while j + KEY_BLOCK <= shared {
        for r in 0..n {
            for h in 0..heads.q {
                let g = h / rep;
                let s = dots(
                    [key(j, g), key(j + 1, g), key(j + 2, g), key(j + 3, g)],
                    q(r, h),
                );
                let o = at(r, h) + j;
                for (x, s) in scores[o..o + KEY_BLOCK].iter_mut().zip(s) {
                    *x = s * scale;
                }
            }
        }
        j += KEY_BLOCK;
    }
    for j in j..shared {
        for r in 0..n {
            for h in 0..heads.q {
                let [s] = dots([key(j, h / rep)], q(r, h));
                scores[at(r, h) + j] = s * scale;
            }
        }
    }
    // Each row's own rows, then its softmax: weights `p / sum` in place of the scores.
    for r in 0..n {
        for h in 0..heads.q {
            let g = h / rep;
            let o = at(r, h);
            for (i, j) in own(r).enumerate() {
                let [s] = dots([key(j, g)], q(r, h));
                scores[o + shared + i] = s * scale;
            }
            let row = &mut scores[o..o + count(r)];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for p in row.iter_mut() {
                *p = (*p - max).exp();
                sum += *p;
            }
            row.iter_mut().for_each(|p| *p /= sum);
        }
    }

    // Values: the shared rows a block at a time, then each row's own.
    let value = |j: usize, g: usize| &values[j * width + g * hd..][..hd];
    let mut j = 0;
    while j < shared {
        let end = (j + VALUE_BLOCK).min(shared);
        for r in 0..n {
            for h in 0..heads.q {
                let o = at(r, h);
                let w = &scores[o + j..o + end];
                let oh = &mut out[r * qw + h * hd..][..hd];
                weighted(oh, w, j..end, |j| value(j, h / rep));
            }
        }
        j = end;
    }
    for r in 0..n {
        for h in 0..heads.q {
            let o = at(r, h) + shared;
            let w = &scores[o..o + count(r) - shared];
            let oh = &mut out[r * qw + h * hd..][..hd];
            weighted(oh, w, own(r), |j| value(j, h / rep));
        }
    }
}

/// `o += w·v(j)` for the `(w, j)` of `weights` and `rows` in order, a head's output of
/// `o.len()` values: blocks of up to eight registers, then the tail value by value.
#[target_feature(enable = "avx2")]
#[inline]
fn weighted<'v>(
    o: &mut [f32],
    weights: &[f32],
    rows: impl Iterator<Item = usize> + Clone,
    v: impl Fn(usize) -> &'v [f32],
) {
    let vectors = o.len() / LANES;
    let mut e = 0;
    while e < vectors {
        let m = (vectors - e).min(8);
        let at = e * LANES;
        let o = &mut o[at..][..m * LANES];
        let rows = rows.clone();
        match m {
            8 => weighted_regs::<8>(o, weights, rows, |j| &v(j)[at..]),
            7 => weighted_regs::<7>(o, weights, rows, |j| &v(j)[at..]),
            6 => weighted_regs::<6>(o, weights, rows, |j| &v(j)[at..]),
            5 => weighted_regs::<5>(o, weights, rows, |j| &v(j)[at..]),
            4 => weighted_regs::<4>(o, weights, rows, |j| &v(j)[at..]),
            3 => weighted_regs::<3>(o, weights, rows, |j| &v(j)[at..]),
            2 => weighted_regs::<2>(o, weights, rows, |j| &v(j)[at..]),
            _ => weighted_regs::<1>(o, weights, rows, |j| &v(j)[at..]),
        }
        e += m;
    }
    let tail = vectors * LANES;
    for (i, o) in o.iter_mut().enumerate().skip(tail) {
        for (w, j) in weights.iter().zip(rows.clone()) {
            *o += w * v(j)[i];
        }
    }
}

/// `q · k` for each of `N` keys, each bitwise [`dot`](super::dot).
#[target_feature(enable = "avx2")]
#[inline]
fn dots<const N: usize>(keys: [&[f32]; N], q: &[f32]) -> [f32; N] {
    let n = q.len();
    let full = n - n % LANES;
    let keys = keys.map(|k| &k[..n]);
    let mut acc = [_mm256_setzero_ps(); N];
    for c in (0..full).step_by(LANES) {
        // SAFETY: `c + LANES <= n`, the length of `q` and of every key.
        unsafe {
            let x = _mm256_loadu_ps(q.as_ptr().add(c));
            for (a, k) in acc.iter_mut().zip(&keys) {
                *a = _mm256_add_ps(*a, _mm256_mul_ps(x, _mm256_loadu_ps(k.as_ptr().add(c))));
            }
        }
    }
    let mut out = [0.0f32; N];
    for ((o, a), k) in out.iter_mut().zip(&acc).zip(&keys) {
        let mut l = [0.0f32; LANES];
        // SAFETY: `l` holds 8 floats.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), *a) };
        let mut s = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
        for (x, y) in q[full..].iter().zip(&k[full..]) {
            s += x * y;
        }
        *o = s;
    }
    out
}

/// `o += w·v(j)` for the `(w, j)` of `weights` and `rows` in order, `o` being `M`
/// registers (`8·M` values) and `v(j)` at least as long.
#[target_feature(enable = "avx2")]
#[inline]
fn weighted_regs<'v, const M: usize>(
    o: &mut [f32],
    weights: &[f32],
    rows: impl Iterator<Item = usize>,
    v: impl Fn(usize) -> &'v [f32],
) {
    assert_eq!(o.len(), M * LANES);
    let mut acc: [__m256; M] = [_mm256_setzero_ps(); M];
    // SAFETY: `o` holds `M` registers' worth; each `v(j)` is checked to as well.
    unsafe {
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm256_loadu_ps(o.as_ptr().add(i * LANES));
        }
        for (&w, j) in weights.iter().zip(rows) {
            let w = _mm256_set1_ps(w);
            let vj = &v(j)[..M * LANES];
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_ps(
                    *a,
                    _mm256_mul_ps(w, _mm256_loadu_ps(vj.as_ptr().add(i * LANES))),
                );
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.as_mut_ptr().add(i * LANES), *a);
        }
    }
}
