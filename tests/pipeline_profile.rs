//! Measured against predicted: a default-sized job (the default model cut over 4 stages)
//! run with the virtual clock has the bubble ratios the simulator predicts for its plan
//! under the costs it measured itself.
//!
//! In virtual mode every action is timed by its stage thread's CPU time and every receive
//! completes at `max(own clock, sender's clock)`, which is exactly the simulator's rule, so
//! the two differ only by how much each action's cost varies around its median (the
//! simulator uses one T_F, T_I, T_W per stage: their means over the iterations after the
//! warm-up one, see `PipelineRun::mean_cost`; the prediction under the runtime's medians is
//! printed too). The measured figure is the median over those same iterations. Both ratios must be
//! within 10% (relative) of the prediction; the figures are printed for the record.

use pipefill::config::JobConfig;
use pipefill::data::DataConfig;
use pipefill::pipeline::{Clock, PipelineTrainer};
use pipefill::schedules::{ScheduleKind, Timeline};
use pipefill::train::TrainConfig;

const STEPS: u64 = 6;
/// Iteration 0 touches every buffer for the first time (page faults, cold caches) and runs
/// markedly slower; it is a warm-up, not the pipeline's steady behaviour.
const WARMUP: usize = 1;
const TOLERANCE: f64 = 0.10;

fn default_job() -> JobConfig {
    let job = JobConfig::default();
    JobConfig {
        stages: 4,
        data: DataConfig {
            summary_tasks: 1,
            ..job.data
        },
        train: TrainConfig {
            micro_batches: 8,
            eval_tasks: 0,
            ..job.train
        },
        ..job
    }
}

/// The median of the per-iteration figures `f` (each iteration's measured action costs
/// scatter by a few percent around the medians the prediction uses; the median iteration
/// is the typical one).
fn median(timelines: &[&Timeline], f: impl Fn(&Timeline) -> f64) -> f64 {
    let mut v: Vec<f64> = timelines.iter().map(|t| f(t)).collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn measured_matches_predicted(kind: ScheduleKind) {
    let job = default_job();
    let trainer = PipelineTrainer::builtin(&job, kind, None)
        .unwrap()
        .clock(Clock::virtual_free());
    let run = trainer.run(STEPS, |_| {}).unwrap();
    let by_medians = run.predicted.as_ref().expect("every stage was measured");
    let cost = run.mean_cost(WARMUP).unwrap();
    let predicted = run.predict(&cost).unwrap();
    let timelines: Vec<&Timeline> = run.timelines().skip(WARMUP).collect();
    let bubble = median(&timelines, |t| t.bubble_ratio);
    let steady = median(&timelines, |t| t.steady_bubble_ratio);
    let makespan = median(&timelines, |t| t.makespan);
    let ms = |s: f64| s * 1e3;
    let stages: Vec<String> = cost
        .stage
        .iter()
        .map(|c| format!("{:.2}/{:.2}/{:.2}", ms(c.f), ms(c.i), ms(c.w)))
        .collect();
    let name = kind.name();
    println!(
        "{name:<6} mean T_F/T_I/T_W per stage (ms): {}",
        stages.join("  ")
    );
    println!(
        "{name:<6} {:<14} {:>10} {:>10} {:>16}",
        "", "measured", "predicted", "(median costs)"
    );
    println!(
        "{name:<6} {:<14} {:>10.2} {:>10.2} {:>16.2}",
        "makespan ms",
        ms(makespan),
        ms(predicted.makespan),
        ms(by_medians.makespan)
    );
    for (what, m, p, q) in [
        (
            "bubble ratio",
            bubble,
            predicted.bubble_ratio,
            by_medians.bubble_ratio,
        ),
        (
            "steady bubble",
            steady,
            predicted.steady_bubble_ratio,
            by_medians.steady_bubble_ratio,
        ),
    ] {
        println!("{name:<6} {what:<14} {m:>10.4} {p:>10.4} {q:>16.4}");
        let rel = (m - p).abs() / p.abs().max(1e-9);
        assert!(
            rel <= TOLERANCE,
            "{name}: measured {what} {m:.4} is {:.1}% off the predicted {p:.4}",
            rel * 100.0
        );
    }
}

#[test]
fn zb_h1_measured_bubbles_match_the_simulator() {
    measured_matches_predicted(ScheduleKind::ZbH1);
}

#[test]
fn one_f_one_b_measured_bubbles_match_the_simulator() {
    measured_matches_predicted(ScheduleKind::OneFOneB);
}
