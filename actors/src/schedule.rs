//! `ScheduleActor`: builds each iteration's plan, hands it to the stages, and learns the
//! real costs of the actions from what the stages measured.
//!
//! Each new plan is validated, and each dispatched plan simulated (under the measured costs once there are some,
//! else the hint, else unit costs): a plan that cannot make progress is refused before a
//! single stage runs it, and the simulated timeline, when its costs are real seconds, tells
//! each stage how long its bubbles should last (the filler's hint in wall-clock mode).

use std::collections::HashMap;
use std::sync::Arc;

use kameo::Actor;
use kameo::actor::{ActorRef, Recipient};
use kameo::error::Infallible;
use kameo::message::{Context, Message};
use pipefill_schedules::{
    ActionKind, CostModel, Plan, ScheduleKind, StageCost, Timeline, ValidateOptions, build,
    simulate, validate,
};

use crate::error::RuntimeError;
use crate::profiler::PlanMemory;
use crate::stage::{Measured, RunIteration};

/// Where each iteration's plan comes from.
pub enum PlanSource {
    /// A built-in schedule, built once with [`pipefill_schedules::build`].
    Builtin {
        kind: ScheduleKind,
        ranks: usize,
        microbatches: usize,
        chunks: usize,
    },
    /// A fixed plan (e.g. read from a custom schedule file).
    Given(Plan),
    /// Re-planned before every iteration from the costs measured so far (`None` before the
    /// first measurement): the seam for the auto-tuner.
    Replan(Replanner),
}

/// Builds the plan of an iteration from the costs measured so far (`None` before any).
pub type Replanner =
    Box<dyn FnMut(u64, Option<&CostModel>) -> pipefill_schedules::Result<Plan> + Send>;

impl std::fmt::Debug for PlanSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanSource::Builtin {
                kind,
                ranks,
                microbatches,
                chunks,
            } => write!(
                f,
                "{} (p={ranks}, m={microbatches}, v={chunks})",
                kind.name()
            ),
            PlanSource::Given(p) => write!(f, "given plan ({} ranks)", p.num_ranks()),
            PlanSource::Replan(_) => f.write_str("re-planner"),
        }
    }
}

/// Median per-stage action costs measured so far.
#[derive(Clone, Debug, Default)]
pub struct CostSamples {
    /// (stage, kind) → measured durations in seconds.
    samples: HashMap<(u32, ActionKind), Vec<f64>>,
}

impl CostSamples {
    /// Adds every plain compute record of `report` (composites cannot be split per stage).
    pub fn add(&mut self, report: &crate::StageReport) {
        for r in &report.records {
            if matches!(
                r.action.kind,
                ActionKind::F | ActionKind::I | ActionKind::W | ActionKind::B
            ) {
                self.samples
                    .entry((r.action.stage, r.action.kind))
                    .or_default()
                    .push(r.duration());
            }
        }
    }

