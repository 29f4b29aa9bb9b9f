//! The RL loop of `pipefill rl`: GRPO steps, each a rollout batch then one pipelined update.
//!
//! One step:
//! 1. **Prompts**: `rl.prompts` tasks of the job's families from a stream seeded by
//!    `(rl.seed, step)`, keeping those whose prompt leaves room for `rl.max_new_tokens`.
//! 2. **Rollout**: `rl.group` completions per prompt from the current policy through a
//!    [`RolloutEngine`] (the plain KV-cache sampler, or speculative decoding, which is
//!    lossless: the samples are distributed the same either way).
//! 3. **Rewards** by exact answer match ([`super::reward`]), **advantages** normalised per
//!    group ([`super::grpo::group_advantages`]).
//! 4. **Update**: one optimizer step of the pipeline with the job's schedule, through
//!    [`PipelineTrainer::feed`]: `rl.prompts` micro-batches of `rl.group` sequences
//!    ([`update_step`]), prompt targets ignored, the head weighing each sequence's tokens
//!    by `A_i / n` ([`super::update::GrpoTokenLoss`]). With one on-policy update per
//!    rollout batch the policy ratio is 1, so this is the clipped GRPO objective's gradient
//!    exactly (see [`super::grpo`]). Without the KL term the sequences of advantage 0 (groups
//!    whose rewards are all equal) have exactly no gradient and are left out, so the step
//!    runs fewer micro-batches (`fitted_update`; `n` still counts them). The pipeline's
//!    ranks stay alive from step to step ([`PipelineTrainer::run_kept`]): the next update
//!    continues from their parameters and optimizer moments, and the policy is refreshed
//!    from them buffer to buffer, where resuming each step from a checkpoint copied all of
//!    it out and back (bitwise the same result; [`RlTrainer::keep_update_ranks`]).
//!
//! With `rl.kl_coef = β > 0` the objective adds β·k3-KL to a frozen reference (the policy
//! RL started from, or [`RlTrainer::with_reference`]): the reference's per-token log-probs
//! are computed once per rollout batch ([`super::grpo::reference_log_probs`], one forward
//! per sequence of [`update_batches`]) and the head's loss takes the per-token KL term.
//!
//! The learning rate decays by cosine from `rl.lr` to `rl.lr / 10` over the RL steps (the
//! update job's warm-up is the step RL starts at, so its schedule starts at the peak).

use std::sync::Arc;
use std::time::Instant;

use super::config::RlConfig;
use super::grpo::{GrpoError, group_advantages, reference_log_probs};
use super::prompts::PromptSource;
use super::reward::generated_tokens;
pub use super::step_metrics::RlStepMetrics;
use super::step_metrics::{StepTimes, UpdateFigures};
pub use super::update::{UpdateStep, needed_micro_batches, skippable, update_batches, update_step};
use crate::config::{ConfigError, JobConfig};
use crate::data::{DataError, SplitMix64, Task, TaskGenerator};
use crate::model::checkpoint::Checkpoint;
use crate::model::{AdamW, Cut, Gpt, ModelError};
use crate::pipeline::feed::StepFeed;
use crate::pipeline::{KeptRanks, PipelineError, PipelineTrainer, StepMetrics};
use crate::tensor::device::RankBackend;
use crate::tensor::{Backend, CpuBackend};
use crate::train::reference::adamw_config;

/// What can go wrong in an RL run.
#[derive(Debug, thiserror::Error)]
pub enum RlError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("rl update: {0}")]
    Pipeline(#[from] PipelineError),
    #[error("grpo: {0}")]
    Grpo(#[from] GrpoError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Checkpoint(#[from] crate::model::checkpoint::CheckpointError),
    /// The task stream has too few prompts short enough for the token budget.
    #[error(
        "step {step}: only {found} of {wanted} prompts fit model.seq_len = {seq_len} with \
         rl.max_new_tokens = {max_new} (lower rl.max_new_tokens or data.max_size)"
    )]
    NoPrompts {
        step: u64,
        found: usize,
        wanted: usize,
        seq_len: usize,
        max_new: usize,
    },
    /// An earlier update failed and took the policy's optimizer state with it.
    #[error(
        "update: an earlier step's update failed and lost the optimizer state; restart from \
         the last saved checkpoint"
    )]
    UpdateLost,
    /// A rollout engine returned something the update cannot use.
    #[error("rollout: {0}")]
    Rollout(String),
    /// The update was asked to pack its sequences into a count of micro-batches that
    /// cannot hold the ones with a gradient, or more than one per prompt.
    #[error(
        "update: {micro_batches} micro-batches asked for; the sequences with a gradient need \
         {needed} to {prompts} (rl.prompts)"
    )]
    Packing {
        micro_batches: usize,
        needed: usize,
        prompts: usize,
    },
}

