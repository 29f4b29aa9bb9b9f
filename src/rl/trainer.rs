//! The RL loop of `pipefill rl`: GRPO steps, each a rollout batch then one pipelined update.
//!
//! One step:
//! 1. **Prompts**: `rl.prompts` tasks of the job's families from a stream seeded by
//!    `(rl.seed, step)`, keeping those whose prompt leaves room for `rl.max_new_tokens`.
//! 2. **Rollout**: `rl.group` completions per prompt from the current policy through a
//!    [`RolloutGenerator`] (the plain KV-cache sampler, or speculative decoding, which is
//!    lossless: the samples are distributed the same either way).
//! 3. **Rewards** by exact answer match ([`super::reward`]), **advantages** normalised per
//!    group ([`super::grpo::group_advantages`]).
//! 4. **Update**: one optimizer step of the pipeline with the job's schedule, through
//!    [`PipelineTrainer::feed`]: `rl.prompts` micro-batches of `rl.group` sequences
//!    ([`update_step`](super::update::update_step)), prompt targets ignored, the head weighing each sequence's tokens
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
//! per sequence of [`update_batches`](super::update::update_batches)) and the head's loss takes the per-token KL term.
//!
//! The learning rate decays by cosine from `rl.lr` to `rl.lr / 10` over the RL steps (the
//! update job's warm-up is the step RL starts at, so its schedule starts at the peak).

use std::sync::Arc;

use super::generator::RolloutGenerator;
use super::prompts::PromptSource;
use super::step::{
    RolloutFigures, StepParts, StepRollouts, UpdateOutcome, generate, grpo_step, update_job_of,
};
use super::step_metrics::RlStepMetrics;
use super::update::UpdateStep;
use crate::config::JobConfig;
use crate::model::ModelError;
use crate::model::checkpoint::Checkpoint;
use crate::model::{AdamW, Cut, Gpt};
use crate::pipeline::PipelineError;
use crate::pipeline::feed::StepFeed;
use crate::pipeline::{KeptRanks, PipelineTrainer, StepMetrics};
use crate::rl::RlError;
use crate::tensor::device::RankBackend;
use crate::tensor::{Backend, CpuBackend};
use crate::train::reference::adamw_config;

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
        let backend = CpuBackend::for_rank(0, job.train.precision).map_err(ModelError::from)?;
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

    /// One GRPO step with rollouts from `engine` (`rl::step::grpo_step`, the one GRPO step loop). `on_rollout` is called
    /// between the rollout and the update with the step's mean reward.
    pub fn run_step(
        &mut self,
        engine: &mut dyn RolloutGenerator<B>,
        mut on_rollout: impl FnMut(f64),
    ) -> Result<RlStepMetrics, RlError> {
        let (rl, update, step) = (self.job.rl.clone(), self.update_job(), self.step);
        let mut parts = InProcess {
            trainer: self,
            engine,
            on_rollout: &mut on_rollout,
        };
        let metrics = grpo_step(&rl, &update, step, &mut parts)?;
        self.step += 1;
        Ok(metrics.expect("an in-process step generates its rollouts"))
    }
}

/// An in-process step's parts: rollouts from a local engine under the trainer's policy,
/// the update on the trainer's ranks (which refresh the policy).
struct InProcess<'a, B: RankBackend> {
    trainer: &'a mut RlTrainer<B>,
    engine: &'a mut dyn RolloutGenerator<B>,
    on_rollout: &'a mut dyn FnMut(f64),
}

impl<B: RankBackend> StepParts for InProcess<'_, B> {
    type Error = RlError;

    fn rollouts(&mut self, step: u64) -> Result<(StepRollouts, Option<RolloutFigures>), RlError> {
        let t = &mut *self.trainer;
        let models = (&t.policy, t.reference.as_mut());
        let (rollouts, figures) = generate(
            &t.job,
            &t.prompts,
            self.engine,
            models,
            step,
            self.on_rollout,
        )?;
        Ok((rollouts, Some(figures)))
    }

    fn update(
        &mut self,
        _job: &JobConfig,
        trainer: PipelineTrainer,
        update: UpdateStep,
    ) -> Result<UpdateOutcome, RlError> {
        let (m, bubble_ratio) = self.trainer.update(trainer, update.step)?;
        Ok(UpdateOutcome {
            loss: m.loss,
            grad_norm: m.grad_norm,
            lr: m.lr,
            kl: update.kl_hook.and_then(|h| h.mean_kl()),
            bubble_ratio,
        })
    }

    fn error(&self, error: RlError) -> RlError {
        error
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
