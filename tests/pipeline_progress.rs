//! Live progress: `PipelineTrainer::run_profiled` hands each step's measured timeline to
//! the step callback while the run goes, not at its end.
//!
//! "While the run goes" is checked by time: with two iterations in flight, the last
//! iteration is dispatched only after every rank finished iteration `STEPS - 3`, so its
//! whole makespan lies between step 0's completion and the last step's. A callback fired
//! live for step 0 therefore precedes the last one by at least about that makespan; callbacks
//! delivered together when the run ends would be microseconds apart.

use std::time::Instant;

use pipefill::config::JobConfig;
use pipefill::config::TrainConfig;
use pipefill::data::DataConfig;
use pipefill::model::GptConfig;
use pipefill::pipeline::{Clock, PipelineTrainer};
use pipefill::schedules::ScheduleKind;

const STEPS: u64 = 6;

fn job() -> JobConfig {
    JobConfig {
        stages: 2,
        model: GptConfig {
            d_model: 64,
            heads: 4,
            layers: 4,
            seq_len: 64,
            mlp_ratio: 4,
            ..GptConfig::default()
        },
        data: DataConfig {
            summary_tasks: 1,
            ..DataConfig::default()
        },
        train: TrainConfig {
            steps: STEPS,
            micro_batches: 4,
            micro_batch_size: 4,
            threads: 1,
            eval_tasks: 0,
            ..TrainConfig::default()
        },
        ..JobConfig::default()
    }
}

#[test]
fn every_step_callback_sees_its_bubble_ratio_during_the_run() {
    let trainer = PipelineTrainer::builtin(&job(), ScheduleKind::OneFOneB, None)
        .unwrap()
        .clock(Clock::Wall);
    let mut seen = Vec::new();
    let run = trainer
        .run_profiled(STEPS, |m, tl| {
            let tl = tl.unwrap_or_else(|| panic!("step {} came without its timeline", m.step));
            seen.push((
                m.step,
                Instant::now(),
                tl.bubble_ratio,
                tl.steady_bubble_ratio,
            ));
        })
        .unwrap();
    let steps: Vec<u64> = seen.iter().map(|s| s.0).collect();
    assert_eq!(
        steps,
        (0..STEPS).collect::<Vec<_>>(),
        "one callback per step, in order"
    );
    for (&(step, _, bubble, steady), tl) in seen.iter().zip(run.timelines()) {
        assert!(
            bubble > 0.0 && bubble < 1.0,
            "step {step}: bubble ratio {bubble}"
        );
        // The live figures are the run's own measured timelines, not another estimate.
        assert_eq!(bubble, tl.bubble_ratio, "step {step}");
        assert_eq!(steady, tl.steady_bubble_ratio, "step {step}");
    }
    let last_makespan = run.timelines().last().unwrap().makespan;
    let gap = seen[seen.len() - 1].1 - seen[0].1;
    println!(
        "first to last callback: {:.1} ms; last iteration's makespan {:.1} ms",
        gap.as_secs_f64() * 1e3,
        last_makespan * 1e3
    );
    assert!(
        gap.as_secs_f64() >= 0.5 * last_makespan,
        "step 0's callback came {gap:?} before the last one, less than half the last \
         iteration's makespan ({last_makespan} s): it was not delivered during the run"
    );
}
