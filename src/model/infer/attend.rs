//! Causal attention of one new position against a host key/value cache: the inner loop
//! shared by [`InferStage`](super::InferStage) and the drafter's incremental proposals
//! ([`Drafter::propose`](crate::model::drafter::Drafter::propose)). A few new positions
//! against a short cache are a handful of short dot products per head, cheaper in place
//! than laid out for a batched backend product.
//!
//! The dot products keep [`LANES`] partial sums: a plain `iter().sum()` over f32 is one
//! dependent add chain that the compiler may not reorder, so a 64-wide head cost 64 add
//! latencies per cached row, and at `d_model` 256 the attention of a verification's K+1
//! rows was a fifth of the target's step. Every row goes through the same function, so a
//! position's result does not depend on how many positions share the call.

/// Partial sums per dot product (one AVX register of f32; the compiler vectorises them).
const LANES: usize = 8;

/// `a · b` with [`LANES`] partial sums, added pairwise at the end, then the tail in order.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for ((a, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *a += x * y;
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// `out += softmax(q·Kᵀ/√hd)·V` per head over the first `visible` cached rows, `q` and each
/// cache row `width = heads·hd` wide; `scores` is scratch space reused across calls.
pub fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    visible: usize,
    heads: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_rows(q, keys, values, (visible, &[]), heads, scores, out);
}

/// [`attend`] over the cached rows `0..prefix` followed by the rows `extra` (increasing),
/// `visible = (prefix, extra)`: a draft tree's node sees the sequence's prefix, its
/// ancestors and itself. The rows are taken in that order with the same arithmetic as
/// [`attend`], so a node's result is bitwise the one of decoding its path in a cache
/// holding only that path.
pub fn attend_rows(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    (prefix, extra): (usize, &[usize]),
    heads: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let width = q.len();
    let hd = width / heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let rows = || (0..prefix).chain(extra.iter().copied());
    for h in 0..heads {
        let qh = &q[h * hd..][..hd];
        scores.clear();
        scores.extend(rows().map(|j| dot(qh, &keys[j * width + h * hd..][..hd]) * scale));
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for p in scores.iter_mut() {
            *p = (*p - max).exp();
            sum += *p;
        }
        let oh = &mut out[h * hd..][..hd];
        for (p, j) in scores.iter().zip(rows()) {
            let w = p / sum;
            let vj = &values[j * width + h * hd..][..hd];
            oh.iter_mut().zip(vj).for_each(|(o, v)| *o += w * v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_a_wide_sum_for_every_tail_length() {
        for n in [0, 1, 7, 8, 9, 64, 67] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum();
            assert!((f64::from(dot(&a, &b)) - want).abs() < 1e-5, "n = {n}");
        }
    }

    #[test]
    fn one_position_attends_as_softmax_weights_over_values() {
        // Two heads of width 2, three cached rows, checked against the formula in f64.
        let q = [1.0f32, 0.0, 0.0, 2.0];
        let keys = [
            1.0f32, 5.0, 0.0, 0.1, 1.0, -3.0, 0.0, 0.7, 1.0, 2.0, 0.0, -0.4,
        ];
        let values = [
            1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0,
        ];
        let mut out = [0.0f32; 4];
        attend(&q, &keys, &values, 3, 2, &mut Vec::new(), &mut out);
        let scale = 1.0 / 2f64.sqrt();
        for h in 0..2 {
            let s: Vec<f64> = (0..3)
                .map(|j| {
                    (0..2)
                        .map(|i| f64::from(q[h * 2 + i] * keys[j * 4 + h * 2 + i]))
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let e: Vec<f64> = s.iter().map(|x| x.exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..2 {
                let want: f64 = (0..3)
                    .map(|j| e[j] / z * f64::from(values[j * 4 + h * 2 + i]))
                    .sum();
                let got = f64::from(out[h * 2 + i]);
                assert!(
                    (got - want).abs() < 1e-5,
                    "head {h} dim {i}: {got} vs {want}"
                );
            }
        }
        // Head 0 scores all 1/√2: the plain mean of its values.
        assert!((out[0] - 5.0).abs() < 1e-5 && (out[1] - 6.0).abs() < 1e-5);
    }
}
