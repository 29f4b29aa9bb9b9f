//! GRPO over processes (`pipefill launch -n N -- rl`): [`rl_rank_on`], one rank's part.
//!
//! The design of RL systems that shard the training engine and sync weights to a rollout
//! engine: the update is pipelined over the processes (each holds its plan rank's stages and
//! their optimizer moments), and rank 0 is the rollout engine, with the whole policy and the
//! drafter. With `dp` > 1 the world is `dp` replicas of the update's pipeline (global rank =
//! replica × pp + pipeline rank, as in `launch -- train`). Each RL step:
//! 1. every rank sends its stages' parameters to rank 0 on [`RL_CHANNEL`] (the weight sync;
//!    rank 0 then holds the whole policy; the moments follow at the final sync, or every
//!    step with `keep_update_ranks` off). Replicas hold the same bits after every
//!    all-reduced step, so only replica 0's ranks send their stages; the other replicas'
//!    ranks send an empty frame (see the ordering note below);
//! 2. rank 0 samples the step's prompts, generates the rollouts with the in-process rollout
//!    engine ([`PipelineRollouts`], speculation as configured, its drafter started from
//!    `--init`'s as in-process: [`starting_drafter`]), scores them and normalises
//!    the advantages; with `rl.kl_coef > 0` it computes each sequence's completion-token
//!    log-probs under the frozen reference; it sends the rollouts (token ids), advantages
//!    and reference log-probs to every rank;
//! 3. every rank builds the update's micro-batches (targets, prompt mask, loss scales, and
//!    with KL the head's [`GrpoTokenLoss`](crate::rl::update::GrpoTokenLoss)) with the
//!    in-process trainer's own functions and runs one pipelined optimizer step of the
//!    update job over the TCP mesh, as `launch -- train` does; each replica runs its share
//!    of the step's sequences and all-reduces its gradients with the other replicas (the
//!    runtime's [`Replica`](crate::pipeline::shared::Replica) and launch train's ring
//!    all-reduce, on the same channel). The rank's compute (its stages' parameters, AdamW
//!    moments and buffers) stays alive from one step's update to the next, as in-process
//!    ([`RankOptions::keep_update_ranks`]; see `rl/state.rs`).
//!
//! **The KL reference** is the policy RL starts from, as in-process: rank 0 freezes a copy
//! of the whole model at the first weight sync (after the warm-up, or `--init`'s) and runs
//! [`reference_log_probs`](crate::rl::grpo::reference_log_probs) on it, one forward per
//! sequence, the in-process trainer's function on the same bits, so the log-probs and hence
//! the update are bitwise the in-process run's. Rank 0 already holds the whole policy for
//! the rollouts; a reference sharded over the ranks (each its starting stages, forward
//! only) would be one more pipelined pass per step for a model that rank 0 can run alone,
//! and its log-probs would then cross the mesh anyway (the head is on the last rank).
//!
//! **Rollouts with replicas** are generated once, on rank 0, and sent to every replica: the
//! sampling is batch-wide (one seed stream per step), so per-replica generation of a share
//! of the prompts would sample other tokens than `dp` = 1 and the rollouts of the two
//! could not be compared; and each replica's update needs only the token ids (a few KiB).
//!
//! The policy starts from `--init` (every rank reads the checkpoint) or from
//! `rl.warmup_steps` supervised steps, pipelined over the processes too (data-parallel
//! with replicas). The rollout, rewards and update are the in-process `pipefill rl`'s,
//! function for function, and the pipelined step is bitwise the in-process one, so with
//! `dp` = 1 the parameters after K steps equal the in-process run's bitwise (f32 on the
//! CPU); with `dp` > 1 they differ by the gradient sum's order (see `tests/dp.rs`).
//!
//! Each step's pipeline opens new transports, which replace the previous step's on the mesh
//! channels. A rank opens them before its weight-sync frame, and no rank sends an activation
//! before rank 0's rollout arrives, which rank 0 sends only once every rank's frame is in:
//! so no frame of a step can reach a rank's previous, finished transport.

mod channel;
mod rank;
mod state;
mod step;

