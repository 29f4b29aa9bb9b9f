//! The entry point: [`Pipeline`] spawns the actors of one job, runs its iterations and
//! returns a [`RunReport`]; [`run_iterations`] is the one-call form.
//!
//! The coordinator keeps `in_flight` iterations queued at every stage (two by default), so a
//! rank starts iteration k+1 as soon as its own part of k is done, and dispatches the next
//! iteration once every rank has finished one. The first stage failure stops the job: the
//! transport is closed (waking every blocked receive), queued iterations are dropped, and
//! the error names the rank, the action and the cause. A stage actor that dies without a
//! report (a bug in the runtime itself) is noticed within 100 ms.
//!
//! The optimizer step follows the job's [`StepPolicy`] (default: post-validation, no
//! clipping; see [`crate::step`]). After the last iteration every stage is told to settle
//! its pending step, and the report holds one [`StepReport`] per iteration.
//!
//! [`Pipeline::on_iteration`] registers a listener that receives each iteration's measured
//! profile while the job runs (for live figures), not only in the final report.
//!
//! A multi-process job runs [`Pipeline::run_local`] in every process: only the ranks of
//! this process get stage actors, the others are reached through the transport. Every
//! process builds the same fixed plan and dispatches its iterations itself (payloads are
//! tagged by iteration, so no cross-process coordination is needed beyond the payloads and
//! the gradient statistics). The report then holds this process's ranks only: its
//! timelines show the other ranks idle, and its step reports list the local ranks.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use kameo::actor::{ActorRef, Spawn};
use kameo::mailbox;
use pipefill_schedules::{CostModel, Plan, Timeline};
use tokio::sync::mpsc::unbounded_channel;

use crate::clock::Clock;
use crate::compute::StageCompute;
use crate::error::{Result, RuntimeError};
use crate::filler::{BubbleFiller, NoFiller};
use crate::profiler::{IterationProfile, Profiler};
use crate::schedule::{PlanSource, ScheduleActor};
use crate::stage::{StageActor, StageWiring};
use crate::step::{GradStats, StepMode, StepPolicy, StepReport};
use crate::transport::{InProcess, Transport};

mod job;
use job::{Job, RemoteRank};

/// Everything a run measured.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub clock: Clock,
    /// One profile per iteration, in order.
    pub iterations: Vec<IterationProfile>,
    /// One timeline over all iterations.
    pub overall: Timeline,
    /// Per-stage median costs (seconds), when every stage was measured.
    pub measured_cost: Option<CostModel>,
    /// The last plan run.
    pub plan: Option<Arc<Plan>>,
    /// One optimizer step per iteration, in order: global norm, decision, rollbacks.
    pub steps: Vec<StepReport>,
}

impl RunReport {
    /// Speculative steps rolled back over the whole run, on every rank.
    pub fn rollbacks(&self) -> usize {
        self.steps.iter().map(StepReport::rollbacks).sum()
    }

    /// A two-column table of `predicted` (from the simulator) next to the measured timeline
    /// of `iteration`: makespan and both bubble ratios.
    pub fn side_by_side(&self, iteration: usize, predicted: &Timeline) -> String {
        let Some(m) = self.iterations.get(iteration).map(|i| &i.timeline) else {
            return format!("no iteration {iteration} was measured\n");
        };
        let row = |name: &str, p: f64, m: f64| format!("{name:<20} {p:>12.6} {m:>12.6}\n");
        let mut out = format!("{:<20} {:>12} {:>12}\n", "", "predicted", "measured");
        out += &row("makespan", predicted.makespan, m.makespan);
        out += &row("bubble ratio", predicted.bubble_ratio, m.bubble_ratio);
        out += &row(
            "steady bubble ratio",
            predicted.steady_bubble_ratio,
            m.steady_bubble_ratio,
        );
        out
    }
}

