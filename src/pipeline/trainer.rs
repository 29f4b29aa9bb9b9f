//! [`PipelineTrainer`] runs a job through the actor runtime; [`PipelineRun`] is what it
//! learned and measured.
//!
//! One runtime iteration is one optimizer step. The runtime runs on its own thread while
//! the caller's thread receives each completed step's [`StepMetrics`] and hands it to the
//! caller's `on_step` (a progress bar, a metrics file), so nothing the caller does is
//! timed as stage work. [`PipelineTrainer::run_profiled`] also hands over the step's
//! measured timeline (its bubble ratios), which the runtime publishes as soon as every rank
//! has reported the iteration: the step's callback waits for both.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::Duration;

use pipefill_actors::{Clock, IterationProfile, Pipeline, PlanSource, RunReport, StepMode};

use super::compute::RankCompute;
use super::feed::StepFeed;
use super::shared::{RankFinal, Shared};
use super::{PipelineError, check_plan};
use crate::config::JobConfig;
use crate::data::StepData;
use crate::model::checkpoint::{Checkpoint, HostTensor};
use crate::model::{AdamW, Cut, Gpt, ModelChunk, ModelError, OptimizerState};
use crate::schedules::{
    ActionKind, CostModel, Plan, ScheduleKind, StageCost, Timeline, build, read_plan, simulate,
};
use crate::tensor::CpuBackend;
use crate::train::StepMetrics;
use crate::train::reference::{adamw_config, lr_schedule};

/// A pipelined training job: a [`JobConfig`] and the [`Plan`] its ranks follow.
#[derive(Debug, Clone)]
pub struct PipelineTrainer {
    job: JobConfig,
    plan: Plan,
    clock: Clock,
    resume: Option<Checkpoint>,
    /// This pipeline's place among data-parallel replicas (`None`: the whole batch).
    replica: Option<super::shared::Replica>,
    step_mode: StepMode,
    speculative: bool,
    /// Steps handed over by the caller instead of the synthetic stream.
    feed: Option<Arc<StepFeed>>,
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
            step_mode: StepMode::default(),
            speculative: false,
            feed: None,
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
        let cut = Cut::Even(plan.stages);
        let resumed = self.resumed_state()?;
        let mut computes = Vec::with_capacity(plan.num_ranks());
        for rank in 0..plan.num_ranks() {
            let backend = CpuBackend::new(1).map_err(ModelError::from)?;
            let chunks = plan
                .stages_of(rank)
                .into_iter()
                .map(|s| ModelChunk::new(&job.model, backend.clone(), &cut, s as usize))
                .collect::<Result<Vec<_>, _>>()?;
            let mut compute = RankCompute::new(
                rank,
                backend.clone(),
                chunks,
                adamw_config(&job.train),
                lr_schedule(&job.train),
                Arc::clone(shared),
                self.first_step(),
                steps,
            );
            compute.set_speculative(self.speculative);
            if let Some((gpt, state)) = &resumed {
                let mut names = Vec::new();
                for chunk in compute.chunks_mut() {
                    for name in chunk.param_names() {
                        chunk.set_param(&name, &gpt.param_values(&name)?)?;
                        names.push(name);
                    }
                }
                let own = OptimizerState {
                    step: state.step,
                    slots: names
                        .iter()
                        .filter_map(|n| state.slots.get(n).map(|s| (n.clone(), s.clone())))
                        .collect(),
                };
                compute.optimizer_mut().load_state(&backend, &own)?;
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
        on_step: impl FnMut(&StepMetrics, Option<&Timeline>),
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
            Shared::new(plan.num_ranks(), feed, progress).with_replica(self.replica.clone()),
        );
        let computes = self.computes(&shared, steps)?;
        let (profiles, profiles_rx) = channel();
        let mut pipeline = Pipeline::new(PlanSource::Given(plan.clone()), self.clock)
            .iterations(steps)
            .step_mode(self.step_mode)
            .on_iteration(profiles);
        if job.train.clip > 0.0 {
            pipeline = pipeline.max_grad_norm(f64::from(job.train.clip));
        }
        let mut join = StepJoin::new(self.first_step(), profiles_rx, on_step);
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
        let finals = shared.take_finals().ok_or(PipelineError::NoFinalState)?;
        let predicted = match &report.measured_cost {
            Some(cost) => Some(simulate(plan, cost)?),
            None => None,
        };
        Ok(PipelineRun::new(self, metrics, report, predicted, finals))
    }
}

