//! Causal attention of one new position against a host key/value cache: the inner loop
//! shared by [`InferStage`](super::InferStage) and the drafter's incremental proposals
//! ([`Drafter::propose`](crate::model::drafter::Drafter::propose)). A few new positions
//! against a short cache are a handful of short dot products per head, cheaper in place
//! than laid out for a batched backend product.
//!
//! The dot products keep `LANES` partial sums: a plain `iter().sum()` over f32 is one
//! dependent add chain that the compiler may not reorder, so a 64-wide head cost 64 add
//! latencies per cached row, and at `d_model` 256 the attention of a verification's K+1
//! rows was a fifth of the target's step. Every row goes through the same function, so a
//! position's result does not depend on how many positions share the call.
//!
//! Where the CPU has AVX2, `avx2` runs the same arithmetic with 8-lane registers: four
//! cached rows scored at once (four add chains in flight instead of one waiting on its
//! latency) and each head's output kept in registers across the cached rows instead of
//! loaded and stored once per row. Its separate multiplies and adds, lane for lane and in
//! the same order, give bitwise the values of the plain loops here, so no result depends
//! on the instruction set.

#[cfg(target_arch = "x86_64")]
mod avx2;

use super::denormals::Flushed;

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

/// Query heads and the key/value heads they share (grouped-query attention: query head `h`
/// reads key/value head `h / (q / kv)`; `kv = q` is plain multi-head attention).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub q: usize,
    pub kv: usize,
}

impl Heads {
    /// Multi-head attention: one key/value head per query head.
    pub fn mha(heads: usize) -> Self {
        Heads {
            q: heads,
            kv: heads,
        }
    }

    /// Query heads per key/value head.
    fn rep(self) -> usize {
        (self.q / self.kv.max(1)).max(1)
    }
}

/// `out += softmax(q·Kᵀ/√hd)·V` per head over the first `visible` cached rows, `q`
/// `heads.q·hd` wide and each cache row `heads.kv·hd`; `scores` is scratch space reused
/// across calls.
pub fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    visible: usize,
    heads: Heads,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_rows(q, keys, values, (visible, &[]), heads, scores, out);
}

/// What one new position sees: the cached rows `0..prefix`, then the rows `extra`
/// (increasing).
pub type Visible<'a> = (usize, &'a [usize]);

/// [`attend`] over the cached rows `0..prefix` followed by the rows `extra` (increasing),
/// `visible = (prefix, extra)`: a draft tree's node sees the sequence's prefix, its
/// ancestors and itself. The rows are taken in that order with the same arithmetic as
/// [`attend`], so a node's result is bitwise the one of decoding its path in a cache
/// holding only that path.
pub fn attend_rows(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    visible: Visible<'_>,
    heads: Heads,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_span(q, keys, values, &[visible], heads, scores, out);
}

/// [`attend_rows`] for several new positions of one sequence at once: `qs` holds their
/// queries one after another, `visible[r]` what position `r` sees, and `out` their outputs
/// in the same order. Each position's result is bitwise its own [`attend_rows`]; with AVX2
/// the cache is read once for all of them instead of once per position.
pub fn attend_span(
    qs: &[f32],
    keys: &[f32],
    values: &[f32],
    visible: &[Visible<'_>],
    heads: Heads,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let _flushed = Flushed::subnormals();
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2::attend_span(qs, keys, values, visible, heads, scores, out) };
    }
    let qw = qs.len() / visible.len().max(1);
    for ((q, o), &v) in qs.chunks(qw).zip(out.chunks_mut(qw)).zip(visible) {
        attend_rows_plain(q, keys, values, v, heads, scores, o);
    }
}

