//! The policy's start when no `--init` run gives it: the warm-up's supervised steps of the
//! job's pipeline on its tasks, or, for a pretrained model without `rl.warmup_steps`, the
//! imported weights as they are ([`crate::rl::config::RlConfig::warmup`]).

use crate::config::JobConfig;
use crate::model::ModelError;
use crate::model::checkpoint::Checkpoint;
use crate::model::{AdamW, Cut, Gpt};
use crate::pipeline::{PipelineTrainer, StepMetrics};
use crate::rl::RlError;
use crate::tensor::CpuBackend;
use crate::train::reference::adamw_config;

/// Runs the job's warm-up supervised steps of the job's pipeline on the job's tasks (from
/// the model's initial weights), calling `on_step` after each; returns the checkpoint.
pub fn warm_up(job: &JobConfig, on_step: impl FnMut(&StepMetrics)) -> Result<Checkpoint, RlError> {
    let sft = warm_up_job(job);
    if sft.train.steps == 0 {
        // A pretrained policy as it is: its weights (the model imports `model.from`), no
        // optimizer moments yet, at step 0.
        let model = Gpt::new(
            &job.model,
            CpuBackend::new(1).map_err(ModelError::from)?,
            &Cut::Even(1),
        )?;
        let optimizer = AdamW::new(adamw_config(&job.train));
        return Ok(Checkpoint::capture(&model, &optimizer, 0, job.train.seed)?);
    }
    let run = PipelineTrainer::from_job(&sft)?.run(sft.train.steps, on_step)?;
    Ok(run.into_checkpoint())
}

/// The supervised job [`warm_up`] runs (the multi-process warm-up runs it too).
pub(crate) fn warm_up_job(job: &JobConfig) -> JobConfig {
    let mut sft = job.clone();
    sft.train.steps = job.rl.warmup(job.model.from.is_some());
    sft.train.warmup = sft.train.warmup.min(sft.train.steps / 2);
    sft
}
