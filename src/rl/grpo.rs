//! GRPO (group relative policy optimisation): the objective the RL update minimises.
//!
//! For each prompt the policy samples a group of `G` completions; each completion's reward
//! is compared with its own group only ([`group_advantages`]): `A_i = (r_i − mean_g) /
//! (std_g + eps)`, with the population standard deviation of the group. A group whose
//! rewards are all equal teaches nothing and gets advantage 0 everywhere.
//!
//! The per-token loss ([`token_loss`]) is the clipped surrogate of PPO plus an optional KL
//! penalty to a frozen reference policy, with the k3 estimator (unbiased, always ≥ 0):
//!
//! ```text
//! ρ      = exp(log p − log p_old)
//! loss_t = −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A) + β·(exp(d) − d − 1),   d = log p_ref − log p
//! ```
//!
//! and a sequence's loss is the mean over its completion tokens; the step's loss is the
//! mean over the step's sequences ([`grpo_loss`]). Every function returns the gradient
//! with respect to the policy's log-probabilities next to the value, so the update can
//! backpropagate it.
//!
//! # The update as ordinary training
//! With one on-policy update per rollout batch, `p_old = p` when the gradient is taken, so
//! `ρ = 1`, the clip is inactive and `∂loss_t/∂log p_t = −A` (without KL). Sequence `i`'s
//! contribution to the step's gradient is then `(A_i / n) · ∇ NLL_i`, where `NLL_i` is the
//! mean cross-entropy over its completion tokens, which is exactly what a training step
//! computes for a micro-batch holding sequence `i` alone (prompt targets ignored) with
//! loss scale `A_i / n` ([`update_scales`]). That is how the pipelined update runs the
//! GRPO objective through the pipeline's existing `d objective / d loss` scales.
//!
//! The KL term's gradient differs per token (`β·(1 − exp(d))`), and a micro-batch packing
//! several sequences needs a weight per row; neither is one scale per micro-batch. The
//! pipelined update therefore hands the last stage's head a [`GrpoTokenLoss`](super::update::GrpoTokenLoss)
//! ([`crate::model::layers::TokenLoss`], built by [`super::update::update_step`]): each
//! row's tokens get the derivative of its sequence's share of the objective (with KL the
//! mean of [`token_loss`] over its completion tokens at `ρ = 1`, the reference's log-probs
//! computed once per rollout batch by [`reference_log_probs`]), so the micro-batches' losses
//! sum to [`grpo_loss`] and the head backpropagates its per-token gradient.

use crate::model::ModelError;
use crate::rl::RlError;
/// Added to a group's standard deviation so an almost-uniform group cannot blow up.
pub const ADVANTAGE_EPS: f32 = 1e-6;

/// Group-normalised advantages of `rewards`, laid out group after group (`group`
/// consecutive rewards per prompt).
pub fn group_advantages(rewards: &[f32], group: usize) -> Result<Vec<f32>, RlError> {
    if group == 0 || !rewards.len().is_multiple_of(group) {
        return Err(RlError::Ragged {
            len: rewards.len(),
            group,
        });
    }
    if let Some((index, &value)) = rewards.iter().enumerate().find(|(_, r)| !r.is_finite()) {
        return Err(RlError::NotFinite { index, value });
    }
    let mut out = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group) {
        let n = g.len() as f64;
        let mean = g.iter().map(|&r| f64::from(r)).sum::<f64>() / n;
        let var = g
            .iter()
            .map(|&r| (f64::from(r) - mean).powi(2))
            .sum::<f64>()
            / n;
        let denom = var.sqrt() + f64::from(ADVANTAGE_EPS);
        out.extend(g.iter().map(|&r| ((f64::from(r) - mean) / denom) as f32));
    }
    Ok(out)
}

/// The objective's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrpoLoss {
    /// Clip range ε of the probability ratio.
    pub clip: f32,
    /// Weight β of the KL penalty (0: none).
    pub kl_coef: f32,
}

/// One token's loss and its derivative with respect to the policy's `logp`.
///
/// `logp_ref` is the frozen reference's log-prob (ignored when `kl_coef` is 0).
pub fn token_loss(
    cfg: GrpoLoss,
    logp: f32,
    logp_old: f32,
    logp_ref: Option<f32>,
    advantage: f32,
) -> (f32, f32) {
    let ratio = (logp - logp_old).exp();
    let clipped = ratio.clamp(1.0 - cfg.clip, 1.0 + cfg.clip);
    let (plain, cut) = (ratio * advantage, clipped * advantage);
    // min picks the plain term: its derivative is ρ·A; the clipped term is constant in
    // log p outside the clip range (and equal to the plain one inside it).
    let (mut loss, mut grad) = if plain <= cut {
        (-plain, -plain)
    } else {
        (-cut, 0.0)
    };
    if let (Some(r), true) = (logp_ref, cfg.kl_coef != 0.0) {
        let d = r - logp;
        loss += cfg.kl_coef * (d.exp() - d - 1.0);
        grad += cfg.kl_coef * (1.0 - d.exp());
    }
    (loss, grad)
}