/// [`attend_rows`] without SIMD intrinsics: the reference [`avx2`] matches bitwise.
fn attend_rows_plain(
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
        scores.extend(rows().map(|j| dot(qh, key(j)) * scale));
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for p in scores.iter_mut() {
            *p = (*p - max).exp();
            sum += *p;
        }
        let oh = &mut out[h * hd..][..hd];
        for (p, j) in scores.iter().zip(rows()) {
            let w = p / sum;
            let vj = &values[j * width + g * hd..][..hd];
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

    /// The attention written out plainly: one [`dot`] per cached row, outputs in memory,
    /// query head `h` reading key/value head `h / (heads.q / heads.kv)`.
    fn attend_one_by_one(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        seen: &[usize],
        heads: Heads,
    ) -> Vec<f32> {
        let mut out = vec![0.0f32; q.len()];
        let hd = q.len() / heads.q;
        let width = heads.kv * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        for h in 0..heads.q {
            let g = h / (heads.q / heads.kv);
            let qh = &q[h * hd..][..hd];
            let mut s: Vec<f32> = seen
                .iter()
                .map(|&j| dot(qh, &keys[j * width + g * hd..][..hd]) * scale)
                .collect();
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for p in s.iter_mut() {
                *p = (*p - max).exp();
                sum += *p;
            }
            for (p, &j) in s.iter().zip(seen) {
                let w = p / sum;
                for i in 0..hd {
                    out[h * hd + i] += w * values[j * width + g * hd + i];
                }
            }
        }
        out
    }

    #[test]
    fn every_path_is_bitwise_one_dot_per_cached_row() {
        let wave =
            |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin()).collect() };
        // (query heads, key/value heads, query width): grouped-query shapes too.
        for (hq, hkv, width) in [
            (4, 4, 256),
            (4, 4, 512),
            (3, 3, 60),
            (2, 2, 18),
            (4, 2, 256),
            (4, 1, 64),
            (6, 3, 60),
        ] {
            let heads = Heads { q: hq, kv: hkv };
            let kw = width / hq * hkv;
            let (q, keys, values) = (wave(width, 0.37), wave(12 * kw, 0.11), wave(12 * kw, 0.23));
            for prefix in 0..=9 {
                for extra in [&[][..], &[10][..], &[9, 10, 11][..]] {
                    let seen: Vec<usize> = (0..prefix).chain(extra.iter().copied()).collect();
                    if seen.is_empty() {
                        continue;
                    }
                    let want = attend_one_by_one(&q, &keys, &values, &seen, heads);
                    let mut got = vec![0.0f32; width];
                    attend_rows(
                        &q,
                        &keys,
                        &values,
                        (prefix, extra),
                        heads,
                        &mut Vec::new(),
                        &mut got,
                    );
                    assert_eq!(got, want, "heads {heads:?} width {width} rows {seen:?}");
                    let plain = {
                        let mut o = vec![0.0f32; width];
                        attend_rows_plain(
                            &q,
                            &keys,
                            &values,
                            (prefix, extra),
                            heads,
                            &mut Vec::new(),
                            &mut o,
                        );
                        o
                    };
                    assert_eq!(plain, want, "without AVX2, rows {seen:?}");
                }
            }
        }
    }

    #[test]
    fn a_span_is_bitwise_each_of_its_rows_alone() {
        let wave =
            |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin()).collect() };
        // (query heads, key/value heads, query width): a 60-wide head leaves a tail.
        for (hq, hkv, width) in [(4, 4, 256), (4, 2, 256), (3, 3, 60), (6, 3, 60)] {
            let heads = Heads { q: hq, kv: hkv };
            let kw = width / hq * hkv;
            let (keys, values) = (wave(40 * kw, 0.11), wave(40 * kw, 0.23));
            for start in [0, 1, 3, 4, 17, 33] {
                // A chain of five new rows after `start` cached ones, and a tree's rows
                // (each sees the prefix, some of the new rows, and itself).
                let tree = [
                    vec![0],
                    vec![0, 1],
                    vec![0, 2],
                    vec![0, 1, 3],
                    vec![0, 2, 4],
                ];
                let tree: Vec<Vec<usize>> = tree
                    .iter()
                    .map(|s| s.iter().map(|&a| start + a).collect())
                    .collect();
                let chain: Vec<Visible<'_>> = (0..5).map(|r| (start + r + 1, &[][..])).collect();
                let mut mixed: Vec<Visible<'_>> = tree.iter().map(|t| (start, &t[..])).collect();
                mixed[2] = (start + 2, &tree[2][1..]);
                for visible in [&chain[..], &mixed[..], &chain[..1]] {
                    let n = visible.len();
                    let qs = wave(n * width, 0.37);
                    let mut got = vec![0.5f32; n * width];
                    attend_span(
                        &qs,
                        &keys,
                        &values,
                        visible,
                        heads,
                        &mut Vec::new(),
                        &mut got,
                    );
                    for (r, &v) in visible.iter().enumerate() {
                        let mut want = vec![0.5f32; width];
                        let q = &qs[r * width..][..width];
                        attend_rows_plain(q, &keys, &values, v, heads, &mut Vec::new(), &mut want);
                        assert_eq!(
                            &got[r * width..][..width],
                            &want[..],
                            "heads {heads:?} start {start} row {r} of {visible:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn weights_below_the_normal_range_flush_alike_on_every_path() {
        // Scores 0, then -93, -94, ... -103 (16 × key × 1/√16): every weight but the first
        // is subnormal (e^-93 ≈ 4e-41). The first row's values are 0, so the output is
        // the subnormal rows' share alone: nothing once flushed, tiny but not 0 unflushed.
        let (hd, n) = (16, 12);
        let q = vec![1.0f32; hd];
        let keys: Vec<f32> = (0..n * hd)
            .map(|i| match i / hd {
                0 => 0.0,
                j => -(92.0 + j as f32) / 4.0,
            })
            .collect();
        let values: Vec<f32> = (0..n * hd)
            .map(|i| if i < hd { 0.0 } else { 1.0 + (i % 7) as f32 })
            .collect();
        let mut got = vec![0.0f32; hd];
        let heads = Heads::mha(1);
        attend(&q, &keys, &values, n, heads, &mut Vec::new(), &mut got);
        let plain = |flushed: bool| {
            let _f = flushed.then(Flushed::subnormals);
            let mut o = vec![0.0f32; hd];
            let v = (n, &[][..]);
            attend_rows_plain(&q, &keys, &values, v, heads, &mut Vec::new(), &mut o);
            o
        };
        assert_eq!(got, plain(true));
        assert!(got.iter().all(|&x| x == 0.0), "{got:?}");
        #[cfg(target_arch = "x86_64")]
        assert!(
            plain(false).iter().all(|x| x.is_subnormal()),
            "the inputs make subnormals"
        );
    }

    #[test]
    fn grouped_heads_equal_repeated_key_value_heads() {
        // Query heads 0, 1 share kv head 0 and 2, 3 share kv head 1: the same as plain
        // multi-head attention over the cache with each kv head written out twice.
        let wave =
            |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin()).collect() };
        let (hd, rows) = (8, 5);
        let (q, keys, values) = (
            wave(4 * hd, 0.3),
            wave(rows * 2 * hd, 0.7),
            wave(rows * 2 * hd, 0.9),
        );
        let repeat = |x: &[f32]| -> Vec<f32> {
            x.chunks(2 * hd)
                .flat_map(|r| {
                    let (a, b) = r.split_at(hd);
                    [a, a, b, b].concat()
                })
                .collect()
        };
        let mut grouped = vec![0.0f32; 4 * hd];
        let heads = Heads { q: 4, kv: 2 };
        attend(
            &q,
            &keys,
            &values,
            rows,
            heads,
            &mut Vec::new(),
            &mut grouped,
        );
        let mut full = vec![0.0f32; 4 * hd];
        let (k4, v4) = (repeat(&keys), repeat(&values));
        attend(
            &q,
            &k4,
            &v4,
            rows,
            Heads::mha(4),
            &mut Vec::new(),
            &mut full,
        );
        assert_eq!(grouped, full);
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
        attend(
            &q,
            &keys,
            &values,
            3,
            Heads::mha(2),
            &mut Vec::new(),
            &mut out,
        );
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
