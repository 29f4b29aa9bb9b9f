//! Live figures: a listener registered with `Pipeline::on_iteration` receives each
//! iteration's measured profile while the job runs, once per iteration, and it is the very
//! profile the final report holds.

mod common;

use std::sync::mpsc::channel;

use common::Fake;
use pipefill_actors::{Clock, Pipeline, PlanSource};
use pipefill_schedules::{ScheduleKind, generate};

#[tokio::test(flavor = "multi_thread")]
async fn each_iteration_profile_is_published_as_it_completes() {
    let plan = generate(ScheduleKind::ZbH1, 4, 8, 1).unwrap();
    let (fakes, _) = Fake::for_plan(&plan, (0.001, 0.001, 0.001));
    let (tx, rx) = channel();
    let report = Pipeline::new(PlanSource::Given(plan), Clock::virtual_free())
        .iterations(3)
        .on_iteration(tx)
        .run(fakes)
        .await
        .unwrap();
    // The sender lived in the profiler, which the job has shut down: the channel ends.
    let mut live: Vec<_> = rx.iter().collect();
    live.sort_by_key(|p| p.iteration);
    assert_eq!(live.len(), 3, "one profile per iteration");
    for (published, kept) in live.iter().zip(&report.iterations) {
        assert_eq!(published.iteration, kept.iteration);
        assert_eq!(published.ranks_reported, 4);
        assert_eq!(published.records, kept.records);
        assert_eq!(published.timeline.bubble_ratio, kept.timeline.bubble_ratio);
        assert_eq!(
            published.timeline.steady_bubble_ratio,
            kept.timeline.steady_bubble_ratio
        );
        let ratio = published.timeline.bubble_ratio;
        assert!(ratio > 0.0 && ratio < 1.0, "bubble ratio {ratio}");
    }
}
