//! One line of an RL run's `metrics.jsonl` ([`RlStepMetrics`]): what a GRPO step's rollout,
//! drafter, reference and update took and produced. The in-process trainer
//! (`pipefill::rl::trainer`) and a launched job's rank 0 (`pipefill::rl::launched`) fill the
//! same type, so both runs' files have the same fields.

use serde::Serialize;

/// Completion lengths of a step's rollouts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CompletionLengths {
    pub median: f64,
    pub max: usize,
}

impl CompletionLengths {
    /// Of the completions' lengths `lens`.
    pub(crate) fn of(lens: &[usize]) -> Self {
        CompletionLengths {
            median: crate::profile::report::median(lens.iter().map(|&l| l as f64)),
            max: lens.iter().copied().max().unwrap_or(0),
        }
    }
}

/// One line of the RL run's `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RlStepMetrics {
    /// 0-based RL step.
    pub step: u64,
    /// Mean reward of the step's rollouts (the share answered correctly).
    pub reward: f64,
    /// Groups whose rewards differ (the only ones with a gradient).
    pub informative_groups: usize,
    /// Groups the update left out, and sequences (no KL term: advantage 0, exactly no
    /// gradient; see [`super::update::skippable`]).
    pub skipped_groups: usize,
    pub skipped_sequences: usize,
    /// Micro-batches the update ran (`rl.prompts` when nothing is skipped).
    pub update_micro_batches: usize,
    pub sequences: usize,
    /// Generated tokens (up to and with `EOS`).
    pub generated_tokens: usize,
    /// Generation time (drafter training excluded; in a launched run also sending the
    /// rollouts to the other ranks).
    pub rollout_seconds: f64,
    /// The drafter's time on the step's critical path, outside the rollout proper: with
    /// `rl.advanced.drafter_work = "idle-then-after"` the held-out evaluation and the slices that did not
    /// fit the stages' idle time; with `"idle"` only the first step's one-off measurement
    /// of the idle work's costs (see `drafter_work`).
    pub drafter_seconds: f64,
    /// The reference's log-probs of the rollouts (KL only; 0 without).
    pub reference_seconds: f64,
    pub update_seconds: f64,
    /// A launched run's weight sync: every rank's stages in at rank 0 before the rollout
    /// (null in one process, where the policy is the update's own).
    pub sync_seconds: Option<f64>,
    /// Rollout time / whole step time (rollout + drafter + reference + update, and a
    /// launched run's weight sync).
    pub rollout_share: f64,
    /// Idle time of the rollout's stage threads, summed over stages, and the part filled
    /// with routed work (verification passes and drafter slices).
    pub rollout_idle_seconds: Option<f64>,
    pub rollout_idle_filled_seconds: Option<f64>,
    /// Drafter-training slices run in that idle time.
    pub idle_drafter_slices: usize,
    /// The drafter's work and where it ran: in the idle gaps, after the rollout, carried
    /// to the next step or dropped (`rl.advanced.drafter_work`; engines with an idle router).
    pub drafter_work: Option<crate::rl::rollout::idle::DrafterAccount>,
    /// Mean k3 KL to the reference per completion token (KL only).
    pub kl: Option<f64>,
    /// The whole step: prompts, rollout, drafter, rewards, reference, update (and a launched
    /// run's weight sync and gathering of the losses).
    pub step_seconds: f64,
    /// Generated tokens per second of rollout.
    pub tokens_per_s: f64,
    /// Whether the rollouts decoded speculatively.
    pub speculation: bool,
    /// `tokens_per_s` when speculating (else null).
    pub tokens_per_s_sd: Option<f64>,
    /// `tokens_per_s` when not speculating (else null).
    pub tokens_per_s_plain: Option<f64>,
    /// Live sequences after each decode iteration.
    pub live_batch: Vec<usize>,
    /// Generated tokens per sequence (each up to and with its `EOS`, as `generated_tokens`
    /// counts them): median and longest.
    pub completion_lengths: CompletionLengths,
    /// Share of the rollout's time after only its longest 10% of sequences are live
    /// ([`RolloutOutput::tail_share`](crate::rl::rollout::RolloutOutput::tail_share);
    /// generators that do not time their steps: null).
    pub tail_share: Option<f64>,
    pub acceptance_length: Option<f64>,
    pub chosen_k: Option<f64>,
    pub drafter_agreement: Option<f64>,
    /// The update's loss as the pipeline combines its micro-batches' losses: `Σ_i A_i/n ·
    /// NLL_i` over the sequences' mean NLLs (its gradient is GRPO's), or with KL the GRPO
    /// loss, the mean over sequences of their mean per-token loss. A launched run with
    /// replicas and no KL term reports null when a replica's loss scales `A_i / n` sum to
    /// zero (the replica reports its loss over that sum).
    pub surrogate_loss: f32,
    pub grad_norm: f32,
    pub lr: f32,
    /// The update's measured bubble ratio (a launched run's rank 0 merges every rank's
    /// spans).
    pub bubble_ratio: Option<f64>,
}

