//! Per-rank peak activation memory of a plan.
//!
//! The accounting is the zero-bubble paper's: a forward stashes `m_b` units of activations
//! for its backward; the input-gradient backward (I) frees what only it needed
//! (`m_b − m_w`) and keeps `m_w` for the weight-gradient backward (W), which frees the rest;
//! a full backward (B) frees all `m_b` at once. An overlapped F+B counts as its forward
//! then its backward, so its peak includes the forward's stash. SEND/RECV hold nothing
//! (their buffers are the activations already counted).
//!
//! The figure depends only on each rank's order of actions, not on timing, so the
//! validator and the simulator share this one function.

use crate::action::{Action, ActionKind};
use crate::plan::Plan;
use crate::timeline::{CostModel, Timeline};

/// Change in held activation memory caused by one plain (non-composite) action.
fn delta(kind: ActionKind, cost: &CostModel) -> f64 {
    match kind {
        ActionKind::F => cost.m_b,
        ActionKind::I => -(cost.m_b - cost.m_w),
        ActionKind::W => -cost.m_w,
        ActionKind::B => -cost.m_b,
        _ => 0.0,
    }
}

/// Peak activation memory of one rank's action list, in the cost model's units.
///
/// The running total starts at 0; the peak is taken after every part of every action
/// (so an overlap's forward counts before its backward releases anything).
pub fn rank_peak_memory<'a>(
    actions: impl IntoIterator<Item = &'a Option<Action>>,
    cost: &CostModel,
) -> f64 {
    let mut held = 0.0f64;
    let mut peak = 0.0f64;
    for action in actions.into_iter().flatten() {
        for part in action.parts() {
            held += delta(part.kind, cost);
            peak = peak.max(held);
        }
    }
    peak
}

/// Per-rank peak activation memory of `plan` (index = rank), in the cost model's units.
///
/// Works on compute-only and lowered plans alike: SEND/RECV do not change the total.
pub fn peak_memory(plan: &Plan, cost: &CostModel) -> Vec<f64> {
    plan.ranks
        .iter()
        .map(|list| rank_peak_memory(list, cost))
        .collect()
}

/// The most activation memory the ranks hold together at any one time of `timeline`, in
/// the cost models' units, rank `r`'s stash by `cost(r)`: what one process running every
/// rank holds at its peak, where [`peak_memory`]'s sum assumes every rank at its own peak
/// at once. A zero-bubble schedule's ranks peak at different times (each keeps `m_w` per
/// deferred W until its W fills a bubble), so its sum overstates the process. A stash
/// counts from its action's start and a release from its action's end, so the figure
/// holds whatever happens within an action; at equal times releases come first (a rank's next
/// action starts as its last one ends).
pub fn joint_peak_memory<'c>(timeline: &Timeline, cost: impl Fn(usize) -> &'c CostModel) -> f64 {
    let mut events: Vec<(f64, f64)> = Vec::new();
    for span in &timeline.spans {
        let c = cost(span.rank);
        for part in span.action.parts() {
            match delta(part.kind, c) {
                d if d > 0.0 => events.push((span.start, d)),
                d if d < 0.0 => events.push((span.end, d)),
                _ => {}
            }
        }
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let (mut held, mut peak) = (0.0f64, 0.0f64);
    for (_, d) in events {
        held += d;
        peak = peak.max(held);
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::StageMb;
    use crate::plan::{Placement, Plan};

    fn cost() -> CostModel {
        // m_b = 1, m_w = 0.5
        CostModel::uniform(1.0, 1.0, 1.0, 0.0)
    }

    fn one_rank(actions: Vec<Action>) -> Plan {
        let mut p = Plan::new(1, 1, 4, Placement::Contiguous);
        p.ranks[0] = actions.into_iter().map(Some).collect();
        p
    }

    /// F0 I0 F1 I1 W0 W1 on one stage.
    fn split_backward() -> Plan {
        one_rank(vec![
            Action::f(0, 0),
            Action::i(0, 0),
            Action::f(0, 1),
            Action::i(0, 1),
            Action::w(0, 0),
            Action::w(0, 1),
        ])
    }

    #[test]
    fn one_rank_holds_jointly_what_it_holds_alone() {
        let p = split_backward();
        let timeline = crate::simulate::simulate(&p, &cost()).unwrap();
        let c = cost();
        assert_eq!(joint_peak_memory(&timeline, |_| &c), 1.5);
    }

    #[test]
    fn zero_bubble_ranks_peak_apart_and_one_f_one_b_ranks_together() {
        use crate::generators::{ScheduleKind, generate};
        let c = cost();
        let joint_and_sum = |kind| {
            let plan = generate(kind, 4, 4, 1).unwrap();
            let timeline = crate::simulate::simulate(&plan, &c).unwrap();
            let sum: f64 = peak_memory(&plan, &c).iter().sum();
            (joint_peak_memory(&timeline, |_| &c), sum)
        };
        // 1F1B: every rank holds its warm-up's stashes when the first backward starts.
        let (joint, sum) = joint_and_sum(ScheduleKind::OneFOneB);
        assert_eq!(joint, sum);
        // ZB-H1: the ranks' deferred W keep their m_w at different times.
        let (joint, sum) = joint_and_sum(ScheduleKind::ZbH1);
        assert!(joint < sum, "joint {joint}, sum {sum}");
    }

    #[test]
    fn forwards_accumulate_until_backward() {
        // GPipe-like on one stage: 3 forwards stash 3 units before any backward.
        let p = one_rank(vec![
            Action::f(0, 0),
            Action::f(0, 1),
            Action::f(0, 2),
            Action::b(0, 0),
            Action::b(0, 1),
            Action::b(0, 2),
        ]);
        assert_eq!(peak_memory(&p, &cost()), vec![3.0]);
    }

    #[test]
    fn split_backward_keeps_m_w_until_w() {
        // F0 (1) I0 (0.5) F1 (1.5) I1 (1.0) W0 (0.5) W1 (0): peak 1.5.
        let p = split_backward();
        assert_eq!(peak_memory(&p, &cost()), vec![1.5]);
        // Deferring both W to the end keeps m_w per micro-batch held: F0 I0 F1 → 1.5 still,
        // but with m_w = 1 (I frees nothing) the peak is 2.
        let mut c = cost();
        c.m_w = 1.0;
        assert_eq!(peak_memory(&p, &c), vec![2.0]);
    }

    #[test]
    fn overlap_counts_forward_before_backward() {
        // F0 (1), then (F1; B0): the forward raises to 2 before the backward frees 1.
        let p = one_rank(vec![
            Action::f(0, 0),
            Action::overlap(
                StageMb {
                    stage: 0,
                    microbatch: 1,
                },
                StageMb {
                    stage: 0,
                    microbatch: 0,
                },
            ),
            Action::b(0, 1),
        ]);
        assert_eq!(peak_memory(&p, &cost()), vec![2.0]);
    }

    #[test]
    fn comm_and_idle_steps_hold_nothing() {
        let mut p = one_rank(vec![
            Action::new(ActionKind::RecvF, 0, 0),
            Action::f(0, 0),
            Action::new(ActionKind::SendF, 0, 0),
            Action::b(0, 0),
        ]);
        p.ranks[0].insert(1, None);
        assert_eq!(peak_memory(&p, &cost()), vec![1.0]);
    }
}
