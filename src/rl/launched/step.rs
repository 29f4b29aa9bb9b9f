//! A launched rank's parts of a GRPO step ([`StepParts`], the step itself is
//! [`grpo_step`](crate::rl::step::grpo_step)): the rollouts are rank 0's, after the weight
//! sync, sent to every rank; the update runs this rank's stages over the mesh, and rank 0
//! gathers what the step reports (the replicas' losses and KL, every rank's spans).

use std::sync::Arc;
use std::time::Instant;

use super::channel::RL_CHANNEL;
use super::rank::{Ctx, Share, Transports, shares};
use super::state::RankState;
use crate::comm::CommError;
use crate::comm::frame;
use crate::comm::link::PeerLink;
use crate::config::JobConfig;
use crate::config::optimizer::OptimizerConfig;
use crate::model::Gpt;
use crate::pipeline::PipelineTrainer;
use crate::pipeline::feed::StepFeed;
use crate::pipeline::mesh::profile::{ClockSync, PROFILE_CHANNEL, loss_rank, rank_profile};
use crate::profile::merge::{gather_profiles, merge, send_profile};
use crate::rl::RlError;
use crate::rl::prompts::PromptSource;
use crate::rl::step::{RolloutFigures, StepParts, StepRollouts, UpdateOutcome};
use crate::rl::trainer_spec::PipelineRollouts;
use crate::rl::update::UpdateStep;
use crate::tensor::device::RankBackend;
use crate::train::StepMetrics;

/// What a launched rank carries from step to step.
pub(super) struct LaunchedRank<'a, 'm, B: RankBackend> {
    pub ctx: &'a Ctx<'m, B>,
    pub job: &'a JobConfig,
    pub state: RankState<B>,
    /// Rank 0's rollout engine and its prompts.
    pub rollouts: Option<(PipelineRollouts<B>, PromptSource)>,
    /// Rank 0's frozen KL reference, taken at the first weight sync (`rl.kl_coef > 0`).
    pub reference: Option<Gpt<B>>,
    pub clock_sync: ClockSync,
    /// Whether the update's rank stays alive from step to step.
    pub keep: bool,
    /// The RL step under way (0-based), set as its rollouts start.
    pub rl_step: u64,
    /// This step's transports, opened before the weight sync releases the step.
    pub links: Option<Transports<B>>,
}

impl<B: RankBackend> StepParts for LaunchedRank<'_, '_, B> {
    type Error = RlError;

    fn rollouts(&mut self, step: u64) -> Result<(StepRollouts, Option<RolloutFigures>), RlError> {
        let ctx = self.ctx;
        self.rl_step = step;
        // Open this step's transports before the weight sync releases the step.
        self.links = Some(ctx.transports()?);
        let synced = Instant::now();
        ctx.sync_weights(&mut self.state, false)?;
        let sync_seconds = synced.elapsed().as_secs_f64();
        if ctx.rank == 0 && self.job.rl.kl_coef > 0.0 && self.reference.is_none() {
            // The policy RL starts from, whole at rank 0 after the first sync.
            let frozen = self.state.frozen_model(&ctx.backend);
            self.reference = Some(frozen.map_err(|e| ctx.pipeline_err()(e.into()))?);
        }
        let engine = self.rollouts.as_mut().map(|(e, p)| (e, &*p));
        let models = (&self.state.model, self.reference.as_mut());
        let (rollouts, figures) = ctx.exchange_rollouts(self.job, engine, models, step)?;
        let figures = figures.map(|f| RolloutFigures {
            sync_seconds: Some(sync_seconds),
            ..f
        });
        Ok((rollouts, figures))
    }

