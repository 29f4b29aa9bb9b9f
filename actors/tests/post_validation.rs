//! Optimizer post-validation equals the barrier, bit for bit, with real weights
//! (`common::weights`): over 1F1B, ZB-H1, ZB-H2, ZB-V, interleaved 1F1B and a lowered plan,
//! with an iteration whose gradient norm is clipped and one whose Inf gradient must be
//! skipped on every rank; and it shortens ZB-H2 against the barrier.

mod common;

use common::weights::{Log, WeightFake};
use pipefill_actors::{
    Clock, Pipeline, PlanSource, RunReport, RuntimeError, StepDecision, StepMode, StepPolicy,
};
use pipefill_schedules::{Plan, ScheduleKind, generate};

const ITERATIONS: u64 = 5;
const INF_ITERATION: u64 = 3;
const COST: f64 = 0.0003;
/// The last rank's work is this many times as costly in the first test, so rank 0 ends its
/// backwards before the last rank's gradient statistics arrive and steps speculatively:
/// on declared costs, deterministically.
const SLOW_LAST: f64 = 3.0;

async fn run(
    plan: &Plan,
    policy: StepPolicy,
    inf: Option<(usize, u64)>,
    clock: Clock,
    rollback: bool,
) -> (RunReport, Log) {
    run_slow_last(plan, policy, inf, clock, rollback, 1.0).await
}

/// [`run`] with the last rank's work `slow` times as costly.
async fn run_slow_last(
    plan: &Plan,
    policy: StepPolicy,
    inf: Option<(usize, u64)>,
    clock: Clock,
    rollback: bool,
    slow: f64,
) -> (RunReport, Log) {
    let (mut fakes, log) = WeightFake::for_plan(plan, inf, COST);
    for f in &mut fakes {
        f.rollback = rollback;
    }
    if let Some(last) = fakes.last_mut() {
        last.cost *= slow;
        last.step_cost *= slow;
    }
    let report = Pipeline::new(PlanSource::Given(plan.clone()), clock)
        .iterations(ITERATIONS)
        .step_policy(policy)
        .run(fakes)
        .await
        .unwrap();
    let log = std::mem::take(&mut *log.lock().unwrap());
    (report, log)
}

