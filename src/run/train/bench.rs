//! `pipefill bench filler`: what filling the bubbles costs a job's steps. `pipefill train`
//! runs its job once; the comparison with the same job without filler is this benchmark's:
//! the job's pipeline with its filler and with `filler = "none"`, alternating round by round
//! (same plan, model and data; the machine's load drifts alike over both), each round's
//! median step makespan (the first step, which warms up, left out), and the medians over
//! rounds. Nothing is written.
//!
//! Figures (DESIGN.md, "Metrics"): step inflation against the runs without filler; under
//! the virtual clock also each filled step replayed without its fillers (the critical-path
//! inflation alone); the bubble-fill ratio; and the compute actions' cost change under
//! filling (median per stage and kind, the last round's pair).

use super::files::filling;
use crate::config::{ConfigError, Filler, JobConfig};
use crate::pipeline::PipelineTrainer;
use crate::profile::report::{Filling, action_costs, median, median_step_makespan};
use crate::run::RunError;
use crate::run::show::Quiet;

/// The measured rounds of [`filler_bench`].
#[derive(Debug, Clone)]
pub struct FillerBench {
    /// Steps per run.
    pub steps: u64,
    /// Median step makespan of each round's run with the filler, in its clock's seconds.
    pub with: Vec<f64>,
    /// ... and of the run without.
    pub without: Vec<f64>,
    /// Step inflation of each filled run replayed without its fillers (virtual clock only).
    pub replayed: Vec<f64>,
    /// Bubble-fill ratio of each filled run.
    pub fill: Vec<f64>,
    /// The last round's figures, its run without filler as the baseline (for the report's
    /// text and the action cost change); `None` before any round.
    pub last: Option<Filling>,
}

impl FillerBench {
    /// Step inflation: the median over rounds of the filled runs' step makespan against
    /// the median of the runs without, − 1.
    pub fn inflation(&self) -> f64 {
        median(self.with.iter().copied()) / median(self.without.iter().copied()) - 1.0
    }
}

/// Runs `job` (a pipelined job with a filler) `rounds` times with its filler and as many
/// without, alternating, `steps` steps each; `on_run` hears of each run as it starts
/// (round, with the filler).
pub fn filler_bench(
    job: &JobConfig,
    steps: u64,
    rounds: usize,
    mut on_run: impl FnMut(usize, bool),
) -> Result<FillerBench, RunError> {
    let invalid = |field: &str, reason: &str| {
        Err(RunError::from(ConfigError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }))
    };
    if job.filler == Filler::None {
        return invalid("filler", "is \"none\": there is no filler to measure");
    }
    if job.schedule.is_none() {
        return invalid(
            "schedule",
            "is \"none\": fillers run in a pipeline's bubbles; name a schedule",
        );
    }
    let trainer = PipelineTrainer::from_job(job).map_err(|source| RunError::plan(job, source))?;
    let mut bench = FillerBench {
        steps,
        with: Vec::new(),
        without: Vec::new(),
        replayed: Vec::new(),
        fill: Vec::new(),
        last: None,
    };
    for round in 0..rounds {
        on_run(round, true);
        let filled = trainer
            .clone()
            .filler(job.filler)
            .run(steps, |_| {})
            .map_err(|e| RunError::plan(job, e))?;
        on_run(round, false);
        let plain = trainer
            .clone()
            .filler(Filler::None)
            .run(steps, |_| {})
            .map_err(|e| RunError::Baseline {
                source: Box::new(e),
            })?;
        let makespans = |run: &crate::pipeline::PipelineRun| -> Vec<f64> {
            run.timelines().map(|t| t.makespan).collect()
        };
        let without = makespans(&plain);
        let note = format!("the same job with filler = \"none\", {steps} steps, round {round}");
        let costs = action_costs(&plain.report.iterations);
        let Some(f) = filling(job, &filled, Some((&without, note, &costs)), &mut Quiet) else {
            return Err(RunError::NoStepMeasured);
        };
        bench
            .with
            .push(median_step_makespan(&makespans(&filled)).unwrap_or(f64::NAN));
        bench
            .without
            .push(median_step_makespan(&without).unwrap_or(f64::NAN));
        bench.replayed.extend(f.replay_inflation);
        bench.fill.push(f.fill_ratio());
        bench.last = Some(f);
    }
    Ok(bench)
}
