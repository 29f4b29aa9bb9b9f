//! [`PipelineTrainer`] runs a job through the actor runtime; [`PipelineRun`](outcome::PipelineRun) is what it
//! learned and measured.
//!
//! This file holds the trainer's configuration (plan, clock, step mode, filler, resume,
//! periodic checkpoints, data-parallel share) and the ranks' setup; `run` runs it (the
//! runtime on its own thread, the caller's thread joining each step's metrics and profile);
//! `outcome` ([`PipelineRun`](outcome::PipelineRun)) is what a run hands back (final parameters, moments, the drafter,
//! figures); `kept` ([`KeptRanks`](kept::KeptRanks), [`KeptRun`](kept::KeptRun)) runs whose ranks stay alive for the next run (the
//! RL update's steps).
//!
//! One runtime iteration is one optimizer step. The runtime runs on its own thread while
//! the caller's thread receives each completed step's [`crate::train::StepMetrics`] and hands it to the
//! caller's `on_step` (a progress bar, a metrics file), so nothing the caller does is
//! timed as stage work. [`PipelineTrainer::run_profiled`] also hands over the step's
//! measured timeline (its bubble ratios), which the runtime publishes as soon as every rank
//! has reported the iteration: the step's callback waits for both.
//! [`PipelineTrainer::run_observed`] hands over the whole [`super::StepView`]: the
//! iteration's profile (with its bubbles and filler work) and the drafter's figures.
//!
//! With [`PipelineTrainer::filler`]`(Filler::Drafter)` (what `pipefill train` asks for when the
//! job's `filler` is `"drafter"`, its default) the run trains
//! the drafter in the bubbles ([`super::fill`]): a [`pipefill_actors::FillerRouter`] hands each
//! rank's bubbles drafter slices and steps that fit them (or, under `[drafter] placement =
//! "planned"`, each step's planned slices, so the drafter is reproducible and bitwise across
//! a resume). Every few steps the caller's thread measures the drafter's top-1 agreement
//! with the target on held-out rows, from the weights the drafter publishes;
//! [`PipelineRun::drafter`](outcome::PipelineRun::drafter) holds every replica's final weights and the router's figures.

use std::sync::Arc;

use pipefill_actors::{Clock, StepMode};

use super::compute::{RankCompute, RankJob};
use super::executor::{Links, RankStart, rebuild};
use super::feed::StepFeed;
use super::shared::Shared;
use crate::config::{Filler, JobConfig, ScheduleChoice};
use crate::model::ModelError;
use crate::model::checkpoint::Checkpoint;
use crate::model::{Gpt, OptimizerState};
use crate::pipeline::error::PipelineError;
use crate::schedules::{AutoReplanner, Plan, ScheduleKind, build, read_plan};
use crate::tensor::CpuBackend;
use crate::tensor::device::RankBackend;

pub(super) mod kept;
pub(super) mod outcome;
mod run;

/// A pipelined training job: a [`JobConfig`] and the [`Plan`] its ranks follow.
#[derive(Debug, Clone)]
pub struct PipelineTrainer {
    job: JobConfig,
    plan: Plan,
    clock: Clock,
    /// Shared, so that a caller resuming once per step (the RL update) hands it over
    /// without a copy.
    resume: Option<Arc<Checkpoint>>,
    /// This pipeline's place among data-parallel replicas (`None`: the whole batch).
    replica: Option<super::shared::Replica>,
    /// Save a sharded checkpoint every `.0` steps under run directory `.1`.
    checkpoints: Option<(u64, std::path::PathBuf)>,
    step_mode: StepMode,
    speculative: bool,
    /// Steps handed over by the caller instead of the synthetic stream.
    feed: Option<Arc<StepFeed>>,
    filler: Filler,
    /// `schedule = "auto"`: re-plans from the measured costs (the plan above is the ZB-H1
    /// the first iterations run).
    auto: Option<AutoReplanner>,
}

