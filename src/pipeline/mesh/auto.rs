//! `schedule = "auto"` in a multi-process job: the in-process run's switch from ZB-H1 to the
//! auto plan of the measured costs, agreed between the processes.
//!
//! In one process the runtime's schedule actor sees every stage's measurements and
//! re-plans from them ([`AutoReplanner`] behind `PlanSource::Replan`). A launched rank's
//! runtime sees only its own stage, so the ranks agree on the costs themselves:
//! 1. Every rank runs iterations 0 and 1 with ZB-H1, as the in-process run does (both are
//!    dispatched before anything is measured).
//! 2. [`CostMeter`] wraps the rank's compute and times each F, I and W of its stage the way
//!    the runtime's clock does: thread CPU time under the virtual clock, elapsed time under
//!    the wall clock.
//! 3. Before iteration [`SWITCH_AT`] (2), which the runtime dispatches once this rank has
//!    finished iteration 0 (two iterations in flight), every rank takes the medians of its
//!    stage's iteration-0 actions (the first `m` of each kind), and the ranks all-gather
//!    them over the mesh ([`all_gather`] on [`COST_CHANNEL`], every world rank, in rank
//!    order). Stage s costs the mean over the replicas of pipeline rank s's medians, summed
//!    in replica order, so every rank holds bitwise the same cost model and the
//!    deterministic [`AutoReplanner`] (within ZB-H1's memory, as in-process) gives every
//!    rank the same plan, from the same iteration on.
//! 4. Every later iteration runs that plan. (The in-process run re-plans when a cost drifts
//!    by more than 10 %; across processes each re-plan would need another gather before
//!    the iteration, so the launched run keeps its first auto plan.)
//!
//! The parameters stay bitwise those of the in-process run: every auto plan keeps each
//! stage's micro-batch order, so the gradients are summed in the reference trainer's order
//! (tests/launch_auto.rs). [`AutoSwitch::choice`] tells the caller what was gathered and
//! chosen, for the run's log.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use pipefill_actors::{Clock, GradStats, PlanSource, Replanner, StageCompute, StepDecision};
use serde::{Deserialize, Serialize};

use crate::comm::collective::all_gather;
use crate::comm::frame;
use crate::comm::link::{Channel, PeerLink};
use crate::config::JobConfig;
use crate::schedules::{
    ActionKind, AutoReplanner, CostModel, Plan, ScheduleError, ScheduleKind, StageCost, build,
    to_csv,
};

/// The mesh channel of the cost all-gather.
pub const COST_CHANNEL: Channel = u32::MAX - 21;

/// The first iteration that runs the auto plan (see the module docs).
pub const SWITCH_AT: u64 = 2;

/// What the ranks gathered and chose.
#[derive(Clone, Debug)]
pub struct AutoChoice {
    /// The first iteration (of this run) that runs [`AutoChoice::plan`].
    pub iteration: u64,
    /// This rank's stage and its iteration-0 medians (seconds).
    pub stage: u32,
    pub measured: StageCost,
    /// The gathered cost model, one entry per stage (the same on every rank).
    pub cost: CostModel,
    pub plan: Plan,
}

impl AutoChoice {
    /// A digest of the plan's text form, to compare the ranks' plans in a log.
    pub fn plan_hash(&self) -> u64 {
        plan_hash(&self.plan)
    }
}

