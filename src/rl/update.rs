//! The RL update's step: a rollout batch as pipeline micro-batches, and the GRPO loss the
//! last stage's head takes for them.
//!
//! [`update_step`] packs the step's `n = rl.prompts × rl.group` sequences into
//! micro-batches of `rl.group` rows each (what `pipefill rl` and `launch rl` train on):
//! `rl.prompts` of them when every sequence has a gradient. Without the KL term a sequence
//! of advantage 0 (every sequence of a group whose rewards are all equal) has exactly zero
//! loss and gradient, so it is left out ([`skippable`]) and the step runs fewer
//! micro-batches ([`needed_micro_batches`]; the caller picks the count its schedule and
//! replicas can run). The loss still divides by all `n` sequences, so the step's gradient
//! is the full batch's, and the optimizer steps as before (even when no sequence is left
//! with a gradient: one micro-batch of a zero-loss sequence then carries the step). With one sequence per micro-batch ([`update_batches`], the plain form the
//! tests and the reference's log-probs use) every matrix product of a stage had one
//! ~50-token row block, too small for packing the weight panels to pay: the update ran far
//! slower than SFT (docs/benchmarks.md, "Smaller figures behind design choices"). Rows are
//! padded to their micro-batch's longest (`PAD` inputs, ignored targets; causal attention
//! keeps the padding out of the real positions, and ignored targets give it no gradient),
//! so the sequences are sorted by length before they are chunked; the chunks are ordered
//! shortest, longest, second shortest, … so that a data-parallel replica's consecutive
//! share holds short and long ones alike.
//!
//! A loss scale per micro-batch cannot weigh each row by its own `A_i / n`, so every
//! packed step hands the head a [`GrpoTokenLoss`] with scale 1: micro-batch `j`'s loss is
//! `Σ_{i in j} w_i · mean_t f_it` over its rows' completion tokens, and the head
//! backpropagates the per-token derivatives. Without KL `f = −log p` and `w_i = A_i / n`
//! (the gradient of the on-policy GRPO objective, see [`super::grpo`], and the same
//! reported surrogate as one micro-batch per sequence with scale `A_i / n`); with KL `f` is
//! [`token_loss`] at `ρ = 1` against the reference's log-probs and `w_i = 1 / n`, which sums
//! to [`super::grpo::grpo_loss`]. Either way the step's gradient is the one-per-sequence
//! update's up to float rounding (tests/rl_update.rs compares them).

use std::sync::{Arc, Mutex, PoisonError};

use super::config::RlConfig;
use super::generator::Rollout;
use super::grpo::{GrpoLoss, token_loss, update_scales};
use crate::data::{MicroBatch, tokenizer};
use crate::model::layers::TokenLoss;
use crate::pipeline::feed::StepBatches;
use crate::rl::RlError;
use crate::tensor::IGNORE_TARGET;

/// The update's step of one micro-batch per rollout (inputs = the sequence without its last
/// token, targets = the next tokens with the prompt's ignored) and loss scale `A_i / n`.
pub fn update_batches(rollouts: &[Rollout], advantages: &[f32]) -> Result<StepBatches, RlError> {
    check_counts(rollouts, advantages)?;
    let batches = rollouts
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (inputs, targets) = row(i, r)?;
            Ok(MicroBatch {
                rows: 1,
                seq_len: inputs.len(),
                inputs,
                targets,
            })
        })
        .collect::<Result<Vec<_>, RlError>>()?;
    Ok(StepBatches {
        batches,
        scales: update_scales(advantages),
        token_loss: None,
    })
}