/// How long the parts of a step took (seconds).
pub(crate) struct StepTimes {
    /// The rollout itself: without the drafter's own work and the reference's log-probs.
    pub rollout: f64,
    pub reference: f64,
    pub update: f64,
    /// The weight sync (a launched run).
    pub sync: Option<f64>,
    /// The whole step.
    pub step: f64,
}

/// What the step's update did, as the pipeline reported it.
pub(crate) struct UpdateFigures {
    pub micro_batches: usize,
    pub skipped_groups: usize,
    pub skipped_sequences: usize,
    /// The GRPO surrogate loss of the whole batch.
    pub loss: f32,
    pub grad_norm: f32,
    pub lr: f32,
    pub kl: Option<f64>,
    pub bubble_ratio: Option<f64>,
}

impl RlStepMetrics {
    /// Step `step`'s line from its rollout's figures, its times and its update: the one
    /// place a line is put together, in process or launched.
    pub(crate) fn new(
        step: u64,
        rollout: &crate::rl::step::RolloutFigures,
        times: StepTimes,
        update: UpdateFigures,
    ) -> Self {
        let (scored, batch, speculation) = (&rollout.scored, &rollout.batch, rollout.speculation);
        let (tokens_per_s, tokens_per_s_sd, tokens_per_s_plain) =
            rollout_rates(scored.generated_tokens, times.rollout, speculation);
        RlStepMetrics {
            step,
            reward: scored.reward,
            informative_groups: scored.informative_groups,
            skipped_groups: update.skipped_groups,
            skipped_sequences: update.skipped_sequences,
            update_micro_batches: update.micro_batches,
            sequences: rollout.sequences,
            generated_tokens: scored.generated_tokens,
            rollout_seconds: times.rollout,
            drafter_seconds: batch.drafter_seconds,
            reference_seconds: times.reference,
            update_seconds: times.update,
            sync_seconds: times.sync,
            rollout_share: times.rollout / times.step.max(1e-9),
            rollout_idle_seconds: batch.idle_seconds,
            rollout_idle_filled_seconds: batch.idle_filled_seconds,
            idle_drafter_slices: batch.idle_drafter_slices,
            drafter_work: batch.drafter_work.clone(),
            kl: update.kl,
            step_seconds: times.step,
            tokens_per_s,
            speculation,
            tokens_per_s_sd,
            tokens_per_s_plain,
            live_batch: batch.live_batch.clone(),
            completion_lengths: scored.completion_lengths,
            tail_share: batch.tail_share,
            acceptance_length: batch.acceptance_length,
            chosen_k: batch.chosen_k,
            drafter_agreement: batch.drafter_agreement,
            surrogate_loss: update.loss,
            grad_norm: update.grad_norm,
            lr: update.lr,
            bubble_ratio: update.bubble_ratio,
        }
    }
}

/// Rollout throughput: generated tokens per second of rollout, and the same figure under
/// `(tokens_per_s_sd, tokens_per_s_plain)` by whether the rollout speculated.
fn rollout_rates(
    generated_tokens: usize,
    rollout_seconds: f64,
    speculation: bool,
) -> (f64, Option<f64>, Option<f64>) {
    let per_s = generated_tokens as f64 / rollout_seconds.max(1e-9);
    (
        per_s,
        speculation.then_some(per_s),
        (!speculation).then_some(per_s),
    )
}

#[cfg(test)]
mod tests {
    use super::RlStepMetrics;
    use crate::config::memory::STEP_LINE_BYTES;

    /// The memory estimate counts a step's lines as [`STEP_LINE_BYTES`].
    #[test]
    fn a_steps_lines_fit_the_memory_estimates_figure() {
        let bytes =
            std::mem::size_of::<crate::train::StepMetrics>() + std::mem::size_of::<RlStepMetrics>();
        assert!(bytes as u64 <= STEP_LINE_BYTES, "{bytes} bytes");
    }
}
