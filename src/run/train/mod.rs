//! The training runner: `pipefill train`, however it runs, goes through [`train`]: the
//! single-device reference trainer (`schedule = "none"`), the pipeline with every rank in
//! this process, or one rank of a launched job (`pipefill launch`, mpirun, srun, torchrun).
//! It owns what the three share: the checks before anything runs (memory, device, `dp`),
//! the run directory (claimed before any work), the metrics line (one
//! [`crate::run::StepLine`] per step through [`crate::run::RunLog`]) and the final
//! checkpoint; in one process also the data (loaded once, summed up) and the held-out score.
//! What differs is the engine the steps run on (`engine::Engine`; `engine::drive` runs any
//! of them, so every path ticks, logs, sums up, checkpoints and ends alike), which also
//! resumes from its own kind of checkpoint and writes its own profile files:
//!
//! - `reference`: the reference trainer on the job's device;
//! - `pipelined`: the actor runtime, every rank in this process, rank `r` on
//!   [`crate::tensor::device::RankBackend::for_rank`]`(r)`;
//! - `launched`: this process's rank of the plan, the others over the TCP mesh (NCCL
//!   between GPUs), rank 0 writing the run directory.

mod bench;
mod engine;
mod files;
mod launched;
mod pipelined;
mod reference;
#[cfg(test)]
mod tests;

use crate::run::RunError;
pub use bench::{FillerBench, filler_bench};

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::show::{Bar, Show, Tick};
use super::{Resume, RunDir, Start};
use crate::config::JobConfig;
use crate::config::memory::Workload;
use crate::data::{DataSource, DatasetSummary, StepData};
use crate::model::Gpt;
use crate::tensor::Backend;
use crate::train::eval::{exact_match, held_out_tasks};

/// Runs `job` as `start` asks, from `resume` when given (a run directory or a checkpoint
/// directory, [`crate::model::checkpoint::resume::ResumePoint::find`]) up to
/// `train.steps`, showing its progress on `show`; the run directory it wrote (a launched
/// rank other than 0: the one rank 0 wrote).
///
/// A launched rank ends its process (exit status 1, the reason on stderr) a few seconds
/// after a peer fails ([`crate::launch::watchdog`]): a dead peer must end every rank.
pub fn train(
    job: &JobConfig,
    resume: Option<&Path>,
    start: &Start,
    show: &mut dyn Show,
) -> Result<PathBuf, RunError> {
    let env = start.env;
    super::check_memory(job, start, Workload::Train, show)?;
    // Before joining any other rank: a device that cannot be used here ends the run at once.
    let device = job.device.usable_on_local_rank(env.local_rank)?;
    if env.is_distributed() {
        return launched::train(job, env, device, resume, start.existing, show);
    }
    // Before any work: a run directory that holds another run ends the run at once.
    let run_dir = RunDir::claim(
        job.out_dir.as_deref(),
        "",
        resume.map_or(Resume::Fresh, Resume::From),
        start.existing,
    )?;
    // Loaded once, for the summary and the run.
    let data = load_data(job, show)?;
    show.line(DatasetSummary::of(&data)?.to_string().trim_end());
    if job.schedule.is_none() {
        reference::train(job, device, resume, &run_dir, data, show)?;
    } else {
        pipelined::train(job, resume, &run_dir, data, show)?;
    }
    Ok(run_dir.path().to_path_buf())
}

/// The job's step data. A JSONL dataset is tokenized here, once for the summary and the
/// run, ticking [`Bar::Tokenizing`] with the records tokenized and the tokens they gave,
/// and ends with one line saying what was read.
fn load_data(job: &JobConfig, show: &mut dyn Show) -> Result<StepData, RunError> {
    let d = &job.data;
    let Some(path) = d.path.as_deref().filter(|_| d.source == DataSource::Jsonl) else {
        return Ok(StepData::new(d.clone(), job.model.seq_len, job.train.seed)?);
    };
    let started = Instant::now();
    let mut read = None;
    let data = StepData::load(d.clone(), job.model.seq_len, job.train.seed, &mut |t| {
        let message = format!("{} tokens", t.tokens);
        show.tick(Tick {
            bar: Bar::Tokenizing,
            pos: t.records as u64,
            len: t.of as u64,
            message: &message,
            plain: None,
        });
        read = Some(t);
    });
    show.finish(Bar::Tokenizing, data.is_ok());
    let data = data?;
    if let Some(t) = read {
        show.line(&format!(
            "data: {} records, {} tokens from {} (tokenized in {:.1} s)",
            t.records,
            t.tokens,
            path.display(),
            started.elapsed().as_secs_f64()
        ));
    }
    Ok(data)
}

/// The `model:` line every path shows first: the model's size and shape, where it runs,
/// and a `train.precision` other than f32.
fn model_line(job: &JobConfig, on: &str) -> String {
    let m = &job.model;
    let precision = match job.train.precision {
        crate::tensor::DType::F32 => "",
        crate::tensor::DType::Bf16 => ", in bf16 (f32 master weights)",
    };
    format!(
        "model: {} params ({} layers, d_model {}, {} heads, seq {}) on {on}{precision}",
        m.param_count(),
        m.layers,
        m.d_model,
        m.heads,
        m.seq_len,
    )
}

/// Scores greedy completions of the job's held-out tasks and shows the exact match.
fn evaluate<B: Backend>(
    job: &JobConfig,
    model: &mut Gpt<B>,
    show: &mut dyn Show,
) -> Result<(), RunError> {
    let (d, t) = (&job.data, &job.train);
    // The held-out tasks are the synthetic ones (character-tokenized); a JSONL run has none.
    if t.eval_tasks == 0 || d.source != DataSource::Synthetic {
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
    show.line(&format!(
        "exact match (greedy) on {} held-out tasks that fit seq_len {}: {}/{} ({:.1}%)",
        em.tasks,
        job.model.seq_len,
        em.correct,
        em.tasks,
        100.0 * em.accuracy()
    ));
    Ok(())
}
