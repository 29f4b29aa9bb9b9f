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
//!   `zb-h1` on 4 ranks) runs the real model through the actor runtime ([`pipelined`]);
//!   its run directory also holds the bubble report (`report.txt`, `report.json`), the
//!   Chrome/Perfetto trace (`trace.json`) and the SVG timeline (`timeline.svg`), written by
//!   [`run_files`].
//! - `schedule = "none"` runs the single-device reference trainer (here), the oracle every
//!   schedule must reproduce.
//!
//! `device` (`--device`) is checked before anything runs: `"cuda"` in a build without the
//! `cuda` feature, without a driver or without the GPU is one error naming the field. On
//! GPUs, the reference trainer computes on `cuda:0`, each rank of a launched job on the GPU
//! of its local rank, and rank `r` of the single-process pipeline on GPU `r` mod the GPU
//! count.

mod pipelined;
mod run_files;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::bail;
use indicatif::{ProgressBar, ProgressStyle};

use pipefill::config::memory::{Bytes, MemoryLimit, Workload};
use pipefill::config::{Clock, JobConfig};
use pipefill::data::{DataSource, DatasetSummary, StepData};
use pipefill::launch::RankEnv;
use pipefill::model::Gpt;
use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::checkpoint::resume::ResumePoint;
use pipefill::run::{Existing, Resume, RunDir, RunLog, StepLine, steps_left};
use pipefill::tensor::device::Device;
use pipefill::tensor::{Backend, CpuBackend};
use pipefill::train::Trainer;
use pipefill::train::eval::{exact_match, held_out_tasks};
use pipefill::train::reference::cpu_threads;

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Job file (TOML). Without one, the embedded default job (examples/default.toml).
    config: Option<PathBuf>,
    /// Override one field of the job, e.g. `--set train.lr=1e-3` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Train the Hugging Face model in directory DIR (Llama, Qwen2, Mistral): its config.json
    /// gives the model's shape, its safetensors the starting weights (sets `model.from`).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zb-v, the
    /// path of a schedule file (.csv/.toml), or "none" (one device, the reference trainer).
    #[arg(long)]
    schedule: Option<String>,
    /// How stage timelines are timed: virtual (thread CPU time per stage) or wall.
    #[arg(long, value_enum)]
    clock: Option<Clock>,
    /// What the ranks compute on: cpu or cuda (overrides device; a launched rank uses the
    /// GPU of its local rank).
    #[arg(long, value_enum)]
    device: Option<DeviceArg>,
    /// Number of optimizer steps (overrides train.steps).
    #[arg(long)]
    steps: Option<u64>,
    /// Output directory (overrides out_dir).
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
    /// Continue from the checkpoint directory DIR (e.g. runs/X/checkpoint) up to
    /// train.steps; the job must have the checkpoint's model and data seed.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Replace the run already in the output directory (its job.toml, metrics, reports and
    /// checkpoints; other files stay). Without it a non-empty output directory is refused,
    /// unless `--resume` continues the run in it.
    #[arg(long)]
    overwrite: bool,
    /// Most memory the run may use, e.g. `8GiB`, `512MiB` (a launched rank: its share of the
    /// job) [default: the memory available, MemAvailable in /proc/meminfo]. A job whose
    /// estimate exceeds it is refused before anything is allocated.
    #[arg(long, value_name = "SIZE")]
    max_memory: Option<String>,
}