pub use channel::RL_CHANNEL;

use crate::model::ModelError;
use crate::pipeline::PipelineError;
use crate::rl::RlError;

use std::sync::Arc;
use std::time::Duration;

use pipefill_actors::Clock;

use crate::comm::link::PeerLink;
use crate::comm::tcp::TcpMesh;
use crate::config::JobConfig;
use crate::data::StepData;
use crate::model::checkpoint::Checkpoint;
use crate::model::drafter::state::DrafterState;
use crate::model::{AdamW, Cut, Gpt, OptimizerState};
use crate::pipeline::PipelineTrainer;
use crate::pipeline::feed::StepFeed;
use crate::pipeline::mesh::check_world;
use crate::pipeline::mesh::profile::sync_clock;
use crate::rl::generator::RolloutGenerator;
use crate::rl::prompts::PromptSource;
use crate::rl::step::grpo_step;
use crate::rl::step::update_job_of;
use crate::rl::step_metrics::RlStepMetrics;
use crate::rl::trainer_spec::PipelineRollouts;
use crate::rl::warm_up::warm_up_job;
use crate::tensor::CpuBackend;
use crate::tensor::device::RankBackend;
use crate::train::reference::adamw_config;
use rank::Ctx;
use state::{RankState, Start};
use step::LaunchedRank;

/// How long a rank waits for rank 0 to have gathered the final weights.
const FINAL_WAIT: Duration = Duration::from_secs(120);

/// What rank 0 ends with.
pub struct RlLaunchRun {
    /// The whole policy and optimizer after the last step.
    pub checkpoint: Checkpoint,
    /// Every step as rank 0 saw it (the in-process run's type, with the weight sync).
    pub steps: Vec<RlStepMetrics>,
}

/// How a rank runs its part ([`rl_rank_with`], [`rl_rank_on`]); [`Default`]: as the CLI runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankOptions {
    /// Whether the rank's update compute (its stages' parameters, AdamW moments and
    /// buffers) stays alive from step to step, as in-process
    /// ([`RlTrainer::keep_update_ranks`](crate::rl::trainer::RlTrainer::keep_update_ranks),
    /// default on); off, every update rebuilds the rank from host copies of the previous
    /// one's. The results are bitwise the same.
    pub keep_update_ranks: bool,
}

impl Default for RankOptions {
    fn default() -> Self {
        RankOptions {
            keep_update_ranks: true,
        }
    }
}

/// Runs `job`'s RL (`rl.steps` GRPO steps) as the mesh's rank, on one CPU thread, from
/// `init` when given (every rank passes the same checkpoint) or after `rl.warmup_steps`
/// supervised steps, with `options` (every rank passes the same). Rank 0 calls `on_step`
/// after each step and returns the final policy; the other ranks return `None`.
pub fn rl_rank_with(
    job: &JobConfig,
    mesh: &Arc<TcpMesh>,
    clock: Clock,
    init: Option<&Checkpoint>,
    options: RankOptions,
    on_step: impl FnMut(&RlStepMetrics),
) -> Result<Option<RlLaunchRun>, RlError> {
    let backend =
        CpuBackend::for_rank(mesh.rank(), job.train.precision).map_err(|e| RlError::OnRank {
            rank: mesh.rank(),
            error: Box::new(ModelError::from(e).into()),
        })?;
    rl_rank_on(backend, job, mesh, clock, init, options, on_step)
}