/// The update's packed step (see the module docs): `micro_batches` micro-batches of at
/// most `rl.group` rows, scale 1 each, the head's [`GrpoTokenLoss`] weighing the rows.
/// With `logp_ref` (each sequence's completion-token log-probs under the frozen reference,
/// as [`super::grpo::reference_log_probs`] computes them on [`update_batches`]) the loss has
/// the KL term, and the hook is returned too, for its KL figure.
///
/// Sequences whose loss and gradient are exactly zero ([`skippable`]) are left out (the
/// shortest of them are kept as padding when `micro_batches` needs more rows than the
/// others fill): `micro_batches` must lie in [`needed_micro_batches`]`..=rl.prompts`. The
/// loss still averages over all `n` sequences, so the gradient is the full step's; with
/// every sequence kept (`rl.prompts` micro-batches and nothing skippable) the layout is
/// the one-group-per-micro-batch packing of the whole step.
pub fn update_step(
    rl: &RlConfig,
    rollouts: &[Rollout],
    advantages: &[f32],
    logp_ref: Option<Vec<Vec<f32>>>,
    micro_batches: usize,
) -> Result<UpdateStep, RlError> {
    check_counts(rollouts, advantages)?;
    if rollouts.len() != rl.sequences() {
        return Err(RlError::Rollout(format!(
            "{} rollouts for {} prompts × group {}",
            rollouts.len(),
            rl.prompts,
            rl.group
        )));
    }
    let needed = needed_micro_batches(rl, advantages);
    if !(needed..=rl.prompts).contains(&micro_batches) {
        return Err(RlError::Packing {
            micro_batches,
            needed,
            prompts: rl.prompts,
        });
    }
    let rows = rollouts
        .iter()
        .enumerate()
        .map(|(i, r)| row(i, r))
        .collect::<Result<Vec<_>, RlError>>()?;
    let lens: Vec<usize> = rows.iter().map(|(x, _)| x.len()).collect();
    let selected = selection(rl, advantages, &lens, micro_batches);
    let layout: Vec<Vec<usize>> = packing(
        &selected.iter().map(|&i| lens[i]).collect::<Vec<_>>(),
        rl.group,
    )
    .into_iter()
    .map(|chunk| chunk.into_iter().map(|j| selected[j]).collect())
    .collect();
    let batches = layout
        .iter()
        .map(|seqs| {
            let seq_len = seqs.iter().map(|&i| rows[i].0.len()).max().unwrap_or(0);
            let mut inputs = Vec::with_capacity(seqs.len() * seq_len);
            let mut targets = Vec::with_capacity(seqs.len() * seq_len);
            for &i in seqs {
                let (x, t) = &rows[i];
                inputs.extend_from_slice(x);
                inputs.resize(inputs.len() + seq_len - x.len(), tokenizer::PAD);
                targets.extend_from_slice(t);
                targets.resize(targets.len() + seq_len - t.len(), IGNORE_TARGET);
            }
            MicroBatch {
                rows: seqs.len(),
                seq_len,
                inputs,
                targets,
            }
        })
        .collect::<Vec<_>>();
    let mut in_update = vec![false; rollouts.len()];
    for &i in &selected {
        in_update[i] = true;
    }
    let skipped_sequences = in_update.iter().filter(|&&kept| !kept).count();
    let skipped_groups = in_update
        .chunks(rl.group.max(1))
        .filter(|g| g.iter().all(|&kept| !kept))
        .count();
    let tokens = rollouts.iter().map(|r| r.generated.len()).collect();
    let cfg = GrpoLoss {
        clip: rl.clip,
        kl_coef: rl.kl_coef,
    };
    let hook = Arc::new(GrpoTokenLoss::new(
        cfg,
        advantages.to_vec(),
        tokens,
        logp_ref,
        layout,
    )?);
    let kl_hook = hook.has_reference().then(|| Arc::clone(&hook));
    Ok(UpdateStep {
        step: StepBatches {
            scales: vec![1.0; batches.len()],
            batches,
            token_loss: Some(hook),
        },
        kl_hook,
        skipped_sequences,
        skipped_groups,
    })
}

/// A packed update step ([`update_step`]) and what it left out.
#[derive(Debug)]
pub struct UpdateStep {
    pub step: StepBatches,
    /// The head's loss when it has the KL term (for the step's KL figure).
    pub kl_hook: Option<Arc<GrpoTokenLoss>>,
    /// Sequences not in any micro-batch (their loss and gradient are exactly zero).
    pub skipped_sequences: usize,
    /// Groups none of whose sequences is in a micro-batch.
    pub skipped_groups: usize,
}

/// Whether a sequence of advantage `a` has exactly zero loss and gradient, so the update
/// may leave it out: with `ρ = 1` (one on-policy update) its clipped surrogate is `min(ρ·0,
/// clip(ρ)·0) = 0` for every token and its per-token derivative `−A/(len·n) = 0`; with the
/// KL term its tokens still pull towards the reference, so nothing is skippable. GRPO gives
/// `A = 0` to every sequence of a group whose rewards are all equal (DAPO filters those
/// groups for the same reason).
pub fn skippable(rl: &RlConfig, a: f32) -> bool {
    zero_loss(a, rl.kl_coef != 0.0)
}

/// Whether a sequence of advantage `a` has exactly zero loss and gradient: the one rule
/// that both the packing ([`skippable`]) and the head's layout check follow.
fn zero_loss(a: f32, kl_term: bool) -> bool {
    a == 0.0 && !kl_term
}