impl PipelineTrainer {
    /// A trainer for `job` following `plan` (compute-only or lowered). The plan's
    /// micro-batches must be the job's `train.micro_batches`, and every stage needs a block.
    pub fn new(job: &JobConfig, plan: Plan) -> Result<Self, PipelineError> {
        job.model.validate()?;
        job.train.validate()?;
        check_plan(&plan, job.model.layers, replica_micro_batches(job)?)?;
        Ok(PipelineTrainer {
            job: job.clone(),
            plan,
            clock: job.clock.runtime(),
            resume: None,
            replica: None,
            checkpoints: None,
            step_mode: StepMode::default(),
            speculative: false,
            feed: None,
            filler: Filler::None,
            auto: None,
        })
    }

    /// A built-in schedule over `job.stages` ranks with `job.train.micro_batches`
    /// micro-batches and `chunks` stages per rank (the kind's default when `None`).
    pub fn builtin(
        job: &JobConfig,
        kind: ScheduleKind,
        chunks: Option<usize>,
    ) -> Result<Self, PipelineError> {
        let chunks = chunks.unwrap_or_else(|| kind.default_chunks());
        let plan = build(kind, job.stages, replica_micro_batches(job)?, chunks)?;
        Self::new(job, plan)
    }

    /// The plan named by `job.schedule`: a built-in kind, or a `.csv`/`.toml` schedule
    /// file, which must have `job.stages` ranks.
    pub fn from_job(job: &JobConfig) -> Result<Self, PipelineError> {
        match &job.schedule {
            ScheduleChoice::None => Err(PipelineError::Config {
                field: "schedule",
                reason: "is \"none\": that job trains on one device with the reference \
                         trainer, not a pipeline"
                    .into(),
            }),
            ScheduleChoice::Builtin(kind) => Self::builtin(job, *kind, None),
            ScheduleChoice::Auto => {
                // ZB-H1 until every stage is measured, then the auto plan for the measured
                // costs within ZB-H1's own memory (p forwards' activations per rank).
                let mut trainer = Self::builtin(job, ScheduleKind::ZbH1, Some(1))?;
                trainer.auto = Some(AutoReplanner::new(
                    job.stages,
                    replica_micro_batches(job)?,
                    None,
                ));
                Ok(trainer)
            }
            ScheduleChoice::File(path) => {
                let plan = read_plan(path)?;
                if plan.num_ranks() != job.stages {
                    return Err(PipelineError::Config {
                        field: "stages",
                        reason: format!(
                            "is {}, but schedule file {} has {} ranks",
                            job.stages,
                            path.display(),
                            plan.num_ranks()
                        ),
                    });
                }
                Self::new(job, plan)
            }
        }
    }

    /// Times the run with `clock` instead of the job's.
    pub fn clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// How the ranks agree on each optimizer step (default: the runtime's post-validation;
    /// [`StepMode::Barrier`] waits for every rank at the end of each step).
    pub fn step_mode(mut self, mode: StepMode) -> Self {
        self.step_mode = mode;
        self
    }

    /// Lets ranks step speculatively under post-validation, before every rank's gradient
    /// statistics are known, rolling back when the exact decision differs (default off: a
    /// rank defers its step until it knows them). Results are the same either way.
    pub fn speculative_steps(mut self, on: bool) -> Self {
        self.speculative = on;
        self
    }

    /// What runs in the bubbles: `job.filler` for the job's own choice (what `pipefill
    /// train` does). Off by default, so a library caller (the RL updates, the tests of the
    /// pipeline's timing) gets exactly the pipeline it built.
    pub fn filler(mut self, filler: Filler) -> Self {
        self.filler = filler;
        self
    }

    /// Saves a sharded checkpoint (one shard per rank, manifest last) under `run_dir`
    /// (`checkpoints/step-N/`, see [`crate::model::checkpoint::sharded`]) after every
    /// `every`-th step of the run; 0: never. The run keeps its newest `checkpoint_keep` of
    /// them (the job's; see [`crate::model::checkpoint::retain`]).
    pub fn checkpoint_every(mut self, every: u64, run_dir: &std::path::Path) -> Self {
        self.checkpoints = (every > 0).then(|| (every, run_dir.to_path_buf()));
        self
    }

