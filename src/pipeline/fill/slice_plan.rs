//! [`SlicePlan`]: which drafter slices each rank runs in each target step under the planned
//! placement ([`FillMode::Planned`]), computed once from the plan and the job's configs.
//!
//! Why: under the measured placement a slice's size is chosen from the idle time measured at
//! run time, so two runs (or a run and its resumption) train different drafters. Here the
//! plan is simulated ([`simulate`]) under a cost model that depends only on the configs
//! ([`modelled_costs`]: floating-point operations of the target's stages and of a drafter
//! slice, at one nominal rate), and each rank's predicted bubble slots are filled, in time
//! order, with full slices and one smaller slice for the rest of the slot
//! ([`DrafterTuning::planned_fill`] of each slot). The resulting list of slice sizes is the
//! same every step; it is a pure function, so every process of a multi-process run computes
//! the same list for its rank. When the slices really run (in a bubble they fit, or at the
//! step's end) is up to measured times; what they compute is not.

use crate::config::JobConfig;
use crate::model::GptConfig;
use crate::model::drafter::{DraftBatch, DrafterConfig, FillMode};
use crate::schedules::{CostModel, Plan, ScheduleError, StageCost, simulate};

/// Every this many target steps, micro-batch 0's rows are held out of training.
pub const HELD_OUT_EVERY: u64 = 4;

/// Nominal floating-point rate of the modelled costs: only ratios matter to the plan, this
/// just makes the simulated times read as seconds of a slow core.
const NOMINAL_FLOPS: f64 = 1e9;

/// The drafter slices of every rank in one target step, by rank, in the order they run
/// (sizes in layout rows, as [`crate::model::drafter::DrafterTrainer::slice_size`] counts).
#[derive(Clone, Debug, PartialEq)]
pub struct SlicePlan {
    ranks: Vec<Vec<u64>>,
    micro_batches: usize,
    /// Modelled cost of the slices / the simulated bubble time (before `drafter.advanced.planned_fill`).
    predicted_fill: f64,
}

impl SlicePlan {
    /// The slices of `plan`'s ranks for `job` (its model, train and drafter sections).
    pub fn new(plan: &Plan, job: &JobConfig) -> Result<Self, ScheduleError> {
        let (cost, slice) = modelled_costs(plan, job);
        let timeline = simulate(plan, &cost)?;
        let d = &job.drafter;
        let full = slice.max_rows();
        let mut ranks = vec![Vec::new(); plan.num_ranks()];
        let (mut used, mut idle) = (0.0, 0.0);
        for slot in &timeline.slots {
            idle += slot.length;
            let mut budget = slot.length * d.advanced.planned_fill;
            let sizes = &mut ranks[slot.rank];
            while budget >= slice.cost(full) {
                sizes.push(full as u64);
                budget -= slice.cost(full);
                used += slice.cost(full);
            }
            // The largest smaller slice that fits what is left of the slot.
            if let Some(rows) = (1..full)
                .rev()
                .map(|r| slice.normalize(r))
                .find(|&r| slice.cost(r) <= budget)
            {
                sizes.push(rows as u64);
                used += slice.cost(rows);
            }
        }
        Ok(SlicePlan {
            ranks,
            micro_batches: plan.microbatches,
            predicted_fill: if idle > 0.0 { used / idle } else { 0.0 },
        })
    }

    /// The plan of `job` when its drafter is placed by plan, `None` for the measured
    /// placement.
    pub fn of_job(plan: &Plan, job: &JobConfig) -> Result<Option<Self>, ScheduleError> {
        match job.drafter.placement {
            FillMode::Planned => Self::new(plan, job).map(Some),
            FillMode::Measured => Ok(None),
        }
    }

    /// The slice sizes `rank` runs in target step `step`, in order. None where the step
    /// has no rows to train on: slices of step `s` sample the rows of step `s − 1` (complete
    /// on every rank by then), so step 0 has none, and neither does the step after a step
    /// whose only micro-batch was held out.
    pub fn slices(&self, rank: usize, step: u64) -> &[u64] {
        let held_out_only =
            self.micro_batches == 1 && (step.wrapping_sub(1)).is_multiple_of(HELD_OUT_EVERY);
        if step == 0 || held_out_only {
            return &[];
        }
        self.ranks.get(rank).map_or(&[], Vec::as_slice)
    }

    /// Ranks planned.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Of the simulated bubble time, the share the slices fill under the modelled costs.
    pub fn predicted_fill(&self) -> f64 {
        self.predicted_fill
    }
}

/// Modelled cost of drafter slices (see [`modelled_costs`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SliceCost {
    /// Seconds per layout row of everything but attention.
    per_row: f64,
    /// Seconds per layout row and per position of its window (attention).
    per_row_position: f64,
    max_rows: usize,
    max_window: usize,
}

impl SliceCost {
    /// Layout rows of a full slice.
    pub fn max_rows(&self) -> usize {
        self.max_rows * self.max_window
    }

    /// The layout rows a slice asked for `rows` really has (the trainer's layout).
    pub fn normalize(&self, rows: usize) -> usize {
        let (r, p) = DraftBatch::shape_within(rows, self.max_rows, self.max_window);
        r * p
    }

    /// Modelled seconds of a slice of `rows` layout rows.
    pub fn cost(&self, rows: usize) -> f64 {
        let (r, p) = DraftBatch::shape_within(rows, self.max_rows, self.max_window);
        let n = (r * p) as f64;
        n * (self.per_row + self.per_row_position * p as f64)
    }
}