/// Pairs each step's metrics (from the ranks) with its iteration's measured timeline (from
/// the runtime's profiler) and hands each pair to the caller once both have arrived; the
/// two come on separate channels, in either order.
struct StepJoin<F> {
    first_step: u64,
    profiles: Receiver<IterationProfile>,
    /// Timelines by step, waiting for their metrics.
    timelines: BTreeMap<u64, Timeline>,
    /// Metrics waiting for their timeline.
    waiting: BTreeMap<u64, StepMetrics>,
    done: Vec<StepMetrics>,
    on_step: F,
}

impl<F: FnMut(&StepMetrics, Option<&Timeline>)> StepJoin<F> {
    fn new(first_step: u64, profiles: Receiver<IterationProfile>, on_step: F) -> Self {
        StepJoin {
            first_step,
            profiles,
            timelines: BTreeMap::new(),
            waiting: BTreeMap::new(),
            done: Vec::new(),
            on_step,
        }
    }

    /// Takes the published timelines and hands over every step now complete.
    fn poll(&mut self) {
        while let Ok(p) = self.profiles.try_recv() {
            self.timelines
                .insert(self.first_step + p.iteration, p.timeline);
        }
        let ready: Vec<u64> = self
            .waiting
            .keys()
            .copied()
            .filter(|s| self.timelines.contains_key(s))
            .collect();
        for step in ready {
            if let Some(m) = self.waiting.remove(&step) {
                let tl = self.timelines.remove(&step);
                (self.on_step)(&m, tl.as_ref());
                self.done.push(m);
            }
        }
    }

    fn metrics(&mut self, m: StepMetrics) {
        self.waiting.insert(m.step, m);
        self.poll();
    }

    /// After the run: hands over what is left (with its timeline when it came) and returns
    /// every step's metrics.
    fn finish(mut self) -> Vec<StepMetrics> {
        self.poll();
        for (step, m) in std::mem::take(&mut self.waiting) {
            let tl = self.timelines.remove(&step);
            (self.on_step)(&m, tl.as_ref());
            self.done.push(m);
        }
        self.done
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
        PipelineRun {
            measured_cost: report.measured_cost.clone(),
            next_step: trainer.first_step() + report.iterations.len() as u64,
            steps,
            report,
            predicted,
            plan: trainer.plan.clone(),
            job: trainer.job.clone(),
            params: by_stage.into_values().flatten().collect(),
            optimizer,
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
    /// format, so either trainer can resume it.
    pub fn checkpoint(&self) -> Result<Checkpoint, PipelineError> {
        let gpt = self.model()?;
        let be = gpt.chunks()[0].backend().clone();
        let mut optimizer = AdamW::new(adamw_config(&self.job.train));
        optimizer.load_state(&be, &self.optimizer)?;
        Ok(Checkpoint::capture(
            &gpt,
            &optimizer,
            self.next_step,
            self.job.train.seed,
        )?)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedules::{Action, Span};

    fn metrics(step: u64) -> StepMetrics {
        StepMetrics {
            step,
            loss: 1.0,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens: 8,
            seconds: 0.1,
        }
    }

    /// Iteration `iteration`'s profile, with one rank busy for `busy` of a makespan of 1.
    fn profile(iteration: u64, busy: f64) -> IterationProfile {
        let span = |rank, start, end| Span {
            rank,
            start,
            end,
            action: Action::new(ActionKind::F, rank as u32, 0),
        };
        IterationProfile {
            iteration,
            timeline: Timeline::from_spans(2, vec![span(0, 0.0, 1.0), span(1, 0.0, busy)], &[]),
            records: Vec::new(),
            bubbles: Vec::new(),
            fillers: Vec::new(),
            ranks_reported: 2,
        }
    }

    #[test]
    fn each_step_is_handed_over_once_its_metrics_and_timeline_are_both_in() {
        let (tx, rx) = channel();
        let mut seen = Vec::new();
        let mut join = StepJoin::new(10, rx, |m: &StepMetrics, tl: Option<&Timeline>| {
            seen.push((m.step, tl.map(|t| t.bubble_ratio)));
        });
        // Metrics first: step 10 waits for iteration 0's timeline.
        join.metrics(metrics(10));
        tx.send(profile(1, 0.5)).unwrap();
        join.poll();
        // Timeline first: iteration 1 (step 11) is handed over with its metrics.
        join.metrics(metrics(11));
        tx.send(profile(0, 0.75)).unwrap();
        join.poll();
        // Step 12's timeline never comes: it is handed over without one at the end.
        join.metrics(metrics(12));
        let done: Vec<u64> = join.finish().iter().map(|m| m.step).collect();
        assert_eq!(done, [11, 10, 12]);
        assert_eq!(
            seen,
            [(11, Some(0.25)), (10, Some(0.125)), (12, None)],
            "bubble ratio = idle / (ranks × makespan)"
        );
    }
}
