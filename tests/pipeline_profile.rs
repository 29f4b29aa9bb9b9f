//! Measured against predicted: a default-sized job (the default model cut over 4 stages)
//! run with the virtual clock has the bubble ratios the simulator predicts for its plan
//! under the costs it measured itself.
//!
//! In virtual mode every action is timed by its stage thread's CPU time and every receive
//! completes at `max(own clock, sender's clock)`, which is exactly the simulator's rule, so
//! the two differ only by how much each action's cost varies around the per-stage T_F, T_I,
//! T_W the simulator uses. Each iteration after the warm-up one is predicted from its own
//! per-stage mean costs (`PipelineRun::cost_over`): a noisy neighbour that slows a whole
//! iteration down slows its prediction down too, so what is checked is the schedule's
//! behaviour, not the machine's load. The median iteration's makespan must be within 10%
//! of its prediction and its bubble ratios within 5 points, in one of up to three runs (a
//! burst of load from a neighbour can scatter most of a run); the figures, and the
//! prediction under the means over the whole run and under the runtime's medians, are
//! printed for the record.

use pipefill::config::JobConfig;
use pipefill::data::DataConfig;
use pipefill::pipeline::{Clock, PipelineTrainer};
use std::sync::Mutex;

use pipefill::config::TrainConfig;
use pipefill::schedules::{ScheduleKind, Timeline};

const STEPS: u64 = 8;
/// Iteration 0 touches every buffer for the first time (page faults, cold caches) and runs
/// markedly slower; it is a warm-up, not the pipeline's steady behaviour.
const WARMUP: usize = 1;
const TOLERANCE: f64 = 0.10;
/// The bubble ratios are fractions of the makespan, so they are compared in points of it:
/// measured within 5 points of predicted. Relative to a ratio near 0.2 the same error
/// reads 4x larger than the makespan's: on a Sapphire Rapids box, once its one-thread
/// actions ran at full speed (`tensor/cpu/upper.rs`), ZB-H1's makespan came within 2-3% of
/// the prediction while its bubble ratio was 0.21 against 0.19 (12-17%).
const RATIO_POINTS: f64 = 0.05;
/// Runs of one schedule before the check fails. The box is shared: a neighbour's burst of
/// load can scatter the action costs of most of a run's iterations (a 10-20% error now and
/// then, where a quiet run is within a few per cent), but a schedule whose measured bubbles
/// really depart from the simulator's is off in every run.
const ATTEMPTS: usize = 3;
/// The two tests run one at a time: on a 2-core machine two 4-stage pipelines side by side
/// thrash each other's caches and the action costs scatter far more than in a real run.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

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

/// The median of `v`.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs `kind` until an attempt's median iteration is within [`TOLERANCE`] and
/// [`RATIO_POINTS`], at most
/// [`ATTEMPTS`] times.
fn measured_matches_predicted(kind: ScheduleKind) {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut misses = Vec::new();
    for _ in 0..ATTEMPTS {
        match attempt(kind) {
            Ok(()) => return,
            Err(miss) => misses.push(miss),
        }
    }
    panic!("{}", misses.join("\n"));
}

/// One run of `kind`: its figures printed, or why its median iteration is off.
fn attempt(kind: ScheduleKind) -> Result<(), String> {
    let job = default_job();
    let trainer = PipelineTrainer::builtin(&job, kind, None)
        .unwrap()
        .clock(Clock::virtual_free());
    let run = trainer.run(STEPS, |_| {}).unwrap();
    let by_medians = run.predicted.as_ref().expect("every stage was measured");
    let cost = run.mean_cost(WARMUP).unwrap();
    let overall = run.predict(&cost).unwrap();
    let timelines: Vec<&Timeline> = run.timelines().skip(WARMUP).collect();
    // Each iteration next to the simulator's timeline under that iteration's own costs.
    let pairs: Vec<(&Timeline, Timeline)> = timelines
        .iter()
        .map(|t| {
            let own = run.cost_over([*t]).expect("every stage ran a forward");
            (*t, run.predict(&own).unwrap())
        })
        .collect();
    let of = |f: fn(&Timeline) -> f64| {
        let measured = median(pairs.iter().map(|(m, _)| f(m)).collect());
        let predicted = median(pairs.iter().map(|(_, p)| f(p)).collect());
        let rel = median(
            pairs
                .iter()
                .map(|(m, p)| (f(m) - f(p)).abs() / f(p).abs().max(1e-9))
                .collect(),
        );
        let points = median(pairs.iter().map(|(m, p)| (f(m) - f(p)).abs()).collect());
        (measured, predicted, rel, points)
    };
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
        "{name:<6} {:<14} {:>10} {:>10} {:>8} {:>12} {:>16}",
        "", "measured", "predicted", "error", "(run means)", "(median costs)"
    );
    let (m, p, rel, _) = of(|t| t.makespan);
    println!(
        "{name:<6} {:<14} {:>10.2} {:>10.2} {:>7.1}% {:>12.2} {:>16.2}",
        "makespan ms",
        ms(m),
        ms(p),
        rel * 100.0,
        ms(overall.makespan),
        ms(by_medians.makespan)
    );
    if rel > TOLERANCE {
        return Err(format!(
            "{name}: the median iteration's measured makespan is {:.1}% off its prediction \
             (medians: measured {:.2} ms, predicted {:.2} ms)",
            rel * 100.0,
            ms(m),
            ms(p)
        ));
    }
    for (what, f, q, r) in [
        (
            "bubble ratio",
            (|t: &Timeline| t.bubble_ratio) as fn(&Timeline) -> f64,
            overall.bubble_ratio,
            by_medians.bubble_ratio,
        ),
        (
            "steady bubble",
            |t: &Timeline| t.steady_bubble_ratio,
            overall.steady_bubble_ratio,
            by_medians.steady_bubble_ratio,
        ),
    ] {
        let (m, p, rel, points) = of(f);
        println!(
            "{name:<6} {what:<14} {m:>10.4} {p:>10.4} {:>7.1}% {q:>12.4} {r:>16.4}",
            rel * 100.0
        );
        if points > RATIO_POINTS {
            return Err(format!(
                "{name}: the median iteration's measured {what} is {:.1} points of the \
                 makespan off its prediction (medians: measured {m:.4}, predicted {p:.4})",
                points * 100.0
            ));
        }
    }
    Ok(())
}

#[test]
fn zb_h1_measured_bubbles_match_the_simulator() {
    measured_matches_predicted(ScheduleKind::ZbH1);
}

#[test]
fn one_f_one_b_measured_bubbles_match_the_simulator() {
    measured_matches_predicted(ScheduleKind::OneFOneB);
}
