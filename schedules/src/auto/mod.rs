//! The auto-scheduler: the plan with the least bubble under a memory limit, built from
//! measured (or modelled) per-stage costs instead of the hand-made schedules' assumption
//! of equal stages and `T_F = T_I = T_W`.
//!
//! As in the zero-bubble paper (Qi et al., ICLR 2024, section 4), a heuristic warm-starts a
//! search:
//! - `greedy`: a list scheduler that simulates time while it builds the plan (as many
//!   forwards as memory allows in warm-up, then 1F-1I, W's into gaps or when memory
//!   demands), with a handful of knobs left open (warm-up depth and W's held back per rank,
//!   the gap a W may fill, F/I priority, depth- or breadth-first over chunks);
//! - `search`: tries families of knob settings, hill-climbs the per-rank knobs of the
//!   best, then moves one or two actions at a time within the best plan's rank lists
//!   (local search over the order of W's and extra F's), each candidate scored by the
//!   simulator.
//!
//! The built-in schedules of the same shape (same `v`, same placement) that fit the limit
//! are candidates too, so the result is never worse than the best of them. Every stage runs
//! its F's, I's and W's in micro-batch order, as the built-ins do, so a stage accumulates
//! its weight gradients in the reference trainer's order. Plans are
//! ranked by steady bubble ratio, then bubble ratio, then peak memory (DESIGN.md,
//! "Metrics"); the winner is validated against the limit before it is returned.
//!
//! [`AutoReplanner`] re-plans while training: ZB-H1 until the costs are measured, then
//! the auto plan for them.

pub(crate) mod greedy;
mod replan;
mod search;

pub use self::replan::AutoReplanner;

use crate::error::{Result, ScheduleError};
use crate::generators::{ScheduleKind, generate};
use crate::plan::{Placement, Plan};
use crate::timeline::{CostModel, Timeline};
use crate::validate::{ValidateOptions, validate};

use self::search::Scored;

/// Where the returned plan came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The greedy list scheduler under one of the knob families tried.
    Greedy,
    /// The search's improvement of a greedy plan (per-rank knobs or W moves).
    Search,
    /// A built-in schedule of the same shape: nothing built beat it.
    Builtin(ScheduleKind),
}

/// The auto-scheduler's answer with what it was compared against.
#[derive(Clone, Debug)]
pub struct AutoPlan {
    /// Compute-only plan, validated within the memory limit.
    pub plan: Plan,
    /// The plan's simulated timeline under the cost model it was built for.
    pub timeline: Timeline,
    pub origin: Origin,
    /// The best built-in schedule of the same shape within the limit, and its timeline.
    pub best_builtin: Option<(ScheduleKind, Timeline)>,
    /// Plans scored by the simulator during the search.
    pub evaluated: usize,
}

/// The plan with the least steady bubble for `ranks` ranks, `microbatches` micro-batches and
/// `chunks` stages per rank placed by `placement`, under `cost` (one entry, or one per
/// stage), with at most `memory_limit` activation memory on any rank (in the cost model's
/// units; `f64::INFINITY` for none). Compute-only; [`crate::lower`](fn@crate::lower) adds
/// SEND/RECV.
pub fn auto(
    cost: &CostModel,
    ranks: usize,
    microbatches: usize,
    chunks: usize,
    placement: Placement,
    memory_limit: f64,
) -> Result<Plan> {
    auto_plan(cost, ranks, microbatches, chunks, placement, memory_limit).map(|a| a.plan)
}

