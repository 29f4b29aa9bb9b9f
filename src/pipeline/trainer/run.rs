//! Running a [`PipelineTrainer`]: the runtime on its own thread, this thread joining each
//! step's metrics with its measured profile (and the drafter's figures) for the caller.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::mpsc::channel;
use std::time::Duration;

use pipefill_actors::{FillerRouter, IterationProfile, PlanSource};

use super::super::compute::RankCompute;
use super::super::executor::{ReplicaLinks, ReplicaSteps, Stepping};
use super::super::feed::StepFeed;
use super::super::fill::state::samplers_fit;
use super::super::fill::{DrafterFill, HELD_OUT_EVERY, HeldOutEval, SlicePlan};
use super::super::join::{DrafterRun, DrafterStep, StepJoin, StepView};
use super::super::shared::Shared;
use super::PipelineTrainer;
use super::outcome::PipelineRun;
use crate::config::{DeviceKind, Filler, JobConfig};
use crate::data::StepData;
use crate::model::ModelError;
use crate::model::drafter::FillMode;
use crate::pipeline::error::PipelineError;
use crate::schedules::{Plan, Timeline, simulate};
use crate::tensor::device::{OnBackend, RankBackend, on_backend};
use crate::train::StepMetrics;

impl PipelineTrainer {
    /// Checks the checkpoint the trainer resumes from against its job before anything runs:
    /// every parameter of the model, and the drafter's state (one sampler per rank) when the
    /// run fills its bubbles with it. A caller that writes files checks first, so that a
    /// checkpoint the run cannot continue from is refused before a file changes.
    pub fn check_resume(&self) -> Result<(), PipelineError> {
        self.resumed_state()?;
        let drafter = self.resume.as_ref().and_then(|c| c.drafter.as_ref());
        if let (Filler::Drafter, Some(state)) = (self.filler, drafter) {
            samplers_fit(state, self.plan.num_ranks())?;
        }
        Ok(())
    }

    /// Runs `steps` optimizer steps. `on_step` is called on this thread with each step's
    /// metrics as soon as every rank has stepped and the step's iteration is measured.
    pub fn run(
        &self,
        steps: u64,
        mut on_step: impl FnMut(&StepMetrics),
    ) -> Result<PipelineRun, PipelineError> {
        self.run_profiled(steps, |m, _| on_step(m))
    }

    /// Runs `steps` optimizer steps. `on_step` is called on this thread, during the run,
    /// with each step's metrics and the measured [`Timeline`] of its iteration (bubble
    /// ratios, makespan) as soon as both are known: every rank has stepped and reported the
    /// iteration. The timeline is `None` only if the runtime never published it (the step
    /// is then handed over when the run ends).
    pub fn run_profiled(
        &self,
        steps: u64,
        mut on_step: impl FnMut(&StepMetrics, Option<&Timeline>),
    ) -> Result<PipelineRun, PipelineError> {
        self.run_observed(steps, |v| {
            on_step(v.metrics, v.profile.map(|p| &p.timeline))
        })
    }

    /// Runs `steps` optimizer steps. `on_step` is called on this thread, during the run, with
    /// each step's [`StepView`] as soon as every rank has stepped and reported the iteration.
    ///
    /// Each rank computes on the job's `device`: the CPU backend on one thread, or with
    /// `device = "cuda"` GPU `rank mod count` of this machine's (checked before anything is
    /// built; without the `cuda` feature, a driver or a GPU, one error naming `device`).
    pub fn run_observed(
        &self,
        steps: u64,
        mut on_step: impl FnMut(&StepView),
    ) -> Result<PipelineRun, PipelineError> {
        self.run_observed_until(steps, |v| {
            on_step(v);
            ControlFlow::Continue(())
        })
    }

    /// [`PipelineTrainer::run_observed`] where `on_step` may stop the run: after a
    /// [`ControlFlow::Break`] every rank ends at the end of its step, and the run is
    /// [`PipelineError::Stopped`] (a caller that could not record a step stops there).
    pub fn run_observed_until(
        &self,
        steps: u64,
        mut on_step: impl FnMut(&StepView) -> ControlFlow<()>,
    ) -> Result<PipelineRun, PipelineError> {
        struct Run<'a, 'f> {
            trainer: &'a PipelineTrainer,
            steps: u64,
            on_step: &'f mut dyn FnMut(&StepView) -> ControlFlow<()>,
        }
        impl OnBackend for Run<'_, '_> {
            type Output = Result<PipelineRun, PipelineError>;
            fn run<B: RankBackend>(self) -> Self::Output {
                self.trainer.run_on::<B>(self.steps, self.on_step)
            }
        }
        let cuda = self.job.device == DeviceKind::Cuda;
        if cuda {
            // Names `device` when CUDA cannot be used at all, before anything is built.
            self.job.device.usable_on_local_rank(0)?;
        }
        let run = Run {
            trainer: self,
            steps,
            on_step: &mut on_step,
        };
        on_backend(cuda, run).map_err(ModelError::from)?
    }