/// One sampled sequence: `BOS` and the prompt's tokens, then the generated tokens (ending
/// in `EOS` unless the token budget cut it off).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rollout {
    pub prompt: Vec<u32>,
    pub generated: Vec<u32>,
}

/// A rollout batch and how it was produced.
#[derive(Debug, Clone, Default)]
pub struct RolloutBatch {
    /// `group` rollouts of every prompt, group after group.
    pub rollouts: Vec<Rollout>,
    /// Live sequences (still generating) after each decode iteration: the long tail.
    pub live_batch: Vec<usize>,
    /// Mean accepted draft tokens per verification + 1 (speculation only).
    pub acceptance_length: Option<f64>,
    /// Mean draft length the engine chose (speculation only).
    pub chosen_k: Option<f64>,
    /// Top-1 agreement of the drafter with the policy on this step's rollouts, before
    /// training on them (engines with a drafter only).
    pub drafter_agreement: Option<f64>,
    /// Seconds of drafter training inside `generate`, after the rollout proper.
    pub drafter_seconds: f64,
    /// Idle time of the rollout's stage threads (summed over stages), and the part of it
    /// filled with routed work (engines with stage threads only).
    pub idle_seconds: Option<f64>,
    pub idle_filled_seconds: Option<f64>,
    /// Drafter-training slices run in the stages' idle time.
    pub idle_drafter_slices: usize,
    /// The drafter's work of the step and where it ran (engines with an idle-work router).
    pub drafter_work: Option<crate::rl::rollout::idle::DrafterAccount>,
}

/// What a step asks of a [`RolloutEngine`]: `group` completions of each of `prompts` (each
/// `BOS` + prompt tokens), each ending at `eos` (the prompts' tokenizer's) or after
/// `max_new` tokens; `step` seeds the sampling.
#[derive(Debug, Clone, Copy)]
pub struct RolloutRequest<'a> {
    pub prompts: &'a [Vec<u32>],
    pub group: usize,
    pub max_new: usize,
    pub eos: u32,
    pub step: u64,
}

impl<'a> RolloutRequest<'a> {
    /// The prompt of each sequence of the batch, in its order: every prompt `group` times,
    /// group after group (as [`RolloutBatch::rollouts`]).
    pub fn sequence_prompts(&self) -> impl Iterator<Item = &'a Vec<u32>> + 'a {
        let group = self.group;
        (self.prompts.iter()).flat_map(move |p| std::iter::repeat_n(p, group))
    }
}

/// Generates the rollouts of a step, on the policy's backend `B`.
pub trait RolloutEngine<B: Backend> {
    /// The completions `request` asks for, under `policy`.
    fn generate(
        &mut self,
        policy: &Gpt<B>,
        request: RolloutRequest<'_>,
    ) -> Result<RolloutBatch, RlError>;

    /// Whether the engine decodes speculatively.
    fn speculative(&self) -> bool;
}

/// RL step `step`'s rollouts from `engine` under `policy`, one reward each: the step's
/// prompts ([`PromptSource::prompts`]), `rl.group` completions each, scored by
/// [`PromptSource::score`]. The in-process trainer and the multi-process rollout rank share
/// it.
pub(crate) fn scored_rollouts<B: Backend>(
    job: &JobConfig,
    source: &PromptSource,
    engine: &mut dyn RolloutEngine<B>,
    policy: &Gpt<B>,
    step: u64,
) -> Result<(RolloutBatch, Vec<f32>), RlError> {
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
    let batch = engine.generate(policy, request)?;
    if batch.rollouts.len() != rl.sequences() {
        return Err(RlError::Rollout(format!(
            "{} rollouts for {} prompts × group {}",
            batch.rollouts.len(),
            prompts.len(),
            rl.group
        )));
    }
    let rewards = batch
        .rollouts
        .iter()
        .enumerate()
        .map(|(i, r)| source.score(&prompts[i / rl.group], &r.generated))
        .collect::<Result<Vec<f32>, _>>()?;
    Ok((batch, rewards))
}

