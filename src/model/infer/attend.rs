//! Causal attention of one new position against a host key/value cache: the inner loop
//! shared by [`InferStage`](super::InferStage) and the drafter's incremental proposals
//! ([`Drafter::propose`](crate::model::drafter::Drafter::propose)). A few new positions
//! against a short cache are a handful of short dot products per head, cheaper in place
//! than laid out for a batched backend product.

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
    let width = q.len();
    let hd = width / heads;
    let scale = 1.0 / (hd as f32).sqrt();
    for h in 0..heads {
        let qh = &q[h * hd..][..hd];
        scores.clear();
        scores.extend((0..visible).map(|j| {
            let kj = &keys[j * width + h * hd..][..hd];
            qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale
        }));
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for p in scores.iter_mut() {
            *p = (*p - max).exp();
            sum += *p;
        }
        let oh = &mut out[h * hd..][..hd];
        for (j, p) in scores.iter().enumerate() {
            let w = p / sum;
            let vj = &values[j * width + h * hd..][..hd];
            oh.iter_mut().zip(vj).for_each(|(o, v)| *o += w * v);
        }
    }
}
