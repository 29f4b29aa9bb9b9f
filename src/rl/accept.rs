//! The acceptance rules of speculative decoding: pure functions over the target's and the
//! drafter's distributions, lossless by construction.
//!
//! A draft is a chain `d_1..d_K` proposed after the last verified token; verification gives
//! the target's distribution `p_0..p_K` at the K+1 positions (p_i predicts the token after
//! `d_i`, with `d_0` the last verified token).
//! - **Greedy**: accept the longest prefix with `d_{i+1} = argmax p_i`, then add one bonus
//!   token `argmax p_m` at the first mismatch (or after the whole chain). The result is the
//!   token sequence plain greedy decoding produces, whatever the drafter proposed.
//! - **Sampling** (Leviathan et al. 2023, Chen et al. 2023): accept `d_{i+1}` with probability
//!   `min(1, p_i(d)/q_i(d))`; on the first rejection draw from `norm(max(0, p_i − q_i))` and
//!   stop; if all K are accepted draw the bonus from `p_K`. Every emitted token is then
//!   distributed exactly as if drawn from the target.

use crate::data::rng::SplitMix64;

/// Index of the largest value (the first on ties, as plain greedy decoding picks).
pub fn argmax(p: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in p.iter().enumerate() {
        if v > p[best] {
            best = i;
        }
    }
    best as u32
}

/// Softmax of `logits / temperature` (temperature > 0).
pub fn softmax(logits: &[f32], temperature: f32) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = logits
        .iter()
        .map(|&l| ((l - max) / temperature).exp())
        .collect();
    let sum: f32 = p.iter().sum();
    p.iter_mut().for_each(|v| *v /= sum);
    p
}

/// A draw from the (not necessarily normalised, non-negative) weights `w`.
pub fn sample(w: &[f32], rng: &mut SplitMix64) -> u32 {
    let total: f64 = w.iter().map(|&v| v as f64).sum();
    let mut u = rng.next_f64() * total;
    for (i, &v) in w.iter().enumerate() {
        u -= v as f64;
        if u < 0.0 {
            return i as u32;
        }
    }
    // Rounding left a sliver of mass: the last token with weight takes it.
    w.iter().rposition(|&v| v > 0.0).unwrap_or(0) as u32
}

/// The outcome of verifying one draft.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// How many draft tokens were accepted (`0..=K`).
    pub accepted: usize,
    /// The tokens to append: the accepted draft prefix, then one more (bonus or correction).
    pub tokens: Vec<u32>,
}

/// Greedy verification: `target` holds `K+1` rows (`target[i]` = logits or probabilities
/// predicting the token after draft position `i`).
pub fn accept_greedy(draft: &[u32], target: &[&[f32]]) -> Verdict {
    assert_eq!(
        target.len(),
        draft.len() + 1,
        "K+1 target rows for K drafts"
    );
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (i, &d) in draft.iter().enumerate() {
        let t = argmax(target[i]);
        tokens.push(t);
        if t != d {
            return Verdict {
                accepted: i,
                tokens,
            };
        }
    }
    tokens.push(argmax(target[draft.len()]));
    Verdict {
        accepted: draft.len(),
        tokens,
    }
}

