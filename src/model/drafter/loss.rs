//! The drafter's two loss terms, on the host, per row (= one training pair), with their
//! gradients. Masked-out rows contribute neither loss nor gradient.
//!
//! They run on the host because the drafter's rows are few (a slice is a handful of
//! sequences) and the [`crate::tensor::Backend`] has no soft-target cross-entropy; the
//! logits and predicted hidden states come back with one copy each.

/// Soft cross-entropy `−Σ_v p_v · log softmax(z)_v` of each unmasked row of
/// `logits: [rows, vocab]` against `target: [rows, vocab]`. Writes
/// `dlogits = weight · (softmax(z)·Σ_v p_v − p)` (0 on masked rows) and returns the summed,
/// unweighted loss.
pub fn soft_cross_entropy(
    logits: &[f32],
    target: &[f32],
    mask: &[bool],
    vocab: usize,
    weight: f32,
    dlogits: &mut [f32],
) -> f64 {
    let mut total = 0.0;
    for (r, &on) in mask.iter().enumerate() {
        let span = r * vocab..(r + 1) * vocab;
        let out = &mut dlogits[span.clone()];
        if !on {
            out.fill(0.0);
            continue;
        }
        let (z, p) = (&logits[span.clone()], &target[span]);
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = z.iter().map(|&x| f64::from(x - max).exp()).sum();
        let lse = sum.ln() + f64::from(max);
        let p_sum: f64 = p.iter().map(|&x| f64::from(x)).sum();
        for ((o, &zv), &pv) in out.iter_mut().zip(z).zip(p) {
            let q = (f64::from(zv) - lse).exp();
            total -= f64::from(pv) * (f64::from(zv) - lse);
            *o = (f64::from(weight) * (q * p_sum - f64::from(pv))) as f32;
        }
    }
    total
}

/// SmoothL1 with threshold `beta`, averaged over the `dim` elements of each unmasked row of
/// `pred` and `target` (`[rows, dim]`): `s(x) = x²/(2β)` for `|x| < β`, `|x| − β/2` beyond.
/// Writes `dpred = weight · clamp(x/β, −1, 1) / dim` (0 on masked rows) and returns the
/// summed, unweighted loss.
pub fn smooth_l1(
    pred: &[f32],
    target: &[f32],
    mask: &[bool],
    dim: usize,
    beta: f32,
    weight: f32,
    dpred: &mut [f32],
) -> f64 {
    let mut total = 0.0;
    let per = weight / dim as f32;
    for (r, &on) in mask.iter().enumerate() {
        let span = r * dim..(r + 1) * dim;
        let out = &mut dpred[span.clone()];
        if !on {
            out.fill(0.0);
            continue;
        }
        let mut row = 0.0;
        for ((o, &a), &b) in out.iter_mut().zip(&pred[span.clone()]).zip(&target[span]) {
            let x = a - b;
            row += if x.abs() < beta {
                f64::from(0.5 * x * x / beta)
            } else {
                f64::from(x.abs() - 0.5 * beta)
            };
            *o = per * (x / beta).clamp(-1.0, 1.0);
        }
        total += row / dim as f64;
    }
    total
}

/// Replaces each row of `logits: [rows, vocab]` by its softmax (in f64, like
/// [`soft_cross_entropy`]'s), or by zeros where `mask` is off.
pub fn softmax_rows(logits: &mut [f32], mask: &[bool], vocab: usize) {
    for (row, &on) in logits.chunks_mut(vocab).zip(mask) {
        if !on {
            row.fill(0.0);
            continue;
        }
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
        for x in row.iter_mut() {
            *x = (f64::from(*x - max).exp() / sum) as f32;
        }
    }
}

/// Index of the largest value (the first on ties); `None` for an empty row.
pub fn argmax(row: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in row.iter().enumerate() {
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i)
}
