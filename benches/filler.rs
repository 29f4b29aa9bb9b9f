//! Bubble filling on the default job (4 stages, 4 micro-batches, virtual clock): for ZB-H1
//! and 1F1B, runs `PIPEFILL_BENCH_STEPS` steps (default 100) with the drafter in the bubbles
//! and prints one row per schedule: the bubble-fill ratio over the whole run (filler time
//! inside the measured timeline's idle slots / their length, as report.txt's), the drafter
//! slices that overran the idle time they were handed out for, the mean slice size (layout
//! rows, sized to the idle left), and the step inflation, replayed per step without its
//! fillers (the report's figure on the virtual clock).
//!
//! `cargo bench -p pipefill --bench filler` (issue 5's targets: fill ≥ 90%, inflation ≤ 2%).

use std::time::Instant;

use pipefill::config::{Filler, JobConfig};
use pipefill::pipeline::{Clock, PipelineTrainer};
use pipefill::profile::report::{Filling, step_inflations};
use pipefill::schedules::ScheduleKind;

fn main() {
    let steps = std::env::var("PIPEFILL_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100u64);
    let mut job = JobConfig::default();
    job.train.steps = steps;
    job.train.eval_tasks = 0;
    println!("default job, {steps} steps, filler = \"drafter\", virtual clock");
    println!(
        "{:<8} {:>8} {:>9} {:>9} {:>10} {:>10} {:>8}",
        "schedule", "fill", "slices", "overran", "rows/slice", "inflation", "wall s"
    );
    for kind in [ScheduleKind::ZbH1, ScheduleKind::OneFOneB] {
        let started = Instant::now();
        let trainer = PipelineTrainer::builtin(&job, kind, None)
            .expect("the default job builds a pipeline")
            .filler(Filler::Drafter);
        let run = trainer.run(steps, |_| {}).expect("the run completes");
        let spans = run.filler_spans();
        let mut filling = Filling::measure("drafter", &run.report.overall, &spans);
        if let Clock::Virtual { link_latency } = run.report.clock {
            let per_step = step_inflations(&run.report.iterations, link_latency)
                .expect("the run's steps replay");
            filling = filling.with_replay(&per_step);
        }
        let drafter = run.drafter.as_ref().expect("the drafter ran");
        let slices = &drafter.router.kinds["drafter"];
        let inflation = filling
            .step_inflation()
            .map_or("-".to_string(), |i| format!("{:+.2}%", 100.0 * i));
        println!(
            "{:<8} {:>7.1}% {:>9} {:>9} {:>10.1} {:>10} {:>8.1}",
            kind.to_string(),
            100.0 * filling.fill_ratio(),
            slices.slices,
            slices.overran,
            slices.units as f64 / slices.slices.max(1) as f64,
            inflation,
            started.elapsed().as_secs_f64()
        );
    }
}
