//! `pipefill bench filler [JOB] [--set ...] [--steps N] [--rounds R] [--json]`: the job's
//! pipeline with its filler against the same job without, alternating round by round
//! ([`pipefill::run::train::filler_bench`]); prints the medians. Nothing is written.

use anyhow::bail;
use pipefill::config::JobConfig;
use pipefill::profile::report::median;
use pipefill::run::train::{FillerBench, filler_bench};
use serde_json::json;

#[derive(clap::Args)]
pub struct FillerArgs {
    /// Job file (TOML). Without one, the embedded default job (examples/default.toml).
    config: Option<std::path::PathBuf>,
    /// Override one field of the job, e.g. `--set schedule=1f1b` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Steps of each run.
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Runs with the filler, each followed by one without (medians over them).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print one JSON object instead of the lines.
    #[arg(long)]
    json: bool,
}

pub fn run(a: FillerArgs) -> anyhow::Result<()> {
    if a.steps < 2 || a.rounds == 0 {
        bail!(
            "--steps {} --rounds {}: each run needs 2 steps or more (its first warms up) and \
             there must be a round",
            a.steps,
            a.rounds
        );
    }
    let job = match &a.config {
        Some(path) => JobConfig::load(path, &a.sets)?,
        None => JobConfig::embedded(&a.sets)?,
    };
    if !a.json {
        println!(
            "filler \"{}\" on schedule {}, {} ranks, {} steps a run, {} rounds alternating \
             with filler = \"none\" ({} clock)",
            format!("{:?}", job.filler).to_lowercase(),
            job.schedule,
            job.stages,
            a.steps,
            a.rounds,
            job.clock.name()
        );
    }
    let bench = filler_bench(&job, a.steps, a.rounds, |round, with| {
        if !a.json {
            let what = if with { "with" } else { "without" };
            eprintln!("round {round}: {what} filler");
        }
    })?;
    if a.json {
        println!("{}", to_json(&bench));
        return Ok(());
    }
    let pct = |x: f64| format!("{:+.2}%", 100.0 * x);
    println!(
        "median step makespan: {:.4} s with filler, {:.4} s without; step inflation {}",
        median(bench.with.iter().copied()),
        median(bench.without.iter().copied()),
        pct(bench.inflation())
    );
    if !bench.replayed.is_empty() {
        println!(
            "replayed without its fillers (critical path alone): step inflation {}",
            pct(median(bench.replayed.iter().copied()))
        );
    }
    println!(
        "bubble-fill ratio {:.1}%",
        100.0 * median(bench.fill.iter().copied())
    );
    if let Some(change) = bench
        .last
        .as_ref()
        .and_then(|f| f.action_cost_change(|_| true))
    {
        println!(
            "compute actions' cost under filling (last round): {}",
            pct(change)
        );
    }
    Ok(())
}

fn to_json(b: &FillerBench) -> serde_json::Value {
    json!({
        "steps": b.steps,
        "rounds": b.with.len(),
        "step_makespan_with": b.with,
        "step_makespan_without": b.without,
        "step_inflation": b.inflation(),
        "replayed_step_inflation": b.replayed,
        "bubble_fill_ratio": b.fill,
        "action_cost_change": b.last.as_ref().and_then(|f| f.action_cost_change(|_| true)),
    })
}
