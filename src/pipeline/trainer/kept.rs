//! Ranks kept alive between runs: [`PipelineTrainer::run_kept`] and [`KeptRanks`].
//!
//! `pipefill rl` runs one pipelined optimizer step per RL step, each a run of its own (the
//! step's micro-batch count, and so its plan, changes with the rollouts). Resuming every
//! run from a checkpoint copied each parameter and AdamW moment out of the ranks (the run's
//! final state), into a checkpoint, into a whole model and back into fresh ranks (the
//! next run). A kept run instead moves each rank's chunks and optimizer out when it ends
//! ([`KeptRanks`]) and the next run's ranks continue from them: no copy, no allocation.
//! The result is bitwise the resumed one's (same parameters, moments and step count; the
//! update's tests compare checkpoints of both).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::channel;

use pipefill_actors::RunReport;

use super::super::compute::{RankCompute, RankParts};
use super::super::executor::{RankStart, ReplicaLinks, Stepping};
use super::super::shared::Shared;
use super::PipelineTrainer;
use crate::config::Filler;
use crate::model::ModelError;
use crate::model::checkpoint::{Checkpoint, HostTensor};
use crate::model::{GptConfig, ModelChunk, OptimizerState};
use crate::pipeline::error::PipelineError;
use crate::tensor::device::RankBackend;
use crate::tensor::{Backend, CpuBackend};
use crate::train::StepMetrics;

/// A finished run's ranks, alive: each rank's chunks (parameters) and AdamW (moments, step
/// count), for the next [`PipelineTrainer::run_kept`] to continue from.
pub struct KeptRanks<B: Backend = CpuBackend> {
    /// By rank.
    ranks: Vec<RankParts<B>>,
    model: GptConfig,
    data_seed: u64,
    next_step: u64,
}

impl<B: Backend> std::fmt::Debug for KeptRanks<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeptRanks")
            .field("ranks", &self.ranks.len())
            .field("next_step", &self.next_step)
            .finish_non_exhaustive()
    }
}

/// What a kept run hands back: its steps' metrics, the runtime's report, and the ranks.
#[derive(Debug)]
pub struct KeptRun<B: Backend = CpuBackend> {
    /// Each step's metrics, in step order.
    pub steps: Vec<StepMetrics>,
    pub report: RunReport,
    pub ranks: KeptRanks<B>,
}

impl<B: Backend> KeptRanks<B> {
    /// The step a continuation starts at.
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// Whether `trainer`'s plan places on every rank the stages it holds here (else the
    /// state has to go through a [`KeptRanks::checkpoint`]).
    pub fn fits(&self, trainer: &PipelineTrainer) -> bool {
        self.ranks.len() == trainer.plan.num_ranks()
            && self.ranks.iter().all(|r| {
                r.chunks
                    .keys()
                    .copied()
                    .eq(trainer.plan.stages_of(r.rank).iter().copied())
            })
    }

    /// Every chunk, by stage (= model order).
    fn chunks(&self) -> BTreeMap<u32, (&B, &ModelChunk<B>)> {
        self.ranks
            .iter()
            .flat_map(|r| r.chunks.iter().map(move |(&s, c)| (s, (&r.backend, c))))
            .collect()
    }

    /// Overwrites every parameter of `model` (the same model's whole or another cut) with
    /// the kept ones, buffer to buffer.
    pub fn copy_params_into(&self, model: &mut crate::model::Gpt<B>) -> Result<(), PipelineError> {
        let chunks = self.chunks();
        let kept: BTreeMap<&str, (&B, &crate::model::Param<B>)> = chunks
            .values()
            .flat_map(|&(be, c)| {
                c.params()
                    .into_iter()
                    .map(move |p| (p.name.as_str(), (be, p)))
            })
            .collect();
        let mut params = model.params_mut();
        if params.len() != kept.len() {
            return Err(PipelineError::Config {
                field: "model",
                reason: format!(
                    "has {} parameters, the kept ranks {}",
                    params.len(),
                    kept.len()
                ),
            });
        }
        for p in &mut params {
            let (be, src) = kept
                .get(p.name.as_str())
                .ok_or_else(|| ModelError::UnknownParam(p.name.clone()))?;
            be.copy(&src.value, &mut p.value)
                .map_err(ModelError::from)?;
        }
        Ok(())
    }