/// A digest of `plan`'s text form (FNV-1a, 64 bits: stable across processes and builds).
pub fn plan_hash(plan: &Plan) -> u64 {
    to_csv(plan).bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Measured actions of one rank: `(stage, kind, seconds)` in the order they ran.
type Samples = Arc<Mutex<Vec<(u32, ActionKind, f64)>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each update is one push or one replacement: still consistent after a panic.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One rank's part of a launched auto-scheduled run (see the module docs).
#[derive(Clone, Debug)]
pub struct AutoSwitch {
    pp: usize,
    dp: usize,
    microbatches: usize,
    clock: Clock,
    choice: Arc<Mutex<Option<AutoChoice>>>,
}

/// One rank's iteration-0 medians on the wire.
#[derive(Serialize, Deserialize)]
struct RankCosts {
    stage: u32,
    cost: StageCost,
}

impl AutoSwitch {
    /// For a job of `dp` replicas of a `pp`-rank pipeline with `microbatches` per replica
    /// and step, timed on `clock`.
    pub fn new(pp: usize, dp: usize, microbatches: usize, clock: Clock) -> Self {
        AutoSwitch {
            pp,
            dp,
            microbatches,
            clock,
            choice: Arc::default(),
        }
    }

    /// The switch of a launched rank of `job` that runs `plan` (ZB-H1, this replica's
    /// share of the micro-batches) when the job is auto-scheduled; `None` otherwise.
    pub fn for_job(job: &JobConfig, plan: &Plan, clock: Clock) -> Option<Self> {
        job.schedule
            .is_auto()
            .then(|| AutoSwitch::new(plan.num_ranks(), job.dp, plan.microbatches, clock))
    }

    /// What was gathered and chosen, once the switch happened (`None` in a run of at most
    /// [`SWITCH_AT`] iterations).
    pub fn choice(&self) -> Option<AutoChoice> {
        lock(&self.choice).clone()
    }

    /// The plan source of the rank at `link` (ZB-H1, then the agreed auto plan) and its
    /// compute, metered. The pipeline must be told that the re-planner agrees across
    /// processes (`Pipeline::replanner_agrees`).
    pub fn wire<C: StageCompute>(
        &self,
        link: Arc<dyn PeerLink>,
        compute: C,
    ) -> Result<(PlanSource, CostMeter<C>), ScheduleError> {
        let samples = Samples::default();
        let meter = CostMeter {
            inner: compute,
            samples: Some(Arc::clone(&samples)),
            virtual_clock: self.clock.is_virtual(),
        };
        Ok((PlanSource::Replan(self.replanner(link, samples)?), meter))
    }

    fn replanner(
        &self,
        link: Arc<dyn PeerLink>,
        samples: Samples,
    ) -> Result<Replanner, ScheduleError> {
        let zb_h1 = build(ScheduleKind::ZbH1, self.pp, self.microbatches, 1)?;
        let this = self.clone();
        let mut chosen: Option<Plan> = None;
        Ok(Box::new(move |iteration, _local_only| {
            if iteration < SWITCH_AT {
                return Ok(zb_h1.clone());
            }
            if let Some(plan) = &chosen {
                return Ok(plan.clone());
            }
            let choice = this.agree(link.as_ref(), &samples, iteration)?;
            let plan = choice.plan.clone();
            chosen = Some(plan.clone());
            *lock(&this.choice) = Some(choice);
            Ok(plan)
        }))
    }

    /// Gathers every rank's iteration-0 medians and builds the plan they give.
    fn agree(
        &self,
        link: &dyn PeerLink,
        samples: &Samples,
        iteration: u64,
    ) -> Result<AutoChoice, ScheduleError> {
        let rank = link.rank();
        let fail = |reason: String| ScheduleError::Unsupported {
            schedule: "auto".into(),
            reason: format!("rank {rank}: {reason}"),
        };
        let stage = (rank % self.pp) as u32;
        let measured = first_medians(&lock(samples), stage, self.microbatches).ok_or_else(|| {
            fail(format!(
                "stage {stage} has not measured {} forwards, input and weight backwards before iteration {iteration}",
                self.microbatches
            ))
        })?;
        let own = RankCosts {
            stage,
            cost: measured,
        };
        let bytes = frame::encode(&own).map_err(|e| fail(e.to_string()))?;
        let group: Vec<usize> = (0..self.pp * self.dp).collect();
        let frames = all_gather(link, &group, COST_CHANNEL, &bytes)
            .map_err(|e| fail(format!("gathering the measured costs: {e}")))?;
        let zero = StageCost {
            f: 0.0,
            i: 0.0,
            w: 0.0,
        };
        let mut sums = vec![zero; self.pp];
        for (from, bytes) in frames.iter().enumerate() {
            let c: RankCosts = frame::decode(bytes)
                .map_err(|e| fail(format!("rank {from}'s measured costs: {e}")))?;
            if c.stage as usize != from % self.pp {
                return Err(fail(format!(
                    "rank {from} measured stage {}, expected {}",
                    c.stage,
                    from % self.pp
                )));
            }
            let s = &mut sums[c.stage as usize];
            (s.f, s.i, s.w) = (s.f + c.cost.f, s.i + c.cost.i, s.w + c.cost.w);
        }
        let n = self.dp as f64;
        let cost = CostModel {
            stage: sums
                .into_iter()
                .map(|s| StageCost {
                    f: s.f / n,
                    i: s.i / n,
                    w: s.w / n,
                })
                .collect(),
            // The runtime's base model: link latency of the clock, default memory figures.
            comm: self.clock.link_latency(),
            ..CostModel::default()
        };
        let plan =
            AutoReplanner::new(self.pp, self.microbatches, None).plan(iteration, Some(&cost))?;
        Ok(AutoChoice {
            iteration,
            stage,
            measured,
            cost,
            plan,
        })
    }
}

/// The medians of the first `m` F, I and W of `stage` (its iteration 0), if all were run.
fn first_medians(samples: &[(u32, ActionKind, f64)], stage: u32, m: usize) -> Option<StageCost> {
    let median = |kind: ActionKind| {
        let mut v: Vec<f64> = samples
            .iter()
            .filter(|(s, k, _)| *s == stage && *k == kind)
            .map(|(_, _, t)| *t)
            .take(m)
            .collect();
        if v.len() < m || m == 0 {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(if m % 2 == 1 {
            v[m / 2]
        } else {
            (v[m / 2 - 1] + v[m / 2]) / 2.0
        })
    };
    Some(StageCost {
        f: median(ActionKind::F)?,
        i: median(ActionKind::I)?,
        w: median(ActionKind::W)?,
    })
}

/// A rank's compute that times its F, I, W and B actions (see the module docs); every
/// other call goes straight through. Off, it only passes through.
pub struct CostMeter<C> {
    inner: C,
    samples: Option<Samples>,
    virtual_clock: bool,
}

impl<C> CostMeter<C> {
    /// Times every action on the virtual clock's measure (thread CPU time) or wall time.
    pub fn on(inner: C, virtual_clock: bool) -> Self {
        CostMeter {
            inner,
            samples: Some(Arc::default()),
            virtual_clock,
        }
    }

    /// Passes every call through, timing nothing.
    pub fn off(inner: C) -> Self {
        CostMeter {
            inner,
            samples: None,
            virtual_clock: false,
        }
    }

    fn timed<T>(&mut self, stage: u32, kind: ActionKind, f: impl FnOnce(&mut C) -> T) -> T {
        let Some(samples) = &self.samples else {
            return f(&mut self.inner);
        };
        let samples = Arc::clone(samples);
        let (cpu, wall) = (pipefill_actors::thread_cpu_time(), Instant::now());
        let out = f(&mut self.inner);
        let seconds = if self.virtual_clock {
            pipefill_actors::thread_cpu_time() - cpu
        } else {
            wall.elapsed().as_secs_f64()
        };
        lock(&samples).push((stage, kind, seconds));
        out
    }
}

impl<C: StageCompute> StageCompute for CostMeter<C> {
    type Tensor = C::Tensor;
    type Error = C::Error;

    fn forward(
        &mut self,
        stage: u32,
        microbatch: u32,
        input: Option<C::Tensor>,
    ) -> Result<Option<C::Tensor>, C::Error> {
        self.timed(stage, ActionKind::F, |c| {
            c.forward(stage, microbatch, input)
        })
    }

    fn backward_input(
        &mut self,
        stage: u32,
        microbatch: u32,
        grad: Option<C::Tensor>,
    ) -> Result<Option<C::Tensor>, C::Error> {
        self.timed(stage, ActionKind::I, |c| {
            c.backward_input(stage, microbatch, grad)
        })
    }

    fn backward_weight(&mut self, stage: u32, microbatch: u32) -> Result<(), C::Error> {
        self.timed(stage, ActionKind::W, |c| {
            c.backward_weight(stage, microbatch)
        })
    }

    fn backward(
        &mut self,
        stage: u32,
        microbatch: u32,
        grad: Option<C::Tensor>,
    ) -> Result<Option<C::Tensor>, C::Error> {
        self.timed(stage, ActionKind::B, |c| {
            c.backward(stage, microbatch, grad)
        })
    }

    fn optimizer_step(&mut self, iteration: u64) -> Result<(), C::Error> {
        self.inner.optimizer_step(iteration)
    }

    fn grad_stats(&mut self, iteration: u64) -> Result<GradStats, C::Error> {
        self.inner.grad_stats(iteration)
    }

    fn apply_step(
        &mut self,
        iteration: u64,
        decision: StepDecision,
        speculative: bool,
    ) -> Result<(), C::Error> {
        self.inner.apply_step(iteration, decision, speculative)
    }

    fn can_roll_back(&self) -> bool {
        self.inner.can_roll_back()
    }

    fn rollback_step(&mut self, iteration: u64) -> Result<(), C::Error> {
        self.inner.rollback_step(iteration)
    }

    fn confirm_step(&mut self, iteration: u64) -> Result<(), C::Error> {
        self.inner.confirm_step(iteration)
    }
}

/// The plan source and compute of a launched rank: `auto`'s switch when the job is
/// auto-scheduled, else `plan` throughout.
pub fn plan_source<C: StageCompute>(
    auto: Option<&AutoSwitch>,
    plan: &Plan,
    link: Arc<dyn PeerLink>,
    compute: C,
) -> Result<(PlanSource, CostMeter<C>), ScheduleError> {
    match auto {
        Some(auto) => auto.wire(link, compute),
        None => Ok((PlanSource::Given(plan.clone()), CostMeter::off(compute))),
    }
}

#[cfg(test)]
#[path = "auto_tests.rs"]
mod tests;
