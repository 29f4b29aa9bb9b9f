//! `pipefill train [CONFIG.toml] [--set key=value ...] [--schedule S] [--clock C] [--steps N]`:
//! trains the model of a job file (the embedded default job when none is given).
//!
//! Every run loads its data once (a JSONL dataset under a bar of the records tokenized, then
//! one `data:` line), prints the dataset summary (with the solution-length histogram), then a
//! progress bar with step, loss and tokens/s, then a summary line and the held-out exact
//! match, and writes its run directory (`out_dir`): `job.toml`, `metrics.jsonl` (one JSON
//! line per step) and the final checkpoint.
//!
//! - A pipeline schedule (a built-in name or a custom schedule file; the default is
//!   `zb-h1` on 4 ranks) runs the real model through the actor runtime; its run directory
//!   also holds the bubble report (`report.txt`, `report.json`), the Chrome/Perfetto trace
//!   (`trace.json`) and the SVG timeline (`timeline.svg`).
//! - `schedule = "none"` runs the single-device reference trainer, the oracle every
//!   schedule must reproduce.
//!
//! This module parses the arguments; the run itself, in one process or as one rank of a
//! launched job, is [`pipefill::run::train`].
//!
//! `device` (`--device`) is checked before anything runs: `"cuda"` in a build without the
//! `cuda` feature, without a driver or without the GPU is one error naming the field. On
//! GPUs, the reference trainer computes on `cuda:0`, each rank of a launched job on the GPU
//! of its local rank, and rank `r` of the single-process pipeline on GPU `r` mod the GPU
//! count.

use std::path::PathBuf;

use crate::cli::job::JobArgs;
use crate::cli::show::Terminal;
use pipefill::config::{ClockKind, DeviceKind};
use pipefill::launch::RankEnv;

#[derive(clap::Args)]
pub struct TrainArgs {
    #[command(flatten)]
    job: JobArgs,
    /// Train the Hugging Face model in directory DIR (Llama, Qwen2, Mistral): its config.json
    /// gives the model's shape, its safetensors the starting weights (sets `model.from`).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zb-v,
    /// dualpipe-v, the path of a schedule file (.csv/.toml), or "none" (one device, the
    /// reference trainer).
    #[arg(long)]
    schedule: Option<String>,
    /// How stage timelines are timed: virtual (thread CPU time per stage) or wall.
    #[arg(long, value_enum)]
    clock: Option<ClockKind>,
    /// What the ranks compute on: cpu or cuda (overrides device; a launched rank uses the
    /// GPU of its local rank).
    #[arg(long, value_enum)]
    device: Option<DeviceKind>,
    /// Number of optimizer steps (overrides train.steps).
    #[arg(long)]
    steps: Option<u64>,
    /// Continue from the checkpoint directory DIR (e.g. runs/X/checkpoint) up to
    /// train.steps; the job must have the checkpoint's model and data seed.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let mut sets = Vec::new();
    if let Some(device) = args.device {
        sets.push(format!("device=\"{device}\""));
    }
    if let Some(clock) = args.clock {
        sets.push(format!("clock=\"{}\"", clock.name()));
    }
    if let Some(steps) = args.steps {
        sets.push(format!("train.steps={steps}"));
    }
    if let Some(schedule) = &args.schedule {
        sets.push(format!(
            "schedule={}",
            toml::Value::String(schedule.clone())
        ));
    }
    let job = args.job.job(sets, args.model.as_deref())?;
    // One rank of a multi-process job (pipefill launch, torchrun, mpirun, srun), or alone.
    let env = RankEnv::detect()?;
    let start = args.job.start(&env);
    let resume = args.resume.as_deref();
    pipefill::run::train(&job, resume, &start, &mut Terminal::default())?;
    Ok(())
}
