//! The pipeline with every rank in this process: the real model through the actor runtime,
//! one stage actor per rank, following the job's schedule (built-in, `auto`, or a custom
//! file), then the run directory's profiling files (see [`super::files`]).
//!
//! With a filler (`filler = "drafter"`, the default) the progress shows the share of each
//! step's waits that filler work used and the drafter's held-out agreement. The run is the
//! job, once: its step inflation is each step replayed without its fillers (virtual clock);
//! the comparison with separate runs of the job without filler is `pipefill bench filler`
//! ([`super::filler_bench`]).

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use super::engine::{Engine, Steps, drive, step_message};
use super::files::{filling, write_profile};
use super::{evaluate, model_line};
use crate::config::DeviceKind;
use crate::config::{Filler, JobConfig};
use crate::data::StepData;
use crate::model::checkpoint::Checkpoint;
use crate::model::checkpoint::resume::ResumePoint;
use crate::model::checkpoint::sharded::{Layout, load_sharded};
use crate::pipeline::feed::StepFeed;
use crate::pipeline::{PipelineRun, PipelineTrainer, StepView};
use crate::run::RunError;
use crate::run::show::Show;
use crate::run::{RunDir, RunLog, StepLine, steps_left};

/// Runs `job`'s pipeline (from `resume`'s checkpoint when given) into `run_dir`, showing its
/// progress and the bubble report on `show`.
pub(super) fn train(
    job: &JobConfig,
    resume: Option<&Path>,
    run_dir: &RunDir,
    data: StepData,
    show: &mut dyn Show,
) -> Result<(), RunError> {
    let mut trainer = PipelineTrainer::from_job(job)
        .map_err(|source| RunError::plan(job, source))?
        .filler(job.filler)
        .feed(Arc::new(StepFeed::new(data, job.train.clone())));
    if let Some(dir) = resume {
        let checkpoint = load_resume(dir, &trainer)?;
        trainer = trainer.resume(&checkpoint);
        trainer.check_resume()?;
        show.line(&format!(
            "resuming from {} at step {}",
            dir.display(),
            trainer.first_step()
        ));
    }
    let first_step = trainer.first_step();
    let t = &job.train;
    let left = steps_left(first_step, t.steps)?;
    let plan = trainer.plan().clone();
    let clock = job.clock.name();
    show.line(&model_line(
        job,
        match job.device {
            DeviceKind::Cpu => "the CPU",
            DeviceKind::Cuda => "the GPUs (rank r on cuda:r mod their count)",
        },
    ));
    let replicas = match job.dp {
        1 => String::new(),
        dp => format!(" × {dp} data-parallel replicas (threads of this process)"),
    };
    show.line(&format!(
        "pipeline: schedule {} on {} ranks ({} stages, {} per rank){replicas}, {} micro-batches \
         × {} sequences per step, {clock} clock",
        job.schedule,
        plan.num_ranks(),
        plan.stages,
        plan.stages_per_rank(),
        t.micro_batches,
        t.micro_batch_size,
    ));

    // Each step's line goes to metrics.jsonl as the step completes, its measured bubble
    // ratios with it.
    let log = RunLog::open(run_dir, job, first_step)?;
    let mut engine = InProcess {
        job,
        trainer,
        out_dir: run_dir.path(),
        agreement: None,
    };
    drive(job, &mut engine, left, Some((run_dir, log)), show)
}

/// The pipeline with every rank in this process as an [`Engine`].
struct InProcess<'j> {
    job: &'j JobConfig,
    trainer: PipelineTrainer,
    out_dir: &'j Path,
    /// The drafter's latest held-out agreement (measured every few steps).
    agreement: Option<f64>,
}

impl InProcess<'_> {
    /// The tick message of the step `v`: loss, learning rate, tokens/s, the step's measured
    /// bubble ratios, with a filler the share of its waits filled, and the drafter's latest
    /// agreement.
    fn message(&mut self, v: &StepView) -> String {
        let mut line = step_message(v.metrics, v.profile.map(|p| &p.timeline));
        if let Some(p) = v.profile
            && self.job.filler != Filler::None
            && p.waited() > 0.0
        {
            line += &format!(" | fill {:.1}%", 100.0 * p.filled() / p.waited());
        }
        if let Some(a) = v.drafter.and_then(|d| d.agreement) {
            self.agreement = Some(a);
        }
        if let Some(a) = self.agreement {
            line += &format!(" | draft agree {:.1}%", 100.0 * a);
        }
        line
    }
}

impl Engine for InProcess<'_> {
    type Ran = PipelineRun;

    fn run(&mut self, steps: u64, out: &mut Steps<'_>) -> Result<PipelineRun, RunError> {
        let filler = self.job.filler != Filler::None;
        let main = self
            .trainer
            .clone()
            .checkpoint_every(self.job.checkpoint_every, self.out_dir);
        // A step that cannot be logged stops the run (every rank ends its step), and its
        // error is the run's.
        let mut failed = None;
        let run = main.run_observed_until(steps, |v: &StepView| {
            if failed.is_some() {
                return ControlFlow::Break(());
            }
            let message = self.message(v);
            match out.step(&StepLine::of_view(v, filler), &message) {
                Ok(()) => ControlFlow::Continue(()),
                Err(e) => {
                    failed = Some(e);
                    ControlFlow::Break(())
                }
            }
        });
        match failed {
            Some(e) => Err(e),
            None => Ok(run?),
        }
    }

    fn checkpoint(&mut self, run: &mut PipelineRun) -> Result<Option<Checkpoint>, RunError> {
        Ok(Some(run.checkpoint()?))
    }

    fn after(
        &mut self,
        run: PipelineRun,
        dir: &Path,
        show: &mut dyn Show,
    ) -> Result<&'static str, RunError> {
        let job = self.job;
        let filling = filling(job, &run, None, show);
        let report = write_profile(dir, job, &run, filling)?;
        show.line("");
        show.line(report.to_text().trim_end());
        show.line("");
        evaluate(job, &mut run.model()?, show)?;
        Ok("report.txt, trace.json, timeline.svg, metrics.jsonl, checkpoint/")
    }
}

/// The checkpoint `--resume PATH` names ([`ResumePoint::find`]: a run directory's newest, a
/// sharded checkpoint directory, or a whole-model one). A sharded one must have been written
/// by this job's layout and settings (checked against its manifest).
fn load_resume(path: &Path, trainer: &PipelineTrainer) -> Result<Checkpoint, RunError> {
    let point = ResumePoint::find(path).map_err(|e| RunError::resume(path, e))?;
    match point {
        ResumePoint::Sharded(dir) => {
            let layout = Layout {
                dp: trainer.job().dp,
                stage_rank: trainer.plan().stage_rank.clone(),
            };
            let hash = trainer.job().fingerprint();
            load_sharded(&dir, &layout, &hash).map_err(|e| RunError::resume(&dir, e))
        }
        ResumePoint::Whole(dir) => Checkpoint::load(&dir).map_err(|e| RunError::resume(&dir, e)),
    }
}
