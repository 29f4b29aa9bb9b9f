//! A job split over processes ([`Pipeline::run_local`]): each "process" runs only its own
//! ranks, the others are reached through the shared transport. Here the processes are two
//! pipelines in one test process sharing one in-process transport, which is exactly what
//! the TCP transport gives each real process; the weights after every step must be bitwise
//! those of the whole job run by one pipeline, with clipping's gradient statistics crossing
//! between the halves.

mod common;

use std::sync::Arc;

use common::weights::WeightFake;
use pipefill_actors::{
    Clock, GradStats, InProcess, Pipeline, PlanSource, RunReport, Transport, run_iterations,
};
use pipefill_schedules::{ScheduleKind, generate};

const ITERATIONS: u64 = 4;

fn pipeline(plan: &pipefill_schedules::Plan) -> Pipeline {
    Pipeline::new(PlanSource::Given(plan.clone()), Clock::virtual_free())
        .iterations(ITERATIONS)
        .max_grad_norm(0.5)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_split_over_two_processes_equals_the_whole_job() {
    let plan = generate(ScheduleKind::ZbH1, 4, 6, 1).unwrap();
    let (fakes, whole_log) = WeightFake::for_plan(&plan, None, 0.0005);
    pipeline(&plan).run(fakes).await.unwrap();

    let (fakes, split_log) = WeightFake::for_plan(&plan, None, 0.0005);
    let tensors: Arc<InProcess<_>> = Arc::new(InProcess::new(4));
    let stats: Arc<InProcess<GradStats>> = Arc::new(InProcess::new(4));
    let mut halves = vec![Vec::new(), Vec::new()];
    for (rank, fake) in fakes.into_iter().enumerate() {
        halves[rank / 2].push((rank, fake));
    }
    let second = halves.pop().unwrap();
    let first = halves.pop().unwrap();
    let run = |local, plan: &pipefill_schedules::Plan| {
        let t: Arc<dyn Transport<_>> = tensors.clone();
        let s: Arc<dyn Transport<GradStats>> = stats.clone();
        pipeline(plan).stats_transport(s).run_local(local, t)
    };
    let (a, b): (pipefill_actors::Result<RunReport>, _) =
        tokio::join!(run(first, &plan), run(second, &plan));
    let (a, b) = (a.unwrap(), b.unwrap());

    assert_eq!(*split_log.lock().unwrap(), *whole_log.lock().unwrap());
    assert!(!whole_log.lock().unwrap().after_step.is_empty());
    // Each half reports its own ranks' steps and records.
    for (report, ranks) in [(&a, [0, 1]), (&b, [2, 3])] {
        assert_eq!(report.steps.len() as u64, ITERATIONS);
        let stepped: Vec<usize> = report.steps[0].ranks.iter().map(|r| r.rank).collect();
        assert_eq!(stepped, ranks);
        assert!(
            report.iterations[0]
                .records
                .iter()
                .all(|r| ranks.contains(&r.rank))
        );
    }
    assert_eq!(a.steps[2].decision, b.steps[2].decision);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_local_ranks_and_a_replanner_are_refused() {
    let plan = generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    let (fakes, _) = WeightFake::for_plan(&plan, None, 0.0);
    let t: Arc<InProcess<_>> = Arc::new(InProcess::new(2));
    let local: Vec<_> = fakes.into_iter().map(|f| (5, f)).collect();
    let err = pipeline(&plan)
        .run_local(local, t.clone())
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("each must be distinct and below 2"),
        "{err}"
    );

    let (mut fakes, _) = WeightFake::for_plan(&plan, None, 0.0);
    let replan = PlanSource::Replan(Box::new(move |_, _| {
        generate(ScheduleKind::OneFOneB, 2, 2, 1)
    }));
    let err = Pipeline::new(replan, Clock::virtual_free())
        .run_local(vec![(0, fakes.remove(0))], t)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("fixed plan"), "{err}");
    // The whole job on one pipeline still runs through the same path.
    let (fakes, _) = WeightFake::for_plan(&plan, None, 0.0);
    run_iterations(plan, fakes, Clock::virtual_free(), 1)
        .await
        .unwrap();
}
