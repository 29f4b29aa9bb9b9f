//! The RL runner: `pipefill rl`, in one process or as one rank of a launched job, goes
//! through [`rl`]: GRPO on the job's tasks (the `[rl]` section), each step a rollout batch
//! then one pipelined update with the job's schedule ([`crate::rl::trainer`]).
//!
//! It owns what both ways share: the checks before anything runs (device, `[rl]`, memory,
//! a schedule for the update), the starting policy (a `pipefill train` run given with
//! `--init`, its checkpoint and the `[model]` and data seed it was trained with, or
//! `rl.warmup_steps` supervised pipelined steps), the run directory (`job.toml`,
//! `metrics.jsonl` one line per RL step, the final `checkpoint/`) and the summary. The
//! steps run on `in_process` (rollouts, drafter and every rank of the update in this
//! process) or `launched` (rank 0 the rollouts, every rank its stages of the update).
//! With speculation the rollouts' drafter starts from the `--init` checkpoint's when that
//! run trained one in its bubbles (`filler = "drafter"`).

mod in_process;
mod launched;
mod line;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use super::show::{Bar, Show, Tick};
use super::{Resume, RunDir, Start};
use crate::config::JobConfig;
use crate::config::memory::Workload;
use crate::model::checkpoint::Checkpoint;
use crate::rl::warm_up::warm_up;
use crate::run::RunError;
use crate::tensor::device::on_backend;

/// Runs `job`'s RL as `start` asks, the policy from the `pipefill train` run in `init`
/// when given (its `checkpoint/` and `job.toml`; else a supervised warm-up), showing its
/// progress on `show`; the run directory it wrote (a launched rank other than 0: `None`,
/// rank 0 writes it).
///
/// A launched rank ends its process a few seconds after a peer fails, as in
/// [`crate::run::train`](fn@crate::run::train).
pub fn rl(
    job: &JobConfig,
    init: Option<&Path>,
    start: &Start,
    show: &mut dyn Show,
) -> Result<Option<PathBuf>, RunError> {
    let env = start.env;
    let mut job = job.clone();
    // Before anything runs: a device that cannot be used here ends the run at once.
    let cuda = job.device.usable_on_local_rank(env.local_rank)?.is_cuda();
    let checkpoint = match init {
        Some(dir) => Some(init_from(&mut job, dir, show)?),
        None => None,
    };
    job.rl.validate(job.model.seq_len)?;
    // A launched run shards its update's optimizer where asked; one process does not.
    if !env.is_distributed() {
        crate::config::optimizer::OptimizerConfig::check_rl(&job)?;
    }
    // The rollouts' drafter trains whatever the job's filler: its settings are checked now,
    // not at its first slice.
    if job.rl.speculation {
        job.check_drafter()?;
    }
    super::check_memory(&job, start, Workload::Rl, show)?;
    if job.schedule.is_none() {
        return Err(RunError::RlWithoutSchedule);
    }
    job.rl
        .check_trained(checkpoint.is_some(), job.model.from.is_some())?;
    if env.is_distributed() {
        return launched::rl(&job, env, cuda, checkpoint, start.existing, show);
    }
    // Before any work: a run directory that holds another run ends the run at once.
    let run_dir = RunDir::claim(
        job.out_dir.as_deref(),
        "rl-",
        Resume::Unsupported,
        start.existing,
    )?;
    let rl = &job.rl;
    show.line(&format!(
        "model: {} params ({} layers, d_model {}, seq {}) on the {}; update: schedule {} on {} \
         ranks, {} sequences ({} prompts × group {}) per step, packed {} per micro-batch",
        job.model.param_count(),
        job.model.layers,
        job.model.d_model,
        job.model.seq_len,
        match cuda {
            true => "GPU (the update's rank r on GPU r mod their count)",
            false => "CPU",
        },
        job.schedule,
        job.stages,
        rl.sequences(),
        rl.prompts,
        rl.group,
        rl.group
    ));
    let checkpoint = match checkpoint {
        Some(c) => c,
        None => supervised_warm_up(&job, show)?,
    };
    let run = in_process::InProcess {
        job: &job,
        checkpoint,
        run_dir: &run_dir,
        show,
    };
    on_backend(cuda, run)??;
    Ok(Some(run_dir.path().to_path_buf()))
}

/// Which drafter the rollouts start from, for the in-process and the launched run alike:
/// the starting checkpoint's after `version` optimizer steps, or untrained (`None`).
fn drafter_line(version: Option<u64>) -> String {
    match version {
        Some(steps) => format!(
            "drafter: the starting checkpoint's (trained in its run's bubbles, {steps} optimizer \
             steps)"
        ),
        None => "drafter: untrained (the starting checkpoint has none; a `pipefill train` run \
                 with filler = \"drafter\" trains one in its bubbles)"
            .into(),
    }
}

/// The checkpoint of the `pipefill train` run in `dir`, adopting its `[model]` and data
/// seed (the checkpoint holds that model, trained on that stream).
pub fn init_from(
    job: &mut JobConfig,
    dir: &Path,
    show: &mut dyn Show,
) -> Result<Checkpoint, RunError> {
    let init = JobConfig::load(&dir.join("job.toml"), &[]).map_err(|e| RunError::Init {
        dir: dir.to_path_buf(),
        what: ": not a pipefill train run",
        source: Box::new(e),
    })?;
    if init.model != job.model || init.train.seed != job.train.seed {
        show.line(&format!(
            "--init {}: using its [model] and train.seed (the checkpoint's)",
            dir.display()
        ));
        job.model = init.model;
        job.train.seed = init.train.seed;
    }
    let checkpoint = Checkpoint::load(&dir.join("checkpoint")).map_err(|e| RunError::Init {
        dir: dir.to_path_buf(),
        what: "",
        source: Box::new(e),
    })?;
    show.line(&format!(
        "policy: {} at step {}",
        dir.join("checkpoint").display(),
        checkpoint.meta.step
    ));
    Ok(checkpoint)
}

/// Where the policy of a run without `--init` starts: the warm-up's steps, or the
/// pretrained model as it is.
fn warm_up_line(job: &JobConfig) -> String {
    match (job.rl.warmup(job.model.from.is_some()), &job.model.from) {
        (0, Some(dir)) => format!(
            "policy: the pretrained model in {} (no warm-up)",
            dir.display()
        ),
        (steps, _) => {
            format!("warm-up: {steps} supervised steps on the job's tasks (no --init run)")
        }
    }
}

/// The warm-up's supervised pipelined steps ([`crate::rl::config::RlConfig::warmup`]),
/// ticking [`Bar::WarmUp`]; none (the imported weights as they are) for a pretrained policy
/// without `rl.warmup_steps`.
fn supervised_warm_up(job: &JobConfig, show: &mut dyn Show) -> Result<Checkpoint, RunError> {
    let steps = job.rl.warmup(job.model.from.is_some());
    show.line(&warm_up_line(job));
    let checkpoint = warm_up(job, |m| {
        show.tick(Tick {
            bar: Bar::WarmUp,
            pos: m.step + 1,
            len: steps,
            message: &format!("loss {:.4}", m.loss),
            plain: None,
        });
    });
    show.finish(Bar::WarmUp, checkpoint.is_ok());
    Ok(checkpoint?)
}
