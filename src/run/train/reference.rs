//! `schedule = "none"`: the single-device reference trainer, the oracle every schedule must
//! reproduce, on the job's device (the CPU with `train.threads`, or `cuda:0`).

use std::path::Path;

use super::engine::{Engine, Steps, drive, step_message};
use super::{evaluate, model_line};
use crate::config::JobConfig;
use crate::data::StepData;
use crate::model::checkpoint::Checkpoint;
use crate::model::checkpoint::resume::ResumePoint;
use crate::run::RunError;
use crate::run::show::Show;
use crate::run::{RunDir, RunLog, StepLine, steps_left};
use crate::tensor::Backend;
use crate::tensor::device::Device;
use crate::train::Trainer;
use crate::train::reference::cpu_backend;

/// Trains `job` on one `device` (from `resume`'s checkpoint when given), writing `run_dir`.
pub(super) fn train(
    job: &JobConfig,
    device: Device,
    resume: Option<&Path>,
    run_dir: &RunDir,
    data: StepData,
    show: &mut dyn Show,
) -> Result<(), RunError> {
    if job.stages != 1 {
        show.line(&format!(
            "schedule \"none\": the whole model on one device (stages = {} is ignored)",
            job.stages
        ));
    }
    match device {
        Device::Cpu { .. } => {
            let backend = cpu_backend(&job.train)?;
            let trainer = Trainer::with_data(backend, &job.model, data, &job.train)?;
            run(job, resume, run_dir, trainer, show)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda { ordinal } => {
            let backend =
                crate::tensor::cuda::CudaBackend::new(ordinal)?.with_storage(job.train.precision);
            let trainer = Trainer::with_data(backend, &job.model, data, &job.train)?;
            run(job, resume, run_dir, trainer, show)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => Err(crate::tensor::TensorError::CudaNotCompiled.into()),
    }
}

/// Runs `job` with the reference `trainer` into `run_dir`.
fn run<B: Backend>(
    job: &JobConfig,
    resume: Option<&Path>,
    run_dir: &RunDir,
    mut trainer: Trainer<B>,
    show: &mut dyn Show,
) -> Result<(), RunError> {
    if let Some(path) = resume {
        // A run directory, or a checkpoint in one, as the pipelined runs take it.
        let dir = match ResumePoint::find(path)? {
            ResumePoint::Whole(dir) => dir,
            ResumePoint::Sharded(dir) => return Err(RunError::ShardedForReference { dir }),
        };
        let checkpoint = Checkpoint::load(&dir)?;
        trainer.restore(&checkpoint)?;
        show.line(&format!(
            "resumed from {} at step {}",
            dir.display(),
            trainer.step()
        ));
    }
    let first_step = trainer.step();
    let left = steps_left(first_step, job.train.steps)?;
    let t = &job.train;
    show.line(&model_line(job, &trainer.backend().name()));
    show.line(&format!(
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
    ));
    let log = RunLog::open(run_dir, job, first_step)?;
    let mut engine = Reference { job, trainer };
    drive(job, &mut engine, left, Some((run_dir, log)), show)
}

/// The reference trainer as an [`Engine`].
struct Reference<'j, B: Backend> {
    job: &'j JobConfig,
    trainer: Trainer<B>,
}

impl<B: Backend> Engine for Reference<'_, B> {
    type Ran = ();

    fn run(&mut self, steps: u64, out: &mut Steps<'_>) -> Result<(), RunError> {
        for _ in 0..steps {
            let m = self.trainer.train_step()?;
            out.step(&StepLine::new(&m, None), &step_message(&m, None))?;
        }
        Ok(())
    }

    fn checkpoint(&mut self, _: &mut ()) -> Result<Option<Checkpoint>, RunError> {
        Ok(Some(self.trainer.final_checkpoint()?))
    }

    fn after(&mut self, _: (), _: &Path, show: &mut dyn Show) -> Result<&'static str, RunError> {
        evaluate(self.job, self.trainer.model_mut(), show)?;
        Ok("job.toml, metrics.jsonl, checkpoint/")
    }
}
