//! (5) Iterations overlap: a rank starts iteration k+1 as soon as its own part of k is
//! done; payloads tagged by iteration keep early arrivals apart. Also: the bubble-filler
//! seam runs filler work inside bubbles, and the schedule actor learns the real costs.
//!
//! The timed checks run on the declared clock: every action lasts exactly its cost, so a
//! timeline is a fixed function of the plan and the runtime's rules, and the checks hold
//! to the bit on any host load (on the thread CPU clock a shared VM stretched them).

mod common;

use std::sync::{Arc, Mutex};

use common::{COST_NONE, Fake, assert_routed, cost_model, work};
use pipefill_actors::{
    Bubble, BubbleFiller, Clock, FillerWork, Pipeline, PlanSource, StepMode, run_iterations,
};
use pipefill_schedules::{Plan, ScheduleKind, generate, simulate};

const COST: (f64, f64, f64) = (0.001, 0.001, 0.001);

#[tokio::test(flavor = "multi_thread")]
async fn zb_h2_iterations_overlap_in_virtual_time() {
    let plan = generate(ScheduleKind::ZbH2, 4, 8, 1).unwrap();
    zb_h2_overlap(&plan).await;
}

async fn zb_h2_overlap(plan: &Plan) {
    let last = plan.num_ranks() - 1;
    // Default step policy (post-validation): rank 0's first-stage forwards of iteration 1
    // run on its speculatively stepped weights, before the last rank has finished 0.
    let (fakes, observed) = Fake::for_plan(plan, COST);
    let report = run_iterations(plan.clone(), fakes, Clock::declared_free(), 2)
        .await
        .unwrap();
    assert_routed(&observed.lock().unwrap(), plan);
    let (first, second) = (&report.iterations[0], &report.iterations[1]);
    let rank0_starts = second
        .rank_records(0)
        .map(|r| r.start)
        .fold(f64::INFINITY, f64::min);
    let last_ends = first.rank_records(last).map(|r| r.end).fold(0.0, f64::max);
    assert!(
        rank0_starts < last_ends,
        "rank 0 started iteration 1 at {rank0_starts}, after rank {last} finished iteration 0 at {last_ends}"
    );
    assert!(
        report.overall.makespan < 2.0 * first.timeline.makespan,
        "two iterations took {} s, one {} s",
        report.overall.makespan,
        first.timeline.makespan
    );

    // Without any agreement on the step, iterations overlap fully and pay the steady
    // bubble, not the synchronous one: two iterations take well under twice one.
    let (fakes, _) = Fake::for_plan(plan, COST);
    let unchecked = Pipeline::new(PlanSource::Given(plan.clone()), Clock::declared_free())
        .iterations(2)
        .step_mode(StepMode::Unchecked)
        .run(fakes)
        .await
        .unwrap();
    let one = unchecked.iterations[0].timeline.makespan;
    assert!(
        unchecked.overall.makespan < 2.0 * one * 0.95,
        "unchecked: two iterations took {} s, one {one} s",
        unchecked.overall.makespan
    );
    assert!(
        unchecked.overall.makespan <= report.overall.makespan + 1e-4,
        "unchecked took {} s, post-validated {} s",
        unchecked.overall.makespan,
        report.overall.makespan
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_barrier_between_iterations_when_one_is_in_flight() {
    let plan = generate(ScheduleKind::ZbH2, 4, 8, 1).unwrap();
    let (fakes, _) = Fake::for_plan(&plan, COST_NONE);
    let report = Pipeline::new(PlanSource::Given(plan), Clock::Wall)
        .iterations(2)
        .in_flight(1)
        .run(fakes)
        .await
        .unwrap();
    let first_end = report.iterations[0]
        .records
        .iter()
        .map(|r| r.end)
        .fold(0.0, f64::max);
    let second_start = report.iterations[1]
        .records
        .iter()
        .map(|r| r.start)
        .fold(f64::INFINITY, f64::min);
    assert!(
        second_start >= first_end,
        "iteration 1 started before iteration 0 ended"
    );
}

/// Runs a fixed slice of CPU work in every bubble it is offered while at least that much
/// idle time is predicted, and logs every offer.
struct SliceFiller {
    slice: f64,
    offers: Arc<Mutex<Vec<Bubble>>>,
}

impl BubbleFiller for SliceFiller {
    fn fill(&mut self, bubble: &Bubble) -> Option<FillerWork> {
        self.offers.lock().unwrap().push(*bubble);
        let slice = self.slice;
        (bubble.predicted_idle? >= slice).then(|| FillerWork {
            label: "drafter slice".into(),
            predicted_cost: slice,
            run: Box::new(move || {
                work(slice);
                Ok(())
            }),
        })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn filler_work_runs_inside_bubbles_without_stretching_the_step() {
    let plan = generate(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
    fillers_fit(&plan).await;
}

async fn fillers_fit(plan: &Plan) {
    let plan = plan.clone();
    let offers = Arc::new(Mutex::new(Vec::new()));
    let fillers: Vec<Box<dyn BubbleFiller>> = (0..4)
        .map(|_| {
            Box::new(SliceFiller {
                slice: 0.0005,
                offers: Arc::clone(&offers),
            }) as Box<dyn BubbleFiller>
        })
        .collect();
    let (fakes, observed) = Fake::for_plan(&plan, COST);
    let report = Pipeline::new(PlanSource::Given(plan.clone()), Clock::declared_free())
        .fillers(fillers)
        .run(fakes)
        .await
        .unwrap();
    assert_routed(&observed.lock().unwrap(), &plan);
    let it = &report.iterations[0];
    assert!(!it.fillers.is_empty(), "no filler work ran");
    // Every filler span lies inside a recorded bubble of its rank.
    for f in &it.fillers {
        assert!(f.error.is_none());
        let inside = it
            .bubbles
            .iter()
            .any(|b| b.rank == f.rank && b.start <= f.start + 1e-9 && f.end <= b.end + 1e-6);
        assert!(inside, "filler {f:?} outside every bubble");
    }
    // On a per-rank clock the predicted idle time is exact, so fitted work never delays the
    // step: the makespan is the simulator's for the compute alone.
    let predicted = simulate(&plan, &cost_model(COST)).unwrap();
    let makespan = it.timeline.makespan;
    assert!(
        (makespan - predicted.makespan).abs() <= 1e-9,
        "makespan {makespan} vs {}",
        predicted.makespan
    );
    let offers = offers.lock().unwrap();
    assert!(
        offers
            .iter()
            .all(|b| b.predicted_idle.is_some_and(|t| t > 0.0))
    );
    let filled: f64 = it.fillers.iter().map(|f| f.end - f.start).sum();
    let idle: f64 = it.bubbles.iter().map(|b| b.end - b.start).sum();
    assert!(
        filled > 0.3 * idle,
        "filled {filled}s of {idle}s of bubbles"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_schedule_actor_measures_per_stage_costs() {
    measured_costs_predict_the_run().await;
}

async fn measured_costs_predict_the_run() {
    let report = {
        let plan_source = PlanSource::Builtin {
            kind: ScheduleKind::ZbH1,
            ranks: 4,
            microbatches: 8,
            chunks: 1,
        };
        let plan = generate(ScheduleKind::ZbH1, 4, 8, 1).unwrap();
        let (fakes, _) = Fake::for_plan(&plan, COST);
        Pipeline::new(plan_source, Clock::declared_free())
            .iterations(2)
            .run(fakes)
            .await
            .unwrap()
    };
    let cost = report.measured_cost.expect("every stage measured");
    assert_eq!(cost.stage.len(), 4);
    for c in &cost.stage {
        for (name, got) in [("T_F", c.f), ("T_I", c.i), ("T_W", c.w)] {
            assert!((got - 0.001).abs() <= 1e-12, "{name} measured {got}");
        }
    }
    // The measured model predicts what was measured.
    let plan = report.plan.as_ref().unwrap();
    let predicted = simulate(plan, &cost).unwrap();
    let measured = report.iterations[1].timeline.makespan;
    assert!(
        (measured - predicted.makespan).abs() <= 1e-9,
        "measured {measured}, predicted {} from {cost:?}",
        predicted.makespan
    );
}
