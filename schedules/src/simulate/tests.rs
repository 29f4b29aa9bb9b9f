//! The simulator against hand-timed plans, lowered plans, placements and broken plans.

use super::*;
use crate::action::StageMb;
use crate::generators::{ScheduleKind, generate};
use crate::plan::Placement;

fn plan_of(ranks: usize, stages: usize, m: usize, lists: &[&[&str]]) -> Plan {
    let placement = if stages == ranks {
        Placement::Contiguous
    } else {
        Placement::Custom((0..stages).map(|s| s * ranks / stages).collect())
    };
    let mut plan = Plan::new(ranks, stages, m, placement);
    for (r, list) in lists.iter().enumerate() {
        plan.ranks[r] = list
            .iter()
            .map(|t| (!t.is_empty()).then(|| t.parse::<Action>().unwrap()))
            .collect();
    }
    plan
}

fn times(t: &Timeline, rank: usize) -> Vec<(String, f64, f64)> {
    t.spans
        .iter()
        .filter(|s| s.rank == rank)
        .map(|s| (s.action.to_string(), s.start, s.end))
        .collect()
}

#[test]
fn one_f_one_b_two_ranks_exact_timeline() {
    let plan = generate(ScheduleKind::OneFOneB, 2, 3, 1).unwrap();
    let t = simulate(&plan, &CostModel::uniform(1.0, 1.0, 1.0, 0.0)).unwrap();
    let s = |a: &str, b, c| (a.to_string(), b, c);
    assert_eq!(
        times(&t, 0),
        [
            s("0F0", 0.0, 1.0),
            s("0F1", 1.0, 2.0),
            s("0B0", 4.0, 6.0),
            s("0F2", 6.0, 7.0),
            s("0B1", 7.0, 9.0),
            s("0B2", 10.0, 12.0),
        ]
    );
    assert_eq!(
        times(&t, 1),
        [
            s("1F0", 1.0, 2.0),
            s("1B0", 2.0, 4.0),
            s("1F1", 4.0, 5.0),
            s("1B1", 5.0, 7.0),
            s("1F2", 7.0, 8.0),
            s("1B2", 8.0, 10.0),
        ]
    );
    // (m + p − 1)(T_F + T_B) and 1F1B's peak: p − r micro-batches on rank r.
    assert_eq!(t.makespan, 12.0);
    assert_eq!(t.ranks[0].peak_memory, 2.0);
    assert_eq!(t.ranks[1].peak_memory, 1.0);
}

#[test]
fn link_latency_delays_cross_rank_inputs_only() {
    let plan = plan_of(2, 2, 1, &[&["0F0", "0B0"], &["1F0", "1B0"]]);
    let t = simulate(&plan, &CostModel::uniform(1.0, 1.0, 1.0, 0.5)).unwrap();
    let starts: Vec<_> = t.spans.iter().map(|s| (s.rank, s.start, s.end)).collect();
    assert_eq!(
        starts,
        [(0, 0.0, 1.0), (0, 5.0, 7.0), (1, 1.5, 2.5), (1, 2.5, 4.5)]
    );
    // Two stages on one rank: no latency between them.
    let local = plan_of(1, 2, 1, &[&["0F0", "1F0", "1B0", "0B0"]]);
    let t = simulate(&local, &CostModel::uniform(1.0, 1.0, 1.0, 0.5)).unwrap();
    assert_eq!(t.makespan, 6.0);
}

#[test]
fn lowered_plan_times_like_its_compute_only_form() {
    let lowered = plan_of(
        2,
        2,
        1,
        &[
            &["0F0", "0SEND_F0", "0RECV_B0", "0B0"],
            &["1RECV_F0", "1F0", "1B0", "1SEND_B0"],
        ],
    );
    let cost = CostModel::uniform(1.0, 1.0, 1.0, 0.5);
    let t = simulate(&lowered, &cost).unwrap();
    let compute = simulate(&lowered.compute_only(), &cost).unwrap();
    assert_eq!(t.spans, compute.spans);
    assert_eq!(t.makespan, 7.0);
}

#[test]
fn a_late_send_delays_the_receiver() {
    // Rank 0 sends its forward only after an unrelated forward of micro-batch 1.
    let plan = plan_of(
        2,
        2,
        2,
        &[
            &["0F0", "0F1", "0SEND_F0", "0SEND_F1"],
            &["1RECV_F0", "1F0", "1RECV_F1", "1F1"],
        ],
    );
    let mut plan = plan;
    plan.microbatches = 2;
    let t = simulate(&plan, &CostModel::uniform(1.0, 1.0, 1.0, 0.25)).unwrap();
    assert_eq!(times(&t, 1)[0], ("1F0".to_string(), 2.25, 3.25));
}

#[test]
fn split_backward_and_overlap_durations() {
    let plan = plan_of(1, 1, 2, &[&["0F0", "(0F1;0B0)OVERLAP_F_B", "0I1", "0W1"]]);
    let t = simulate(&plan, &CostModel::uniform(1.0, 2.0, 3.0, 0.0)).unwrap();
    let s = |a: &str, b, c| (a.to_string(), b, c);
    assert_eq!(
        times(&t, 0),
        [
            s("0F0", 0.0, 1.0),
            s("(0F1;0B0)OVERLAP_F_B", 1.0, 7.0),
            s("0I1", 7.0, 9.0),
            s("0W1", 9.0, 12.0),
        ]
    );
    assert_eq!(t.steady_bubble_ratio, 0.0);
}