/// Sampling verification: `p` holds the target's `K+1` probability rows, `q` the drafter's
/// `K` rows (the distributions the draft tokens were drawn from).
pub fn accept_sampling(draft: &[u32], p: &[&[f32]], q: &[&[f32]], rng: &mut SplitMix64) -> Verdict {
    assert_eq!(p.len(), draft.len() + 1, "K+1 target rows for K drafts");
    assert_eq!(q.len(), draft.len(), "one draft row per draft token");
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (i, &d) in draft.iter().enumerate() {
        let (pi, qi) = (p[i][d as usize], q[i][d as usize]);
        // q(d) = 0 cannot happen for a token drawn from q; treat it as certain acceptance
        // only if p agrees it is possible.
        let accept = if qi <= 0.0 {
            pi > 0.0
        } else {
            rng.next_f64() < (pi / qi).min(1.0) as f64
        };
        if accept {
            tokens.push(d);
            continue;
        }
        let residual: Vec<f32> = p[i]
            .iter()
            .zip(q[i])
            .map(|(a, b)| (a - b).max(0.0))
            .collect();
        let t = if residual.iter().any(|&v| v > 0.0) {
            sample(&residual, rng)
        } else {
            // p == q exactly: a rejection has probability 0; fall back on p itself.
            sample(p[i], rng)
        };
        tokens.push(t);
        return Verdict {
            accepted: i,
            tokens,
        };
    }
    tokens.push(sample(p[draft.len()], rng));
    Verdict {
        accepted: draft.len(),
        tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_matching_prefix_and_one_bonus() {
        let rows: [&[f32]; 4] = [
            &[0.0, 1.0, 0.0],
            &[0.0, 0.0, 1.0],
            &[1.0, 0.0, 0.0],
            &[0.0, 1.0, 0.0],
        ];
        let all = accept_greedy(&[1, 2, 0], &rows);
        assert_eq!(
            all,
            Verdict {
                accepted: 3,
                tokens: vec![1, 2, 0, 1]
            }
        );
        let some = accept_greedy(&[1, 0, 0], &rows);
        assert_eq!(
            some,
            Verdict {
                accepted: 1,
                tokens: vec![1, 2]
            }
        );
        let none = accept_greedy(&[2, 2, 0], &rows);
        assert_eq!(
            none,
            Verdict {
                accepted: 0,
                tokens: vec![1]
            }
        );
    }

    /// The first emitted token must be distributed as p_0, whatever q is: a chi-square test
    /// over many draws with a fixed seed on a 5-token vocabulary.
    #[test]
    fn sampling_acceptance_reproduces_the_target_distribution() {
        let p0 = [0.05f32, 0.4, 0.25, 0.2, 0.1];
        let p1 = [0.2f32, 0.2, 0.2, 0.2, 0.2];
        let q0 = [0.5f32, 0.1, 0.1, 0.2, 0.1];
        let mut rng = SplitMix64::new(7);
        let n = 200_000;
        let (mut counts, mut second) = ([0usize; 5], [0usize; 5]);
        let mut accepted = 0;
        for _ in 0..n {
            let d = sample(&q0, &mut rng);
            let v = accept_sampling(&[d], &[&p0, &p1], &[&q0], &mut rng);
            counts[v.tokens[0] as usize] += 1;
            if v.accepted == 1 {
                accepted += 1;
                second[v.tokens[1] as usize] += 1;
            }
        }
        let chi2 = |counts: &[usize; 5], p: &[f32; 5], n: usize| -> f64 {
            counts
                .iter()
                .zip(p)
                .map(|(&c, &pi)| {
                    let e = pi as f64 * n as f64;
                    (c as f64 - e).powi(2) / e
                })
                .sum()
        };
        // 4 degrees of freedom: P(χ² > 18.47) = 0.001.
        let first = chi2(&counts, &p0, n);
        assert!(first < 18.47, "first token χ² = {first}, counts {counts:?}");
        let bonus = chi2(&second, &p1, accepted);
        assert!(bonus < 18.47, "bonus token χ² = {bonus}, counts {second:?}");
        // The acceptance rate is Σ min(p, q) = 0.05+0.1+0.1+0.2+0.1 = 0.55.
        let rate = accepted as f64 / n as f64;
        assert!((rate - 0.55).abs() < 0.01, "acceptance rate {rate}");
        // A biased q must change the counts if acceptance were skipped: the test can fail.
        let naive: [usize; 5] = std::array::from_fn(|i| (q0[i] as f64 * n as f64) as usize);
        assert!(chi2(&naive, &p0, n) > 18.47);
    }

    #[test]
    fn identical_distributions_accept_everything() {
        let p = [0.3f32, 0.7];
        let mut rng = SplitMix64::new(1);
        for _ in 0..1000 {
            let d = sample(&p, &mut rng);
            let v = accept_sampling(&[d, d], &[&p, &p, &p], &[&p, &p], &mut rng);
            assert_eq!(v.accepted, 2);
        }
    }

    #[test]
    fn softmax_and_argmax() {
        let p = softmax(&[1.0, 3.0, 2.0], 1.0);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(argmax(&p), 1);
        assert_eq!(argmax(&[2.0, 2.0]), 0, "ties go to the first");
    }
}