/// The mean of `rewards` (the share of the step's rollouts answered correctly).
pub(crate) fn mean_reward(rewards: &[f32]) -> f64 {
    rewards.iter().map(|&r| f64::from(r)).sum::<f64>() / rewards.len() as f64
}

/// What a step's scored rollouts come to, as both the in-process trainer and a launched
/// run's rank 0 report them ([`RlStepMetrics`]).
pub(crate) struct ScoredFigures {
    /// [`mean_reward`] of the rewards.
    pub reward: f64,
    /// Groups with a non-zero advantage (the only ones with a gradient).
    pub informative_groups: usize,
    /// Tokens generated, up to and with `EOS` ([`generated_tokens`]).
    pub generated_tokens: usize,
}

/// The advantages of `rewards` (groups of `group`, [`group_advantages`]) and the
/// [`ScoredFigures`] of `rollouts` with them; `eos` ends a generation.
pub(crate) fn scored_figures(
    rollouts: &[Rollout],
    rewards: &[f32],
    group: usize,
    eos: u32,
) -> Result<(Vec<f32>, ScoredFigures), RlError> {
    let advantages = group_advantages(rewards, group)?;
    let figures = ScoredFigures {
        reward: mean_reward(rewards),
        informative_groups: advantages
            .chunks(group)
            .filter(|g| g.iter().any(|&a| a != 0.0))
            .count(),
        generated_tokens: generated_tokens(rollouts.iter().map(|r| r.generated.as_slice()), eos),
    };
    Ok((advantages, figures))
}

