//! The runtime against built-in schedules, with the fake compute: plan order, routing, and
//! (the key test) virtual-clock timelines that match the simulator under the fake's costs.

mod common;

use common::{Fake, assert_routed, cost_model, lower_simply};
use pipefill_actors::{Clock, RunReport, run_iterations};
use pipefill_schedules::{Plan, ScheduleKind, Timeline, build, generate, simulate};

/// CPU seconds per F, I, W of every stage.
const COST: (f64, f64, f64) = (0.0015, 0.0015, 0.001);

fn plan(kind: ScheduleKind) -> Plan {
    generate(kind, 4, 8, kind.default_chunks()).expect("built-in plan")
}

async fn run(plan: &Plan, clock: Clock, iterations: u64) -> (RunReport, common::Observed) {
    let (fakes, observed) = Fake::for_plan(plan, COST);
    let report = run_iterations(plan.clone(), fakes, clock, iterations)
        .await
        .unwrap_or_else(|e| panic!("run failed: {e}"));
    let observed = std::mem::take(&mut *observed.lock().unwrap());
    (report, observed)
}

/// (1) each rank's records are its plan list, in order; (2) payloads reached their stage.
fn assert_follows_plan(
    report: &RunReport,
    plan: &Plan,
    observed: &common::Observed,
    iterations: u64,
) {
    assert_eq!(report.iterations.len(), iterations as usize);
    for it in &report.iterations {
        assert_eq!(it.ranks_reported, plan.num_ranks());
        for (rank, list) in plan.ranks.iter().enumerate() {
            let ran: Vec<_> = it.rank_records(rank).map(|r| (r.index, r.action)).collect();
            let planned: Vec<_> = list
                .iter()
                .enumerate()
                .filter_map(|(i, a)| a.map(|a| (i, a)))
                .collect();
            assert_eq!(ran, planned, "rank {rank}, iteration {}", it.iteration);
        }
    }
    assert_routed(observed, plan);
    let mut steps = observed.optimizer_steps.clone();
    steps.sort();
    let want: Vec<_> = (0..plan.num_ranks())
        .flat_map(|r| (0..iterations).map(move |i| (r, i)))
        .collect();
    assert_eq!(steps, want, "one optimizer step per rank and iteration");
}

fn within(name: &str, measured: f64, predicted: f64, rel: f64, abs: f64) {
    let tol = (rel * predicted.abs()).max(abs);
    assert!(
        (measured - predicted).abs() <= tol,
        "{name}: measured {measured:.6}, predicted {predicted:.6} (tolerance {tol:.6})"
    );
}

/// (3) the virtual clock reproduces the simulator: makespan within 10%, both bubble
/// ratios within 10% (or 0.02 absolute when the ratio is near zero).
fn assert_matches_simulation(report: &RunReport, predicted: &Timeline) {
    let measured = &report.iterations[0].timeline;
    eprintln!("{}", report.side_by_side(0, predicted));
    within("makespan", measured.makespan, predicted.makespan, 0.10, 0.0);
    within(
        "bubble ratio",
        measured.bubble_ratio,
        predicted.bubble_ratio,
        0.10,
        0.02,
    );
    within(
        "steady bubble ratio",
        measured.steady_bubble_ratio,
        predicted.steady_bubble_ratio,
        0.10,
        0.02,
    );
    for (m, p) in measured.ranks.iter().zip(&predicted.ranks) {
        within(&format!("rank {} busy", m.rank), m.busy, p.busy, 0.10, 0.0);
    }
}

async fn check_schedule(kind: ScheduleKind) {
    let compute_only = plan(kind);
    let predicted = simulate(&compute_only, &cost_model(COST)).expect("simulates");
    // Compute-only: cross-rank payloads are sent and received on demand.
    let (report, observed) = run(&compute_only, Clock::virtual_free(), 1).await;
    assert_follows_plan(&report, &compute_only, &observed, 1);
    assert_matches_simulation(&report, &predicted);
    // Lowered: the plan's own SEND/RECV actions move the payloads.
    let lowered = lower_simply(&compute_only);
    assert!(!lowered.is_compute_only());
    let (report, observed) = run(&lowered, Clock::virtual_free(), 1).await;
    assert_follows_plan(&report, &lowered, &observed, 1);
    assert_matches_simulation(&report, &predicted);
    // Lowered by the schedules crate (`build`): RECVs may sit earlier than their consumer.
    let built = build(kind, 4, 8, kind.default_chunks()).expect("built plan");
    assert!(!built.is_compute_only());
    let predicted = simulate(&built, &cost_model(COST)).expect("simulates");
    let (report, observed) = run(&built, Clock::virtual_free(), 1).await;
    assert_follows_plan(&report, &built, &observed, 1);
    assert_matches_simulation(&report, &predicted);
    // Wall clock: same order and routing, two overlapping iterations.
    let (report, observed) = run(&built, Clock::Wall, 2).await;
    assert_follows_plan(&report, &built, &observed, 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn one_f_one_b() {
    check_schedule(ScheduleKind::OneFOneB).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn zb_h1() {
    check_schedule(ScheduleKind::ZbH1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn zb_v() {
    check_schedule(ScheduleKind::ZbV).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn interleaved_1f1b() {
    check_schedule(ScheduleKind::Interleaved1F1B).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn link_latency_delays_receivers_as_simulated() {
    let plan = plan(ScheduleKind::OneFOneB);
    let latency = 0.0005;
    let mut cost = cost_model(COST);
    cost.comm = latency;
    let predicted = simulate(&plan, &cost).expect("simulates");
    let (report, observed) = run(
        &plan,
        Clock::Virtual {
            link_latency: latency,
        },
        1,
    )
    .await;
    assert_follows_plan(&report, &plan, &observed, 1);
    assert_matches_simulation(&report, &predicted);
    let free = simulate(&plan, &cost_model(COST)).unwrap();
    assert!(report.iterations[0].timeline.makespan > free.makespan * 1.05);
}
