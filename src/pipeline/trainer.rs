//! [`PipelineTrainer`] runs a job through the actor runtime; [`PipelineRun`] is what it
//! learned and measured.
//!
//! One runtime iteration is one optimizer step. The runtime runs on its own thread while
//! the caller's thread receives each completed step's [`StepMetrics`] and hands it to the
//! caller's `on_step` (a progress bar, a metrics file), so nothing the caller does is
//! timed as stage work. [`PipelineTrainer::run_profiled`] also hands over the step's
//! measured timeline (its bubble ratios), which the runtime publishes as soon as every rank
//! has reported the iteration: the step's callback waits for both.
//! [`PipelineTrainer::run_observed`] hands over the whole [`StepView`]: the iteration's
//! profile (with its bubbles and filler work) and the drafter's figures.
//!
//! With [`PipelineTrainer::filler`]`(Filler::Drafter)` (what `pipefill train` asks for when the
//! job's `filler` is `"drafter"`, its default) the run trains
//! the drafter in the bubbles ([`super::fill`]): a [`FillerRouter`] hands each rank's bubbles
//! drafter slices and steps that fit them. Every few steps the caller's thread measures the
//! drafter's top-1 agreement with the target on held-out rows, from the weights the drafter
//! publishes; [`PipelineRun::drafter`] holds every replica's final weights and the router's
//! figures.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::Duration;

use pipefill_actors::{
    Clock, FillerRouter, IterationProfile, Pipeline, PlanSource, RunReport, StepMode,
};

use super::compute::RankCompute;
use super::feed::StepFeed;
use super::fill::{DrafterFill, HELD_OUT_EVERY, HeldOutEval};
use super::join::{DrafterRun, DrafterStep, StepJoin, StepView};
use super::shared::{RankFinal, Shared};
use super::{PipelineError, check_plan};
use crate::config::{Filler, JobConfig};
use crate::data::StepData;
use crate::model::checkpoint::{Checkpoint, HostTensor};
use crate::model::drafter::state::DrafterState;
use crate::model::{AdamW, Cut, Gpt, ModelError, OptimizerState};
use crate::schedules::{
    ActionKind, AutoReplanner, CostModel, Plan, ScheduleKind, StageCost, Timeline, build,
    read_plan, simulate,
};
use crate::tensor::CpuBackend;
use crate::train::StepMetrics;
use crate::train::reference::adamw_config;