/// [`auto`], with the plan's timeline, where it came from and the best built-in it beat.
pub fn auto_plan(
    cost: &CostModel,
    ranks: usize,
    microbatches: usize,
    chunks: usize,
    placement: Placement,
    memory_limit: f64,
) -> Result<AutoPlan> {
    let shape = check(cost, ranks, microbatches, chunks, placement, memory_limit)?;
    let mut builtins: Vec<(ScheduleKind, Scored)> = ScheduleKind::ALL
        .into_iter()
        .filter_map(|kind| {
            let plan = generate(kind, ranks, microbatches, chunks).ok()?;
            let same_shape = plan.stage_rank == shape.stage_rank;
            let scored = Scored::new(plan, cost)?;
            (same_shape && scored.peak <= memory_limit).then_some((kind, scored))
        })
        .collect();
    builtins.sort_by(|a, b| a.1.order(&b.1));
    let best_builtin = builtins.first().map(|(k, s)| (*k, s.timeline.clone()));

    let found = search::search(&shape, cost, memory_limit);
    let evaluated = found.evaluated;
    let (scored, origin) = match (found.best, builtins.into_iter().next()) {
        (Some((s, origin)), Some((kind, b))) => {
            if b.order(&s).is_lt() {
                (b, Origin::Builtin(kind))
            } else {
                (s, origin)
            }
        }
        (Some((s, origin)), None) => (s, origin),
        (None, Some((kind, b))) => (b, Origin::Builtin(kind)),
        (None, None) => {
            return Err(unsupported(format!(
                "no plan found within the memory limit {memory_limit}"
            )));
        }
    };
    let opts = ValidateOptions {
        cost: cost.clone(),
        memory_limit: memory_limit.is_finite().then_some(memory_limit),
    };
    validate(&scored.plan, &opts)?;
    Ok(AutoPlan {
        plan: scored.plan,
        timeline: scored.timeline,
        origin,
        best_builtin,
        evaluated,
    })
}

fn unsupported(reason: String) -> ScheduleError {
    ScheduleError::Unsupported {
        schedule: "auto".into(),
        reason,
    }
}

/// Checks the inputs; the empty plan of that shape on success.
fn check(
    cost: &CostModel,
    ranks: usize,
    microbatches: usize,
    chunks: usize,
    placement: Placement,
    memory_limit: f64,
) -> Result<Plan> {
    if ranks == 0 || microbatches == 0 || chunks == 0 {
        return Err(unsupported(format!(
            "needs at least one rank, micro-batch and stage per rank \
             (p = {ranks}, m = {microbatches}, v = {chunks})"
        )));
    }
    let stages = ranks
        .checked_mul(chunks)
        .filter(|&s| u32::try_from(s).is_ok() && u32::try_from(microbatches).is_ok())
        .ok_or_else(|| {
            unsupported(format!(
                "p × v = {ranks} × {chunks} stages or m = {microbatches} micro-batches \
                 exceed {}",
                u32::MAX
            ))
        })?;
    placement
        .check(ranks, stages)
        .map_err(|reason| unsupported(format!("placement {}: {reason}", placement.name())))?;
    if cost.stage.len() > 1 && cost.stage.len() != stages {
        return Err(unsupported(format!(
            "the cost model has {} per-stage entries but the plan has {stages} stages",
            cost.stage.len()
        )));
    }
    let times = cost.stage.iter().flat_map(|c| [c.f, c.i, c.w]);
    let speeds = cost.rank_speed.iter().copied();
    if times
        .chain([cost.comm])
        .any(|t| !(t.is_finite() && t >= 0.0))
        || speeds.clone().any(|s| !(s.is_finite() && s > 0.0))
    {
        return Err(unsupported(
            "costs must be finite and ≥ 0, and rank speeds finite and > 0".into(),
        ));
    }
    // With recomputation, I may keep more for W than the forward held (m_w > m_b).
    if !(cost.m_b.is_finite() && cost.m_b > 0.0 && cost.m_w.is_finite() && cost.m_w >= 0.0) {
        return Err(unsupported(format!(
            "memory per forward must be > 0 and the part kept for W finite and ≥ 0 \
             (m_b = {}, m_w = {})",
            cost.m_b, cost.m_w
        )));
    }
    let shape = Plan::new(ranks, stages, microbatches, placement);
    // Every stage of a rank must be able to stash one micro-batch's forward at once.
    let most = (0..ranks)
        .map(|r| shape.stages_of(r).len())
        .max()
        .unwrap_or(1);
    let need = cost.m_b.max(cost.m_w) * most as f64;
    if memory_limit.is_nan() || memory_limit < need {
        return Err(unsupported(format!(
            "memory limit {memory_limit} is below {need}, the activations of one micro-batch \
             on a rank holding {most} stage(s) (m_b = {}, m_w = {} each)",
            cost.m_b, cost.m_w
        )));
    }
    Ok(shape)
}
