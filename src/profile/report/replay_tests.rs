//! Tests of the replay: hand-built runs whose every clock move is known.

use super::*;
use crate::profile::ProfileError;

fn rec(rank: usize, iteration: u64, index: usize, action: Action, at: (f64, f64)) -> ActionRecord {
    ActionRecord {
        rank,
        iteration,
        index,
        action,
        start: at.0,
        end: at.1,
        waited: 0.0,
    }
}

fn step(rank: usize, iteration: u64, before: usize, work: StepWork, at: (f64, f64)) -> StepRecord {
    StepRecord {
        rank,
        iteration,
        before,
        work,
        start: at.0,
        end: at.1,
    }
}

fn began(rank: usize, iteration: u64, t: f64) -> StepRecord {
    step(rank, iteration, 0, StepWork::Began, (t, t))
}

const LAT: f64 = 0.5;

/// Two ranks, two stages, one micro-batch, two iterations, links of [`LAT`]; every clock
/// move of the virtual clock as the runtime makes it:
/// - iteration 0: 0F0 [0,1), 1F0 [1.5,2.5), 1B0 [2.5,4.5), 0B0 [5,7). Rank 1's statistics
///   leave at 4.6 and rank 0's at 7.1; rank 0 has both at once and steps exactly [7.1,7.3);
///   rank 1 does not (rank 0's arrive at 7.6), so it defers its step to iteration 1;
/// - iteration 1: rank 1 waits for rank 0's statistics, steps [7.6 + `late`, 9.1 + `late`)
///   (1.5 long: it bounds 1F0, whose input is there at 8.8) and goes on. `late` > 0 is a
///   filler that overran that wait; every later action of rank 1 and rank 0's backward
///   shift by it.
fn two_iterations(late: f64) -> (Vec<ActionRecord>, Vec<StepRecord>) {
    use StepWork::{Exact, Stats};
    let l = late;
    let records = vec![
        rec(0, 0, 0, Action::f(0, 0), (0.0, 1.0)),
        rec(0, 0, 1, Action::b(0, 0), (5.0, 7.0)),
        rec(1, 0, 0, Action::f(1, 0), (1.5, 2.5)),
        rec(1, 0, 1, Action::b(1, 0), (2.5, 4.5)),
        rec(0, 1, 0, Action::f(0, 0), (7.3, 8.3)),
        rec(0, 1, 1, Action::b(0, 0), (12.6 + l, 14.6 + l)),
        rec(1, 1, 0, Action::f(1, 0), (9.1 + l, 10.1 + l)),
        rec(1, 1, 1, Action::b(1, 0), (10.1 + l, 12.1 + l)),
    ];
    let steps = vec![
        began(0, 0, 0.0),
        step(0, 0, 2, Stats { step: 0 }, (7.0, 7.1)),
        step(0, 0, 2, Exact { step: 0 }, (7.1, 7.3)),
        began(1, 0, 0.0),
        step(1, 0, 2, Stats { step: 0 }, (4.5, 4.6)),
        began(0, 1, 7.3),
        step(0, 1, 2, Stats { step: 1 }, (14.6 + l, 14.7 + l)),
        step(0, 1, 2, Exact { step: 1 }, (14.7 + l, 14.9 + l)),
        began(1, 1, 4.6),
        step(1, 1, 0, Exact { step: 0 }, (7.6 + l, 9.1 + l)),
        step(1, 1, 2, Stats { step: 1 }, (12.1 + l, 12.2 + l)),
    ];
    (records, steps)
}

fn profiles(records: &[ActionRecord], steps: &[StepRecord]) -> Vec<IterationProfile> {
    let last = records.iter().map(|r| r.iteration).max().unwrap_or(0);
    (0..=last)
        .map(|iteration| {
            let records: Vec<ActionRecord> = records
                .iter()
                .filter(|r| r.iteration == iteration)
                .copied()
                .collect();
            let spans = records.iter().map(ActionRecord::span).collect();
            IterationProfile {
                iteration,
                timeline: Timeline::from_spans(2, spans, &[]),
                records,
                bubbles: Vec::new(),
                fillers: Vec::new(),
                steps: steps
                    .iter()
                    .filter(|s| s.iteration == iteration)
                    .copied()
                    .collect(),
                ranks_reported: 2,
            }
        })
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(1.0)
}