    /// A checkpoint of the kept parameters and optimizer state: what the run's
    /// [`PipelineRun::checkpoint`](super::outcome::PipelineRun::checkpoint) would have held had it exported them.
    pub fn checkpoint(&self) -> Result<Checkpoint, PipelineError> {
        let mut params = Vec::new();
        for (be, chunk) in self.chunks().into_values() {
            for p in chunk.params() {
                params.push(HostTensor {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    data: be.to_host(&p.value).map_err(ModelError::from)?,
                });
            }
        }
        let mut optimizer = OptimizerState::default();
        for r in &self.ranks {
            let mut own = r.optimizer.state(&r.backend)?;
            optimizer.step = own.step;
            optimizer.slots.append(&mut own.slots);
        }
        Ok(crate::model::checkpoint::sharded::from_state(
            self.model.clone(),
            self.data_seed,
            self.next_step,
            params,
            &optimizer,
        ))
    }
}

impl PipelineTrainer {
    /// Runs `steps` optimizer steps as [`PipelineTrainer::run`] does and hands the ranks
    /// back alive instead of exporting their state. With `ranks` the run continues from
    /// them (at their next step; the resume checkpoint, if any, is not read), else from
    /// the resume checkpoint or the job's initial model. No filler and no periodic
    /// checkpoints (their state lives outside the ranks). A failed run loses the ranks.
    ///
    /// The ranks compute on `B`, each opening its own ([`RankBackend::for_rank`]): the
    /// caller picks it for the job's `device`.
    pub fn run_kept<B: RankBackend>(
        &self,
        ranks: Option<KeptRanks<B>>,
        steps: u64,
    ) -> Result<KeptRun<B>, PipelineError> {
        let refuse = |field, reason: &str| {
            Err(PipelineError::Config {
                field,
                reason: reason.into(),
            })
        };
        if steps == 0 {
            return refuse("steps", "must be at least 1");
        }
        if !matches!(self.filler, Filler::None) {
            return refuse("filler", "must be none for a run that keeps its ranks");
        }
        if self.replica.is_none() && self.job.dp > 1 {
            return refuse(
                "dp",
                "must be 1 for a run that keeps its ranks in one process (each launched \
                 process keeps its own)",
            );
        }
        if self.checkpoints.is_some() {
            return refuse(
                "checkpoint_every",
                "must be 0 for a run that keeps its ranks",
            );
        }
        let job = &self.job;
        if let Some(k) = &ranks {
            if k.model != job.model || k.data_seed != job.train.seed {
                return refuse(
                    "model",
                    "differs from the kept ranks' model or data seed (train.seed)",
                );
            }
            if !k.fits(self) {
                return refuse(
                    "schedule",
                    "places other stages on the ranks than the kept ranks hold",
                );
            }
        }
        let first = ranks.as_ref().map_or(self.first_step(), |k| k.next_step);
        let feed = self.step_feed()?;
        feed.prefetch(first);
        let (progress, steps_rx) = channel();
        let shared = Arc::new(
            Shared::new(self.plan.num_ranks(), feed, progress)
                .with_replica(self.replica.clone())
                .with_tie(Shared::tie_in_process(&self.job.model, &self.plan)),
        );
        let mut computes = match ranks {
            Some(k) => k
                .ranks
                .into_iter()
                .map(|parts| {
                    let run = self.rank_run(&shared, first, steps);
                    let (rank, backend) = (parts.rank, parts.backend.clone());
                    RankCompute::start::<CpuBackend>(run, rank, backend, RankStart::Kept(parts))
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => {
                let backends = self.backends::<B>(self.plan.num_ranks())?;
                self.computes::<B>(&shared, steps, backends, self.resumed_state()?.as_ref())?
            }
        };
        let (keep, kept_rx) = channel();
        for compute in &mut computes {
            compute.set_speculative(self.speculative);
            compute.keep_into(keep.clone());
        }
        drop(keep);
        let stepping = Stepping {
            step_mode: self.step_mode,
            ..Stepping::of_job(job, self.clock, steps)
        };
        let local = computes.into_iter().enumerate().collect();
        let report = stepping.run(self.plan_source(), local, ReplicaLinks::default())?;
        let mut metrics: Vec<StepMetrics> = steps_rx.try_iter().collect();
        metrics.sort_by_key(|m| m.step);
        let mut parts: Vec<RankParts<B>> = kept_rx.try_iter().collect();
        parts.sort_by_key(|p| p.rank);
        if parts.len() != self.plan.num_ranks() {
            return Err(PipelineError::NoFinalState);
        }
        Ok(KeptRun {
            steps: metrics,
            ranks: KeptRanks {
                ranks: parts,
                model: job.model.clone(),
                data_seed: job.train.seed,
                next_step: first + report.iterations.len() as u64,
            },
            report,
        })
    }
}