/// Runs `job` on a new multi-thread tokio runtime; refused inside a tokio runtime (that
/// would block one of its workers).
fn block_on(job: impl Future<Output = Result<RunReport>>) -> Result<RunReport> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(RuntimeError::Config(
            "run_blocking called inside a tokio runtime: await Pipeline::run instead".into(),
        ));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| RuntimeError::Actor(format!("cannot start the tokio runtime: {e}")))?;
    rt.block_on(job)
}

/// A job: where plans come from, which clock, how many iterations.
pub struct Pipeline {
    source: PlanSource,
    clock: Clock,
    iterations: u64,
    in_flight: u64,
    stall_timeout: Option<Duration>,
    cost_hint: Option<CostModel>,
    memory_cost: CostModel,
    fillers: Vec<Box<dyn BubbleFiller>>,
    step: StepPolicy,
    stats: Option<Arc<dyn Transport<GradStats>>>,
    listener: Option<Sender<IterationProfile>>,
    /// The re-planner builds the same plan in every process (see [`Pipeline::replanner_agrees`]).
    replan_agrees: bool,
}

impl Pipeline {
    pub fn new(source: PlanSource, clock: Clock) -> Self {
        Pipeline {
            source,
            clock,
            iterations: 1,
            in_flight: 2,
            stall_timeout: None,
            cost_hint: None,
            memory_cost: CostModel::default(),
            fillers: Vec::new(),
            step: StepPolicy::default(),
            stats: None,
            listener: None,
            replan_agrees: false,
        }
    }

    /// Declares that a [`PlanSource::Replan`] re-planner builds the same plan for every
    /// iteration in every process of a job split over processes, agreeing with the others
    /// itself (e.g. from costs all-gathered between them): the runtime hands it only this
    /// process's measurements (`None` until every stage is measured here, i.e. always in a
    /// split job), so [`Pipeline::run_local`] refuses a re-planner without this promise.
    pub fn replanner_agrees(mut self) -> Self {
        self.replan_agrees = true;
        self
    }

    /// Sends each iteration's measured profile to `listener` as soon as every rank has
    /// reported it, while the job runs (the same profile the [`RunReport`] holds at the end).
    pub fn on_iteration(mut self, listener: Sender<IterationProfile>) -> Self {
        self.listener = Some(listener);
        self
    }

    /// The optimizer-step policy: clipping and how ranks agree (default: post-validation,
    /// no clipping).
    pub fn step_policy(mut self, policy: StepPolicy) -> Self {
        self.step = policy;
        self
    }

    /// Clips the global gradient norm to `max` (see [`crate::step`]).
    pub fn max_grad_norm(mut self, max: f64) -> Self {
        self.step.max_grad_norm = Some(max);
        self
    }

    /// How the ranks agree on each optimizer step (default [`StepMode::PostValidate`]).
    pub fn step_mode(mut self, mode: StepMode) -> Self {
        self.step.mode = mode;
        self
    }

    /// The link that carries gradient statistics between ranks (default: in-process).
    pub fn stats_transport(mut self, stats: Arc<dyn Transport<GradStats>>) -> Self {
        self.stats = Some(stats);
        self
    }

    /// Number of iterations to run (default 1).
    pub fn iterations(mut self, n: u64) -> Self {
        self.iterations = n;
        self
    }

    /// Iterations queued at each stage at once (default 2: consecutive iterations overlap;
    /// 1 puts a barrier between iterations).
    pub fn in_flight(mut self, n: u64) -> Self {
        self.in_flight = n.max(1);
        self
    }

    /// Fails the job when no rank finishes an iteration for `timeout` (off by default: a
    /// real model's iteration may legitimately take long). The error names the ranks that
    /// have not finished the oldest open iteration.
    pub fn stall_timeout(mut self, timeout: Duration) -> Self {
        self.stall_timeout = Some(timeout);
        self
    }

    /// Costs (seconds) to predict bubbles with before any are measured.
    pub fn cost_hint(mut self, cost: CostModel) -> Self {
        self.cost_hint = Some(cost);
        self
    }

