//! The filler router in a running pipeline (declared clock, so every action and slice
//! lasts exactly its cost): slices of known cost go into the bubbles they fit, fill most of
//! the idle time, and do not stretch the iterations.

mod common;

use common::{Fake, assert_routed, work};
use pipefill_actors::{Clock, FillerRouter, FillerSource, Pipeline, PlanSource, RunReport, Slice};
use pipefill_schedules::{Plan, ScheduleKind, generate};

const COST: (f64, f64, f64) = (0.001, 0.001, 0.001);
const SLICE: f64 = 0.0001;

/// Slices of exactly [`SLICE`] seconds of CPU.
struct Spin(u64);

impl FillerSource for Spin {
    fn kind(&self) -> &str {
        "spin"
    }

    fn next(&mut self, rank: usize, units: u64) -> Option<Slice> {
        self.0 += 1;
        Some(Slice {
            label: format!("spin {} on {rank}", self.0),
            units,
            run: Box::new(|| {
                work(SLICE);
                Ok(())
            }),
        })
    }
}

async fn run(plan: &Plan, router: Option<&FillerRouter>) -> RunReport {
    let (fakes, observed) = Fake::for_plan(plan, COST);
    let mut pipeline =
        Pipeline::new(PlanSource::Given(plan.clone()), Clock::declared_free()).iterations(3);
    if let Some(router) = router {
        pipeline = pipeline.fillers(router.fillers(plan.num_ranks()));
    }
    let report = pipeline.run(fakes).await.unwrap();
    assert_routed(&observed.lock().unwrap(), plan);
    report
}

#[tokio::test(flavor = "multi_thread")]
async fn routed_slices_fill_the_bubbles_without_stretching_the_step() {
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
        let plan = generate(kind, 4, 8, 1).unwrap();
        let bare = run(&plan, None).await;
        let router = FillerRouter::default();
        router.add_source(Spin(0), Some(SLICE));
        let filled = run(&plan, Some(&router)).await;

        let (used, waited) = fillers_in_bubbles(kind, &filled);
        let stats = router.stats();
        let spin = &stats.kinds["spin"];
        assert!(spin.slices > 0 && spin.estimate.samples == spin.slices);
        assert!(
            (spin.estimate.mean - SLICE).abs() < 1e-9 * SLICE,
            "{kind}: estimate {:?}",
            spin.estimate
        );
        timing_checks(kind, &bare, &filled, used, waited, 0.85);
    }
}

/// Checks that every filler of `filled` ran without error inside a bubble of its rank;
/// returns the seconds the fillers used and the seconds the bubbles lasted.
fn fillers_in_bubbles(kind: ScheduleKind, filled: &RunReport) -> (f64, f64) {
    let mut waited = 0.0;
    let mut used = 0.0;
    for it in &filled.iterations {
        for f in &it.fillers {
            assert!(f.error.is_none(), "{f:?}");
            let inside = it
                .bubbles
                .iter()
                .any(|b| b.rank == f.rank && b.start <= f.start && f.end <= b.end + 1e-12);
            assert!(
                inside,
                "{kind}: filler {f:?} outside every bubble of its rank"
            );
            used += f.end - f.start;
        }
        waited += it.bubbles.iter().map(|b| b.end - b.start).sum::<f64>();
    }
    (used, waited)
}

/// The checks that read the timeline: the share of the waits the fillers used, and the
/// makespan's inflation, none (on a per-rank clock the predicted idle time is exact, so a
/// slice that fits never delays the next action).
fn timing_checks(
    kind: ScheduleKind,
    bare: &RunReport,
    filled: &RunReport,
    used: f64,
    waited: f64,
    share: f64,
) {
    assert!(
        used >= share * waited,
        "{kind}: filler used {used} s of {waited} s waited"
    );
    let inflation = filled.overall.makespan / bare.overall.makespan - 1.0;
    assert!(
        inflation <= 1e-9,
        "{kind}: makespan {} with fillers, {} without",
        filled.overall.makespan,
        bare.overall.makespan
    );
}

/// Fixed and per-unit CPU cost of a [`SizedSpin`] slice: a full one (12 units) costs 350 µs,
/// a third of a 1 ms action, so whole slices alone would strand much of each bubble.
const FIXED: f64 = 50e-6;
const PER_UNIT: f64 = 25e-6;

/// Slices of 1..=12 units costing exactly `FIXED + PER_UNIT · units` seconds of CPU.
struct SizedSpin(Vec<u64>);

impl FillerSource for SizedSpin {
    fn kind(&self) -> &str {
        "sized spin"
    }

    fn sizes(&self) -> (u64, u64) {
        (1, 12)
    }

    fn next(&mut self, rank: usize, units: u64) -> Option<Slice> {
        self.0.push(units);
        Some(Slice {
            label: format!("{units} units on {rank}"),
            units,
            run: Box::new(move || {
                work(FIXED + PER_UNIT * units as f64);
                Ok(())
            }),
        })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sized_slices_fill_the_waits_up_to_the_margin() {
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
        let plan = generate(kind, 4, 8, 1).unwrap();
        let bare = run(&plan, None).await;
        let router = FillerRouter::default();
        // The prior: the line the slices follow, as a calibration before the job measures.
        let prior = pipefill_actors::router::CostEstimate::prior_line(12.0, 350e-6, PER_UNIT);
        router.add_sized_source(SizedSpin(Vec::new()), Some(prior));
        let filled = run(&plan, Some(&router)).await;

        let (used, waited) = fillers_in_bubbles(kind, &filled);
        let sizes: std::collections::BTreeSet<&str> = filled
            .iterations
            .iter()
            .flat_map(|it| &it.fillers)
            .map(|f| f.label.split(' ').next().unwrap())
            .collect();
        let stats = router.stats();
        let k = &stats.kinds["sized spin"];
        assert!(
            (k.estimate.slope - PER_UNIT).abs() < 1e-6 * PER_UNIT,
            "{kind}: fitted {:?}",
            k.estimate
        );
        assert!(sizes.len() > 2, "{kind}: slices of sizes {sizes:?} only");
        timing_checks(kind, &bare, &filled, used, waited, 0.9);
    }
}