    fn update(
        &mut self,
        job: &JobConfig,
        trainer: PipelineTrainer,
        update: UpdateStep,
    ) -> Result<UpdateOutcome, RlError> {
        let ctx = self.ctx;
        let plan = trainer.plan();
        let last_stage = loss_rank(plan);
        let shares = shares(&update.step.batches, &update.step.scales, ctx.dp);
        let first = self.state.step;
        let feed = Arc::new(StepFeed::given([(first, update.step)]));
        let links = match self.links.take() {
            Some(links) => links,
            None => ctx.transports()?,
        };
        let from = self.state.start();
        self.clock_sync.at_run_start();
        // A sharded optimizer's last update exports instead: its ranks gather the replicas'
        // moments on the first replica as the run ends (`Zero::gather_state`), which the
        // last weight sync sends to rank 0; a kept rank holds only its replica's share.
        let last = self.rl_step + 1 == self.job.rl.steps;
        let keep = self.keep && !(last && OptimizerConfig::sharded(job));
        let (report, ended, log) = ctx.run(job, plan, feed, (first, 1), from, keep, links)?;
        // Rank 0 merges every rank's spans, as a launched `train` does.
        let own = rank_profile(ctx.rank, ctx.prank, &report, &self.clock_sync);
        let profile_err = |error| RlError::RankProfile {
            rank: ctx.rank,
            error,
        };
        let bubble_ratio = match ctx.rank {
            0 => {
                let all = gather_profiles(ctx.mesh.as_ref(), PROFILE_CHANNEL, own);
                let merged = all
                    .and_then(|p| merge(&p, ctx.mesh.world()))
                    .map_err(profile_err)?;
                merged.iterations.first().map(|t| t.bubble_ratio)
            }
            _ => {
                send_profile(ctx.mesh.as_ref(), PROFILE_CHANNEL, &own).map_err(profile_err)?;
                None
            }
        };
        (self.state.ended(ended)).map_err(|e| ctx.pipeline_err()(e.into()))?;
        self.state.step += 1;
        let losses = gather_losses(ctx, last_stage, log)?;
        let kl = ctx.gather_kl(update.kl_hook.as_deref(), last_stage, &shares)?;
        let first_log = losses.first().and_then(|l| l.first());
        Ok(UpdateOutcome {
            loss: surrogate(&losses, &shares),
            grad_norm: (report.steps.first()).map_or(f32::NAN, |s| s.grad_norm as f32),
            lr: first_log.map_or(f32::NAN, |m| m.lr),
            kl,
            bubble_ratio,
        })
    }

    fn error(&self, error: RlError) -> RlError {
        self.ctx.rl_err()(error)
    }
}

/// Every replica's step log at rank 0, from its last stage's process (the losses are known
/// there only); empty elsewhere. On [`RL_CHANNEL`] in the binary frame, not launch train's
/// JSON step log: a replica whose loss scales sum to zero reports a NaN loss, which JSON
/// cannot carry.
fn gather_losses<B: RankBackend>(
    ctx: &Ctx<'_, B>,
    last_stage: usize,
    log: Vec<StepMetrics>,
) -> Result<Vec<Vec<StepMetrics>>, RlError> {
    let rank = ctx.rank;
    let bad = |peer: usize| {
        move |e: CommError| RlError::BadFrame {
            rank,
            peer,
            what: "step log",
            error: e,
        }
    };
    if rank != 0 {
        if ctx.prank == last_stage {
            let bytes = frame::encode(&log).map_err(bad(0))?;
            ctx.mesh
                .send(0, RL_CHANNEL, &bytes)
                .map_err(ctx.link_err(0, "sending the step log"))?;
        }
        return Ok(Vec::new());
    }
    let mut own = Some(log);
    (0..ctx.dp)
        .map(|d| match d * ctx.pp + last_stage {
            0 => Ok(own.take().unwrap_or_default()),
            from => {
                let bytes = ctx
                    .mesh
                    .recv(from, RL_CHANNEL)
                    .map_err(ctx.link_err(from, "receiving the step log"))?;
                frame::decode(&bytes).map_err(bad(from))
            }
        })
        .collect()
}

/// The update's loss as one pipeline would report it: with replicas each reports its
/// `Σ scale·loss` over its scales' sum (the runtime's mean over a replica's share), which is
/// multiplied back here: a share without a gradient (every scale 0) adds 0, and one whose
/// scales sum to zero otherwise is unknown (NaN).
fn surrogate(losses: &[Vec<StepMetrics>], shares: &[Share]) -> f32 {
    let loss = |d: usize| losses.get(d).and_then(|l| l.first()).map(|m| m.loss);
    if shares.len() == 1 {
        return loss(0).unwrap_or(f32::NAN);
    }
    let mut total = 0.0f64;
    for (d, share) in shares.iter().enumerate() {
        match loss(d) {
            _ if !share.informative => {}
            Some(l) if share.scale_sum != 0.0 => {
                total += f64::from(l) * f64::from(share.scale_sum);
            }
            _ => return f32::NAN,
        }
    }
    total as f32
}