/// One sampled completion's per-token log-probs under the current policy, the policy that
/// sampled it, and (optional) the frozen reference.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceLogProbs {
    pub logp: Vec<f32>,
    pub logp_old: Vec<f32>,
    pub logp_ref: Option<Vec<f32>>,
}

/// The step's GRPO loss: the mean over sequences of each sequence's mean token loss, and
/// its gradient with respect to every token's `logp` (same layout as the inputs). A
/// sequence without tokens contributes nothing to the loss but counts in the mean.
pub fn grpo_loss(
    cfg: GrpoLoss,
    seqs: &[SequenceLogProbs],
    advantages: &[f32],
) -> Result<(f32, Vec<Vec<f32>>), RlError> {
    if advantages.len() != seqs.len() {
        return Err(RlError::AdvantageCount {
            advantages: advantages.len(),
            sequences: seqs.len(),
        });
    }
    let n = seqs.len().max(1) as f64;
    let mut total = 0.0f64;
    let mut grads = Vec::with_capacity(seqs.len());
    for (i, (s, &a)) in seqs.iter().zip(advantages).enumerate() {
        let len = s.logp.len();
        let check = |what, got: usize| {
            (got != len).then_some(RlError::GrpoLength {
                sequence: i,
                what,
                got,
                expected: len,
            })
        };
        if let Some(e) = check("logp_old", s.logp_old.len())
            .or_else(|| s.logp_ref.as_ref().and_then(|r| check("logp_ref", r.len())))
        {
            return Err(e);
        }
        let weight = 1.0 / (len.max(1) as f64 * n);
        let mut g = Vec::with_capacity(len);
        for t in 0..len {
            let r = s.logp_ref.as_ref().map(|r| r[t]);
            let (l, d) = token_loss(cfg, s.logp[t], s.logp_old[t], r, a);
            total += f64::from(l) * weight;
            g.push((f64::from(d) * weight) as f32);
        }
        grads.push(g);
    }
    Ok((total as f32, grads))
}

/// Each sequence's completion-token log-probs under `reference` (one forward per
/// sequence; `batches` as [`super::update::update_batches`] builds them, prompt targets
/// ignored), as [`GrpoTokenLoss`](super::update::GrpoTokenLoss) takes them.
pub fn reference_log_probs<B: crate::tensor::Backend>(
    reference: &mut crate::model::Gpt<B>,
    batches: &[crate::data::MicroBatch],
) -> Result<Vec<Vec<f32>>, ModelError> {
    let vocab = reference.config().vocab;
    batches
        .iter()
        .map(|mb| {
            let shape = crate::model::Shape {
                batch: mb.rows,
                seq: mb.seq_len,
            };
            let logits = reference.logits(shape, &mb.inputs)?;
            Ok(mb
                .targets
                .iter()
                .enumerate()
                .filter(|&(_, &t)| t != crate::tensor::IGNORE_TARGET)
                .map(|(r, &t)| {
                    crate::model::layers::log_prob(&logits[r * vocab..(r + 1) * vocab], t as usize)
                })
                .collect())
        })
        .collect()
}