    /// The cost model whose memory figures (m_b, m_w) the timelines' peak memory uses.
    pub fn memory_cost(mut self, cost: CostModel) -> Self {
        self.memory_cost = cost;
        self
    }

    /// One bubble filler per rank (default: [`NoFiller`] everywhere).
    pub fn fillers(mut self, fillers: Vec<Box<dyn BubbleFiller>>) -> Self {
        self.fillers = fillers;
        self
    }

    /// Runs the job with one compute per rank, over the in-process transport.
    pub async fn run<C: StageCompute>(self, computes: Vec<C>) -> Result<RunReport> {
        let transport: Arc<dyn Transport<C::Tensor>> = Arc::new(InProcess::new(computes.len()));
        self.run_with(computes, transport).await
    }

    /// Runs the job from synchronous code (a CLI): starts a multi-thread tokio runtime for
    /// the actors and blocks until the job ends. Fails when called inside a tokio runtime.
    pub fn run_blocking<C: StageCompute>(self, computes: Vec<C>) -> Result<RunReport> {
        block_on(self.run(computes))
    }

    /// [`Pipeline::run_local`] from synchronous code (one process of a multi-process job),
    /// as [`Pipeline::run_blocking`] does for a whole job.
    pub fn run_local_blocking<C: StageCompute>(
        self,
        local: Vec<(usize, C)>,
        transport: Arc<dyn Transport<C::Tensor>>,
    ) -> Result<RunReport> {
        block_on(self.run_local(local, transport))
    }

    /// Runs the job with one compute per rank over `transport`. Needs a multi-thread tokio
    /// runtime (stage actors own OS threads that block on it).
    pub async fn run_with<C: StageCompute>(
        self,
        computes: Vec<C>,
        transport: Arc<dyn Transport<C::Tensor>>,
    ) -> Result<RunReport> {
        let ranks = computes.len();
        if ranks == 0 || transport.ranks() != ranks {
            return Err(RuntimeError::Config(format!(
                "{ranks} computes for a transport of {} ranks: one compute per rank is needed",
                transport.ranks()
            )));
        }
        self.run_local(computes.into_iter().enumerate().collect(), transport)
            .await
    }