    /// The median of `(stage, kind)`, if measured.
    pub fn median(&self, stage: u32, kind: ActionKind) -> Option<f64> {
        let mut v = self.samples.get(&(stage, kind))?.clone();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        Some(if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        })
    }

    /// A cost model (seconds) of `stages` stages from the medians; `None` until every stage
    /// has a measured forward. A plan with full backwards only gives T_I = T_B, T_W = 0.
    /// Link latency and memory figures are taken from `base`.
    pub fn cost_model(&self, stages: usize, base: &CostModel) -> Option<CostModel> {
        let stage = (0..stages as u32)
            .map(|s| {
                let f = self.median(s, ActionKind::F)?;
                let (i, w) = match (self.median(s, ActionKind::I), self.median(s, ActionKind::B)) {
                    (Some(i), _) => (i, self.median(s, ActionKind::W).unwrap_or(0.0)),
                    (None, Some(b)) => (b, 0.0),
                    (None, None) => (0.0, 0.0),
                };
                Some(StageCost { f, i, w })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(CostModel {
            stage,
            ..base.clone()
        })
    }
}

/// The schedule actor.
pub struct ScheduleActor {
    source: PlanSource,
    /// The plan of a fixed source, built once.
    fixed: Option<Arc<Plan>>,
    /// Costs known before anything is measured (seconds); also the base for link latency
    /// and memory figures of the measured model.
    hint: Option<CostModel>,
    base: CostModel,
    samples: CostSamples,
    stages: Vec<Recipient<RunIteration>>,
    /// Where each new plan's peak memory goes (the profiler).
    memory: Option<Recipient<PlanMemory>>,
    last_plan: Option<Arc<Plan>>,
}

impl ScheduleActor {
    /// `hint` is the cost model used before any cost is measured; `base` gives the link
    /// latency and memory figures of the measured cost model.
    pub fn new(source: PlanSource, hint: Option<CostModel>, base: CostModel) -> Self {
        ScheduleActor {
            source,
            fixed: None,
            hint,
            base,
            samples: CostSamples::default(),
            stages: Vec::new(),
            memory: None,
            last_plan: None,
        }
    }

    /// The cost model measured so far, if every stage has been measured.
    pub fn measured_cost(&self) -> Option<CostModel> {
        let stages = self.last_plan.as_ref()?.stages;
        self.samples.cost_model(stages, &self.base)
    }

    /// The plan of `iteration`.
    pub fn plan_for(&mut self, iteration: u64) -> Result<Arc<Plan>, RuntimeError> {
        if let Some(p) = &self.fixed {
            return Ok(Arc::clone(p));
        }
        let measured = self.measured_cost();
        let plan = match &mut self.source {
            PlanSource::Builtin {
                kind,
                ranks,
                microbatches,
                chunks,
            } => {
                let p = Arc::new(build(*kind, *ranks, *microbatches, *chunks)?);
                self.fixed = Some(Arc::clone(&p));
                p
            }
            PlanSource::Given(p) => {
                let p = Arc::new(p.clone());
                self.fixed = Some(Arc::clone(&p));
                p
            }
            PlanSource::Replan(f) => Arc::new(f(iteration, measured.as_ref())?),
        };
        Ok(plan)
    }

    /// Builds, checks and predicts the plan of `iteration`.
    pub fn prepare(&mut self, iteration: u64) -> Result<RunIteration, RuntimeError> {
        let plan = self.plan_for(iteration)?;
        if plan.num_ranks() != self.stages.len() {
            return Err(RuntimeError::Config(format!(
                "the plan of iteration {iteration} has {} ranks but the job has {} stage actors",
                plan.num_ranks(),
                self.stages.len()
            )));
        }
        // Validate each new plan once: a broken plan gets the validator's error naming the
        // rank, the position and the rule, before any stage runs it.
        if !self
            .last_plan
            .as_ref()
            .is_some_and(|p| Arc::ptr_eq(p, &plan))
        {
            let opts = ValidateOptions {
                cost: self.base.clone(),
                memory_limit: None,
            };
            let validation = validate(&plan, &opts)?;
            if let Some(profiler) = &self.memory {
                // Only the timelines' memory column is lost if the profiler is gone.
                let _ = profiler
                    .tell(PlanMemory {
                        iteration,
                        peak: validation.peak_memory,
                    })
                    .try_send();
            }
        }
        self.last_plan = Some(Arc::clone(&plan));
        let known = self.measured_cost().or_else(|| self.hint.clone());
        // Simulate even without known costs: a plan that cannot progress fails here,
        // with the simulator's explanation, instead of hanging the stages.
        let predicted = simulate(&plan, known.as_ref().unwrap_or(&CostModel::default()))?;
        Ok(RunIteration {
            iteration,
            plan,
            predicted: known.map(|_| Arc::new(predicted)),
        })
    }
}

impl Actor for ScheduleActor {
    type Args = Self;
    type Error = Infallible;

    async fn on_start(args: Self::Args, _actor_ref: ActorRef<Self>) -> Result<Self, Self::Error> {
        Ok(args)
    }
}

/// Connects the schedule actor to the stage actors (index = rank) and to the profiler.
pub struct Attach {
    pub stages: Vec<Recipient<RunIteration>>,
    pub memory: Option<Recipient<PlanMemory>>,
}

impl Message<Attach> for ScheduleActor {
    type Reply = ();

    async fn handle(&mut self, msg: Attach, _ctx: &mut Context<Self, Self::Reply>) {
        self.stages = msg.stages;
        self.memory = msg.memory;
    }
}

/// Builds the plan of `iteration` and hands it to every stage.
#[derive(Clone, Copy, Debug)]
pub struct Dispatch {
    pub iteration: u64,
}

impl Message<Dispatch> for ScheduleActor {
    type Reply = Result<(), RuntimeError>;

    async fn handle(
        &mut self,
        msg: Dispatch,
        _ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let run = self.prepare(msg.iteration)?;
        for (rank, stage) in self.stages.iter().enumerate() {
            stage
                .tell(run.clone())
                .try_send()
                .map_err(|e| RuntimeError::Actor(format!("rank {rank}'s stage actor: {e}")))?;
        }
        Ok(())
    }
}

impl Message<Measured> for ScheduleActor {
    type Reply = ();

    async fn handle(&mut self, msg: Measured, _ctx: &mut Context<Self, Self::Reply>) {
        self.samples.add(&msg.0);
    }
}

/// Asks for the cost model measured so far and the last plan dispatched.
#[derive(Clone, Copy, Debug)]
pub struct Measurements;

impl Message<Measurements> for ScheduleActor {
    type Reply = (Option<CostModel>, Option<Arc<Plan>>);

    async fn handle(
        &mut self,
        _msg: Measurements,
        _ctx: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        (self.measured_cost(), self.last_plan.clone())
    }
}

/// A predicted timeline of `plan` under `cost`, for side-by-side reports.
pub fn predict(plan: &Plan, cost: &CostModel) -> Result<Timeline, RuntimeError> {
    Ok(simulate(plan, cost)?)
}