    /// The run with each rank computing on a `B` ([`PipelineTrainer::backends`]).
    fn run_on<B: RankBackend>(
        &self,
        steps: u64,
        on_step: &mut dyn FnMut(&StepView) -> ControlFlow<()>,
    ) -> Result<PipelineRun, PipelineError> {
        if steps == 0 {
            return Err(PipelineError::Config {
                field: "steps",
                reason: "must be at least 1".into(),
            });
        }
        let planned = job_is_planned(self);
        if planned && self.speculative {
            return Err(PipelineError::Config {
                field: "drafter.placement",
                reason:
                    "is \"planned\", which needs steps that are never rolled back (a rolled-back \
                         step's forwards run again and capture their rows twice): turn speculative \
                         steps off"
                        .into(),
            });
        }
        let (job, plan) = (&self.job, &self.plan);
        let feed = self.step_feed()?;
        feed.prefetch(self.first_step());
        let checkpointing = self.checkpointing()?;
        let resumed = self.resumed_state()?;
        // One pipeline per replica (the job's `dp`, or the one this trainer is), each with
        // its own shared state over the same steps.
        let pp = plan.num_ranks();
        let mut replicas = Vec::new();
        let mut receivers = Vec::new();
        let links = self.links();
        let mut backends = self.backends::<B>(links.len() * pp)?.into_iter();
        for links in links {
            let (progress, steps_rx) = channel();
            let shared = Arc::new(
                Shared::new(pp, Arc::clone(&feed), progress)
                    .with_replica(links.replica.clone())
                    .with_tie(links.tie.clone())
                    .with_checkpoints(checkpointing.clone()),
            );
            let own = backends.by_ref().take(pp).collect();
            let computes = self.computes::<B>(&shared, steps, own, resumed.as_ref())?;
            replicas.push((shared, computes, links.ends));
            receivers.push(steps_rx);
        }
        drop(resumed);
        let shareds: Vec<Arc<Shared>> = replicas.iter().map(|r| Arc::clone(&r.0)).collect();
        let shared = Arc::clone(&shareds[0]);
        let (profiles, profiles_rx) = channel();
        let mut first = ReplicaLinks {
            listener: Some(profiles),
            ..ReplicaLinks::default()
        };
        let router = FillerRouter::default();
        // The drafter lives in the first replica's pipeline (as launched).
        let fill = match self.filler {
            Filler::Drafter => Some(join_drafter(
                &self.job,
                &self.plan,
                self.first_step(),
                &mut replicas[0].1,
            )?),
            Filler::None => None,
        };
        if let Some(fill) = &fill {
            // A resumed run continues the checkpoint's drafter, and saves it with its own.
            if let Some(state) = self.resume.as_ref().and_then(|c| c.drafter.as_ref()) {
                fill.import_state(state)?;
            }
            shared.checkpoint_drafter(Arc::clone(fill));
        }
        let mut eval = match &fill {
            Some(fill) => {
                fill.attach(&router);
                first.fillers = router.fillers(pp);
                Some(HeldOutEval::new(&job.model, &job.drafter, fill)?)
            }
            None => None,
        };
        let last_step = self.first_step() + steps - 1;
        let mut agreement = Vec::new();
        let mut measure = |m: &StepMetrics, p: Option<&IterationProfile>| {
            let drafter = fill.as_ref().zip(eval.as_mut()).map(|(fill, eval)| {
                let (slices, loss, _) = fill.take_tally();
                let due = m.step.is_multiple_of(HELD_OUT_EVERY) || m.step == last_step;
                // A failed measurement only loses the figure; training goes on.
                let measured = due.then(|| eval.measure(fill).ok().flatten()).flatten();
                if let Some((version, a)) = measured {
                    agreement.push((m.step, version, a));
                }
                DrafterStep {
                    version: fill.board().latest().map_or(0, |w| w.version),
                    slices,
                    loss,
                    agreement: measured.map(|(_, a)| a),
                }
            });
            let flow = on_step(&StepView {
                metrics: m,
                profile: p,
                drafter,
            });
            if flow.is_break() {
                shareds.iter().for_each(|s| s.stop());
            }
        };
        let mut join = StepJoin::new(self.first_step(), profiles_rx, &mut measure);
        let mut merge = ReplicaSteps::new(receivers);
        let stepping = Stepping {
            step_mode: self.step_mode,
            ..Stepping::of_job(job, self.clock, steps)
        };
        let mut links = vec![first];
        links.resize_with(replicas.len(), ReplicaLinks::default);
        let outcomes = std::thread::scope(|scope| {
            let runners: Vec<_> = replicas
                .into_iter()
                .zip(links)
                .map(|((_, computes, ends), links)| {
                    let source = self.plan_source();
                    scope.spawn(move || {
                        let local = computes.into_iter().enumerate().collect();
                        let outcome = stepping.run(source, local, links);
                        if outcome.is_err() {
                            // The other replicas would wait for this one's gradients.
                            ends.iter().for_each(|e| drop(e.close()));
                        }
                        outcome
                    })
                })
                .collect();
            loop {
                let done = runners.iter().all(|r| r.is_finished());
                match merge.wait(Duration::from_millis(20)) {
                    Some(whole) => whole.into_iter().for_each(|m| join.metrics(m)),
                    None if !done => join.poll(),
                    None => break,
                }
            }
            let outcomes: Vec<_> = runners.into_iter().map(|r| r.join()).collect();
            merge.drain().into_iter().for_each(|m| join.metrics(m));
            outcomes
        });
        let metrics = join.finish();
        let mut reports = Vec::with_capacity(outcomes.len());
        for outcome in outcomes {
            match outcome {
                Ok(report) => reports.push(report),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        // A checkpoint write that failed is why the ranks stopped: its error comes first.
        shared.join_checkpoints()?;
        let mut reports = reports.into_iter();
        let report = reports.next().ok_or(PipelineError::NoFinalState)??;
        for other in reports {
            other?;
        }
        let finals = shared.take_finals().ok_or(PipelineError::NoFinalState)?;
        // An auto-scheduled run is predicted (and reported) by the plan its last step ran.
        let plan = match (&self.auto, &report.plan) {
            (Some(_), Some(last)) => last.as_ref(),
            _ => plan,
        };
        let predicted = match &report.measured_cost {
            Some(cost) => Some(simulate(plan, cost)?),
            None => None,
        };
        let drafter = match &fill {
            Some(fill) => Some(DrafterRun {
                replicas: fill.settle()?,
                router: router.stats(),
                agreement,
                frozen_table_bytes: fill.frozen_table_bytes(),
            }),
            None => None,
        };
        let mut run = PipelineRun::new(self, metrics, report, predicted, finals);
        run.drafter = drafter;
        run.drafter_state = fill.map(|f| f.export_state()).transpose()?;
        Ok(run)
    }
}

impl PipelineTrainer {
    /// The steps the run trains on: the caller's feed, or the job's synthetic stream.
    pub(super) fn step_feed(&self) -> Result<Arc<StepFeed>, PipelineError> {
        Ok(match &self.feed {
            Some(feed) => Arc::clone(feed),
            None => {
                let job = &self.job;
                let data = StepData::new(job.data.clone(), job.model.seq_len, job.train.seed)?;
                Arc::new(StepFeed::new(data, job.train.clone()))
            }
        })
    }

    /// Where the runtime's plans come from: the plan, or the auto re-planner.
    pub(super) fn plan_source(&self) -> PlanSource {
        match &self.auto {
            Some(replanner) => {
                let mut replanner = replanner.clone();
                PlanSource::Replan(Box::new(move |i, cost| replanner.plan(i, cost)))
            }
            None => PlanSource::Given(self.plan.clone()),
        }
    }
}

/// Whether `trainer` fills its bubbles with the drafter under the planned placement.
fn job_is_planned(trainer: &PipelineTrainer) -> bool {
    matches!(trainer.filler, Filler::Drafter) && trainer.job.drafter.placement == FillMode::Planned
}

/// The drafter of a run of `job` following `plan` from target step `step`: one replica per
/// rank of `computes`, seeded from the target's first and last chunks, and the last stage's
/// capture hooked to its buffer.
fn join_drafter<B: RankBackend>(
    job: &JobConfig,
    plan: &Plan,
    step: u64,
    computes: &mut [RankCompute<B>],
) -> Result<Arc<DrafterFill>, PipelineError> {
    let last_stage = (plan.stages - 1) as u32;
    let last_rank = plan.stage_rank[last_stage as usize];
    let (first, last) = match (
        computes[0].chunk_ref(0),
        computes[last_rank].chunk_ref(last_stage),
    ) {
        (Some(f), Some(l)) => (f, l),
        _ => {
            return Err(PipelineError::Config {
                field: "plan",
                reason: "places stage 0 off rank 0: the drafter's frozen copies need it there"
                    .into(),
            });
        }
    };
    // Each rank's replica on the rank's own device: its slices fill that rank's bubbles.
    let backends = computes.iter().map(|c| c.backend().clone()).collect();
    let mut fill = DrafterFill::on_backends(&job.model, &job.drafter, backends, first, last, step)?;
    if let Some(slices) = SlicePlan::of_job(plan, job)? {
        fill.plan_slices(slices, step);
    }
    let fill = Arc::new(fill);
    for c in computes.iter_mut() {
        c.set_drafter(Arc::clone(&fill))?;
    }
    Ok(fill)
}