/// The loss scale of each sequence's micro-batch in the on-policy update without KL:
/// `A_i / n` (see the module docs), so that `Σ scale_i · ∇ NLL_i = ∇ grpo_loss`.
pub fn update_scales(advantages: &[f32]) -> Vec<f32> {
    let n = advantages.len().max(1) as f32;
    advantages.iter().map(|&a| a / n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Cut, Gpt, GptConfig, Shape};
    use crate::rl::update::GrpoTokenLoss;
    use crate::tensor::{CpuBackend, IGNORE_TARGET};

    const CFG: GrpoLoss = GrpoLoss {
        clip: 0.2,
        kl_coef: 0.0,
    };

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-5 * (1.0 + b.abs())
    }

    #[test]
    fn advantages_are_normalised_within_each_group() {
        // Group 1: mean 0.5, std 0.5; group 2: all equal, so nothing to learn.
        let a = group_advantages(&[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], 4).unwrap();
        let one = 0.5 / (0.5 + ADVANTAGE_EPS);
        for (got, want) in a.iter().zip([one, -one, -one, one, 0.0, 0.0, 0.0, 0.0]) {
            assert!(close(*got, want), "{a:?}");
        }
        // [0, 1, 2]: mean 1, population std sqrt(2/3).
        let a = group_advantages(&[0.0, 1.0, 2.0], 3).unwrap();
        let s = (2.0f32 / 3.0).sqrt();
        assert!(
            close(a[0], -1.0 / s) && close(a[1], 0.0) && close(a[2], 1.0 / s),
            "{a:?}"
        );
        assert!(matches!(
            group_advantages(&[1.0; 5], 2),
            Err(RlError::Ragged { len: 5, group: 2 })
        ));
        assert_eq!(
            group_advantages(&[1.0, f32::NAN], 2)
                .unwrap_err()
                .to_string(),
            "grpo: reward 1 is NaN, not a finite number"
        );
    }

    #[test]
    fn clipped_surrogate_by_hand() {
        let ln = f32::ln;
        // On-policy: ratio 1, loss −A, gradient −A.
        assert_eq!(token_loss(CFG, -0.7, -0.7, None, 2.0), (-2.0, -2.0));
        // ratio 1.5, A = 2: plain 3 > clipped 2.4, so the clipped term wins, gradient 0.
        let (l, g) = token_loss(CFG, ln(1.5), 0.0, None, 2.0);
        assert!(close(l, -2.4) && g == 0.0, "{l} {g}");
        // ratio 1.5, A = −1: plain −1.5 < clipped −1.2: the plain term, gradient −ρA.
        let (l, g) = token_loss(CFG, ln(1.5), 0.0, None, -1.0);
        assert!(close(l, 1.5) && close(g, 1.5), "{l} {g}");
        // ratio 0.5, A = 1: plain 0.5 < clipped 0.8: the plain term.
        let (l, g) = token_loss(CFG, ln(0.5), 0.0, None, 1.0);
        assert!(close(l, -0.5) && close(g, -0.5), "{l} {g}");
        // ratio 0.5, A = −1: plain −0.5 > clipped −0.8: clipped, gradient 0.
        let (l, g) = token_loss(CFG, ln(0.5), 0.0, None, -1.0);
        assert!(close(l, 0.8) && g == 0.0, "{l} {g}");
    }

    #[test]
    fn k3_kl_by_hand_and_by_finite_difference() {
        let cfg = GrpoLoss {
            clip: 0.2,
            kl_coef: 0.1,
        };
        // p = 0.5, p_ref = 0.25: d = ln 0.5, k3 = 0.5 − ln 0.5 − 1, ∂/∂log p = 1 − 0.5.
        let (logp, r) = (0.5f32.ln(), 0.25f32.ln());
        let (l, g) = token_loss(cfg, logp, logp, Some(r), 0.0);
        assert!(close(l, 0.1 * (0.5 - 0.5f32.ln() - 1.0)), "{l}");
        assert!(close(g, 0.1 * 0.5), "{g}");
        // KL off: the reference is ignored.
        assert_eq!(token_loss(CFG, logp, logp, Some(r), 0.0), (0.0, 0.0));
        // Every branch's gradient against a central difference.
        for (lp, old, a) in [(-0.3, -0.5, 1.0), (-0.3, -0.25, -2.0), (-1.0, -0.4, 0.7)] {
            let h = 1e-3;
            let f = |x: f32| f64::from(token_loss(cfg, x, old, Some(-0.6), a).0);
            let fd = (f(lp + h) - f(lp - h)) / (2.0 * f64::from(h));
            let (_, g) = token_loss(cfg, lp, old, Some(-0.6), a);
            assert!(
                (fd - f64::from(g)).abs() < 1e-3,
                "{lp} {old} {a}: {fd} vs {g}"
            );
        }
    }

    #[test]
    fn step_loss_is_the_mean_of_sequence_means() {
        let seq = |logp: Vec<f32>| SequenceLogProbs {
            logp_old: logp.clone(),
            logp,
            logp_ref: None,
        };
        let seqs = [seq(vec![-1.0, -2.0]), seq(vec![-0.5])];
        // ratio 1: loss = ½·(½·(−1 − 1) + 1) = 0; ∂/∂log p = −A / (len · n).
        let (loss, grads) = grpo_loss(CFG, &seqs, &[1.0, -1.0]).unwrap();
        assert!(close(loss, 0.0), "{loss}");
        assert_eq!(grads, vec![vec![-0.25, -0.25], vec![0.5]]);
        let mut bad = seqs.to_vec();
        bad[1].logp_ref = Some(vec![0.0, 0.0]);
        assert_eq!(
            grpo_loss(CFG, &bad, &[1.0, 1.0]).unwrap_err().to_string(),
            "grpo: sequence 1: logp_ref has 2 values, the policy's log-probs 1"
        );
        assert!(matches!(
            grpo_loss(CFG, &seqs, &[1.0]),
            Err(RlError::AdvantageCount { .. })
        ));
    }

    /// The update's micro-batch scales give the GRPO gradient of the model's parameters,
    /// computed directly as Σ_t (∂loss/∂log p_t) · ∇ log p_t, one token at a time.
    #[test]
    fn update_scales_reproduce_the_grpo_gradient_on_a_model() {
        let cfg = GptConfig {
            vocab: 11,
            d_model: 16,
            heads: 4,
            layers: 2,
            seq_len: 8,
            mlp_ratio: 2,
            seed: 3,
            ..GptConfig::default()
        };
        let mut gpt = Gpt::new(&cfg, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
        // Three sequences: prompt length, then completion; targets ignore the prompt.
        let rows: [(&[u32], usize); 3] = [
            (&[1, 4, 5, 6, 7, 2, 0, 0], 2),
            (&[1, 3, 9, 8, 2, 0, 0, 0], 3),
            (&[1, 5, 5, 10, 10, 10, 4, 2], 1),
        ];
        let lens = [5usize, 4, 7];
        let advantages = group_advantages(&[1.0, 0.0, 0.5], 3).unwrap();
        let shape = Shape { batch: 1, seq: 8 };
        let targets_of = |ids: &[u32], prompt: usize, len: usize| -> Vec<u32> {
            (0..8)
                .map(|t| {
                    if t + 1 >= prompt && t + 1 < len {
                        ids[t + 1]
                    } else {
                        IGNORE_TARGET
                    }
                })
                .collect()
        };
        // Each completion token's log-prob under the model.
        let mut seqs = Vec::new();
        for (&(ids, prompt), &len) in rows.iter().zip(&lens) {
            let logits = gpt.logits(shape, ids).unwrap();
            let logp: Vec<f32> = targets_of(ids, prompt, len)
                .iter()
                .enumerate()
                .filter(|(_, t)| **t != IGNORE_TARGET)
                .map(|(pos, &t)| {
                    let row = &logits[pos * 11..(pos + 1) * 11];
                    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f32>().ln();
                    row[t as usize] - lse
                })
                .collect();
            seqs.push(SequenceLogProbs {
                logp_old: logp.clone(),
                logp,
                logp_ref: None,
            });
        }
        let (_, dlogp) = grpo_loss(CFG, &seqs, &advantages).unwrap();
        let grads = |gpt: &Gpt<CpuBackend>| -> Vec<f32> {
            gpt.param_names()
                .iter()
                .flat_map(|n| gpt.grad_values(n).unwrap())
                .collect()
        };
        // Direct: one micro-batch per token, whose loss is −log p_t, with scale −∂L/∂log p_t.
        gpt.zero_grads().unwrap();
        let mut mb = 0;
        for (s, (&(ids, prompt), &len)) in rows.iter().zip(&lens).enumerate() {
            let full = targets_of(ids, prompt, len);
            let counted = full
                .iter()
                .enumerate()
                .filter(|(_, t)| **t != IGNORE_TARGET);
            for (k, (pos, &t)) in counted.enumerate() {
                let mut one = vec![IGNORE_TARGET; 8];
                one[pos] = t;
                gpt.forward_backward(mb, shape, ids, &one, -dlogp[s][k])
                    .unwrap();
                mb += 1;
            }
        }
        let direct = grads(&gpt);
        // The update: one micro-batch per sequence with scale A_i / n.
        gpt.zero_grads().unwrap();
        let scales = update_scales(&advantages);
        for (i, (&(ids, prompt), &len)) in rows.iter().zip(&lens).enumerate() {
            let t = targets_of(ids, prompt, len);
            gpt.forward_backward(i, shape, ids, &t, scales[i]).unwrap();
        }
        let update = grads(&gpt);
        let norm = direct.iter().map(|g| g * g).sum::<f32>().sqrt();
        assert!(norm > 1e-4, "the case has a gradient: {norm}");
        let err = direct
            .iter()
            .zip(&update)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f32>()
            .sqrt();
        assert!(err <= 1e-5 * norm.max(1.0), "error {err} of norm {norm}");
    }

    /// The head's hooked loss (GRPO with KL through [`GrpoTokenLoss`](crate::rl::update::GrpoTokenLoss), both sequences packed
    /// in one micro-batch of two rows, scale 1) has the gradient of [`grpo_loss`] computed
    /// from the logits: checked by central differences on the entries of two parameters
    /// with the largest gradients.
    #[test]
    fn kl_token_loss_gradient_matches_finite_differences() {
        let cfg = GptConfig {
            vocab: 11,
            d_model: 16,
            heads: 4,
            layers: 2,
            seq_len: 6,
            mlp_ratio: 2,
            seed: 5,
            ..GptConfig::default()
        };
        let loss_cfg = GrpoLoss {
            clip: 0.2,
            kl_coef: 0.5,
        };
        let mut gpt = Gpt::new(&cfg, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
        let shape = Shape { batch: 1, seq: 6 };
        let rows: [(&[u32], &[u32]); 2] = [
            (&[1, 4, 5, 6, 7, 2], &[IGNORE_TARGET, 5, 6, 7, 2, 9]),
            (
                &[1, 3, 9, 8, 2, 0],
                &[IGNORE_TARGET, IGNORE_TARGET, 8, 2, 0, 3],
            ),
        ];
        let advantages = vec![0.8f32, -0.8];
        // A reference that differs from the policy, so the KL term has a gradient.
        let logp_ref = vec![
            vec![-1.0, -2.5, -0.3, -3.0, -1.7],
            vec![-2.0, -0.5, -2.2, -1.1],
        ];
        let log_probs = |gpt: &mut Gpt<CpuBackend>| -> Vec<Vec<f32>> {
            rows.iter()
                .map(|&(ids, targets)| {
                    let logits = gpt.logits(shape, ids).unwrap();
                    (targets.iter().enumerate())
                        .filter(|&(_, &t)| t != IGNORE_TARGET)
                        .map(|(p, &t)| {
                            crate::model::layers::log_prob(
                                &logits[p * 11..(p + 1) * 11],
                                t as usize,
                            )
                        })
                        .collect()
                })
                .collect()
        };
        // The sampling policy's log-probs stay those of the unperturbed model.
        let old = log_probs(&mut gpt);
        // The objective from the logits, as grpo_loss defines it.
        let objective = |gpt: &mut Gpt<CpuBackend>| -> f64 {
            let seqs: Vec<SequenceLogProbs> = (log_probs(gpt).into_iter())
                .zip(&old)
                .zip(&logp_ref)
                .map(|((logp, o), r)| SequenceLogProbs {
                    logp,
                    logp_old: o.clone(),
                    logp_ref: Some(r.clone()),
                })
                .collect();
            f64::from(grpo_loss(loss_cfg, &seqs, &advantages).unwrap().0)
        };
        let tokens = logp_ref.iter().map(Vec::len).collect();
        let hook = std::sync::Arc::new(
            GrpoTokenLoss::new(
                loss_cfg,
                advantages.clone(),
                tokens,
                Some(logp_ref.clone()),
                vec![vec![0, 1]],
            )
            .unwrap(),
        );
        gpt.chunks_mut()[0]
            .set_token_loss(Some(hook.clone()))
            .unwrap();
        gpt.zero_grads().unwrap();
        let (ids, targets): (Vec<u32>, Vec<u32>) = rows
            .iter()
            .flat_map(|&(i, t)| i.iter().copied().zip(t.iter().copied()))
            .unzip();
        let packed = Shape { batch: 2, seq: 6 };
        let hooked = f64::from(
            gpt.forward_backward(0, packed, &ids, &targets, 1.0)
                .unwrap(),
        );
        gpt.chunks_mut()[0].set_token_loss(None).unwrap();
        let at = objective(&mut gpt);
        assert!((hooked - at).abs() < 1e-5, "hooked loss {hooked} vs {at}");
        assert!(hook.mean_kl().unwrap() > 0.0);
        let names = gpt.param_names();
        for name in [&names[names.len() - 1], &names[2]] {
            let grad = gpt.grad_values(name).unwrap();
            let mut order: Vec<usize> = (0..grad.len()).collect();
            order.sort_by(|&a, &b| grad[b].abs().total_cmp(&grad[a].abs()));
            let values = gpt.param_values(name).unwrap();
            for &j in &order[..4] {
                let h = 1e-2f32;
                let mut at_j = |x: f32| {
                    let mut v = values.clone();
                    v[j] = x;
                    gpt.set_param(name, &v).unwrap();
                    objective(&mut gpt)
                };
                let fd = (at_j(values[j] + h) - at_j(values[j] - h)) / f64::from(2.0 * h);
                gpt.set_param(name, &values).unwrap();
                let g = f64::from(grad[j]);
                assert!(
                    (fd - g).abs() <= 2e-2 * g.abs() + 1e-4,
                    "{name}[{j}]: finite difference {fd} vs analytic {g}"
                );
            }
        }
    }
}