    /// What the ranks need to save periodic checkpoints, if the run saves any.
    fn checkpointing(&self) -> Result<Option<super::shared::Checkpointing>, PipelineError> {
        use crate::model::checkpoint::retain::Retention;
        use crate::model::checkpoint::sharded::{Layout, param_stages};
        let Some((every, run_dir)) = &self.checkpoints else {
            return Ok(None);
        };
        let config_hash = self.job.fingerprint();
        // One per run: it deletes only what this run wrote, or what the run it continues
        // wrote in the same directory.
        let retention = match self.first_step() {
            0 => Retention::new(self.job.checkpoint_keep),
            step => Retention::continuing(self.job.checkpoint_keep, run_dir, &config_hash, step)?,
        };
        Ok(Some(super::shared::Checkpointing {
            every: *every,
            run_dir: run_dir.clone(),
            model: self.job.model.clone(),
            data_seed: self.job.train.seed,
            layout: Layout {
                dp: self.replica.as_ref().map_or(self.job.dp, |r| r.count),
                stage_rank: self.plan.stage_rank.clone(),
            },
            stage_of: param_stages(&self.job.model, self.plan.stages)?,
            config_hash,
            retention: Arc::new(retention),
        }))
    }

    /// A trainer for replica `replica.index` of `replica.count` data-parallel pipelines of
    /// the same plan (see [`super::shared::Replica`]): each runs its share of every step's
    /// micro-batches, with the whole batch's loss scales, and each rank all-reduces its
    /// gradients with the same rank of the other replicas before the optimizer step. The
    /// job's `train.micro_batches` is the whole batch; `plan` runs
    /// `train.micro_batches / replica.count` of them.
    pub fn replica(
        job: &JobConfig,
        plan: Plan,
        replica: super::shared::Replica,
    ) -> Result<Self, PipelineError> {
        let (m, n) = (job.train.micro_batches, replica.count);
        if n == 0 || replica.index >= n || m % n != 0 {
            return Err(PipelineError::Config {
                field: "dp",
                reason: format!(
                    "replica {} of {n} cannot take an equal share of train.micro_batches = {m}",
                    replica.index
                ),
            });
        }
        let mut share = job.clone();
        share.train.micro_batches = m / n;
        share.dp = 1;
        let mut trainer = Self::new(&share, plan)?;
        trainer.job = job.clone();
        trainer.replica = Some(replica);
        Ok(trainer)
    }

    /// Continues from `checkpoint` (parameters, optimizer moments, step); its model and
    /// data seed must be the job's (checked by the run).
    pub fn resume(self, checkpoint: &Checkpoint) -> Self {
        self.resume_shared(Arc::new(checkpoint.clone()))
    }

    /// [`PipelineTrainer::resume`] without copying `checkpoint` (parameters and moments,
    /// three times the model's size).
    pub fn resume_shared(mut self, checkpoint: Arc<Checkpoint>) -> Self {
        self.resume = Some(checkpoint);
        self
    }

    /// Trains on `feed`'s steps (e.g. [`StepFeed::given`] RL rollouts with their loss
    /// scales) instead of the job's synthetic data stream.
    pub fn feed(mut self, feed: Arc<StepFeed>) -> Self {
        self.feed = Some(feed);
        self
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn job(&self) -> &JobConfig {
        &self.job
    }

    /// The step the run starts at (0, or the resumed checkpoint's).
    pub fn first_step(&self) -> u64 {
        self.resume.as_ref().map_or(0, |c| c.meta.step)
    }

    /// What each rank of a run of `steps` steps from `first_step` is built from.
    pub(super) fn rank_run(
        &self,
        shared: &Arc<Shared>,
        first_step: u64,
        steps: u64,
    ) -> RankJob<'_> {
        RankJob::new(&self.job, &self.plan, shared, (first_step, steps))
    }