/// The fewest micro-batches of `rl.group` rows that hold every sequence with a gradient
/// (not [`skippable`]), and at least one: the optimizer steps even when no sequence has a
/// gradient (AdamW's moments and weight decay move the parameters all the same).
pub fn needed_micro_batches(rl: &RlConfig, advantages: &[f32]) -> usize {
    let kept = advantages.iter().filter(|&&a| !skippable(rl, a)).count();
    kept.div_ceil(rl.group.max(1)).max(1)
}

/// The sequences [`update_step`] packs into `micro_batches` chunks of `rl.group` rows, in
/// index order: every one with a gradient, then as many of the shortest skippable ones
/// (ties by index) as it takes for the chunks to number `micro_batches`.
fn selection(
    rl: &RlConfig,
    advantages: &[f32],
    lens: &[usize],
    micro_batches: usize,
) -> Vec<usize> {
    let (mut selected, mut spare): (Vec<usize>, Vec<usize>) =
        (0..advantages.len()).partition(|&i| !skippable(rl, advantages[i]));
    let fill = ((micro_batches.max(1) - 1) * rl.group + 1).saturating_sub(selected.len());
    spare.sort_by_key(|&i| (lens[i], i));
    selected.extend(spare.into_iter().take(fill));
    selected.sort_unstable();
    selected
}

fn check_counts(rollouts: &[Rollout], advantages: &[f32]) -> Result<(), RlError> {
    if rollouts.len() != advantages.len() {
        return Err(RlError::AdvantageCount {
            advantages: advantages.len(),
            sequences: rollouts.len(),
        });
    }
    Ok(())
}

/// Sequence `i`'s inputs (without its last token) and targets (the next tokens, the
/// prompt's ignored): `generated.len()` counted targets.
fn row(i: usize, r: &Rollout) -> Result<(Vec<u32>, Vec<u32>), RlError> {
    if r.prompt.is_empty() || r.generated.is_empty() {
        return Err(RlError::Rollout(format!(
            "sequence {i} has {} prompt and {} generated tokens (each needs one)",
            r.prompt.len(),
            r.generated.len()
        )));
    }
    let ids: Vec<u32> = r.prompt.iter().chain(&r.generated).copied().collect();
    let len = ids.len() - 1;
    let targets = (0..len)
        .map(|t| {
            if t + 1 < r.prompt.len() {
                IGNORE_TARGET
            } else {
                ids[t + 1]
            }
        })
        .collect();
    Ok((ids[..len].to_vec(), targets))
}

/// The sequences of each micro-batch, `rows` per micro-batch (the last may hold fewer):
/// sorted by `lens` (ties by index) and chunked, the chunks ordered shortest, longest,
/// second shortest, second longest, ….
fn packing(lens: &[usize], rows: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| (lens[i], i));
    let chunks: Vec<Vec<usize>> = order.chunks(rows.max(1)).map(<[usize]>::to_vec).collect();
    let (mut lo, mut hi) = (0, chunks.len());
    let mut out = Vec::with_capacity(chunks.len());
    while lo < hi {
        out.push(chunks[lo].clone());
        lo += 1;
        if lo < hi {
            hi -= 1;
            out.push(chunks[hi].clone());
        }
    }
    out
}

/// The GRPO objective of a packed update as the head's per-token loss (see the module
/// docs): micro-batch `j` holds sequences `rows[j]`, row after row, each contributing its
/// `tokens[i]` completion tokens to the micro-batch's counted targets in that order. It
/// also sums the k3 KL it sees (with a reference), for the step's metrics.
#[derive(Debug)]
pub struct GrpoTokenLoss {
    cfg: GrpoLoss,
    advantages: Vec<f32>,
    tokens: Vec<usize>,
    /// Each sequence's reference log-probs (the KL term); `None`: no KL term.
    logp_ref: Option<Vec<Vec<f32>>>,
    rows: Vec<Vec<usize>>,
    /// `(Σ k3, tokens)` over the forwards so far.
    kl: Mutex<(f64, usize)>,
}