    /// Runs the ranks of this process, `(rank, compute)` pairs, in a job whose other ranks
    /// run in other processes, reached through `transport` (which spans every rank; so must
    /// the statistics transport). The plan must be fixed (a re-planner would see only local
    /// measurements and could build different plans in different processes), unless the
    /// re-planner agrees with the other processes itself ([`Pipeline::replanner_agrees`]). Bubble
    /// fillers, when given, are one per local rank, in the order of `local`.
    pub async fn run_local<C: StageCompute>(
        mut self,
        local: Vec<(usize, C)>,
        transport: Arc<dyn Transport<C::Tensor>>,
    ) -> Result<RunReport> {
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if !multi_thread {
            return Err(RuntimeError::Config(
                "stage actors need a multi-thread tokio runtime \
                 (#[tokio::main], #[tokio::test(flavor = \"multi_thread\")] or Pipeline::run_blocking)"
                    .into(),
            ));
        }
        let ranks = transport.ranks();
        let mut local_ranks: Vec<usize> = local.iter().map(|(r, _)| *r).collect();
        local_ranks.sort_unstable();
        local_ranks.dedup();
        if local.is_empty()
            || local_ranks.len() != local.len()
            || local_ranks[local.len() - 1] >= ranks
        {
            return Err(RuntimeError::Config(format!(
                "local ranks {:?} for a transport of {ranks} ranks: each must be distinct and below {ranks}",
                local.iter().map(|(r, _)| *r).collect::<Vec<_>>()
            )));
        }
        if local.len() < ranks
            && matches!(self.source, PlanSource::Replan(_))
            && !self.replan_agrees
        {
            return Err(RuntimeError::Config(
                "a job split over processes needs a fixed plan, not a re-planner \
                 (unless it agrees across processes: Pipeline::replanner_agrees)"
                    .into(),
            ));
        }
        if !self.fillers.is_empty() && self.fillers.len() != local.len() {
            return Err(RuntimeError::Config(format!(
                "{} bubble fillers for {} ranks",
                self.fillers.len(),
                local.len()
            )));
        }
        if let Some(max) = self
            .step
            .max_grad_norm
            .filter(|m| !(m.is_finite() && *m > 0.0))
        {
            return Err(RuntimeError::Config(format!(
                "max_grad_norm {max}: the clipping norm must be a positive, finite number"
            )));
        }
        if self.step.mode == StepMode::Unchecked && self.step.max_grad_norm.is_some() {
            return Err(RuntimeError::Config(
                "max_grad_norm needs the ranks' gradient statistics: \
                 use StepMode::PostValidate or StepMode::Barrier, not Unchecked"
                    .into(),
            ));
        }
        let stats: Arc<dyn Transport<GradStats>> = match self.stats.take() {
            Some(stats) => stats,
            None => Arc::new(InProcess::new(ranks)),
        };
        if stats.ranks() != ranks {
            return Err(RuntimeError::Config(format!(
                "the statistics transport has {} ranks, the job {ranks}",
                stats.ranks()
            )));
        }
        let mut fillers = std::mem::take(&mut self.fillers).into_iter();
        let link_latency = self.clock.link_latency();
        let base = CostModel {
            comm: link_latency,
            ..self.memory_cost.clone()
        };
        let schedule = ScheduleActor::spawn_with_mailbox(
            ScheduleActor::new(self.source, self.cost_hint, base),
            mailbox::unbounded(),
        );
        let mut profiler = Profiler::new(ranks);
        if let Some(listener) = self.listener.take() {
            profiler = profiler.with_listener(listener);
        }
        let profiler = Profiler::spawn_with_mailbox(profiler, mailbox::unbounded());
        let (events_tx, mut events) = unbounded_channel();
        let abort = Arc::new(AtomicBool::new(false));
        let epoch = Instant::now();
        let stages: Vec<(usize, ActorRef<StageActor<C>>)> = local
            .into_iter()
            .map(|(rank, compute)| {
                let wiring = StageWiring {
                    rank,
                    clock: self.clock,
                    epoch,
                    transport: Arc::clone(&transport),
                    stats: Arc::clone(&stats),
                    step: self.step,
                    filler: fillers.next().unwrap_or_else(|| Box::new(NoFiller)),
                    observers: vec![profiler.clone().recipient(), schedule.clone().recipient()],
                    events: events_tx.clone(),
                    abort: Arc::clone(&abort),
                };
                let stage = StageActor::spawn_in_thread_with_mailbox(
                    StageActor::new(compute, wiring),
                    mailbox::unbounded(),
                );
                (rank, stage)
            })
            .collect();
        let remote = (local_ranks.len() < ranks)
            .then(|| RemoteRank::spawn_with_mailbox(RemoteRank, mailbox::unbounded()));
        let job = Job {
            schedule,
            profiler,
            stages,
            remote,
            ranks,
            transport,
            stats,
            abort,
        };
        let outcome = job
            .drive(
                &mut events,
                self.iterations,
                self.in_flight,
                self.stall_timeout,
            )
            .await;
        let report = match outcome {
            Ok(steps) => job.report(self.clock, steps).await,
            Err(e) => Err(e),
        };
        job.shutdown();
        report
    }
}

/// Runs `iterations` iterations of `plan` with one compute per rank on the in-process
/// transport, iterations overlapping (two in flight).
pub async fn run_iterations<C: StageCompute>(
    plan: Plan,
    computes: Vec<C>,
    clock: Clock,
    iterations: u64,
) -> Result<RunReport> {
    Pipeline::new(PlanSource::Given(plan), clock)
        .iterations(iterations)
        .run(computes)
        .await
}