/// [`rl_rank_with`] computing on `backend` (a launched rank's: its local rank's GPU with
/// `device = "cuda"`): the policy, rank 0's rollouts and drafter, and this rank's stages of
/// every update. Tensors between the ranks go over the mesh (TCP).
pub fn rl_rank_on<B: RankBackend>(
    backend: B,
    job: &JobConfig,
    mesh: &Arc<TcpMesh>,
    clock: Clock,
    init: Option<&Checkpoint>,
    options: RankOptions,
    mut on_step: impl FnMut(&RlStepMetrics),
) -> Result<Option<RlLaunchRun>, RlError> {
    let (rank, world, dp) = (mesh.rank(), mesh.world(), job.dp);
    let rl_err = |error: RlError| RlError::OnRank {
        rank,
        error: Box::new(error),
    };
    let pipeline_err = |error: PipelineError| RlError::RankPipeline {
        rank,
        error: Box::new(error),
    };
    job.rl
        .validate(job.model.seq_len)
        .map_err(|e| rl_err(e.into()))?;
    let first_update = init.map_or(job.rl.warmup(job.model.from.is_some()), |c| c.meta.step);
    let update = update_job_of(job, first_update);
    let plan = replica_plan(
        &update,
        rank,
        "the update's sequences (rl.prompts × rl.group)",
    )?;
    let pp = plan.num_ranks();
    check_world(pp, dp, world)?;
    let ctx = Ctx {
        mesh,
        rank,
        replica: rank / pp,
        prank: rank % pp,
        pp,
        dp,
        clock,
        backend: backend.clone(),
    };
    let keep = options.keep_update_ranks;
    let state = start(&ctx, job, init, keep)?;
    let rollouts = match rank {
        0 => Some((
            rollout_engine(job, init, backend.clone()).map_err(rl_err)?,
            PromptSource::from_job(job).map_err(rl_err)?,
        )),
        _ => None,
    };
    let profile_err = |error| RlError::RankProfile { rank, error };
    let clock_sync = sync_clock(mesh, clock.is_virtual()).map_err(profile_err)?;
    let mut parts = LaunchedRank {
        ctx: &ctx,
        job,
        state,
        rollouts,
        reference: None,
        clock_sync,
        keep,
        rl_step: 0,
        links: None,
    };
    let mut steps = Vec::new();
    for step in 0..job.rl.steps {
        if let Some(line) = grpo_step(&job.rl, &update, step, &mut parts)? {
            on_step(&line);
            steps.push(line);
        }
    }
    let mut state = parts.state;
    // The last weight sync: rank 0 ends with the whole policy and optimizer.
    ctx.sync_weights(&mut state, true)?;
    if rank != 0 {
        // Leave only after rank 0 does: an exit now could reset the connection before rank
        // 0 has read this rank's weights.
        mesh.quiesce();
        if !mesh.wait_gone(0, FINAL_WAIT) {
            return Err(RlError::Peer {
                rank,
                reason: mesh.failure().unwrap_or_else(|| {
                    format!("rank 0 did not confirm the final weights within {FINAL_WAIT:?}")
                }),
            });
        }
        return Ok(None);
    }
    mesh.close().map_err(ctx.link_err(0, "closing the mesh"))?;
    let mut optimizer = AdamW::new(adamw_config(&update.train));
    optimizer
        .load_state(&backend, &state.optimizer)
        .map_err(|e| pipeline_err(e.into()))?;
    let mut checkpoint = Checkpoint::capture(&state.model, &optimizer, state.step, job.train.seed)
        .map_err(|e| rl_err(e.into()))?;
    if let Some((engine, _)) = &parts.rollouts {
        let init = init.and_then(|c| c.drafter.as_ref());
        checkpoint.drafter = final_drafter(init, engine).map_err(rl_err)?;
    }
    Ok(Some(RlLaunchRun { checkpoint, steps }))
}

/// The drafter that rank 0's rollouts start from, by the in-process `pipefill rl --init`
/// rule: with speculation, `init`'s when that run trained one in its bubbles; `None` means
/// untrained (or no speculation, which needs no drafter).
pub fn starting_drafter<'a>(
    job: &JobConfig,
    init: Option<&'a Checkpoint>,
) -> Option<&'a DrafterState> {
    init.filter(|_| job.rl.speculation)
        .and_then(|c| c.drafter.as_ref())
}

/// The drafter a finished RL run's checkpoint keeps: where the rollouts speculated,
/// `engine`'s (it has followed the policy through the run:
/// [`PipelineRollouts::drafter_state`]); otherwise (speculation off, or found not to pay on
/// this target) `init`'s, the starting checkpoint's, as it was, since nothing trained it.
pub fn final_drafter<B: RankBackend>(
    init: Option<&DrafterState>,
    engine: &PipelineRollouts<B>,
) -> Result<Option<DrafterState>, RlError> {
    match engine.speculative() {
        true => engine.drafter_state().map(Some),
        false => Ok(init.cloned()),
    }
}

