//! Activation recomputation in the cost model: a forward keeps a share of its activations
//! and the input-gradient backward (I) runs that share of the forward again first.
//!
//! [`Recomputation`] is what one mode costs and saves as shares of a stage's forward (the
//! engine derives them from the model's layers; this crate knows no tensors), and
//! [`CostModel::recomputed`] applies it: `T_I += rerun · T_F` (so B too), `m_b ×= keep`.
//! What I leaves for W (`m_w`) does not change: W still needs its inputs and output
//! gradients, so with recomputation `m_w` may exceed `m_b` and an I *raises* the memory a
//! rank holds until its W ([`crate::memory`] counts it so). A recomputed block's internals
//! held during the I itself are not modelled.
//!
//! [`auto_recomputing`] is the auto-scheduler for a memory limit that may need
//! recomputation: the plan without it when one fits, else with the first mode that fits.

use serde::{Deserialize, Serialize};

use crate::auto::{AutoPlan, auto_plan};
use crate::error::Result;
use crate::plan::Placement;
use crate::timeline::CostModel;

/// What one recomputation mode costs and saves on every stage, as shares of the stage's
/// forward.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recomputation {
    /// The mode's name, for reports.
    pub name: String,
    /// Share of `m_b` a forward still holds until its I.
    pub keep: f64,
    /// Share of `T_F` the I runs again before its own work.
    pub rerun: f64,
}

impl CostModel {
    /// This cost model with `r` on every stage: `T_I += rerun · T_F`, `m_b ×= keep`.
    pub fn recomputed(&self, r: &Recomputation) -> CostModel {
        let mut cost = self.clone();
        for s in &mut cost.stage {
            s.i += r.rerun * s.f;
        }
        cost.m_b *= r.keep;
        cost
    }
}

/// [`auto_plan`]'s answer, and the recomputation it needs (`None`: none).
#[derive(Clone, Debug)]
pub struct RecomputedPlan {
    pub auto: AutoPlan,
    /// Index into the modes offered.
    pub recompute: Option<usize>,
    /// The cost model the plan was built and timed for.
    pub cost: CostModel,
}

/// The auto-scheduler's plan under `memory_limit`: without recomputation when any plan
/// fits, else with the first of `modes` (least recomputation first) under which one
/// fits, since each costs compute on every I. The error is the last mode's (or the plain
/// one's when `modes` is empty).
pub fn auto_recomputing(
    cost: &CostModel,
    ranks: usize,
    microbatches: usize,
    chunks: usize,
    placement: Placement,
    memory_limit: f64,
    modes: &[Recomputation],
) -> Result<RecomputedPlan> {
    let plain = std::iter::once((None, cost.clone()));
    let recomputed = modes
        .iter()
        .enumerate()
        .map(|(i, r)| (Some(i), cost.recomputed(r)));
    let mut last = None;
    for (recompute, cost) in plain.chain(recomputed) {
        match auto_plan(
            &cost,
            ranks,
            microbatches,
            chunks,
            placement.clone(),
            memory_limit,
        ) {
            Ok(auto) => {
                return Ok(RecomputedPlan {
                    auto,
                    recompute,
                    cost,
                });
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("the plain cost model is always tried"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::peak_memory;

    fn full() -> Recomputation {
        Recomputation {
            name: "full".into(),
            keep: 0.1,
            rerun: 1.0,
        }
    }

    #[test]
    fn greedy_plans_keep_what_an_i_adds_within_the_limit() {
        // Split backwards: every I adds m_w − m_b = 0.4 until its W; the greedy scheduler
        // reserves it, so its plans stay within the limit.
        let cost = CostModel::uniform(1.0, 1.0, 1.0, 0.0).recomputed(&full());
        let shape = crate::plan::Plan::new(4, 4, 8, Placement::Contiguous);
        for depth in [1, 2, 4] {
            let knobs = crate::auto::greedy::Knobs {
                depth: vec![depth; 4],
                keep: vec![usize::MAX; 4],
                gap: 1.0,
                f_first: false,
                deep_first: true,
            };
            let plan = crate::auto::greedy::schedule(&shape, &cost, 0.7, &knobs).unwrap();
            let peaks = peak_memory(&plan, &cost);
            assert!(peaks.iter().all(|&p| p <= 0.7 + 1e-9), "{depth}: {peaks:?}");
            // Every rank held an I's W stash (m_w = 0.5), more than its forwards alone ever
            // could (at most depth · m_b = 0.4): the I's growth is counted.
            assert!(peaks.iter().all(|&p| p >= 0.5 - 1e-9), "{depth}: {peaks:?}");
        }
    }

    #[test]
    fn recomputation_lengthens_i_and_shrinks_the_forward_stash() {
        let cost = CostModel::uniform(2.0, 3.0, 1.0, 0.5).recomputed(&full());
        let s = cost.of(0);
        assert_eq!((s.f, s.i, s.w, s.b()), (2.0, 5.0, 1.0, 6.0));
        assert_eq!((cost.m_b, cost.m_w), (0.1, 0.5));
    }

    #[test]
    fn a_limit_no_plain_plan_meets_is_met_by_recomputing() {
        let cost = CostModel::uniform(1.0, 1.0, 1.0, 0.0);
        // One micro-batch's forward (m_b = 1) does not fit 0.6: no plan without recomputing.
        let placement = Placement::Contiguous;
        assert!(auto_plan(&cost, 4, 8, 1, placement.clone(), 0.6).is_err());
        let selective = Recomputation {
            name: "selective".into(),
            keep: 0.75,
            rerun: 0.2,
        };
        let modes = [selective, full()];
        let found = auto_recomputing(&cost, 4, 8, 1, placement.clone(), 0.6, &modes).unwrap();
        assert_eq!(found.recompute, Some(1), "selective keeps 0.75 > 0.6: full");
        // An I raises a rank's memory (m_w 0.5 > m_b 0.1) unless a fused B frees it all:
        // either way the plan stays within the limit.
        let peaks = peak_memory(&found.auto.plan, &found.cost);
        assert!(peaks.iter().all(|&p| p <= 0.6 + 1e-9), "{peaks:?}");
        // Recomputing costs an extra forward on each I.
        let plain = auto_plan(&cost, 4, 8, 1, placement.clone(), 8.0).unwrap();
        assert!(found.auto.timeline.makespan > plain.timeline.makespan);
        // A limit the plain plans meet needs no recomputation.
        let found = auto_recomputing(&cost, 4, 8, 1, placement, 4.0, &modes).unwrap();
        assert_eq!(found.recompute, None);
    }
}
