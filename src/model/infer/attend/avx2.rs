//! [`attend_rows`](super::attend_rows) on AVX2: the plain loops' arithmetic, lane for lane.
//!
//! A score is [`dot`](super::dot): eight partial sums (one register), each adding `q·k` of
//! its lane chunk by chunk, summed pairwise, then the tail in order; four cached rows are
//! scored together so that four such chains are in flight. A head's output adds `w·v` per
//! cached row in order, each element in a register over all the rows (blocks of up to 8
//! registers, 64 values) rather than loaded and stored per row. Multiplies and adds stay
//! separate instructions (no FMA), as in the plain code.

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps, _mm256_setzero_ps,
    _mm256_storeu_ps,
};

use super::{Heads, LANES};

/// [`attend_rows`](super::attend_rows) on AVX2.
///
/// # Safety
/// Needs AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn attend_rows(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    (prefix, extra): (usize, &[usize]),
    heads: Heads,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = q.len() / heads.q;
    let (width, rep) = (heads.kv * hd, heads.rep());
    let scale = 1.0 / (hd as f32).sqrt();
    let rows = || (0..prefix).chain(extra.iter().copied());
    for h in 0..heads.q {
        let qh = &q[h * hd..][..hd];
        let g = h / rep;
        let key = |j: usize| &keys[j * width + g * hd..][..hd];
        scores.clear();
        let mut it = rows();
        while let (Some(a), Some(b), Some(c), Some(d)) =
            (it.next(), it.next(), it.next(), it.next())
        {
            let s = dots([key(a), key(b), key(c), key(d)], qh);
            scores.extend(s.map(|s| s * scale));
        }
        // The last rows, fewer than four (`it` went past them: skip the ones scored).
        let done = scores.len();
        for j in rows().skip(done) {
            let [s] = dots([key(j)], qh);
            scores.push(s * scale);
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for p in scores.iter_mut() {
            *p = (*p - max).exp();
            sum += *p;
        }
        let value = |j: usize| &values[j * width + g * hd..][..hd];
        let oh = &mut out[h * hd..][..hd];
        let vectors = hd / LANES;
        let mut e = 0;
        while e < vectors {
            let m = (vectors - e).min(8);
            let at = e * LANES;
            let (s, o) = (&scores[..], &mut oh[at..][..m * LANES]);
            match m {
                8 => weighted::<8>(o, s, sum, rows(), |j| &value(j)[at..]),
                7 => weighted::<7>(o, s, sum, rows(), |j| &value(j)[at..]),
                6 => weighted::<6>(o, s, sum, rows(), |j| &value(j)[at..]),
                5 => weighted::<5>(o, s, sum, rows(), |j| &value(j)[at..]),
                4 => weighted::<4>(o, s, sum, rows(), |j| &value(j)[at..]),
                3 => weighted::<3>(o, s, sum, rows(), |j| &value(j)[at..]),
                2 => weighted::<2>(o, s, sum, rows(), |j| &value(j)[at..]),
                _ => weighted::<1>(o, s, sum, rows(), |j| &value(j)[at..]),
            }
            e += m;
        }
        let tail = vectors * LANES;
        for (i, o) in oh.iter_mut().enumerate().skip(tail) {
            for (p, j) in scores.iter().zip(rows()) {
                *o += p / sum * value(j)[i];
            }
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

/// `o += (p / sum)·v(j)` for the `(p, j)` of `scores` and `rows` in order, `o` being `M`
/// registers (`8·M` values) and `v(j)` at least as long.
#[target_feature(enable = "avx2")]
#[inline]
fn weighted<'v, const M: usize>(
    o: &mut [f32],
    scores: &[f32],
    sum: f32,
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
        for (p, j) in scores.iter().zip(rows) {
            let w = _mm256_set1_ps(p / sum);
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