/// `--device`'s values (the job file's `device`).
#[derive(Clone, Copy, clap::ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let mut sets = args.set.clone();
    if let Some(device) = args.device {
        let name = match device {
            DeviceArg::Cpu => "cpu",
            DeviceArg::Cuda => "cuda",
        };
        sets.push(format!("device=\"{name}\""));
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
    if let Some(dir) = &args.out_dir {
        let dir = dir.display().to_string();
        sets.push(format!("out_dir={}", toml::Value::String(dir)));
    }
    if let Some(dir) = &args.model {
        let dir = dir.display().to_string();
        sets.push(format!("model.from={}", toml::Value::String(dir)));
    }
    let job = match &args.config {
        Some(path) => JobConfig::load(path, &sets)?,
        None => JobConfig::embedded(&sets)?,
    };
    // One rank of a multi-process job (pipefill launch, torchrun, mpirun, srun).
    let rank_env = pipefill::launch::RankEnv::detect()?;
    check_memory(&job, &rank_env, args.max_memory.as_deref(), Workload::Train)?;
    // Before joining any other rank: a device that cannot be used here ends the run at once.
    let device = job.device.usable_on_local_rank(rank_env.local_rank)?;
    let existing = Existing::overwrite(args.overwrite);
    let resume = args.resume.as_deref();
    if rank_env.is_distributed() {
        return crate::cli::launch::train_distributed(&job, &rank_env, resume, existing);
    }
    // Before any work: a run directory that holds another run ends the run at once.
    let run_dir = RunDir::claim(
        job.out_dir.as_deref(),
        "",
        resume.map_or(Resume::Fresh, Resume::From),
        existing,
    )?;
    // Loaded once, for the summary and the run.
    let data = load_data(&job)?;
    print!("{}", DatasetSummary::of(&data)?);
    if !job.schedule.is_none() {
        return pipelined::train(&job, resume, &run_dir, data);
    }
    if job.stages != 1 {
        println!(
            "schedule \"none\": the whole model on one device (stages = {} is ignored)",
            job.stages
        );
    }
    match device {
        Device::Cpu { .. } => {
            let backend = CpuBackend::new(cpu_threads(&job.train))?;
            let trainer = Trainer::with_data(backend, &job.model, data, &job.train)?;
            train_reference(&job, resume, &run_dir, trainer)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda { ordinal } => {
            let backend = pipefill::tensor::cuda::CudaBackend::new(ordinal)?;
            let trainer = Trainer::with_data(backend, &job.model, data, &job.train)?;
            train_reference(&job, resume, &run_dir, trainer)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => Err(pipefill::tensor::device::DeviceError::CudaNotCompiled.into()),
    }
}

/// Before anything is allocated: the job's sizes against `max_memory` (or the memory there
/// is), a launched rank's share of them on each rank. A single process also refuses
/// `dp > 1` ([`refuse_dp`]) and prints its estimate.
pub(crate) fn check_memory(
    job: &JobConfig,
    rank_env: &RankEnv,
    max_memory: Option<&str>,
    workload: Workload,
) -> anyhow::Result<()> {
    let limit = MemoryLimit::resolve(max_memory)?;
    let processes = if rank_env.is_distributed() {
        rank_env.world
    } else {
        1
    };
    let estimate = job.check_memory(workload, &limit, processes)?;
    if !rank_env.is_distributed() {
        let command = match workload {
            Workload::Train => "train",
            Workload::Rl => "rl",
        };
        refuse_dp(job, command)?;
        println!("memory: {} estimated, {limit}", Bytes(estimate.total));
    }
    Ok(())
}

/// A single process runs one pipeline: `dp > 1` needs `dp × stages` processes, each a rank
/// of a launched job, so a single-process `command` with it is refused rather than run as
/// `dp = 1`.
fn refuse_dp(job: &JobConfig, command: &str) -> anyhow::Result<()> {
    if job.dp > 1 {
        bail!(
            "dp = {}: a single-process `pipefill {command}` runs one pipeline; launch dp × stages = \
             {} processes (`pipefill launch -n {} -- {command} ...`), or set dp = 1",
            job.dp,
            job.dp.saturating_mul(job.stages),
            job.dp.saturating_mul(job.stages)
        );
    }
    Ok(())
}

/// Runs `job` with the reference `trainer` (from `resume`'s checkpoint when given),
/// printing progress and writing the run's files into `run_dir`.
fn train_reference<B: Backend>(
    job: &JobConfig,
    resume: Option<&Path>,
    run_dir: &RunDir,
    mut trainer: Trainer<B>,
) -> anyhow::Result<()> {
    if let Some(path) = resume {
        // A run directory, or a checkpoint in one, as the pipelined runs take it.
        let dir = match ResumePoint::find(path)? {
            ResumePoint::Whole(dir) => dir,
            ResumePoint::Sharded(dir) => bail!(
                "{}: a sharded checkpoint of a pipelined run; schedule \"none\" resumes from a \
                 whole-model one (a run's checkpoint/)",
                dir.display()
            ),
        };
        let checkpoint = Checkpoint::load(&dir)?;
        trainer.restore(&checkpoint)?;
        println!("resumed from {} at step {}", dir.display(), trainer.step());
    }
    let first_step = trainer.step();
    steps_left(first_step, job.train.steps)?;
    let t = &job.train;
    println!(
        "model: {} params ({} layers, d_model {}, {} heads, seq {}) on {}",
        job.model.param_count(),
        job.model.layers,
        job.model.d_model,
        job.model.heads,
        job.model.seq_len,
        trainer.backend().name()
    );
    println!(
        "train: {} steps × {} micro-batches × {} sequences × {} tokens, lr {} (warmup {}), \
         weight decay {}, clip {}",
        t.steps,
        t.micro_batches,
        t.micro_batch_size,
        job.model.seq_len,
        t.lr,
        t.warmup,
        t.weight_decay,
        t.clip
    );

    let mut log = RunLog::open(run_dir, job, first_step)?;
    let bar = progress_bar(t.steps, first_step);
    for _ in first_step..t.steps {
        let m = trainer.train_step()?;
        let line = format!(
            "loss {:.4} | lr {:.2e} | {:.0} tok/s",
            m.loss,
            m.lr,
            m.tokens_per_second()
        );
        show_step(&bar, m.step, t.steps, line);
        log.record(&StepLine::new(&m, None));
    }
    bar.finish();

    let summary = log.finish()?;
    let checkpoint_dir = run_dir.save_final(&mut trainer.checkpoint()?, job)?;
    evaluate(job, trainer.model_mut())?;
    println!(
        "done: {summary}; checkpoint {}, metrics {}",
        checkpoint_dir.display(),
        run_dir.path().join("metrics.jsonl").display()
    );
    Ok(())
}

/// Shows step `step` (0-based) of `steps` on `bar` with its `line`; without a terminal the
/// bar is hidden, and about 20 plain lines are printed over the run instead.
fn show_step(bar: &ProgressBar, step: u64, steps: u64, line: String) {
    let plain_every = (steps / 20).max(1);
    if bar.is_hidden() && (step.is_multiple_of(plain_every) || step + 1 == steps) {
        println!("step {:>5}/{} {line}", step + 1, steps);
    }
    bar.set_message(line);
    bar.inc(1);
}

/// The job's step data. A JSONL dataset is tokenized here, once for the summary and the
/// run, under a bar of the records tokenized and the tokens they gave (drawn on a
/// terminal only), and ends with one line saying what was read.
fn load_data(job: &JobConfig) -> anyhow::Result<StepData> {
    let d = &job.data;
    let Some(path) = d.path.as_deref().filter(|_| d.source == DataSource::Jsonl) else {
        return Ok(StepData::new(d.clone(), job.model.seq_len, job.train.seed)?);
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("tokenizing {bar:30} {pos}/{len} records, {msg} [{elapsed}]")
            .expect("valid template"),
    );
    let started = Instant::now();
    let mut read = None;
    let data = StepData::load(d.clone(), job.model.seq_len, job.train.seed, &mut |t| {
        bar.set_length(t.of as u64);
        bar.set_position(t.records as u64);
        bar.set_message(format!("{} tokens", t.tokens));
        read = Some(t);
    });
    bar.finish_and_clear();
    let data = data?;
    if let Some(t) = read {
        println!(
            "data: {} records, {} tokens from {} (tokenized in {:.1} s)",
            t.records,
            t.tokens,
            path.display(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(data)
}

/// The per-step progress bar, starting at `first_step` of `steps`.
fn progress_bar(steps: u64, first_step: u64) -> ProgressBar {
    let bar = ProgressBar::new(steps);
    bar.set_position(first_step);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} [{elapsed} < {eta}]")
            .expect("valid template"),
    );
    bar
}

/// Scores greedy completions of the job's held-out tasks and prints the exact match.
fn evaluate<B: Backend>(job: &JobConfig, model: &mut Gpt<B>) -> anyhow::Result<()> {
    let (d, t) = (&job.data, &job.train);
    // The held-out tasks are the synthetic ones (character-tokenized); a JSONL run has none.
    if t.eval_tasks == 0 || d.source != pipefill::data::DataSource::Synthetic {
        return Ok(());
    }
    let tasks = held_out_tasks(
        &d.families,
        d.size_scale,
        d.max_size,
        t.seed,
        job.model.seq_len,
        t.eval_tasks,
    )?;
    let em = exact_match(model, &tasks)?;
    println!(
        "exact match (greedy) on {} held-out tasks that fit seq_len {}: {}/{} ({:.1}%)",
        em.tasks,
        job.model.seq_len,
        em.correct,
        em.tasks,
        100.0 * em.accuracy()
    );
    Ok(())
}
