//! The activations' peak in flight: how many micro-batches' stash each rank holds at its
//! schedule's peak ([`InFlight`]), from the plan the job's schedule generates or the
//! schedule file's, under each rank's `train.recompute` mode ([`StashModel`]): a forward
//! holds the share of the calibrated stash its mode keeps, I leaves what W needs (the same
//! in every mode), and a recomputing rank holds one block's recomputed part during an I.
//! [`super::parts::activations`] turns it into bytes.

use super::super::{ConfigError, JobConfig, ScheduleChoice};
use super::costs::*;
use super::size::{Size, div_ceil, f, k, mul};
use crate::model::{Recompute, RecomputeSetting};
use crate::schedules::{CostModel, generate, joint_peak_memory, rank_peak_memory, simulate};

/// Thousandths of one micro-batch's stash on one stage without recomputation: the unit of
/// [`InFlight::units`], fine enough for a recomputing rank's small forward share.
pub(super) const MILLI: u64 = 1000;

/// The stash of each rank in units of one micro-batch's stash on one stage without
/// recomputation (the elements a block keeps, [`Recompute::block_stash`]): a forward holds
/// the share its mode keeps; I leaves what W needs (the same in every mode: W's inputs and
/// output gradients do not depend on it); an I of a recomputing rank holds one block's
/// recomputed part for a moment.
pub(super) struct StashModel {
    /// Per mode, in [`Recompute::ALL`]'s order: the schedule's cost model and the transient.
    modes: [(CostModel, f64); 3],
    setting: crate::model::RecomputeSetting,
}

impl StashModel {
    pub(super) fn of(job: &JobConfig) -> Self {
        let (m, seq) = (&job.model, job.model.seq_len);
        let none = Recompute::None.block_stash(m, seq).forward.max(1) as f64;
        let modes = Recompute::ALL.map(|mode| {
            let stash = mode.block_stash(m, seq);
            let mut cost = CostModel::default().recomputed(&mode.recomputation(m, seq));
            // What I leaves for W, counted as the layers leave it (not the schedules' 0.5).
            cost.m_w = stash.for_w as f64 / none;
            (cost, stash.transient as f64 / none)
        });
        StashModel {
            modes,
            setting: job.train.recompute.clone(),
        }
    }

    fn mode(&self, mode: Recompute) -> &(CostModel, f64) {
        &self.modes[mode as usize]
    }

    /// The cost model of rank `rank`'s stash.
    fn rank(&self, rank: usize) -> &CostModel {
        &self.mode(self.setting.of_rank(rank)).0
    }

    /// The modes of `ranks` ranks, each with how many ranks have it (never a loop over
    /// the ranks: their count may be any size the estimate must refuse).
    fn modes_of(&self, ranks: usize) -> Vec<(Recompute, f64)> {
        match &self.setting {
            RecomputeSetting::Every(m) => vec![(*m, ranks as f64)],
            RecomputeSetting::PerRank(list) => {
                let extra = ranks.saturating_sub(list.len()) as f64;
                let last = list.last().map(|&m| (m, extra));
                list.iter().map(|&m| (m, 1.0)).chain(last).collect()
            }
        }
    }

    /// The most one (stage, micro-batch) holds at any time on any of `ranks` ranks.
    fn most(&self, ranks: usize) -> f64 {
        (self.modes_of(ranks).into_iter())
            .map(|(m, _)| &self.mode(m).0)
            .map(|c| c.m_b.max(c.m_w))
            .fold(0.0, f64::max)
    }

    /// Σ over `ranks` ranks of the recomputed part one I holds for a moment.
    fn transient(&self, ranks: usize) -> f64 {
        (self.modes_of(ranks).into_iter())
            .map(|(m, n)| self.mode(m).1 * n)
            .sum()
    }
}

/// `x` units as thousandths, rounded up.
fn milli(x: f64) -> u64 {
    (x * MILLI as f64).ceil().max(0.0) as u64
}

/// `base` (a count blamed on its field) times `x` units, as thousandths.
fn scaled(base: Size, x: f64) -> Result<Size, ConfigError> {
    mul("the activations", &[base, k(milli(x))])
}

/// Micro-batches in flight at a schedule's peak, in thousandths ([`MILLI`]) of one
/// micro-batch's stash on one stage (over all the ranks), and on the rank that holds the
/// head.
pub(super) struct InFlight {
    /// What the ranks stash together at the plan's simulated peak (the sum of each rank's
    /// own peak for a plan that cannot be simulated, and GPipe's bound), in thousandths.
    pub(super) units: Size,
    /// Σ over ranks of the recomputed part one I holds, in thousandths of one block's stash.
    pub(super) transient: Size,
    /// The head's rank's peak.
    pub(super) head_units: Size,
    /// Model blocks per stage (chunk).
    pub(super) layers_per_stage: Size,
    /// Pipeline ranks (1 for the reference trainer).
    pub(super) ranks: Size,
    /// Compute actions per step.
    pub(super) actions: Size,
}