    /// The backends of `count` ranks of this process (every replica's, in global rank
    /// order): on the wall clock they share the job's threads, since it times what the
    /// ranks take together; the virtual clock times each rank by its own thread's CPU
    /// time, so each computes on one ([`RankBackend::for_ranks`]).
    fn backends<B: RankBackend>(&self, count: usize) -> Result<Vec<B>, PipelineError> {
        let threads = match self.clock {
            Clock::Wall => crate::train::reference::cpu_threads(&self.job.train),
            _ => 1,
        };
        let backends = B::for_ranks(0..count, self.job.train.precision, threads);
        Ok(backends.map_err(ModelError::from)?)
    }

    /// One [`RankCompute`] per rank of one replica, on `backends` (one each, in rank order;
    /// see [`PipelineTrainer::backends`]).
    fn computes<B: RankBackend>(
        &self,
        shared: &Arc<Shared>,
        steps: u64,
        backends: Vec<B>,
        resumed: Option<&(Gpt<CpuBackend>, OptimizerState)>,
    ) -> Result<Vec<RankCompute<B>>, PipelineError> {
        let mut computes = Vec::with_capacity(backends.len());
        for (rank, backend) in backends.into_iter().enumerate() {
            let run = self.rank_run(shared, self.first_step(), steps);
            let start = match resumed {
                Some((gpt, state)) => RankStart::Resumed(gpt, state),
                None => RankStart::Fresh,
            };
            let mut compute = RankCompute::start(run, rank, backend, start)?;
            compute.set_speculative(self.speculative);
            computes.push(compute);
        }
        Ok(computes)
    }

    /// The collectives of the replicas this trainer runs: the one it was made
    /// ([`PipelineTrainer::replica`]), or the job's `dp` replicas, all in this process.
    fn links(&self) -> Vec<Links> {
        match &self.replica {
            Some(replica) => vec![Links {
                replica: Some(replica.clone()),
                tie: Shared::tie_in_process(&self.job.model, &self.plan),
                ..Links::default()
            }],
            None => Links::in_process(&self.job, &self.plan, self.job.dp),
        }
    }

    /// The resumed model and optimizer state, checked against the job by the checkpoint's
    /// own restore.
    pub(super) fn resumed_state(
        &self,
    ) -> Result<Option<(Gpt<CpuBackend>, OptimizerState)>, PipelineError> {
        self.resume
            .as_ref()
            .map(|checkpoint| rebuild(&self.job, checkpoint, true))
            .transpose()
    }
}

/// The micro-batches of each step one pipeline runs: `train.micro_batches` shared equally
/// by the job's `dp` replicas.
fn replica_micro_batches(job: &JobConfig) -> Result<usize, PipelineError> {
    let (m, dp) = (job.train.micro_batches, job.dp.max(1));
    if !m.is_multiple_of(dp) {
        return Err(PipelineError::Config {
            field: "dp",
            reason: format!(
                "is {dp}, which cannot share train.micro_batches = {m} equally between replicas"
            ),
        });
    }
    Ok(m / dp)
}

/// Stages per rank of `plan`, or why the plan cannot drive the model.
fn check_plan(plan: &Plan, layers: usize, microbatches: usize) -> Result<(), PipelineError> {
    let bad = |field, reason| Err(PipelineError::Config { field, reason });
    if plan.num_ranks() == 0 || plan.stages == 0 {
        return bad("plan", "has no ranks or no stages".into());
    }
    if plan.stages > layers {
        return bad(
            "model.layers",
            format!(
                "is {layers}, fewer than the plan's {} stages (each stage needs a block)",
                plan.stages
            ),
        );
    }
    if plan.microbatches != microbatches {
        return bad(
            "train.micro_batches",
            format!(
                "is {microbatches}, but the plan runs {} micro-batches per step",
                plan.microbatches
            ),
        );
    }
    if plan.stage_rank.len() != plan.stages {
        return bad(
            "plan",
            format!(
                "places {} stages but has {}",
                plan.stage_rank.len(),
                plan.stages
            ),
        );
    }
    if let Some(r) = (0..plan.num_ranks()).find(|&r| plan.stages_of(r).is_empty()) {
        return bad("plan", format!("rank {r} holds no stage"));
    }
    Ok(())
}