/// The `count` prompts of RL step `step`: tasks of the job's families, seeded by
/// `(rl.seed, step)`, whose `BOS` + prompt leaves `rl.max_new_tokens` in `model.seq_len`.
pub fn step_prompts(job: &JobConfig, step: u64) -> Result<Vec<Task>, RlError> {
    let (rl, seq_len) = (&job.rl, job.model.seq_len);
    let generator = TaskGenerator::new(
        &job.data.families,
        job.data.size_scale,
        job.data.max_size,
        // Apart from the training stream (seeded by (train.seed, step)) even when the seeds
        // are equal, so RL prompts are not the warm-up's documents.
        SplitMix64::derive(rl.seed ^ 0x5eed_0fa1_u64, step),
    )?;
    // Short prompts are the common case; the bound only guards a budget nothing fits.
    let tasks: Vec<Task> = generator
        .take(1000 * rl.prompts)
        .filter(|t| 1 + t.prompt.chars().count() + rl.max_new_tokens <= seq_len)
        .take(rl.prompts)
        .collect();
    if tasks.len() < rl.prompts {
        return Err(RlError::NoPrompts {
            step,
            found: tasks.len(),
            wanted: rl.prompts,
            seq_len,
            max_new: rl.max_new_tokens,
        });
    }
    Ok(tasks)
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

/// Where the next update starts.
enum UpdateState<B: Backend> {
    /// The checkpoint RL started from (shared with the pipeline that resumes it), or with
    /// [`RlTrainer::keep_update_ranks`] off the previous update's.
    Checkpoint(Arc<Checkpoint>),
    /// The previous update's ranks, alive.
    Kept(KeptRanks<B>),
    /// A failed update took the state with it.
    Lost,
}

/// The RL loop's state: the job, the update's state (parameters and optimizer), the
/// policy's model, the next RL step. The policy, the KL reference and the update's ranks
/// compute on `B` (the job's `device`: [`RlTrainer::on`]).
pub struct RlTrainer<B: RankBackend = CpuBackend> {
    job: JobConfig,
    /// The optimizer step RL started at (the checkpoint's step at the start).
    first_update: u64,
    update: UpdateState<B>,
    /// Whether the update's ranks stay alive between steps (else each update resumes from
    /// the previous one's checkpoint).
    keep_ranks: bool,
    policy: Gpt<B>,
    /// The frozen KL reference (`rl.kl_coef > 0` only).
    reference: Option<Gpt<B>>,
    step: u64,
    prompts: PromptSource,
}

impl RlTrainer<CpuBackend> {
    /// RL from `checkpoint` (a `pipefill train` run's, or [`super::warm_up::warm_up`]'s) on the CPU; the
    /// job's model and data seed must be the checkpoint's.
    pub fn new(job: &JobConfig, checkpoint: Checkpoint) -> Result<Self, RlError> {
        let backend = CpuBackend::new(1).map_err(ModelError::from)?;
        RlTrainer::on(job, checkpoint, backend)
    }
}

impl<B: RankBackend> RlTrainer<B> {
    /// RL from `checkpoint` with the policy (and the KL reference) on `backend`, rank 0's,
    /// and the update's ranks each on their own ([`RankBackend::for_rank`]).
    pub fn on(job: &JobConfig, checkpoint: Checkpoint, backend: B) -> Result<Self, RlError> {
        job.validate()?;
        job.rl.validate(job.model.seq_len)?;
        crate::config::optimizer::OptimizerConfig::check_rl(job)?;
        let reference = (job.rl.kl_coef > 0.0)
            .then(|| restore(job, &checkpoint, backend.clone()))
            .transpose()?;
        let policy = restore(job, &checkpoint, backend)?;
        Ok(RlTrainer {
            job: job.clone(),
            first_update: checkpoint.meta.step,
            update: UpdateState::Checkpoint(Arc::new(checkpoint)),
            keep_ranks: true,
            policy,
            reference,
            step: 0,
            prompts: PromptSource::from_job(job)?,
        })
    }

    /// Uses `reference`'s model as the frozen KL reference instead of the starting policy
    /// (no effect with `rl.kl_coef = 0`).
    pub fn with_reference(mut self, reference: &Checkpoint) -> Result<Self, RlError> {
        if self.reference.is_some() {
            let backend = self.policy.backend().clone();
            self.reference = Some(restore(&self.job, reference, backend)?);
        }
        Ok(self)
    }

    /// Whether the update's pipeline ranks stay alive from step to step (default on);
    /// off, every update resumes from a checkpoint of the previous one, as the
    /// multi-process `launch rl` does. The results are bitwise the same.
    pub fn keep_update_ranks(mut self, keep: bool) -> Self {
        self.keep_ranks = keep;
        self
    }

    /// The policy's checkpoint now: parameters and optimizer state after the last update
    /// (the starting checkpoint before any).
    pub fn checkpoint(&self) -> Result<Checkpoint, RlError> {
        match &self.update {
            UpdateState::Checkpoint(c) => Ok(Checkpoint::clone(c)),
            UpdateState::Kept(ranks) => Ok(ranks.checkpoint()?),
            UpdateState::Lost => Err(RlError::UpdateLost),
        }
    }

    /// What the steps roll out and how they are scored.
    pub fn prompts(&self) -> &PromptSource {
        &self.prompts
    }

    pub fn policy(&self) -> &Gpt<B> {
        &self.policy
    }

    /// The next RL step (= steps done).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The pipeline job of the update: [`update_step`]'s micro-batches, the RL learning rate.
    fn update_job(&self) -> JobConfig {
        update_job_of(&self.job, self.first_update)
    }

    /// One GRPO step with rollouts from `engine`. `on_rollout` is called between the
    /// rollout and the update with the step's mean reward.
    pub fn run_step(
        &mut self,
        engine: &mut dyn RolloutEngine<B>,
        mut on_rollout: impl FnMut(f64),
    ) -> Result<RlStepMetrics, RlError> {
        let rl = self.job.rl.clone();
        let step = self.step;
        let step_started = Instant::now();
        let (batch, rewards) =
            scored_rollouts(&self.job, &self.prompts, engine, &self.policy, step)?;
        let rollout_seconds = step_started.elapsed().as_secs_f64() - batch.drafter_seconds;
        // Shown before the advantages are taken, which can fail.
        on_rollout(mean_reward(&rewards));
        let (advantages, scored) =
            scored_figures(&batch.rollouts, &rewards, rl.group, self.prompts.eos())?;

        let reference_started = Instant::now();
        let logp_ref = match &mut self.reference {
            Some(reference) => {
                let plain = update_batches(&batch.rollouts, &advantages)?;
                Some(reference_log_probs(reference, &plain.batches)?)
            }
            None => None,
        };
        let reference_seconds = reference_started.elapsed().as_secs_f64();
        let started = Instant::now();
        let needed = needed_micro_batches(&rl, &advantages);
        let (job, trainer) = fitted_update(&self.update_job(), needed)?;
        let update_micro_batches = job.train.micro_batches;
        let UpdateStep {
            step: update,
            kl_hook,
            skipped_sequences,
            skipped_groups,
        } = update_step(
            &rl,
            &batch.rollouts,
            &advantages,
            logp_ref,
            update_micro_batches,
        )?;
        let (m, bubble_ratio) = self.update(trainer, update)?;
        let update_seconds = started.elapsed().as_secs_f64();
        self.step += 1;

        let times = StepTimes {
            rollout: rollout_seconds,
            reference: reference_seconds,
            update: update_seconds,
            sync: None,
            step: step_started.elapsed().as_secs_f64(),
        };
        let update = UpdateFigures {
            micro_batches: update_micro_batches,
            skipped_groups,
            skipped_sequences,
            loss: m.loss,
            grad_norm: m.grad_norm,
            lr: m.lr,
            kl: kl_hook.and_then(|h| h.mean_kl()),
            bubble_ratio,
        };
        let sequences = rewards.len();
        let speculation = engine.speculative();
        Ok(RlStepMetrics::new(
            step,
            (&scored, sequences),
            &batch,
            speculation,
            times,
            update,
        ))
    }
}

impl<B: RankBackend> RlTrainer<B> {
    /// Runs `update` (one optimizer step) on `trainer` from the update's state, and
    /// refreshes the policy from its result in place (a fresh model would redo the random
    /// initialisation of every parameter only to overwrite it). Returns the step's metrics
    /// and measured bubble ratio.
    fn update(
        &mut self,
        trainer: PipelineTrainer,
        update: crate::pipeline::feed::StepBatches,
    ) -> Result<(StepMetrics, Option<f64>), RlError> {
        let from = std::mem::replace(&mut self.update, UpdateState::Lost);
        let (trainer, kept) = match from {
            UpdateState::Checkpoint(c) => (trainer.resume_shared(c), None),
            UpdateState::Kept(k) if k.fits(&trainer) => (trainer, Some(k)),
            // A plan that places the stages elsewhere starts from their checkpoint.
            UpdateState::Kept(k) => (trainer.resume(&k.checkpoint()?), None),
            UpdateState::Lost => return Err(RlError::UpdateLost),
        };
        let first = kept
            .as_ref()
            .map_or(trainer.first_step(), KeptRanks::next_step);
        let trainer = trainer.feed(Arc::new(StepFeed::given([(first, update)])));
        if self.keep_ranks {
            let run = trainer.run_kept(kept, 1)?;
            let m = run.steps.first().cloned();
            let bubble_ratio = run
                .report
                .iterations
                .first()
                .map(|i| i.timeline.bubble_ratio);
            run.ranks.copy_params_into(&mut self.policy)?;
            self.update = UpdateState::Kept(run.ranks);
            return Ok((m.ok_or(PipelineError::NoFinalState)?, bubble_ratio));
        }
        // Through a checkpoint (kept ranks, if any, were left by a caller that switched).
        let trainer = match kept {
            Some(k) => trainer.resume(&k.checkpoint()?),
            None => trainer,
        };
        let run = trainer.run(1, |_| {})?;
        let m = run.steps.first().cloned();
        let bubble_ratio = run.timelines().next().map(|t| t.bubble_ratio);
        let checkpoint = run.into_checkpoint();
        for name in self.policy.param_names() {
            let t = checkpoint
                .tensor(&name)
                .ok_or_else(|| ModelError::UnknownParam(name.clone()))?;
            self.policy.set_param(&name, &t.data)?;
        }
        self.update = UpdateState::Checkpoint(Arc::new(checkpoint));
        Ok((m.ok_or(PipelineError::NoFinalState)?, bubble_ratio))
    }
}

/// The whole model of `checkpoint` on `backend`.
fn restore<B: Backend>(
    job: &JobConfig,
    checkpoint: &Checkpoint,
    backend: B,
) -> Result<Gpt<B>, RlError> {
    // Blank: the restore sets every parameter (and fails on a missing one).
    let mut gpt = Gpt::blank(&job.model, backend, &Cut::Even(1))?;
    let mut optimizer = AdamW::new(adamw_config(&job.train));
    checkpoint.restore(&mut gpt, &mut optimizer, job.train.seed)?;
    Ok(gpt)
}
