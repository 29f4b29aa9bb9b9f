//! The runtime against built-in schedules, with the fake compute: plan order, routing, and
//! (the key test) virtual-clock timelines that match the simulator under the fake's costs.

mod common;

use common::{Fake, assert_routed, cost_model, lower_simply, replayed};
use pipefill_actors::{Clock, RunReport, run_iterations};
use pipefill_schedules::{CostModel, Plan, ScheduleKind, build, generate, simulate};

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

/// (3) the virtual clock reproduces the simulator: under the durations its actions ran at
/// ([`replayed`]) every span starts and ends where the simulator puts it (to rounding), so
/// makespan and bubble ratios agree; and it never beats the nominal costs' makespan.
fn assert_matches_simulation(report: &RunReport, plan: &Plan, base: &CostModel) {
    let measured = &report.iterations[0].timeline;
    let floor = simulate(plan, base).expect("simulates");
    assert!(
        measured.makespan >= floor.makespan * (1.0 - 1e-9),
        "makespan {} below the nominal costs' {}",
        measured.makespan,
        floor.makespan
    );
    let predicted = replayed(plan, measured, base);
    let eps = 1e-9 * predicted.makespan;
    assert_eq!(measured.spans.len(), predicted.spans.len());
    for (m, p) in measured.spans.iter().zip(&predicted.spans) {
        assert!(
            m.rank == p.rank
                && m.action == p.action
                && (m.start - p.start).abs() <= eps
                && (m.end - p.end).abs() <= eps,
            "measured {m:?}, simulated {p:?}\n{}",
            report.side_by_side(0, &predicted)
        );
    }
    for (name, m, p) in [
        ("makespan", measured.makespan, predicted.makespan),
        (
            "bubble ratio",
            measured.bubble_ratio,
            predicted.bubble_ratio,
        ),
        (
            "steady bubble ratio",
            measured.steady_bubble_ratio,
            predicted.steady_bubble_ratio,
        ),
    ] {
        assert!((m - p).abs() <= 1e-9, "{name}: measured {m}, simulated {p}");
    }
}

async fn check_schedule(kind: ScheduleKind) {
    let compute_only = plan(kind);
    let cost = cost_model(COST);
    // Compute-only: cross-rank payloads are sent and received on demand.
    let (report, observed) = run(&compute_only, Clock::virtual_free(), 1).await;
    assert_follows_plan(&report, &compute_only, &observed, 1);
    assert_matches_simulation(&report, &compute_only, &cost);
    // Lowered: the plan's own SEND/RECV actions move the payloads.
    let lowered = lower_simply(&compute_only);
    assert!(!lowered.is_compute_only());
    let (report, observed) = run(&lowered, Clock::virtual_free(), 1).await;
    assert_follows_plan(&report, &lowered, &observed, 1);
    assert_matches_simulation(&report, &lowered, &cost);
    // Lowered by the schedules crate (`build`): RECVs may sit earlier than their consumer.
    let built = build(kind, 4, 8, kind.default_chunks()).expect("built plan");
    assert!(!built.is_compute_only());
    let (report, observed) = run(&built, Clock::virtual_free(), 1).await;
    assert_follows_plan(&report, &built, &observed, 1);
    assert_matches_simulation(&report, &built, &cost);
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
    let (report, observed) = run(
        &plan,
        Clock::Virtual {
            link_latency: latency,
        },
        1,
    )
    .await;
    assert_follows_plan(&report, &plan, &observed, 1);
    assert_matches_simulation(&report, &plan, &cost);
    let free = simulate(&plan, &cost_model(COST)).unwrap();
    assert!(report.iterations[0].timeline.makespan > free.makespan * 1.05);
}