#[test]
fn an_unfilled_run_replays_to_its_measured_times() {
    let (records, steps) = two_iterations(0.0);
    let replayed = replay(&records, &steps, LAT).unwrap();
    for (m, r) in records.iter().zip(&replayed) {
        assert!(
            close(m.start, r.start) && close(m.end, r.end),
            "{} of iteration {}: measured {:?}, replayed {:?}",
            m.action,
            m.iteration,
            (m.start, m.end),
            (r.start, r.end)
        );
    }
    let its = profiles(&records, &steps);
    let makespans = replay_makespans(&its, LAT).unwrap();
    assert!(
        close(makespans[0], 7.0) && close(makespans[1], 7.3),
        "{makespans:?}"
    );
    for inflation in step_inflations(&its, LAT).unwrap() {
        assert!(inflation.abs() < 1e-12, "{inflation}");
    }
}

#[test]
fn a_filler_overrun_in_a_wait_for_statistics_is_the_inflation() {
    let (records, steps) = two_iterations(0.4);
    let its = profiles(&records, &steps);
    assert!(close(its[1].timeline.makespan, 7.7));
    // Replayed, rank 1 steps as soon as the statistics are there: iteration 1 takes 7.3.
    let makespans = replay_makespans(&its, LAT).unwrap();
    assert!(close(makespans[1], 7.3), "{makespans:?}");
    let inflation = step_inflations(&its, LAT).unwrap();
    assert!(close(inflation[0], 0.0), "{inflation:?}");
    assert!(close(inflation[1], 7.7 / 7.3 - 1.0), "{inflation:?}");
}

#[test]
fn the_step_bounds_the_next_compute_and_the_statistics_the_step() {
    // The same run with rank 1's deferred step made free: 1F0 of iteration 1 then starts at
    // its input's arrival (8.8), not after the step, and the replay must follow.
    let (records, mut steps) = two_iterations(0.0);
    steps[9].end = steps[9].start;
    let replayed = replay(&records, &steps, LAT).unwrap();
    assert!(close(replayed[6].start, 8.8), "{:?}", replayed[6]);
    // And with rank 0's statistics later, rank 1's step waits for them (+ the link).
    let (records, mut steps) = two_iterations(0.0);
    steps[1].end += 1.0; // rank 0's statistics of iteration 0 leave at 8.1, there at 8.6
    let replayed = replay(&records, &steps, LAT).unwrap();
    // Rank 0 steps [8.1, 8.3) and runs 0F0 [8.3, 9.3) (there at 9.8); rank 1 steps
    // [8.6, 10.1), so 1F0 starts at 10.1.
    assert!(close(replayed[6].start, 10.1), "{:?}", replayed[6]);
}

