//! (4) A failing stage stops the whole job promptly, with an error that names the rank, the
//! action and the cause; and plans or wiring the runtime cannot run are refused with a clear
//! error, never a hang.
//!
//! "Promptly" is measured against the job's own stall timeout, not a raw second: the fault
//! leaves iteration 0 unfinished on every rank, so a failure that did not stop the job
//! itself would end it by the stall watchdog ([`RuntimeError::Stalled`]) or not at all.
//! The failure's own error arriving first, well inside that timeout, is what proves the
//! stop was the failure's doing; a busy machine (many builds at once) stretches both the
//! fault's arrival and its handling, but not past a timeout several seconds long.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use common::{Fake, Fault, lower_simply, swap_ranks};
use kameo::actor::Spawn;
use pipefill_actors::{
    Clock, InProcess, NoFiller, Pipeline, PlanSource, RunIteration, RuntimeError, StageActor,
    StageEvent, StageWiring, StepPolicy, run_iterations,
};
use pipefill_schedules::{Action, Placement, Plan, ScheduleKind, generate};

/// The stall timeout of the faulty jobs: a stop that is not the failure's own would come
/// from it (see the module docs).
const STALL: Duration = Duration::from_secs(6);

/// ZB-H1 (split backward) on 4 ranks with stages 1 and 2 swapped, so that rank 2 runs
/// stage 1.
fn swapped_plan() -> Plan {
    let plan = generate(ScheduleKind::ZbH1, 4, 8, 1).unwrap();
    swap_ranks(&plan, 1, 2)
}

/// Runs with a fault at rank 2's `1I3` under the [`STALL`] timeout and returns the error
/// and how long the job took to stop after the fault fired.
async fn run_with_fault(fault: Fault, clock: Clock) -> (RuntimeError, Duration) {
    let plan = lower_simply(&swapped_plan());
    assert_eq!(plan.rank_of(1), 2);
    // Long actions: the other ranks are mid-compute or blocked when the fault fires.
    let (mut fakes, observed) = Fake::for_plan(&plan, (0.02, 0.02, 0.01));
    fakes[2].fault = Some((Action::i(1, 3), fault));
    let job = Pipeline::new(PlanSource::Given(plan), clock)
        .iterations(3)
        .stall_timeout(STALL)
        .run(fakes);
    let result = tokio::time::timeout(STALL * 5, job)
        .await
        .expect("the job hung after a stage failure, even past its stall timeout");
    let stopped = Instant::now();
    let err = result.expect_err("the job must fail");
    let fired = observed.lock().unwrap().fault_at.expect("the fault fired");
    (err, stopped - fired)
}

/// The job stopped because of the failure, inside the stall timeout (see the module docs).
fn assert_stopped_by_the_failure(took: Duration, what: &str) {
    assert!(
        took < STALL,
        "stopped {took:?} after the {what}: not its own doing (stall timeout {STALL:?})"
    );
}

