//! One GRPO step, written once ([`grpo_step`]) for the in-process trainer
//! ([`super::trainer::RlTrainer::run_step`]) and a launched run's ranks
//! ([`super::launched::rl_rank_on`]).
//!
//! A step is: the step's rollouts with their advantages (and, with the KL term, the
//! reference's log-probs), the fewest micro-batches the sequences with a gradient fit
//! ([`fitted_update`]), those micro-batches ([`update_step`]), one pipelined optimizer step,
//! and the step's [`RlStepMetrics`]. Two things differ between the runs, and they are the
//! two methods of [`StepParts`]: where the rollouts come from (a local engine; or rank 0's,
//! after the weight sync, broadcast to every rank) and where the update runs (this
//! process's ranks over in-process links; or this rank over the mesh, with rank 0 gathering
//! the losses, KL and profiles). Whoever generated the rollouts ([`generate`]) has their
//! [`RolloutFigures`] and reports the step.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::generator::{Rollout, RolloutBatch, RolloutGenerator, RolloutRequest};
use super::grpo::{group_advantages, reference_log_probs};
use super::prompts::PromptSource;
use super::reward::generated_len;
use super::step_metrics::CompletionLengths;
use super::step_metrics::{RlStepMetrics, StepTimes, UpdateFigures};
use super::update::{UpdateStep, needed_micro_batches, update_batches, update_step};
use crate::config::JobConfig;
use crate::config::rl::RlConfig;
use crate::model::Gpt;
use crate::pipeline::PipelineError;
use crate::pipeline::PipelineTrainer;
use crate::rl::RlError;
use crate::tensor::Backend;

/// A step's rollouts as the update needs them (and as rank 0 sends them to the other
/// ranks): the sequences, their advantages and, with the KL term, each sequence's
/// completion-token log-probs under the reference.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct StepRollouts {
    pub rollouts: Vec<Rollout>,
    pub advantages: Vec<f32>,
    pub logp_ref: Option<Vec<Vec<f32>>>,
}

impl StepRollouts {
    /// The update's step in `micro_batches` micro-batches ([`update_step`]), with the KL
    /// term's hook (for its KL figure).
    pub fn update(&self, rl: &RlConfig, micro_batches: usize) -> Result<UpdateStep, RlError> {
        update_step(
            rl,
            &self.rollouts,
            &self.advantages,
            self.logp_ref.clone(),
            micro_batches,
        )
    }

    /// The fewest micro-batches the update can run in ([`needed_micro_batches`]).
    pub fn needed_micro_batches(&self, rl: &RlConfig) -> usize {
        needed_micro_batches(rl, &self.advantages)
    }
}

/// What a step's scored rollouts come to ([`RlStepMetrics`]).
pub(crate) struct ScoredFigures {
    /// [`mean_reward`] of the rewards.
    pub reward: f64,
    /// Groups with a non-zero advantage (the only ones with a gradient).
    pub informative_groups: usize,
    /// Tokens generated, each completion up to and with its `EOS` ([`generated_len`]).
    pub generated_tokens: usize,
    pub completion_lengths: CompletionLengths,
}

/// The figures of a rollout, where it was generated: those of [`RlStepMetrics`] that the
/// rollout measures.
pub(crate) struct RolloutFigures {
    pub scored: ScoredFigures,
    pub sequences: usize,
    pub reference_seconds: f64,
    /// A launched run's weight sync before the rollout.
    pub sync_seconds: Option<f64>,
    pub speculation: bool,
    /// The engine's own figures (live batch, acceptance, idle time, drafter work, ...); its
    /// rollouts are [`StepRollouts::rollouts`].
    pub batch: RolloutBatch,
}

/// What the update reports of itself (meaningful where the step is reported).
pub(crate) struct UpdateOutcome {
    /// The update's loss as one pipeline combines its micro-batches' losses.
    pub loss: f32,
    pub grad_norm: f32,
    pub lr: f32,
    /// Mean k3 KL to the reference per completion token (KL only).
    pub kl: Option<f64>,
    pub bubble_ratio: Option<f64>,
}