/// The peak of `schedule` over `ranks` ranks and `microbatches` micro-batches of a model of
/// `layers` blocks. A schedule file is read for its peak when `read_files` (a broken one is
/// an error naming `schedule`), else bounded by GPipe's.
pub(super) fn in_flight(
    schedule: &ScheduleChoice,
    ranks: usize,
    microbatches: usize,
    layers: usize,
    microbatches_field: &'static str,
    read_files: bool,
    stash: &StashModel,
) -> Result<InFlight, ConfigError> {
    let m = f(microbatches_field, microbatches);
    let layers = f("model.layers", layers);
    if schedule.is_none() {
        // The reference trainer: one micro-batch at a time through the whole model, in the
        // setting's strongest mode.
        let (cost, transient) = stash.mode(stash.setting.strongest());
        return Ok(InFlight {
            units: k(milli(cost.m_b.max(cost.m_w))),
            transient: k(milli(*transient)),
            head_units: k(1),
            layers_per_stage: layers,
            ranks: k(1),
            actions: mul("the plan", &[m, k(2)])?,
        });
    }
    let p = f("stages", ranks);
    let kind = schedule.kind();
    let chunks = kind.map_or(1, |k| k.default_chunks());
    let v = f("stages", chunks);
    let per_cell = kind.map_or(ACTIONS_PER_CELL, |k| k.actions_per_cell());
    let actions = mul("the plan", &[p, v, m, k(per_cell)])?;
    // GPipe's bound: every micro-batch stashed on every stage (a schedule file's stage
    // count is only known once it is read, so it is bounded by one block per stage).
    let most = stash.most(ranks);
    let gpipe = InFlight {
        units: scaled(mul("the activations", &[m, p, v])?, most)?,
        transient: k(milli(stash.transient(ranks))),
        head_units: m,
        layers_per_stage: div_ceil(layers, (ranks as u64).saturating_mul(chunks as u64)),
        ranks: p,
        actions,
    };
    let Some(kind) = kind else {
        let bound = InFlight {
            units: scaled(m, most)?,
            layers_per_stage: layers,
            ..gpipe
        };
        return match read_files {
            true => file_peak(schedule, layers, bound, stash),
            false => Ok(bound),
        };
    };
    if actions.n > MAX_PEAK_ACTIONS {
        return Ok(gpipe);
    }
    let Ok(plan) = generate(kind, ranks, microbatches, chunks) else {
        // The trainer reports why the schedule cannot be built.
        return Ok(gpipe);
    };
    Ok(plan_peak(&plan, layers, gpipe, stash))
}

/// `bound` with the units and blocks per stage of `plan`'s own peak, each rank's stash in
/// its mode.
pub(super) fn plan_peak(
    plan: &crate::schedules::Plan,
    layers: Size,
    bound: InFlight,
    stash: &StashModel,
) -> InFlight {
    let ceil = |x: f64| x.ceil().max(0.0) as u64;
    // What the ranks hold together at the plan's simulated peak (one process runs every
    // rank); the sum of each rank's own peak where the plan cannot be simulated.
    let units = match simulate(plan, &CostModel::default()) {
        Ok(timeline) => joint_peak_memory(&timeline, |r| stash.rank(r)),
        Err(_) => (plan.ranks.iter().enumerate())
            .map(|(r, list)| rank_peak_memory(list, stash.rank(r)))
            .sum(),
    };
    // The head is not recomputed: its rank holds its gradients per forward until its W.
    let head_rank = plan.stage_rank.last().copied().unwrap_or(0);
    let head = plan
        .ranks
        .get(head_rank)
        .map_or(0.0, |list| rank_peak_memory(list, &CostModel::default()));
    let head = ceil(head);
    InFlight {
        // Rounded up to whole stashes, as the estimate has always counted them.
        units: Size {
            n: milli(units.ceil()),
            ..bound.units
        },
        transient: k(milli(stash.transient(plan.num_ranks()))),
        head_units: Size {
            n: head,
            ..bound.head_units
        },
        layers_per_stage: div_ceil(layers, plan.stages as u64),
        ..bound
    }
}

/// The peak of the schedule file `schedule` names, read and validated; `bound` for any
/// other choice. A file that cannot be read or used is an error naming `schedule`, its
/// reason on one line.
pub(super) fn file_peak(
    schedule: &ScheduleChoice,
    layers: Size,
    bound: InFlight,
    stash: &StashModel,
) -> Result<InFlight, ConfigError> {
    let Some(path) = schedule.file() else {
        return Ok(bound);
    };
    let invalid = |e: crate::schedules::ScheduleError| ConfigError::Invalid {
        field: "schedule".into(),
        reason: e
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
    };
    let plan = crate::schedules::read_plan(path).map_err(invalid)?;
    crate::schedules::validate(&plan, &Default::default()).map_err(invalid)?;
    let peak = plan_peak(&plan, layers, bound, stash);
    // The micro-batches in flight are the file's, not `train.micro_batches`.
    let blame = |s: Size| Size {
        field: "schedule",
        value: plan.microbatches as u64,
        ..s
    };
    Ok(InFlight {
        units: blame(peak.units),
        head_units: blame(peak.head_units),
        ..peak
    })
}