#[test]
fn speculative_forwards_leave_when_the_step_is_exact_or_recomputed() {
    use StepWork::{Exact, Recompute, Speculative, Stats};
    // Rank 0 steps speculatively at the end of iteration 0 and runs 0F0 of iteration 1 on
    // those weights; its output leaves only once the step is exact.
    let run = |recompute: bool| {
        let records = vec![
            rec(0, 0, 0, Action::f(0, 0), (0.0, 1.0)),
            rec(0, 0, 1, Action::b(0, 0), (4.0, 6.0)),
            rec(1, 0, 0, Action::f(1, 0), (1.0, 2.0)),
            rec(1, 0, 1, Action::b(1, 0), (2.0, 4.0)),
            rec(0, 1, 0, Action::f(0, 0), (6.3, 7.3)),
            rec(1, 1, 0, Action::f(1, 0), (0.0, 1.0)),
        ];
        let mut steps = vec![
            began(0, 0, 0.0),
            step(0, 0, 2, Stats { step: 0 }, (6.0, 6.1)),
            step(0, 0, 2, Speculative { step: 0 }, (6.1, 6.3)),
            began(1, 0, 0.0),
            step(1, 0, 2, Stats { step: 0 }, (4.0, 9.0)),
            began(0, 1, 6.3),
            // Rank 1's statistics arrive at 9: the step is exact [9, 9.5).
            step(0, 1, 1, Exact { step: 0 }, (9.0, 9.5)),
            began(1, 1, 9.0),
            step(1, 1, 0, Exact { step: 0 }, (9.0, 9.2)),
        ];
        if recompute {
            let work = Recompute {
                step: 0,
                action: Action::f(0, 0),
            };
            steps.push(step(0, 1, 1, work, (9.5, 10.5)));
        }
        replay(&records, &steps, 0.0).unwrap()
    };
    // 0F0 ran [6.3, 7.3), but 1F0 of iteration 1 gets it at 9.5 (or 10.5 recomputed).
    assert!(close(run(false)[5].start, 9.5), "{:?}", run(false)[5]);
    assert!(close(run(true)[5].start, 10.5), "{:?}", run(true)[5]);
}

#[test]
fn lowered_plans_receive_at_the_send_stamp_plus_the_link_latency() {
    use ActionKind::{RecvB, RecvF, SendB, SendF};
    let records = vec![
        rec(0, 0, 0, Action::f(0, 0), (0.0, 1.0)),
        rec(0, 0, 1, Action::new(SendF, 0, 0), (1.0, 1.0)),
        rec(0, 0, 2, Action::new(RecvB, 0, 0), (5.0, 5.0)),
        rec(0, 0, 3, Action::b(0, 0), (5.0, 7.0)),
        rec(1, 0, 0, Action::new(RecvF, 1, 0), (1.5, 1.5)),
        rec(1, 0, 1, Action::f(1, 0), (1.5, 2.5)),
        rec(1, 0, 2, Action::b(1, 0), (2.5, 4.5)),
        rec(1, 0, 3, Action::new(SendB, 1, 0), (4.5, 4.5)),
    ];
    let steps = [began(0, 0, 0.0), began(1, 0, 0.0)];
    let its = profiles(&records, &steps);
    assert_eq!(replay_makespans(&its, LAT).unwrap(), vec![7.0]);
    // Without the latency both hand-offs are immediate: 1 + 1 + 2 + 2.
    assert_eq!(replay_makespans(&its, 0.0).unwrap(), vec![6.0]);
}

#[test]
fn a_run_missing_a_producer_or_its_start_is_refused() {
    let records = [
        rec(1, 0, 0, Action::f(1, 0), (0.0, 1.0)),
        // Stage 0 is on rank 0, but its forward is missing from the records.
        rec(0, 0, 0, Action::b(0, 0), (1.0, 2.0)),
    ];
    let steps = [began(0, 0, 0.0), began(1, 0, 0.0)];
    let err = replay(&records, &steps, 0.0).unwrap_err();
    assert!(
        matches!(
            &err,
            ProfileError::Stuck {
                rank: 0,
                iteration: 0,
                ..
            }
        ),
        "{err}"
    );
    let err = replay(&records, &steps[..1], 0.0).unwrap_err();
    assert!(matches!(err, ProfileError::NoStart { rank: 1 }));
    // A step nobody sent statistics for never becomes exact.
    let exact = step(0, 0, 1, StepWork::Exact { step: 0 }, (1.0, 1.0));
    let err = replay(&records[..1], &[began(1, 0, 0.0), exact], 0.0).unwrap_err();
    assert!(matches!(err, ProfileError::NoStart { rank: 0 }), "{err}");
    let err = replay(
        &[rec(0, 0, 0, Action::f(0, 0), (0.0, 1.0))],
        &[began(0, 0, 0.0), exact],
        0.0,
    )
    .unwrap_err();
    assert!(matches!(err, ProfileError::Stuck { rank: 0, .. }), "{err}");
    assert!(replay_makespans(&[], 0.0).unwrap().is_empty());
}