/// A pipelined training job: a [`JobConfig`] and the [`Plan`] its ranks follow.
#[derive(Debug, Clone)]
pub struct PipelineTrainer {
    job: JobConfig,
    plan: Plan,
    clock: Clock,
    resume: Option<Checkpoint>,
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

/// The runtime's clock for the job file's `clock`.
fn clock_of(job: &JobConfig) -> Clock {
    match job.clock {
        crate::config::Clock::Virtual => Clock::virtual_free(),
        crate::config::Clock::Wall => Clock::Wall,
    }
}

impl PipelineTrainer {
    /// A trainer for `job` following `plan` (compute-only or lowered). The plan's
    /// micro-batches must be the job's `train.micro_batches`, and every stage needs a block.
    pub fn new(job: &JobConfig, plan: Plan) -> Result<Self, PipelineError> {
        job.model.validate()?;
        job.train.validate()?;
        check_plan(&plan, job.model.layers, job.train.micro_batches)?;
        Ok(PipelineTrainer {
            job: job.clone(),
            plan,
            clock: clock_of(job),
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
        let plan = build(kind, job.stages, job.train.micro_batches, chunks)?;
        Self::new(job, plan)
    }

    /// The plan named by `job.schedule`: a built-in kind, or a `.csv`/`.toml` schedule
    /// file, which must have `job.stages` ranks.
    pub fn from_job(job: &JobConfig) -> Result<Self, PipelineError> {
        let name = job.schedule.trim();
        if name.eq_ignore_ascii_case("none") {
            return Err(PipelineError::Config {
                field: "schedule",
                reason: "is \"none\": that job trains on one device with the reference \
                         trainer, not a pipeline"
                    .into(),
            });
        }
        if let Ok(kind) = name.parse::<ScheduleKind>() {
            return Self::builtin(job, kind, None);
        }
        if name.eq_ignore_ascii_case("auto") {
            // ZB-H1 until every stage is measured, then the auto plan for the measured costs
            // within ZB-H1's own memory (p forwards' activations per rank).
            let mut trainer = Self::builtin(job, ScheduleKind::ZbH1, Some(1))?;
            trainer.auto = Some(AutoReplanner::new(
                job.stages,
                job.train.micro_batches,
                None,
            ));
            return Ok(trainer);
        }
        let plan = read_plan(std::path::Path::new(name))?;
        if plan.num_ranks() != job.stages {
            return Err(PipelineError::Config {
                field: "stages",
                reason: format!(
                    "is {}, but schedule file {name} has {} ranks",
                    job.stages,
                    plan.num_ranks()
                ),
            });
        }
        Self::new(job, plan)
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
    /// `every`-th step of the run; 0: never.
    pub fn checkpoint_every(mut self, every: u64, run_dir: &std::path::Path) -> Self {
        self.checkpoints = (every > 0).then(|| (every, run_dir.to_path_buf()));
        self
    }

    /// What the ranks need to save periodic checkpoints, if the run saves any.
    fn checkpointing(&self) -> Result<Option<super::shared::Checkpointing>, PipelineError> {
        use crate::model::checkpoint::sharded::{Layout, job_fingerprint, param_stages};
        let Some((every, run_dir)) = &self.checkpoints else {
            return Ok(None);
        };
        Ok(Some(super::shared::Checkpointing {
            every: *every,
            run_dir: run_dir.clone(),
            model: self.job.model.clone(),
            data_seed: self.job.train.seed,
            layout: Layout {
                dp: self.replica.as_ref().map_or(1, |r| r.count),
                stage_rank: self.plan.stage_rank.clone(),
            },
            stage_of: param_stages(&self.job.model, self.plan.stages)?,
            config_hash: job_fingerprint(&self.job),
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
        let mut trainer = Self::new(&share, plan)?;
        trainer.job = job.clone();
        trainer.replica = Some(replica);
        Ok(trainer)
    }

    /// Continues from `checkpoint` (parameters, optimizer moments, step); its model and
    /// data seed must be the job's (checked by the run).
    pub fn resume(mut self, checkpoint: &Checkpoint) -> Self {
        self.resume = Some(checkpoint.clone());
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

    /// One [`RankCompute`] per rank, each with its own single-threaded CPU backend (in
    /// virtual-clock mode a stage's thread CPU time must be all of its work).
    fn computes(
        &self,
        shared: &Arc<Shared>,
        steps: u64,
    ) -> Result<Vec<RankCompute<CpuBackend>>, PipelineError> {
        let (job, plan) = (&self.job, &self.plan);
        let resumed = self.resumed_state()?;
        let mut computes = Vec::with_capacity(plan.num_ranks());
        for rank in 0..plan.num_ranks() {
            let backend = CpuBackend::new(1).map_err(ModelError::from)?;
            let mut compute = RankCompute::for_rank(
                job,
                plan,
                rank,
                backend,
                Arc::clone(shared),
                self.first_step(),
                steps,
            )?;
            compute.set_speculative(self.speculative);
            if let Some((gpt, state)) = &resumed {
                compute.load_resumed(gpt, state)?;
            }
            computes.push(compute);
        }
        Ok(computes)
    }

    /// The resumed model and optimizer state, checked against the job by the checkpoint's
    /// own restore.
    fn resumed_state(&self) -> Result<Option<(Gpt<CpuBackend>, OptimizerState)>, PipelineError> {
        let Some(checkpoint) = &self.resume else {
            return Ok(None);
        };
        let be = CpuBackend::new(1).map_err(ModelError::from)?;
        let mut gpt = Gpt::new(&self.job.model, be.clone(), &Cut::Even(1))?;
        let mut optimizer = AdamW::new(adamw_config(&self.job.train));
        checkpoint.restore(&mut gpt, &mut optimizer, self.job.train.seed)?;
        let state = optimizer.state(&be)?;
        Ok(Some((gpt, state)))
    }

    /// Runs `steps` optimizer steps. `on_step` is called on this thread with each step's
    /// metrics as soon as every rank has stepped and the step's iteration is measured.
    pub fn run(
        &self,
        steps: u64,
        mut on_step: impl FnMut(&StepMetrics),
    ) -> Result<PipelineRun, PipelineError> {
        self.run_profiled(steps, |m, _| on_step(m))
    }

    /// Runs `steps` optimizer steps. `on_step` is called on this thread, during the run,
    /// with each step's metrics and the measured [`Timeline`] of its iteration (bubble
    /// ratios, makespan) as soon as both are known: every rank has stepped and reported the
    /// iteration. The timeline is `None` only if the runtime never published it (the step
    /// is then handed over when the run ends).
    pub fn run_profiled(
        &self,
        steps: u64,
        mut on_step: impl FnMut(&StepMetrics, Option<&Timeline>),
    ) -> Result<PipelineRun, PipelineError> {
        self.run_observed(steps, |v| {
            on_step(v.metrics, v.profile.map(|p| &p.timeline))
        })
    }

    /// Runs `steps` optimizer steps. `on_step` is called on this thread, during the run, with
    /// each step's [`StepView`] as soon as every rank has stepped and reported the iteration.
    pub fn run_observed(
        &self,
        steps: u64,
        mut on_step: impl FnMut(&StepView),
    ) -> Result<PipelineRun, PipelineError> {
        if steps == 0 {
            return Err(PipelineError::Config {
                field: "steps",
                reason: "must be at least 1".into(),
            });
        }
        let (job, plan) = (&self.job, &self.plan);
        let feed = match &self.feed {
            Some(feed) => Arc::clone(feed),
            None => {
                let data = StepData::new(job.data.clone(), job.model.seq_len, job.train.seed)?;
                Arc::new(StepFeed::new(data, job.train.clone()))
            }
        };
        feed.prefetch(self.first_step());
        let (progress, steps_rx) = channel();
        let shared = Arc::new(
            Shared::new(plan.num_ranks(), feed, progress)
                .with_replica(self.replica.clone())
                .with_checkpoints(self.checkpointing()?),
        );
        let mut computes = self.computes(&shared, steps)?;
        let (profiles, profiles_rx) = channel();
        let source = match &self.auto {
            Some(replanner) => {
                let mut replanner = replanner.clone();
                PlanSource::Replan(Box::new(move |i, cost| replanner.plan(i, cost)))
            }
            None => PlanSource::Given(plan.clone()),
        };
        let mut pipeline = Pipeline::new(source, self.clock)
            .iterations(steps)
            .step_mode(self.step_mode)
            .on_iteration(profiles);
        if job.train.clip > 0.0 {
            pipeline = pipeline.max_grad_norm(f64::from(job.train.clip));
        }
        let router = FillerRouter::default();
        let fill = match self.filler {
            Filler::Drafter => Some(DrafterFill::join(
                &self.job,
                &self.plan,
                self.first_step(),
                &mut computes,
            )?),
            Filler::None => None,
        };
        if let Some(fill) = &fill {
            // A resumed run continues the checkpoint's drafter, and saves it with its own.
            if let Some(state) = self.resume.as_ref().and_then(|c| c.drafter.as_ref()) {
                fill.import_state(state)?;
            }
            shared.checkpoint_drafter(Arc::clone(fill));
        }
        let mut eval = match &fill {
            Some(fill) => {
                fill.attach(&router);
                pipeline = pipeline.fillers(router.fillers(plan.num_ranks()));
                Some(HeldOutEval::new(&job.model, &job.drafter)?)
            }
            None => None,
        };
        let last_step = self.first_step() + steps - 1;
        let mut agreement = Vec::new();
        let mut measure = |m: &StepMetrics, p: Option<&IterationProfile>| {
            let drafter = fill.as_ref().zip(eval.as_mut()).map(|(fill, eval)| {
                let (slices, loss, _) = fill.take_tally();
                let due = m.step % HELD_OUT_EVERY == 0 || m.step == last_step;
                // A failed measurement only loses the figure; training goes on.
                let measured = due.then(|| eval.measure(fill).ok().flatten()).flatten();
                if let Some((version, a)) = measured {
                    agreement.push((m.step, version, a));
                }
                DrafterStep {
                    version: fill.board().latest().map_or(0, |w| w.version),
                    slices,
                    loss,
                    agreement: measured.map(|(_, a)| a),
                }
            });
            on_step(&StepView {
                metrics: m,
                profile: p,
                drafter,
            });
        };
        let mut join = StepJoin::new(self.first_step(), profiles_rx, &mut measure);
        let outcome = std::thread::scope(|scope| {
            let runner = scope.spawn(|| pipeline.run_blocking(computes));
            loop {
                match steps_rx.recv_timeout(Duration::from_millis(20)) {
                    Ok(m) => join.metrics(m),
                    Err(RecvTimeoutError::Timeout) if !runner.is_finished() => join.poll(),
                    Err(_) => break,
                }
            }
            let outcome = runner.join();
            while let Ok(m) = steps_rx.try_recv() {
                join.metrics(m);
            }
            outcome
        });
        let metrics = join.finish();
        let report = match outcome {
            Ok(report) => report?,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        shared.join_checkpoints()?;
        let finals = shared.take_finals().ok_or(PipelineError::NoFinalState)?;
        // An auto-scheduled run is predicted (and reported) by the plan its last step ran.
        let plan = match (&self.auto, &report.plan) {
            (Some(_), Some(last)) => last.as_ref(),
            _ => plan,
        };
        let predicted = match &report.measured_cost {
            Some(cost) => Some(simulate(plan, cost)?),
            None => None,
        };
        let drafter = match &fill {
            Some(fill) => Some(DrafterRun {
                replicas: fill.settle()?,
                router: router.stats(),
                agreement,
            }),
            None => None,
        };
        let mut run = PipelineRun::new(self, metrics, report, predicted, finals);
        run.drafter = drafter;
        run.drafter_state = fill.map(|f| f.export_state()).transpose()?;
        Ok(run)
    }
}

/// What a pipelined run learned and measured.
#[derive(Debug, Clone)]
pub struct PipelineRun {
    /// Each step's metrics, in step order.
    pub steps: Vec<StepMetrics>,
    /// The runtime's report: per-iteration measured timelines and action records.
    pub report: RunReport,
    /// Per-stage median T_F, T_I, T_W (seconds) over the whole run.
    pub measured_cost: Option<CostModel>,
    /// The simulator's timeline of the plan under [`PipelineRun::measured_cost`].
    pub predicted: Option<Timeline>,
    pub plan: Plan,
    job: JobConfig,
    /// The step after the last one run.
    next_step: u64,
    /// Final parameters in model order.
    params: Vec<HostTensor>,
    optimizer: OptimizerState,
    /// The drafter trained in the bubbles (`filler = "drafter"`).
    pub drafter: Option<DrafterRun>,
    /// Its whole state after the run, for the final checkpoint.
    drafter_state: Option<DrafterState>,
}

impl PipelineRun {
    fn new(
        trainer: &PipelineTrainer,
        mut steps: Vec<StepMetrics>,
        report: RunReport,
        predicted: Option<Timeline>,
        mut finals: Vec<RankFinal>,
    ) -> Self {
        steps.sort_by_key(|m| m.step);
        let mut by_stage: BTreeMap<u32, Vec<HostTensor>> = BTreeMap::new();
        let mut optimizer = OptimizerState::default();
        for fin in &mut finals {
            by_stage.extend(std::mem::take(&mut fin.stages));
            optimizer.step = fin.optimizer.step;
            optimizer.slots.append(&mut fin.optimizer.slots);
        }
        // The plan the last step ran (an auto-scheduled run's may differ from its first).
        let plan = match (&trainer.auto, &report.plan) {
            (Some(_), Some(last)) => last.as_ref().clone(),
            _ => trainer.plan.clone(),
        };
        PipelineRun {
            measured_cost: report.measured_cost.clone(),
            next_step: trainer.first_step() + report.iterations.len() as u64,
            steps,
            report,
            predicted,
            plan,
            job: trainer.job.clone(),
            params: by_stage.into_values().flatten().collect(),
            optimizer,
            drafter: None,
            drafter_state: None,
        }
    }

    /// The measured timeline of every iteration (= step), in order.
    pub fn timelines(&self) -> impl Iterator<Item = &Timeline> {
        self.report.iterations.iter().map(|i| &i.timeline)
    }

    /// Per-stage **mean** T_F, T_I, T_W (seconds) over the iterations from `skip` on (e.g.
    /// 1 to leave out the warm-up iteration); link latency and memory figures as in
    /// [`PipelineRun::measured_cost`]. `None` when some stage has no measured forward.
    ///
    /// Why means next to the runtime's medians: a timeline's busy time is a *sum* of action
    /// costs, which means reproduce exactly; action costs are skewed to the right, so a
    /// prediction under medians under-estimates busy time, and the bubble ratio
    /// (`1 − busy / (ranks × makespan)`) amplifies that error by `(1 − ratio) / ratio`.
    pub fn mean_cost(&self, skip: usize) -> Option<CostModel> {
        let mut sums: BTreeMap<(u32, ActionKind), (f64, usize)> = BTreeMap::new();
        for it in self.report.iterations.iter().skip(skip) {
            for r in &it.records {
                if matches!(
                    r.action.kind,
                    ActionKind::F | ActionKind::I | ActionKind::W | ActionKind::B
                ) {
                    let e = sums.entry((r.action.stage, r.action.kind)).or_default();
                    e.0 += r.duration();
                    e.1 += 1;
                }
            }
        }
        let mean = |stage, kind| sums.get(&(stage, kind)).map(|&(t, n)| t / n as f64);
        let stage = (0..self.plan.stages as u32)
            .map(|s| {
                let f = mean(s, ActionKind::F)?;
                // A plan of fused backwards measures B only: T_I = T_B, T_W = 0, as the
                // runtime's own cost model does.
                let (i, w) = match (mean(s, ActionKind::I), mean(s, ActionKind::B)) {
                    (Some(i), _) => (i, mean(s, ActionKind::W).unwrap_or(0.0)),
                    (None, b) => (b.unwrap_or(0.0), 0.0),
                };
                Some(StageCost { f, i, w })
            })
            .collect::<Option<Vec<_>>>()?;
        let base = self.measured_cost.clone().unwrap_or_default();
        Some(CostModel { stage, ..base })
    }

    /// The simulator's timeline of this run's plan under `cost`.
    pub fn predict(&self, cost: &CostModel) -> Result<Timeline, PipelineError> {
        Ok(simulate(&self.plan, cost)?)
    }

    /// Every parameter's name, in model order.
    pub fn param_names(&self) -> Vec<&str> {
        self.params.iter().map(|p| p.name.as_str()).collect()
    }

    /// A parameter's final values.
    pub fn param_values(&self, name: &str) -> Result<&[f32], PipelineError> {
        self.params
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.data.as_slice())
            .ok_or_else(|| ModelError::UnknownParam(name.to_string()).into())
    }

    /// The step a continuation would start at.
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// The trained model, whole, on a single-threaded CPU backend (evaluation, sampling).
    pub fn model(&self) -> Result<Gpt<CpuBackend>, PipelineError> {
        let be = CpuBackend::new(1).map_err(ModelError::from)?;
        let mut gpt = Gpt::new(&self.job.model, be, &Cut::Even(1))?;
        for p in &self.params {
            gpt.set_param(&p.name, &p.data)?;
        }
        Ok(gpt)
    }

    /// A checkpoint of the final parameters and optimizer state, in the reference trainer's
    /// format, so either trainer can resume it, with the drafter's state when the run
    /// trained one.
    pub fn checkpoint(&self) -> Result<Checkpoint, PipelineError> {
        let gpt = self.model()?;
        let be = gpt.chunks()[0].backend().clone();
        let mut optimizer = AdamW::new(adamw_config(&self.job.train));
        optimizer.load_state(&be, &self.optimizer)?;
        let mut checkpoint =
            Checkpoint::capture(&gpt, &optimizer, self.next_step, self.job.train.seed)?;
        checkpoint.drafter = self.drafter_state.clone();
        Ok(checkpoint)
    }

    /// The drafter's whole state after the run (`filler = "drafter"`).
    pub fn drafter_state(&self) -> Option<&DrafterState> {
        self.drafter_state.as_ref()
    }

    /// Predicted (simulated under the measured costs) next to measured figures of the
    /// last iteration: makespan and both bubble ratios.
    pub fn side_by_side(&self) -> String {
        match &self.predicted {
            Some(p) => self
                .report
                .side_by_side(self.report.iterations.len().saturating_sub(1), p),
            None => "no prediction: not every stage was measured\n".into(),
        }
    }
}
