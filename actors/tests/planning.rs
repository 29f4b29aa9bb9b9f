//! The schedule actor's planning: re-planning from measured costs, predicted bubble lengths
//! handed to the filler in wall-clock mode, peak memory in the timelines, and composite
//! (overlapped F+B) actions.

mod common;

use std::sync::{Arc, Mutex};

use common::{Fake, assert_routed, cost_model, replayed};
use pipefill_actors::{Bubble, BubbleFiller, Clock, FillerWork, Pipeline, PlanSource};
use pipefill_schedules::{
    Action, CostModel, Placement, Plan, ScheduleKind, StageMb, generate, peak_memory,
};

const COST: (f64, f64, f64) = (0.001, 0.001, 0.001);

/// An iteration the re-planner was asked for, and the costs it was given.
type Planned = (u64, Option<CostModel>);

#[tokio::test(flavor = "multi_thread")]
async fn replanning_sees_the_costs_measured_so_far() {
    let seen: Arc<Mutex<Vec<Planned>>> = Arc::default();
    let log = Arc::clone(&seen);
    let source = PlanSource::Replan(Box::new(move |iteration, cost| {
        log.lock().unwrap().push((iteration, cost.cloned()));
        generate(ScheduleKind::ZbH1, 4, 8, 1)
    }));
    let plan = generate(ScheduleKind::ZbH1, 4, 8, 1).unwrap();
    let (fakes, observed) = Fake::for_plan(&plan, COST);
    let report = Pipeline::new(source, Clock::virtual_free())
        .iterations(3)
        .run(fakes)
        .await
        .unwrap();
    assert_eq!(report.iterations.len(), 3);
    assert_routed(&observed.lock().unwrap(), &plan);
    let seen = seen.lock().unwrap();
    let iterations: Vec<u64> = seen.iter().map(|(i, _)| *i).collect();
    assert_eq!(iterations, vec![0, 1, 2]);
    // Iterations 0 and 1 are dispatched together, before anything is measured; iteration 2
    // only once iteration 0 is done everywhere, with its measured costs.
    assert!(seen[0].1.is_none() && seen[1].1.is_none());
    let cost = seen[2]
        .1
        .as_ref()
        .expect("iteration 2 is planned from measured costs");
    assert!((cost.of(0).f - COST.0).abs() < 0.0001, "{cost:?}");
}

struct Recorder(Arc<Mutex<Vec<Bubble>>>);

impl BubbleFiller for Recorder {
    fn fill(&mut self, bubble: &Bubble) -> Option<FillerWork> {
        self.0.lock().unwrap().push(*bubble);
        None
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn wall_clock_bubbles_carry_the_predicted_idle_time() {
    let plan = generate(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
    let offers = Arc::new(Mutex::new(Vec::new()));
    let fillers: Vec<Box<dyn BubbleFiller>> = (0..4)
        .map(|_| Box::new(Recorder(Arc::clone(&offers))) as Box<dyn BubbleFiller>)
        .collect();
    let (fakes, _) = Fake::for_plan(&plan, (0.004, 0.004, 0.004));
    let report = Pipeline::new(PlanSource::Given(plan.clone()), Clock::Wall)
        .cost_hint(cost_model((0.004, 0.004, 0.004)))
        .fillers(fillers)
        .run(fakes)
        .await
        .unwrap();
    // The last rank waits for the whole warm-up before its first forward: 3 forwards, 12 ms.
    let offers = offers.lock().unwrap();
    let first = offers
        .iter()
        .find(|b| b.rank == 3 && b.waiting_for == Action::f(3, 0))
        .expect("rank 3 waited for 3F0");
    let predicted = first
        .predicted_idle
        .expect("a predicted idle time from the cost hint");
    // What is left of the predicted 12 ms when the offer is made (µs later, or a few ms on
    // a loaded machine that preempts the stage thread in between).
    assert!(
        predicted <= 0.012 && predicted > 0.006,
        "predicted {predicted}"
    );
    assert!(!report.iterations[0].bubbles.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn timelines_carry_the_plans_peak_memory() {
    let plan = generate(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
    let (fakes, _) = Fake::for_plan(&plan, (0.0, 0.0, 0.0));
    let report = Pipeline::new(PlanSource::Given(plan.clone()), Clock::Wall)
        .run(fakes)
        .await
        .unwrap();
    let want = peak_memory(&plan, &CostModel::default());
    let got: Vec<f64> = report.iterations[0]
        .timeline
        .ranks
        .iter()
        .map(|r| r.peak_memory)
        .collect();
    assert_eq!(got, want);
    assert_eq!(want[0], 4.0, "1F1B holds p micro-batches on rank 0");
}

/// Two ranks, one stage each; rank 0 overlaps each steady-state forward with the backward
/// of an earlier micro-batch.
fn overlapped_plan() -> Plan {
    let mut plan = Plan::new(2, 2, 4, Placement::Contiguous);
    let sm = |stage, microbatch| StageMb { stage, microbatch };
    plan.ranks[0] = [
        Action::f(0, 0),
        Action::f(0, 1),
        Action::overlap(sm(0, 2), sm(0, 0)),
        Action::overlap(sm(0, 3), sm(0, 1)),
        Action::b(0, 2),
        Action::b(0, 3),
    ]
    .into_iter()
    .map(Some)
    .collect();
    plan.ranks[1] = (0..4)
        .flat_map(|mb| [Action::f(1, mb), Action::b(1, mb)])
        .map(Some)
        .collect();
    plan
}

#[tokio::test(flavor = "multi_thread")]
async fn overlapped_forward_backward_pairs_run_both_halves() {
    let plan = overlapped_plan();
    let (fakes, observed) = Fake::for_plan(&plan, COST);
    let report = Pipeline::new(PlanSource::Given(plan.clone()), Clock::virtual_free())
        .run(fakes)
        .await
        .unwrap();
    assert_routed(&observed.lock().unwrap(), &plan);
    // The simulator times the pairs as the runtime ran them (at the durations they took).
    let measured = &report.iterations[0].timeline;
    let predicted = replayed(&plan, measured, &cost_model(COST));
    assert_eq!(measured.spans, predicted.spans);
    // An overlapped pair costs its forward plus its full backward (at least: the CPU clock
    // can read late, see `replayed`).
    let pair = report.iterations[0]
        .records
        .iter()
        .find(|r| {
            r.action
                == Action::overlap(
                    StageMb {
                        stage: 0,
                        microbatch: 2,
                    },
                    StageMb {
                        stage: 0,
                        microbatch: 0,
                    },
                )
        })
        .unwrap();
    assert!(pair.duration() >= 3.0 * COST.0 * (1.0 - 1e-6), "{pair:?}");
}