#[test]
fn rank_speed_scales_durations_and_idle_steps_are_skipped() {
    let mut plan = plan_of(2, 2, 1, &[&["0F0", "", "0B0"], &["", "1F0", "1B0"]]);
    plan.ranks[0].insert(0, None);
    let mut cost = CostModel::uniform(1.0, 1.0, 1.0, 0.0);
    cost.rank_speed = vec![1.0, 2.0];
    let t = simulate(&plan, &cost).unwrap();
    assert_eq!(
        times(&t, 1),
        [("1F0".into(), 1.0, 1.5), ("1B0".into(), 1.5, 2.5)]
    );
    assert_eq!(t.makespan, 4.5);
}

#[test]
fn costs_that_overflow_are_an_overflow_not_a_deadlock() {
    let plan = crate::generate(crate::ScheduleKind::ZbH1, 4, 8, 1).unwrap();
    let huge = CostModel::uniform(1e308, 1e308, 1e308, 0.0);
    let err = simulate(&plan, &huge).unwrap_err();
    assert!(
        matches!(err, ScheduleError::TimeOverflow { rank: 0, .. }),
        "expected an overflow, got {err}"
    );
    assert!(
        err.to_string().contains("the simulated time overflows"),
        "{err}"
    );
    // A latency that overflows the time of a lowered plan's receive is one too.
    let lowered = crate::lower(&plan).unwrap();
    let err = simulate(&lowered, &CostModel::uniform(1.0, 1.0, 1.0, f64::MAX)).unwrap_err();
    assert!(matches!(err, ScheduleError::TimeOverflow { .. }), "{err}");
    // Large but finite costs still simulate.
    let big = CostModel::uniform(1e300, 1e300, 1e300, 0.0);
    assert!(simulate(&plan, &big).unwrap().makespan.is_finite());
}

#[test]
fn circular_wait_is_a_deadlock_naming_the_ranks() {
    // Rank 0 runs its backward before its forward: it waits for rank 1, which waits for it.
    let plan = plan_of(2, 2, 1, &[&["0B0", "0F0"], &["1F0", "1B0"]]);
    let err = simulate(&plan, &CostModel::default()).unwrap_err();
    let ScheduleError::Deadlock(msg) = err else {
        panic!("expected a deadlock, got {err}");
    };
    assert!(msg.contains("rank 0 waits at step 0 (0B0)"), "{msg}");
    assert!(
        msg.contains("rank 1 waits at step 0 (1F0) for the forward 0F0"),
        "{msg}"
    );
}

#[test]
fn a_missing_action_is_a_deadlock_not_a_hang() {
    let plan = plan_of(
        2,
        2,
        2,
        &[&["0F0", "0B0", "0B1"], &["1F0", "1B0", "1F1", "1B1"]],
    );
    let msg = simulate(&plan, &CostModel::default())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("rank 1 waits at step 2 (1F1) for the forward 0F1"),
        "{msg}"
    );
    // W without its I.
    let plan = plan_of(1, 1, 1, &[&["0F0", "0W0", "0I0"]]);
    let msg = simulate(&plan, &CostModel::default())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("(0W0)"), "{msg}");
}

#[test]
fn malformed_plans_are_invalid() {
    let twice = plan_of(1, 1, 1, &[&["0F0", "0F0", "0B0"]]);
    let err = simulate(&twice, &CostModel::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("already produced"), "{err}");
    let wrong_rank = plan_of(2, 2, 1, &[&["1F0"], &["0F0"]]);
    let err = simulate(&wrong_rank, &CostModel::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank 0, step 0 (1F0): stage 1 lives on rank 1"),
        "{err}"
    );
    let out_of_range = plan_of(1, 1, 1, &[&["0F3"]]);
    let err = simulate(&out_of_range, &CostModel::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("micro-batch 3 is outside 0..1"), "{err}");
    let mut overlap = plan_of(1, 1, 1, &[&[]]);
    overlap.ranks[0].push(Some(Action::overlap(
        StageMb {
            stage: 0,
            microbatch: 0,
        },
        StageMb {
            stage: 5,
            microbatch: 0,
        },
    )));
    assert!(simulate(&overlap, &CostModel::default()).is_err());
}

#[test]
fn measured_durations_replay_the_run_that_measured_them() {
    // Durations measured under another model (slower forwards, one slow rank) reproduce
    // that model's timeline exactly, over the base model they replace.
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbV,
    ] {
        let plan = generate(kind, 4, 8, kind.default_chunks()).unwrap();
        let base = CostModel::uniform(1.0, 1.0, 1.0, 0.0);
        let mut other = CostModel::uniform(1.7, 1.1, 0.6, 0.0);
        other.rank_speed = vec![1.0, 0.5, 1.0, 1.0];
        let run = simulate(&plan, &other).unwrap();
        let replayed = simulate_measured(&plan, &base, &run).unwrap();
        assert_eq!(replayed.spans, run.spans, "{kind:?}");
        assert_eq!(replayed.makespan, run.makespan);
        assert_ne!(simulate(&plan, &base).unwrap().makespan, run.makespan);
    }
}