fn policy(mode: StepMode, max_grad_norm: Option<f64>) -> StepPolicy {
    StepPolicy {
        max_grad_norm,
        mode,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn post_validation_equals_the_barrier_with_clipping_and_an_inf_gradient() {
    let mut total_recomputed = 0;
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
    ] {
        let plan = generate(kind, 4, 6, 1).unwrap();
        let inf = Some((0, INF_ITERATION));
        // The unclipped norms decide a limit that iteration 2 (large data) exceeds.
        let (free, _) = run_slow_last(
            &plan,
            policy(StepMode::Barrier, None),
            None,
            Clock::declared_free(),
            true,
            SLOW_LAST,
        )
        .await;
        let norms: Vec<f64> = free.steps.iter().map(|s| s.grad_norm).collect();
        let max = (norms[2] + norms[1]) / 2.0;
        assert!(
            norms[2] > max && norms[1] < max,
            "{kind:?}: norms {norms:?}"
        );

        let (barrier, want) = run_slow_last(
            &plan,
            policy(StepMode::Barrier, Some(max)),
            inf,
            Clock::declared_free(),
            true,
            SLOW_LAST,
        )
        .await;
        let (post, got) = run_slow_last(
            &plan,
            policy(StepMode::PostValidate, Some(max)),
            inf,
            Clock::declared_free(),
            true,
            SLOW_LAST,
        )
        .await;
        assert_eq!(
            want.after_step.len(),
            plan.num_ranks() * ITERATIONS as usize
        );
        assert_eq!(
            got, want,
            "{kind:?}: post-validation differs from the barrier"
        );

        // (a) Clipping triggered at iteration 2 and not at every iteration.
        let decisions: Vec<StepDecision> = barrier.steps.iter().map(|s| s.decision).collect();
        assert!(barrier.steps[2].clipped(), "{kind:?}: {decisions:?}");
        assert!(
            barrier
                .steps
                .iter()
                .any(|s| !s.clipped() && s.decision != StepDecision::Skip)
        );
        for (b, p) in barrier.steps.iter().zip(&post.steps) {
            assert!(
                b.decision.same_as(&p.decision),
                "{kind:?} iteration {}",
                b.iteration
            );
            assert_eq!(b.grad_norm.to_bits(), p.grad_norm.to_bits());
            assert_eq!(b.rollbacks(), 0, "the barrier never speculates");
        }
        // (b) The Inf gradient on rank 0 skipped the step on every rank: weights and
        // momentum after that iteration are those after the one before.
        let skipped = INF_ITERATION;
        assert_eq!(post.steps[skipped as usize].decision, StepDecision::Skip);
        assert!(post.steps[skipped as usize].grad_norm.is_nan());
        for rank in 0..plan.num_ranks() {
            assert_eq!(
                got.after_step[&(rank, skipped)],
                got.after_step[&(rank, skipped - 1)],
                "{kind:?}: rank {rank} changed its weights in the skipped iteration"
            );
            assert_ne!(got.after_step[&(rank, 2)], got.after_step[&(rank, 1)]);
        }
        // (c) Some rank stepped speculatively with a wrong guess there and rolled back.
        let rolled: Vec<(u64, usize)> = post
            .steps
            .iter()
            .flat_map(|s| {
                s.ranks
                    .iter()
                    .filter(|r| r.rolled_back)
                    .map(move |r| (s.iteration, r.rank))
            })
            .collect();
        assert!(
            rolled.iter().any(|&(it, _)| it == 2 || it == skipped),
            "{kind:?}: no rollback in the clipped or skipped iteration: {rolled:?}"
        );
        for s in &post.steps {
            for r in s.ranks.iter().filter(|r| r.rolled_back) {
                let guess = r
                    .speculative
                    .expect("a rollback follows a speculative step");
                assert!(!guess.same_as(&s.decision));
            }
        }
        let recomputed: usize = post
            .steps
            .iter()
            .flat_map(|s| &s.ranks)
            .map(|r| r.recomputed)
            .sum();
        println!(
            "{kind:?}: max_grad_norm {max:.4}, norms {:?}, rollbacks (iteration, rank) {rolled:?}, \
             first-stage forwards recomputed {recomputed}",
            post.steps.iter().map(|s| s.grad_norm).collect::<Vec<_>>()
        );
        total_recomputed += recomputed;
    }
    // Somewhere rank 0 had run forwards on a wrong speculative step and recomputed them
    // (the equality above shows the recomputation was right). On declared costs with a slow
    // last rank this happens in every run (ZB-H1 and ZB-H2); on thread CPU time it depended
    // on timing and now and then did not happen.
    assert!(total_recomputed > 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn wall_clock_and_deferred_steps_equal_the_barrier_too() {
    let plan = generate(ScheduleKind::ZbH2, 4, 6, 1).unwrap();
    let inf = Some((2, INF_ITERATION));
    let (free, _) = run(
        &plan,
        policy(StepMode::Barrier, None),
        None,
        Clock::virtual_free(),
        true,
    )
    .await;
    let max = (free.steps[2].grad_norm + free.steps[1].grad_norm) / 2.0;
    let (_, want) = run(
        &plan,
        policy(StepMode::Barrier, Some(max)),
        inf,
        Clock::Wall,
        true,
    )
    .await;
    // Wall clock: what a rank knows when it speculates depends on thread timing.
    let (_, got) = run(
        &plan,
        policy(StepMode::PostValidate, Some(max)),
        inf,
        Clock::Wall,
        true,
    )
    .await;
    assert_eq!(got, want);
    // A compute that cannot roll back defers its step; same result.
    let (deferred, got) = run(
        &plan,
        policy(StepMode::PostValidate, Some(max)),
        inf,
        Clock::virtual_free(),
        false,
    )
    .await;
    assert_eq!(got, want);
    assert!(
        deferred
            .steps
            .iter()
            .flat_map(|s| &s.ranks)
            .all(|r| r.speculative.is_none())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn post_validation_shortens_zb_h2_against_the_barrier() {
    let plan = generate(ScheduleKind::ZbH2, 4, 8, 1).unwrap();
    let iterations = 6;
    let mut makespan = Vec::new();
    let mut logs = Vec::new();
    for mode in [
        StepMode::Barrier,
        StepMode::PostValidate,
        StepMode::Unchecked,
    ] {
        let (mut fakes, log) = WeightFake::for_plan(&plan, None, 0.001);
        for f in &mut fakes {
            f.large_at = None;
        }
        // Declared costs: the makespans are compared to 0.1 ms, and a shared VM's thread
        // CPU clock now and then reads milliseconds late (CI saw Unchecked lose by 2 ms).
        let report = Pipeline::new(PlanSource::Given(plan.clone()), Clock::declared_free())
            .iterations(iterations)
            .step_mode(mode)
            .run(fakes)
            .await
            .unwrap();
        assert_eq!(report.rollbacks(), 0);
        println!(
            "zb-h2, 4 ranks, 8 micro-batches, {iterations} iterations, {mode:?}: makespan {:.4} s, steady bubble {:.3}",
            report.overall.makespan, report.overall.steady_bubble_ratio
        );
        makespan.push(report.overall.makespan);
        logs.push(std::mem::take(&mut *log.lock().unwrap()));
    }
    // Without clipping or non-finite gradients all three modes compute the same thing.
    assert_eq!(logs[0], logs[1]);
    assert_eq!(logs[0], logs[2]);
    // No agreement at all is the lower bound: the wait for the slowest rank's statistics
    // before the next iteration's later-stage work is what post-validation still pays.
    assert!(makespan[2] <= makespan[1] + 1e-4);
    // The steps (1 ms each) leave the critical path, and rank 0 runs its warm-up forwards
    // early: at least a quarter of a step per iteration is saved.
    assert!(
        makespan[1] < makespan[0] - 0.25 * 0.001 * iterations as f64,
        "post-validation {} vs barrier {}",
        makespan[1],
        makespan[0]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_step_policies_are_refused() {
    let plan = generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    for (policy, what) in [
        (policy(StepMode::Unchecked, Some(1.0)), "Unchecked"),
        (policy(StepMode::Barrier, Some(-1.0)), "max_grad_norm -1"),
        (
            policy(StepMode::PostValidate, Some(f64::NAN)),
            "max_grad_norm NaN",
        ),
    ] {
        let (fakes, _) = WeightFake::for_plan(&plan, None, 0.0);
        let err = Pipeline::new(PlanSource::Given(plan.clone()), Clock::Wall)
            .step_policy(policy)
            .run(fakes)
            .await
            .expect_err("a bad policy");
        assert!(err.to_string().contains(what), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failing_gradient_reduction_stops_the_job_and_names_the_rank() {
    let plan = generate(ScheduleKind::ZbH2, 4, 6, 1).unwrap();
    for mode in [StepMode::Barrier, StepMode::PostValidate] {
        let (mut fakes, _) = WeightFake::for_plan(&plan, None, 0.0);
        fakes[2].stats_error_at = Some(1);
        let err = Pipeline::new(PlanSource::Given(plan.clone()), Clock::Wall)
            .iterations(3)
            .step_mode(mode)
            .stall_timeout(std::time::Duration::from_secs(20))
            .run(fakes)
            .await
            .expect_err("rank 2 fails");
        assert!(
            matches!(
                err,
                RuntimeError::Optimizer {
                    rank: 2,
                    iteration: 1,
                    ..
                }
            ),
            "{mode:?}: {err}"
        );
        assert!(err.to_string().contains("device lost"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn several_chunks_per_rank_and_lowered_plans_equal_the_barrier() {
    let plans = [
        generate(ScheduleKind::ZbV, 4, 8, 2).unwrap(),
        generate(ScheduleKind::Interleaved1F1B, 2, 4, 2).unwrap(),
        // Explicit SEND/RECV: held first-stage outputs leave at their SEND, after validation.
        pipefill_schedules::lower(&generate(ScheduleKind::ZbH2, 4, 6, 1).unwrap()).unwrap(),
    ];
    for plan in &plans {
        let inf = Some((1, INF_ITERATION));
        let (free, _) = run(
            plan,
            policy(StepMode::Barrier, None),
            None,
            Clock::virtual_free(),
            true,
        )
        .await;
        let max = (free.steps[2].grad_norm + free.steps[1].grad_norm) / 2.0;
        let (barrier, want) = run(
            plan,
            policy(StepMode::Barrier, Some(max)),
            inf,
            Clock::virtual_free(),
            true,
        )
        .await;
        let (post, got) = run(
            plan,
            policy(StepMode::PostValidate, Some(max)),
            inf,
            Clock::virtual_free(),
            true,
        )
        .await;
        assert_eq!(got, want, "{} stages", plan.stages);
        assert!(barrier.steps[2].clipped());
        assert_eq!(
            post.steps[INF_ITERATION as usize].decision,
            StepDecision::Skip
        );
    }
}