fn assert_names_rank_and_action(err: &RuntimeError, cause: &str) {
    let text = err.to_string();
    assert!(text.contains("rank 2"), "{text}");
    assert!(text.contains("1I3"), "{text}");
    assert!(text.contains(cause), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_error_stops_the_job_before_the_stall_timeout() {
    for clock in [Clock::Wall, Clock::virtual_free()] {
        let (err, took) = run_with_fault(Fault::Error, clock).await;
        assert!(
            matches!(err, RuntimeError::Stage { rank: 2, action, iteration: 0, .. } if action == Action::i(1, 3)),
            "{err:?}"
        );
        assert_names_rank_and_action(&err, "injected fault at 1I3");
        assert_stopped_by_the_failure(took, "fault");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panic_stops_the_job_before_the_stall_timeout() {
    let (err, took) = run_with_fault(Fault::Panic, Clock::Wall).await;
    assert!(
        matches!(err, RuntimeError::Panic { rank: 2, .. }),
        "{err:?}"
    );
    assert_names_rank_and_action(&err, "injected panic at 1I3");
    assert_stopped_by_the_failure(took, "panic");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deadlocking_plan_is_refused_before_it_runs() {
    // Both ranks start with a backward that waits for the other: nothing can progress.
    let mut plan = Plan::new(2, 2, 1, Placement::Contiguous);
    plan.ranks[0] = vec![
        Some(Action::i(0, 0)),
        Some(Action::f(0, 0)),
        Some(Action::w(0, 0)),
    ];
    plan.ranks[1] = vec![
        Some(Action::f(1, 0)),
        Some(Action::i(1, 0)),
        Some(Action::w(1, 0)),
    ];
    let (fakes, _) = Fake::for_plan(&plan, (0.0, 0.0, 0.0));
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        run_iterations(plan, fakes, Clock::Wall, 1),
    )
    .await
    .expect("a deadlocking plan hung the runtime");
    assert!(matches!(result, Err(RuntimeError::Plan(_))), "{result:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_local_input_out_of_order_names_the_action() {
    // One rank holds both stages and runs stage 1's forward before stage 0's.
    let mut plan = Plan::new(1, 2, 1, Placement::Contiguous);
    plan.ranks[0] = [
        Action::f(1, 0),
        Action::f(0, 0),
        Action::b(1, 0),
        Action::b(0, 0),
    ]
    .into_iter()
    .map(Some)
    .collect();
    let (fakes, _) = Fake::for_plan(&plan, (0.0, 0.0, 0.0));
    let run = Pipeline::new(PlanSource::Given(plan.clone()), Clock::Wall);
    // The validator refuses it before it runs...
    let err = run.run(fakes).await.expect_err("out-of-order plan");
    assert!(matches!(err, RuntimeError::Plan(_)), "{err:?}");
    assert!(err.to_string().contains("1F0"), "{err}");

    // ...and a stage actor handed it directly (no schedule actor) names the action too.
    let (mut fakes, _) = Fake::for_plan(&plan, (0.0, 0.0, 0.0));
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let wiring = StageWiring {
        rank: 0,
        clock: Clock::Wall,
        epoch: Instant::now(),
        transport: Arc::new(InProcess::new(1)),
        stats: Arc::new(InProcess::new(1)),
        step: StepPolicy::default(),
        filler: Box::new(NoFiller),
        observers: Vec::new(),
        events: events_tx,
        abort: Arc::new(AtomicBool::new(false)),
    };
    let stage = StageActor::spawn_in_thread(StageActor::new(fakes.remove(0), wiring));
    stage
        .tell(RunIteration {
            iteration: 0,
            plan: Arc::new(plan),
            predicted: None,
        })
        .await
        .unwrap();
    let event = tokio::time::timeout(Duration::from_secs(10), events.recv())
        .await
        .unwrap();
    let Some(StageEvent::Failed(err)) = event else {
        panic!("expected a failure, got {event:?}");
    };
    assert!(
        matches!(err, RuntimeError::Stage { rank: 0, action, .. } if action == Action::f(1, 0)),
        "{err:?}"
    );
    assert!(err.to_string().contains("has not produced it yet"), "{err}");
    stage.kill();
}

#[tokio::test(flavor = "multi_thread")]
async fn one_compute_per_rank_is_required() {
    let plan = generate(ScheduleKind::OneFOneB, 4, 4, 1).unwrap();
    let (mut fakes, _) = Fake::for_plan(&plan, (0.0, 0.0, 0.0));
    fakes.pop();
    let err = run_iterations(plan, fakes, Clock::Wall, 1)
        .await
        .expect_err("3 computes for 4 ranks");
    assert!(matches!(err, RuntimeError::Config(_)), "{err:?}");
    assert!(err.to_string().contains("4 ranks"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_stage_is_reported_after_the_stall_timeout() {
    let plan = generate(ScheduleKind::OneFOneB, 4, 4, 1).unwrap();
    let (mut fakes, _) = Fake::for_plan(&plan, (0.0, 0.0, 0.0));
    fakes[1].fault = Some((Action::f(1, 2), Fault::Hang(Duration::from_secs(3))));
    let start = Instant::now();
    let err = Pipeline::new(PlanSource::Given(plan), Clock::Wall)
        .stall_timeout(Duration::from_millis(300))
        .run(fakes)
        .await
        .expect_err("a hung stage must stall the job");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    // Every rank waits on rank 1's micro-batch 2 one way or another; none finished.
    assert!(
        matches!(&err, RuntimeError::Stalled { iteration: 0, waiting, .. } if waiting == &vec![0, 1, 2, 3]),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_current_thread_runtime_is_refused_not_a_panic() {
    let plan = generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    let (fakes, _) = Fake::for_plan(&plan, (0.0, 0.0, 0.0));
    let err = run_iterations(plan, fakes, Clock::Wall, 1)
        .await
        .expect_err("current-thread runtime");
    assert!(err.to_string().contains("multi-thread"), "{err}");
}

#[test]
fn run_blocking_starts_its_own_runtime() {
    let plan = generate(ScheduleKind::ZbH1, 2, 4, 1).unwrap();
    let (fakes, observed) = Fake::for_plan(&plan, (0.0, 0.0, 0.0));
    let report = Pipeline::new(PlanSource::Given(plan.clone()), Clock::Wall)
        .run_blocking(fakes)
        .unwrap();
    assert_eq!(report.iterations.len(), 1);
    common::assert_routed(&observed.lock().unwrap(), &plan);
}
