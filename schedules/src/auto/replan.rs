//! Re-planning while training: ZB-H1 until every stage's costs are measured, then the auto
//! plan for the measured costs, re-planned only when they drift.
//!
//! [`AutoReplanner::plan`] has the shape of the runtime's re-planning seam
//! (`pipefill_actors::PlanSource::Replan`, called before each iteration with the costs
//! measured so far), so `schedule = "auto"` is
//! `PlanSource::Replan(Box::new(move |i, cost| replanner.plan(i, cost)))`. Medians move a
//! little every iteration; re-running the search for noise would cost time and change the
//! plan for nothing, so a new plan is built only when some stage's T_F, T_I or T_W moved by
//! more than [`AutoReplanner::drift`] (relative) from the costs the current plan was built
//! for.

use crate::error::Result;
use crate::generators::{ScheduleKind, generate};
use crate::plan::{Placement, Plan};
use crate::timeline::CostModel;

/// Plans each iteration of an auto-scheduled run (see the module docs).
#[derive(Clone, Debug)]
pub struct AutoReplanner {
    ranks: usize,
    microbatches: usize,
    memory_limit: Option<f64>,
    /// Relative change of a measured cost that triggers a new plan (default 0.1).
    pub drift: f64,
    /// The costs the current auto plan was built for, and the plan.
    current: Option<(CostModel, Plan)>,
    replans: usize,
}

impl AutoReplanner {
    /// One stage per rank (ZB-H1's shape) over `ranks` ranks and `microbatches`
    /// micro-batches, within `memory_limit` per rank (`None`: ZB-H1's own peak, `p · M_B`
    /// of the measured model, so auto never needs more memory than the plan it replaces).
    pub fn new(ranks: usize, microbatches: usize, memory_limit: Option<f64>) -> Self {
        AutoReplanner {
            ranks,
            microbatches,
            memory_limit,
            drift: 0.1,
            current: None,
            replans: 0,
        }
    }

    /// The plan of `iteration`, given the costs measured so far (`None` before any):
    /// ZB-H1 while nothing is measured, else the auto plan for `measured` (compute-only).
    pub fn plan(&mut self, _iteration: u64, measured: Option<&CostModel>) -> Result<Plan> {
        let Some(cost) = measured else {
            return generate(ScheduleKind::ZbH1, self.ranks, self.microbatches, 1);
        };
        if let Some((built_for, plan)) = &self.current
            && !self.drifted(built_for, cost)
        {
            return Ok(plan.clone());
        }
        let limit = self.memory_limit.unwrap_or(self.ranks as f64 * cost.m_b);
        let plan = super::auto(
            cost,
            self.ranks,
            self.microbatches,
            1,
            Placement::Contiguous,
            limit,
        )?;
        self.current = Some((cost.clone(), plan.clone()));
        self.replans += 1;
        Ok(plan)
    }

    /// How many auto plans were built so far (one per significant change of the costs).
    pub fn replans(&self) -> usize {
        self.replans
    }

    /// Whether any stage's cost moved by more than `drift` relative to `old`.
    fn drifted(&self, old: &CostModel, new: &CostModel) -> bool {
        let stages = self.ranks as u32;
        let moved = |a: f64, b: f64| (a - b).abs() > self.drift * a.abs().max(b.abs());
        old.comm != new.comm
            || (0..stages).any(|s| {
                let (a, b) = (old.of(s), new.of(s));
                moved(a.f, b.f) || moved(a.i, b.i) || moved(a.w, b.w)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate;
    use crate::timeline::StageCost;

    fn measured(slow: f64) -> CostModel {
        let mut stage = vec![
            StageCost {
                f: 1.0,
                i: 1.0,
                w: 1.0
            };
            4
        ];
        stage[2] = StageCost {
            f: slow,
            i: slow,
            w: slow,
        };
        CostModel {
            stage,
            ..CostModel::uniform(1.0, 1.0, 1.0, 0.05)
        }
    }

    #[test]
    fn zb_h1_until_measured_then_auto_rebuilt_only_on_drift() {
        let mut r = AutoReplanner::new(4, 16, None);
        let first = r.plan(0, None).unwrap();
        assert_eq!(first, generate(ScheduleKind::ZbH1, 4, 16, 1).unwrap());
        assert_eq!(r.replans(), 0);

        let cost = measured(1.5);
        let auto = r.plan(2, Some(&cost)).unwrap();
        assert_eq!(r.replans(), 1);
        let ours = simulate(&auto, &cost).unwrap();
        let zb_h1 = simulate(&first, &cost).unwrap();
        assert!(ours.steady_bubble_ratio < zb_h1.steady_bubble_ratio - 1e-3);
        // Within ZB-H1's memory: p · M_B.
        assert!(ours.ranks.iter().all(|x| x.peak_memory <= 4.0));

        // Noise (2%) keeps the plan; a real change (the slow stage recovering) re-plans.
        assert_eq!(r.plan(3, Some(&measured(1.53))).unwrap(), auto);
        assert_eq!(r.replans(), 1);
        let even = measured(1.0);
        let again = r.plan(4, Some(&even)).unwrap();
        assert_eq!(r.replans(), 2);
        assert_eq!(
            again,
            crate::auto(&even, 4, 16, 1, Placement::Contiguous, 4.0).unwrap()
        );
    }
}