/// Floating-point operations per token of one block's matrix products.
fn block_linear(t: &GptConfig) -> f64 {
    let d = t.d_model as f64;
    2.0 * (4.0 * d * d + 2.0 * (t.mlp_ratio as f64) * d * d)
}

/// The cost model the planned placement simulates: for each stage (blocks cut as
/// [`crate::model::Cut::Even`] cuts them), per micro-batch of `micro_batch_size · seq_len`
/// tokens, T_F = blocks' matrix products + attention over the causal context (+ the LM head
/// and softmax on the last stage), T_I = the same with attention's backward twice, T_W = the
/// weight-gradient products; and a drafter slice's forward + backward (3× a forward: its
/// input projection, one block over its window, the frozen LM head). No measured time enters
/// it, so every run and every process computes the same plan.
pub fn modelled_costs(plan: &Plan, job: &JobConfig) -> (CostModel, SliceCost) {
    let t = &job.model;
    let (d, v, seq) = (t.d_model as f64, t.vocab as f64, t.seq_len as f64);
    let tokens = (job.train.micro_batch_size * t.seq_len) as f64;
    let linear = block_linear(t);
    // Causal attention: scores and weighted sum, over seq/2 positions on average.
    let attention = 2.0 * 2.0 * (seq / 2.0) * d;
    let head = 2.0 * d * v + 5.0 * v;
    let stages = plan.stages.max(1);
    let (base, extra) = (t.layers / stages, t.layers % stages);
    let stage = (0..stages)
        .map(|s| {
            let blocks = (base + usize::from(s < extra)) as f64;
            let last = if s + 1 == stages { head } else { 0.0 };
            let per = |flops: f64| tokens * flops / NOMINAL_FLOPS;
            StageCost {
                f: per(blocks * (linear + attention) + last),
                i: per(blocks * (linear + 2.0 * attention) + last),
                w: per(blocks * linear + last),
            }
        })
        .collect();
    let dc: &DrafterConfig = &job.drafter;
    let max_window = dc.max_positions.min(t.seq_len.saturating_sub(1)).max(1);
    // Each unrolled step (`drafter.unroll`) runs the whole forward + backward again.
    let steps = dc.unroll.max(1) as f64;
    let slice = SliceCost {
        per_row: steps * 3.0 * (2.0 * 2.0 * d * d + linear + head) / NOMINAL_FLOPS,
        // Attention over the window: scores and weighted sum, half the window on average.
        per_row_position: steps * 3.0 * 2.0 * 2.0 * 0.5 * d / NOMINAL_FLOPS,
        max_rows: dc.batch_rows.max(1),
        max_window,
    };
    let cost = CostModel {
        stage,
        ..CostModel::uniform(0.0, 0.0, 0.0, 0.0)
    };
    (cost, slice)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedules::{ScheduleKind, build};

    fn job(placement: FillMode) -> JobConfig {
        let mut job = JobConfig::default();
        job.drafter.placement = placement;
        job
    }

    #[test]
    fn the_plan_is_a_function_of_plan_and_config_and_fills_the_predicted_bubbles() {
        let job = job(FillMode::Planned);
        let plan = build(ScheduleKind::ZbH1, 4, job.train.micro_batches, 1).unwrap();
        let a = SlicePlan::new(&plan, &job).unwrap();
        assert_eq!(a, SlicePlan::new(&plan, &job).unwrap(), "pure");
        assert_eq!(a.ranks(), 4);
        assert!(a.slices(0, 0).is_empty(), "step 0 has no previous rows");
        // Every rank of zb-h1 idles somewhere; every slice is a valid size.
        let (_, slice) = modelled_costs(&plan, &job);
        for r in 0..4 {
            let s = a.slices(r, 3);
            assert!(!s.is_empty(), "rank {r} has no slice");
            assert!(s.iter().all(|&n| n >= 1 && n as usize <= slice.max_rows()));
            assert!(s.iter().all(|&n| slice.normalize(n as usize) == n as usize));
        }
        let f = a.predicted_fill();
        assert!(
            f > 0.5 && f <= job.drafter.advanced.planned_fill + 1e-9,
            "{f}"
        );
        // Filling less of each slot plans fewer rows.
        let mut less = job.clone();
        less.drafter.advanced.planned_fill = 0.3;
        let b = SlicePlan::new(&plan, &less).unwrap();
        let rows = |p: &SlicePlan| {
            (0..4)
                .map(|r| p.slices(r, 3).iter().sum::<u64>())
                .sum::<u64>()
        };
        assert!(rows(&b) < rows(&a), "{} vs {}", rows(&b), rows(&a));
        assert!(
            SlicePlan::of_job(&plan, &JobConfig::default())
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_step_after_a_held_out_only_step_has_no_slices() {
        let mut job = job(FillMode::Planned);
        job.train.micro_batches = 1;
        let plan = build(ScheduleKind::OneFOneB, 2, 1, 1).unwrap();
        let p = SlicePlan::new(&plan, &job).unwrap();
        // Step 4's only micro-batch is held out, so step 5 has nothing to sample.
        assert!(p.slices(1, 5).is_empty());
        assert!(!p.slices(1, 6).is_empty());
        assert_eq!(p.slices(1, 6), p.slices(1, 2));
    }
}