/// Rank 0's rollout engine, its drafter warm-started from [`starting_drafter`] (weights and
/// optimizer moments, as in-process).
pub(crate) fn rollout_engine<B: RankBackend>(
    job: &JobConfig,
    init: Option<&Checkpoint>,
    backend: B,
) -> Result<PipelineRollouts<B>, RlError> {
    let engine = PipelineRollouts::on(job, backend)?;
    match starting_drafter(job, init) {
        Some(state) => engine.with_drafter(state),
        None => Ok(engine),
    }
}

/// The plan of one replica's pipeline for `job`: `1/dp` of its micro-batches (`what`, for
/// the error when they do not split evenly).
fn replica_plan(
    job: &JobConfig,
    rank: usize,
    what: &'static str,
) -> Result<crate::schedules::Plan, RlError> {
    let count = job.train.micro_batches;
    if !count.is_multiple_of(job.dp) {
        return Err(RlError::Shares {
            dp: job.dp,
            what,
            count,
        });
    }
    // The trainer plans each replica's share.
    let trainer = PipelineTrainer::from_job(job).map_err(|error| RlError::RankPipeline {
        rank,
        error: Box::new(error),
    })?;
    Ok(trainer.plan().clone())
}

/// The policy RL starts from, as this rank holds it: `init`'s whole model and optimizer, or
/// `rl.warmup_steps` supervised steps pipelined over the processes (its own stages current,
/// alive with `keep`, else exported for the first weight sync).
fn start<B: RankBackend>(
    ctx: &Ctx<'_, B>,
    job: &JobConfig,
    init: Option<&Checkpoint>,
    keep: bool,
) -> Result<RankState<B>, RlError> {
    let (rl_err, pipeline_err) = (ctx.rl_err(), ctx.pipeline_err());
    job.rl
        .check_trained(init.is_some(), job.model.from.is_some())?;
    if let Some(c) = init {
        // Blank: the restore sets every parameter (and fails on a missing one).
        let mut model = Gpt::blank(&job.model, ctx.backend.clone(), &Cut::Even(1))
            .map_err(|e| pipeline_err(e.into()))?;
        let mut optimizer = AdamW::new(adamw_config(&job.train));
        c.restore(&mut model, &mut optimizer, job.train.seed)
            .map_err(|e| rl_err(e.into()))?;
        let optimizer = optimizer
            .state(&ctx.backend)
            .map_err(|e| pipeline_err(e.into()))?;
        return Ok(RankState::new(model, optimizer, c.meta.step));
    }
    let sft = warm_up_job(job);
    if sft.train.steps == 0 {
        // A pretrained policy as it is: the model imports `model.from`.
        let model = Gpt::new(&job.model, ctx.backend.clone(), &Cut::Even(1))
            .map_err(|e| pipeline_err(e.into()))?;
        return Ok(RankState::new(model, OptimizerState::default(), 0));
    }
    let sft_plan = replica_plan(&sft, ctx.rank, "the warm-up's train.micro_batches")?;
    let data = StepData::new(sft.data.clone(), sft.model.seq_len, sft.train.seed)
        .map_err(|e| pipeline_err(e.into()))?;
    let feed = Arc::new(StepFeed::new(data, sft.train.clone()));
    let run = (0, sft.train.steps);
    let links = ctx.transports()?;
    let (_, ended, _) = ctx.run(&sft, &sft_plan, feed, run, Start::Fresh, keep, links)?;
    // Only this rank's stages of the model are ever read: the others are rank 0's after the
    // first weight sync, and a rebuilt rank loads its own.
    let model = Gpt::blank(&job.model, ctx.backend.clone(), &Cut::Even(1))
        .map_err(|e| pipeline_err(e.into()))?;
    let mut state = RankState::new(model, OptimizerState::default(), sft.train.steps);
    state.ended(ended).map_err(|e| pipeline_err(e.into()))?;
    Ok(state)
}