impl GrpoTokenLoss {
    /// The loss of `advantages.len()` sequences of `tokens` completion tokens each, laid
    /// out in micro-batches as `rows` says (every sequence at most once, and one left out
    /// only if its loss is exactly zero: advantage 0, no KL term); with `logp_ref`,
    /// `tokens[i]` log-probs for each sequence, the KL term of `cfg`.
    pub fn new(
        cfg: GrpoLoss,
        advantages: Vec<f32>,
        tokens: Vec<usize>,
        logp_ref: Option<Vec<Vec<f32>>>,
        rows: Vec<Vec<usize>>,
    ) -> Result<Self, RlError> {
        let n = advantages.len();
        let count = |sequences| RlError::AdvantageCount {
            advantages: n,
            sequences,
        };
        if tokens.len() != n {
            return Err(count(tokens.len()));
        }
        if let Some(r) = &logp_ref {
            if r.len() != n {
                return Err(count(r.len()));
            }
            if let Some(sequence) = (0..n).find(|&i| r[i].len() != tokens[i]) {
                return Err(RlError::GrpoLength {
                    sequence,
                    what: "logp_ref",
                    got: r[sequence].len(),
                    expected: tokens[sequence],
                });
            }
        }
        let mut seen = vec![0usize; n];
        for &i in rows.iter().flatten() {
            match seen.get_mut(i) {
                Some(s) => *s += 1,
                None => return Err(RlError::Layout(format!("no sequence {i} of {n}"))),
            }
        }
        if let Some(i) = seen.iter().position(|&s| s > 1) {
            return Err(RlError::Layout(format!(
                "sequence {i} is in {} micro-batch rows, not one",
                seen[i]
            )));
        }
        // A sequence may be left out only if its loss and gradient are exactly zero, so
        // that the micro-batches' losses still sum to the whole step's objective.
        if let Some(i) =
            (0..n).find(|&i| seen[i] == 0 && !zero_loss(advantages[i], logp_ref.is_some()))
        {
            return Err(RlError::Layout(format!(
                "sequence {i} is in no micro-batch but has a loss (advantage {}{})",
                advantages[i],
                if logp_ref.is_some() { ", KL term" } else { "" }
            )));
        }
        Ok(GrpoTokenLoss {
            cfg,
            advantages,
            tokens,
            logp_ref,
            rows,
            kl: Mutex::new((0.0, 0)),
        })
    }

    /// Whether the loss has the KL term (a reference's log-probs).
    pub fn has_reference(&self) -> bool {
        self.logp_ref.is_some()
    }

    /// Mean k3 KL to the reference per completion token, over the forwards so far.
    pub fn mean_kl(&self) -> Option<f64> {
        let (sum, n) = *self.kl.lock().unwrap_or_else(PoisonError::into_inner);
        (n > 0).then(|| sum / n as f64)
    }
}

impl TokenLoss for GrpoTokenLoss {
    fn loss(&self, mb: usize, logp: &[f32]) -> Result<(f32, Vec<f32>), String> {
        let Some(rows) = self.rows.get(mb) else {
            return Err(format!("no micro-batch {mb} of {}", self.rows.len()));
        };
        let expected: usize = rows.iter().map(|&i| self.tokens[i]).sum();
        if logp.len() != expected {
            return Err(format!(
                "micro-batch {mb} has {} counted targets, its sequences {expected} completion \
                 tokens",
                logp.len()
            ));
        }
        let n = self.advantages.len().max(1) as f64;
        let (mut total, mut kl) = (0.0f64, 0.0f64);
        let mut grads = Vec::with_capacity(logp.len());
        let mut rest = logp;
        for &i in rows {
            let (own, next) = rest.split_at(self.tokens[i]);
            rest = next;
            // Each sequence counts as the mean over its tokens, the step as the mean over
            // its sequences.
            let per_token = 1.0 / (own.len().max(1) as f64 * n);
            let a = self.advantages[i];
            match &self.logp_ref {
                Some(r) => {
                    for (&lp, &rt) in own.iter().zip(&r[i]) {
                        let (l, g) = token_loss(self.cfg, lp, lp, Some(rt), a);
                        total += f64::from(l) * per_token;
                        grads.push((f64::from(g) * per_token) as f32);
                        let d = f64::from(rt - lp);
                        kl += d.exp() - d - 1.0;
                    }
                }
                // At ρ = 1, ∂loss/∂log p = −A; the value reported is A_i/n · NLL_i.
                None => {
                    let w = f64::from(a) * per_token;
                    for &lp in own {
                        total -= w * f64::from(lp);
                        grads.push((-w) as f32);
                    }
                }
            }
        }
        if self.logp_ref.is_some() {
            let mut acc = self.kl.lock().unwrap_or_else(PoisonError::into_inner);
            acc.0 += kl;
            acc.1 += logp.len();
        }
        Ok((total as f32, grads))
    }
}

#[cfg(test)]
mod tests;