/// The two parts of a GRPO step that differ between runs.
pub(crate) trait StepParts {
    type Error;

    /// Step `step`'s rollouts, with their figures where this process generated them.
    fn rollouts(
        &mut self,
        step: u64,
    ) -> Result<(StepRollouts, Option<RolloutFigures>), Self::Error>;

    /// Runs the update's optimizer step `update` (of `job`, `trainer`'s plan).
    fn update(
        &mut self,
        job: &JobConfig,
        trainer: PipelineTrainer,
        update: UpdateStep,
    ) -> Result<UpdateOutcome, Self::Error>;

    /// An error of the step itself (fitting and packing the update), as this run's.
    fn error(&self, error: RlError) -> Self::Error;
}

/// RL step `step` with `parts`, the update job `update` (the update's micro-batches are
/// fitted to the step's rollouts from it). Returns the step's metrics where the rollouts
/// were generated (in-process; a launched run's rank 0), else `None`.
pub(crate) fn grpo_step<P: StepParts>(
    rl: &RlConfig,
    update: &JobConfig,
    step: u64,
    parts: &mut P,
) -> Result<Option<RlStepMetrics>, P::Error> {
    let started = Instant::now();
    let (rollouts, figures) = parts.rollouts(step)?;
    let rolled = started.elapsed().as_secs_f64();
    let updated = Instant::now();
    // Every rank of a launched run fits the same count: the advantages are the same bits.
    let needed = rollouts.needed_micro_batches(rl);
    let (job, trainer) = fitted_update(update, needed).map_err(|e| parts.error(e.into()))?;
    let micro_batches = job.train.micro_batches;
    let packed = rollouts
        .update(rl, micro_batches)
        .map_err(|e| parts.error(e))?;
    let (skipped_groups, skipped_sequences) = (packed.skipped_groups, packed.skipped_sequences);
    let outcome = parts.update(&job, trainer, packed)?;
    let update_seconds = updated.elapsed().as_secs_f64();
    let Some(f) = figures else {
        return Ok(None);
    };
    let b = &f.batch;
    let times = StepTimes {
        rollout: rolled - b.drafter_seconds - f.reference_seconds - f.sync_seconds.unwrap_or(0.0),
        reference: f.reference_seconds,
        update: update_seconds,
        sync: f.sync_seconds,
        step: started.elapsed().as_secs_f64(),
    };
    let update = UpdateFigures {
        micro_batches,
        skipped_groups,
        skipped_sequences,
        loss: outcome.loss,
        grad_norm: outcome.grad_norm,
        lr: outcome.lr,
        kl: outcome.kl,
        bubble_ratio: outcome.bubble_ratio,
    };
    Ok(Some(RlStepMetrics::new(step, &f, times, update)))
}

/// Step `step`'s rollouts generated here by `engine` under `policy`: the step's prompts
/// ([`PromptSource::prompts`]), `rl.group` completions each, scored by
/// [`PromptSource::score`] (`on_reward` sees their mean before the advantages are taken),
/// the advantages normalised per group, and the log-probs of `reference` when given.
pub(crate) fn generate<B: Backend>(
    job: &JobConfig,
    source: &PromptSource,
    engine: &mut dyn RolloutGenerator<B>,
    (policy, reference): (&Gpt<B>, Option<&mut Gpt<B>>),
    step: u64,
    on_reward: &mut dyn FnMut(f64),
) -> Result<(StepRollouts, RolloutFigures), RlError> {
    let rl = &job.rl;
    let prompts = source.prompts(step)?;
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| p.ids.clone()).collect();
    let request = RolloutRequest {
        prompts: &ids,
        group: rl.group,
        max_new: rl.max_new_tokens,
        eos: source.eos(),
        step,
    };
    let mut batch = engine.generate(policy, request)?;
    if batch.rollouts.len() != rl.sequences() {
        return Err(RlError::Rollout(format!(
            "{} rollouts for {} prompts × group {}",
            batch.rollouts.len(),
            prompts.len(),
            rl.group
        )));
    }
    let rewards = (batch.rollouts.iter().enumerate())
        .map(|(i, r)| source.score(&prompts[i / rl.group], &r.generated))
        .collect::<Result<Vec<f32>, _>>()?;
    let reward = mean_reward(&rewards);
    // Shown before the advantages are taken, which can fail.
    on_reward(reward);
    let advantages = group_advantages(&rewards, rl.group)?;
    let lens: Vec<usize> = (batch.rollouts.iter())
        .map(|r| generated_len(&r.generated, source.eos()))
        .collect();
    let scored = ScoredFigures {
        reward,
        informative_groups: (advantages.chunks(rl.group))
            .filter(|g| g.iter().any(|&a| a != 0.0))
            .count(),
        generated_tokens: lens.iter().sum(),
        completion_lengths: CompletionLengths::of(&lens),
    };
    let referenced = Instant::now();
    let logp_ref = match reference {
        Some(reference) => {
            let plain = update_batches(&batch.rollouts, &advantages)?;
            Some(reference_log_probs(reference, &plain.batches)?)
        }
        None => None,
    };
    let reference_seconds = referenced.elapsed().as_secs_f64();
    let rollouts = StepRollouts {
        rollouts: std::mem::take(&mut batch.rollouts),
        advantages,
        logp_ref,
    };
    let figures = RolloutFigures {
        scored,
        sequences: rewards.len(),
        reference_seconds,
        sync_seconds: None,
        speculation: engine.speculative(),
        batch,
    };
    Ok((rollouts, figures))
}

/// The mean of `rewards` (the share of the step's rollouts answered correctly).
pub(crate) fn mean_reward(rewards: &[f32]) -> f64 {
    rewards.iter().map(|&r| f64::from(r)).sum::<f64>() / rewards.len() as f64
}

/// The pipeline job of the RL update when RL started at optimizer step `first_update`:
/// `rl.prompts` micro-batches of `rl.group` sequences ([`update_step`]), the RL learning
/// rate (the multi-process update runs it too); a step with skippable sequences runs fewer
/// ([`fitted_update`]).
pub(crate) fn update_job_of(job: &JobConfig, first_update: u64) -> JobConfig {
    let rl: &RlConfig = &job.rl;
    let mut job = job.clone();
    job.train.micro_batches = rl.prompts;
    job.train.micro_batch_size = rl.group;
    job.train.lr = rl.lr;
    job.train.warmup = first_update;
    job.train.steps = first_update + rl.steps;
    job
}

/// The update's pipeline for a step whose sequences with a gradient need `needed`
/// micro-batches ([`needed_micro_batches`]) over the update job's `dp` data-parallel pipelines: the
/// fewest micro-batches from `needed` to `update`'s (`rl.prompts`) that the replicas share
/// equally and the job's schedule runs (a schedule file runs its own count only; some
/// schedules need a multiple of the ranks). Returns the whole step's job and one replica's
/// trainer (the whole pipeline's with one replica).
pub(crate) fn fitted_update(
    update: &JobConfig,
    needed: usize,
) -> Result<(JobConfig, PipelineTrainer), PipelineError> {
    let (full, replicas) = (update.train.micro_batches, update.dp.max(1));
    let with = |m: usize| {
        let mut job = update.clone();
        job.train.micro_batches = m;
        // The trainer plans each replica's share (`m / dp` micro-batches).
        PipelineTrainer::from_job(&job).map(|t| (job, t))
    };
    // Fewer micro-batches than the full count are an optimisation: one the schedule
    // refuses is passed over, and only the full count's error is the job's.
    (needed.max(1)..full)
        .filter(|m| m % replicas == 0)
        .find_map(|m| with(m).ok())
        .map_or_else(|| with(full), Ok)
}
