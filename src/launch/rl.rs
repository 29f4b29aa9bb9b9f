//! GRPO over processes (`pipefill launch -n N -- rl`): [`rl_rank`], one rank's part.
//!
//! The design of RL systems that shard the training engine and sync weights to a rollout
//! engine: the update is pipelined over the processes (each holds its plan rank's stages and
//! their optimizer moments), and rank 0 is the rollout engine, with the whole policy and the
//! drafter. Each RL step:
//! 1. every rank sends its stages' parameters and moments to rank 0 on [`RL_CHANNEL`] (the
//!    weight sync; rank 0 then holds the whole model and optimizer);
//! 2. rank 0 samples the step's prompts, generates the rollouts with the in-process rollout
//!    engine ([`PipelineRollouts`], speculation as configured), scores them and normalises
//!    the advantages, and sends the rollouts (token ids) and advantages to every rank;
//! 3. every rank builds the update's micro-batches (targets, prompt mask, loss scales) with
//!    the in-process trainer's own [`update_batches`] and runs one pipelined optimizer step
//!    of the update job over the TCP mesh, as `launch -- train` does.
//!
//! The policy starts from `--init` (every rank reads the checkpoint) or from
//! `rl.warmup_steps` supervised steps, pipelined over the processes too. The rollout,
//! rewards and update are the in-process `pipefill rl`'s, function for function, and the
//! pipelined step is bitwise the in-process one, so the parameters after K steps equal the
//! in-process run's bitwise (f32 on the CPU).
//!
//! Each step's pipeline opens new transports, which replace the previous step's on the mesh
//! channels. A rank opens them before it sends its weights, and no rank sends an activation
//! before rank 0's rollout arrives, which rank 0 sends only once every rank's weights are
//! in: so no frame of a step can reach a rank's previous, finished transport.

use std::sync::Arc;
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use pipefill_actors::{Clock, GradStats, Pipeline, PlanSource, RunReport, StepMode, Transport};
use serde::{Deserialize, Serialize};

use super::profile::{loss_rank, recv_metrics, send_metrics};
use super::train::FinalWire;
use crate::comm::frame;
use crate::comm::link::{Channel, LinkError, PeerLink};
use crate::comm::tcp::TcpMesh;
use crate::comm::tcp_transport::{
    BufCodec, STATS_CHANNEL, SerdeCodec, TENSOR_CHANNEL, TcpTransport,
};
use crate::config::JobConfig;
use crate::data::{StepData, Tokenizer};
use crate::model::checkpoint::Checkpoint;
use crate::model::{AdamW, Cut, Gpt, ModelError, OptimizerState};
use crate::pipeline::feed::StepFeed;
use crate::pipeline::shared::{RankFinal, Shared};
use crate::pipeline::{PipelineError, PipelineTrainer, RankCompute};
use crate::rl::grpo::group_advantages;
use crate::rl::trainer::{
    RlError, Rollout, RolloutEngine, scored_rollouts, update_batches, update_job_of, warm_up_job,
};
use crate::rl::trainer_spec::PipelineRollouts;
use crate::schedules::Plan;
use crate::tensor::CpuBackend;
use crate::train::StepMetrics;
use crate::train::reference::adamw_config;

/// Channel of the weight sync (ranks → rank 0) and of the rollouts (rank 0 → ranks).
pub const RL_CHANNEL: Channel = u32::MAX - 8;

/// How long a rank waits for rank 0 to have gathered the final weights.
const FINAL_WAIT: Duration = Duration::from_secs(120);

/// Why a rank's part of a multi-process RL run failed; each names the rank.
#[derive(Debug, thiserror::Error)]
pub enum RlLaunchError {
    #[error(
        "multi-process rl runs one pipeline (dp = 1), not dp = {dp}: the rollout engine is rank 0"
    )]
    Replicas { dp: usize },
    #[error(
        "the update's schedule has {plan} ranks but the job was launched with {world} processes: one rank per process (set stages = {world})"
    )]
    World { plan: usize, world: usize },
    #[error(
        "rl.kl_coef = {kl_coef}: the KL penalty's reference log-probs do not cross processes yet; multi-process rl runs with rl.kl_coef = 0"
    )]
    Kl { kl_coef: f32 },
    #[error("rl.warmup_steps is 0 and no --init run is given: the policy would be untrained")]
    Untrained,
    #[error("rank {rank}: {error}")]
    Rl { rank: usize, error: RlError },
    /// The rank's own pipeline failed (the error names the rank).
    #[error("{error}")]
    Pipeline { rank: usize, error: PipelineError },
    #[error("rank {rank}: {what} with rank {peer}: {source}")]
    Link {
        rank: usize,
        peer: usize,
        what: &'static str,
        #[source]
        source: LinkError,
    },
    #[error("rank {rank}: rank {peer} sent an unreadable {what}: {reason}")]
    BadFrame {
        rank: usize,
        peer: usize,
        what: &'static str,
        reason: String,
    },
    /// The mesh failed: a peer died or broke the protocol (named in the text).
    #[error("rank {rank}: {reason}")]
    Peer { rank: usize, reason: String },
}

/// One RL step as rank 0 saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RlLaunchStep {
    /// 0-based RL step.
    pub step: u64,
    /// Mean reward of the step's rollouts.
    pub reward: f64,
    pub sequences: usize,
    /// Groups whose rewards differ (the only ones with a gradient).
    pub informative_groups: usize,
    /// Rank 0's rollout, rewards included (drafter training excluded).
    pub rollout_seconds: f64,
    /// Drafter training on the step's rollouts.
    pub drafter_seconds: f64,
    /// Weight sync: every rank's stages in at rank 0.
    pub sync_seconds: f64,
    /// The pipelined update over the processes (rank 0's view).
    pub update_seconds: f64,
    pub speculation: bool,
    pub acceptance_length: Option<f64>,
    /// The update's loss (the last stage's process reports it).
    pub surrogate_loss: f32,
    /// The global gradient norm.
    pub grad_norm: f32,
    pub lr: f32,
}

/// What rank 0 ends with.
pub struct RlLaunchRun {
    /// The whole policy and optimizer after the last step.
    pub checkpoint: Checkpoint,
    pub steps: Vec<RlLaunchStep>,
}

/// A step's rollouts on the wire: `(prompt, generated)` token ids and the advantages.
#[derive(Serialize, Deserialize)]
struct RolloutWire {
    rollouts: Vec<(Vec<u32>, Vec<u32>)>,
    advantages: Vec<f32>,
}

/// What a rank holds between steps: a whole model and optimizer state, of which its own
/// stages are current (rank 0: all, after the weight sync), and the next optimizer step.
struct RankState {
    model: Gpt<CpuBackend>,
    optimizer: OptimizerState,
    step: u64,
}

impl RankState {
    fn absorb(&mut self, shard: FinalWire) -> Result<(), ModelError> {
        for (name, _, data) in shard.stages.into_iter().flat_map(|(_, ts)| ts) {
            self.model.set_param(&name, &data)?;
        }
        self.optimizer.step = self.optimizer.step.max(shard.optimizer.step);
        self.optimizer.slots.extend(shard.optimizer.slots);
        Ok(())
    }
}

/// This rank on the mesh, and how its pipelines run.
struct Ctx<'a> {
    mesh: &'a Arc<TcpMesh>,
    rank: usize,
    clock: Clock,
    backend: CpuBackend,
}

/// One pipeline's transports, opened (registered on the mesh) before the step is released.
struct Links {
    tensors: Arc<dyn Transport<<CpuBackend as crate::tensor::Backend>::Buf>>,
    stats: Arc<dyn Transport<GradStats>>,
}

impl Ctx<'_> {
    fn link_err(&self, peer: usize, what: &'static str) -> impl Fn(LinkError) -> RlLaunchError {
        let (rank, mesh) = (self.rank, Arc::clone(self.mesh));
        move |source| match mesh.failure() {
            Some(reason) => RlLaunchError::Peer { rank, reason },
            None => RlLaunchError::Link {
                rank,
                peer,
                what,
                source,
            },
        }
    }

    fn rl_err(&self) -> impl Fn(RlError) -> RlLaunchError {
        let rank = self.rank;
        move |error| RlLaunchError::Rl { rank, error }
    }

    fn pipeline_err(&self) -> impl Fn(PipelineError) -> RlLaunchError {
        let rank = self.rank;
        move |error| RlLaunchError::Pipeline { rank, error }
    }

    fn links(&self) -> Links {
        Links {
            tensors: Arc::new(TcpTransport::new(
                self.mesh,
                TENSOR_CHANNEL,
                BufCodec(self.backend.clone()),
            )),
            stats: Arc::new(TcpTransport::new(self.mesh, STATS_CHANNEL, SerdeCodec)),
        }
    }

    /// Runs `steps` optimizer steps of `plan` from `first_step` as this rank, from `state`'s
    /// stages (fresh ones without), on `links`; returns the rank's report, final state and
    /// step log.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        job: &JobConfig,
        plan: &Plan,
        feed: Arc<StepFeed>,
        first_step: u64,
        steps: u64,
        state: Option<&RankState>,
        links: Links,
    ) -> Result<(RunReport, RankFinal, Vec<StepMetrics>), RlLaunchError> {
        let (rank, pp) = (self.rank, plan.num_ranks());
        let err = self.pipeline_err();
        feed.prefetch(first_step);
        let (progress, step_log) = channel();
        let shared = Arc::new(Shared::new(pp, feed, progress));
        // The other ranks step in their own processes: stand-ins close each step here.
        for step in first_step..first_step + steps {
            for _ in 1..pp {
                shared.stepped(step, 0.0);
            }
        }
        let mut compute = RankCompute::for_rank(
            job,
            plan,
            rank,
            self.backend.clone(),
            Arc::clone(&shared),
            first_step,
            steps,
        )
        .map_err(&err)?;
        if let Some(s) = state {
            compute.load_resumed(&s.model, &s.optimizer).map_err(&err)?;
        }
        let mut pipeline = Pipeline::new(PlanSource::Given(plan.clone()), self.clock)
            .iterations(steps)
            .step_mode(StepMode::default())
            .stats_transport(links.stats);
        if job.train.clip > 0.0 {
            pipeline = pipeline.max_grad_norm(f64::from(job.train.clip));
        }
        let report = pipeline
            .run_local_blocking(vec![(rank, compute)], links.tensors)
            .map_err(|e| match self.mesh.failure() {
                Some(reason) => RlLaunchError::Peer { rank, reason },
                None => err(e.into()),
            })?;
        let own = shared
            .take_own_final(rank)
            .ok_or_else(|| err(PipelineError::NoFinalState))?;
        Ok((report, own, step_log.try_iter().collect()))
    }

    /// The weight sync: every rank sends `own` to rank 0, which absorbs them into `state`.
    fn sync_weights(&self, own: FinalWire, state: &mut RankState) -> Result<(), RlLaunchError> {
        if self.rank != 0 {
            let bytes = frame::encode(&own).map_err(|e| RlLaunchError::BadFrame {
                rank: self.rank,
                peer: 0,
                what: "weights",
                reason: e.to_string(),
            })?;
            return self
                .mesh
                .send(0, RL_CHANNEL, &bytes)
                .map_err(self.link_err(0, "sending the weights"));
        }
        for peer in 1..self.mesh.world() {
            let bytes = self
                .mesh
                .recv(peer, RL_CHANNEL)
                .map_err(self.link_err(peer, "receiving the weights"))?;
            let shard: FinalWire = frame::decode(&bytes).map_err(|e| RlLaunchError::BadFrame {
                rank: 0,
                peer,
                what: "weights",
                reason: e.to_string(),
            })?;
            state
                .absorb(shard)
                .map_err(|e| self.pipeline_err()(e.into()))?;
        }
        Ok(())
    }
}

/// Runs `job`'s RL (`rl.steps` GRPO steps) as the mesh's rank, from `init` when given (every
/// rank passes the same checkpoint) or after `rl.warmup_steps` supervised steps. Rank 0 calls
/// `on_step` after each step and returns the final policy; the other ranks return `None`.
pub fn rl_rank(
    job: &JobConfig,
    mesh: &Arc<TcpMesh>,
    clock: Clock,
    init: Option<&Checkpoint>,
    mut on_step: impl FnMut(&RlLaunchStep),
) -> Result<Option<RlLaunchRun>, RlLaunchError> {
    let (rank, world) = (mesh.rank(), mesh.world());
    let backend = CpuBackend::new(1).map_err(|e| RlLaunchError::Rl {
        rank,
        error: ModelError::from(e).into(),
    })?;
    let ctx = Ctx {
        mesh,
        rank,
        clock,
        backend: backend.clone(),
    };
    let (rl_err, pipeline_err) = (ctx.rl_err(), ctx.pipeline_err());
    if job.dp != 1 {
        return Err(RlLaunchError::Replicas { dp: job.dp });
    }
    job.rl
        .validate(job.model.seq_len)
        .map_err(|e| rl_err(e.into()))?;
    if job.rl.kl_coef > 0.0 {
        return Err(RlLaunchError::Kl {
            kl_coef: job.rl.kl_coef,
        });
    }
    let first_update = init.map_or(job.rl.warmup_steps, |c| c.meta.step);
    let update = update_job_of(job, first_update);
    let trainer = PipelineTrainer::from_job(&update).map_err(&pipeline_err)?;
    let plan = trainer.plan();
    if plan.num_ranks() != world {
        return Err(RlLaunchError::World {
            plan: plan.num_ranks(),
            world,
        });
    }
    let whole = || Gpt::new(&job.model, backend.clone(), &Cut::Even(1));
    let mut state = match init {
        Some(c) => {
            let mut model = whole().map_err(|e| pipeline_err(e.into()))?;
            let mut optimizer = AdamW::new(adamw_config(&job.train));
            c.restore(&mut model, &mut optimizer, job.train.seed)
                .map_err(|e| rl_err(e.into()))?;
            let optimizer = optimizer
                .state(&backend)
                .map_err(|e| pipeline_err(e.into()))?;
            RankState {
                model,
                optimizer,
                step: c.meta.step,
            }
        }
        None => RankState {
            model: whole().map_err(|e| pipeline_err(e.into()))?,
            optimizer: OptimizerState::default(),
            step: 0,
        },
    };
    // This rank's stages after the last pipeline (sent to rank 0 at the next weight sync).
    let mut own = FinalWire::default();
    if init.is_none() {
        let sft = warm_up_job(job);
        if sft.train.steps == 0 {
            return Err(RlLaunchError::Untrained);
        }
        let sft_plan = PipelineTrainer::from_job(&sft)
            .map_err(&pipeline_err)?
            .plan()
            .clone();
        let data = StepData::new(sft.data.clone(), sft.model.seq_len, sft.train.seed)
            .map_err(|e| pipeline_err(e.into()))?;
        let feed = Arc::new(StepFeed::new(data, sft.train.clone()));
        let (_, fin, _) = ctx.run(&sft, &sft_plan, feed, 0, sft.train.steps, None, ctx.links())?;
        own = fin.into();
        // The rank's own slice of `own` is its state; the rest of its model is unused.
        let copy = FinalWire {
            stages: own.stages.clone(),
            optimizer: own.optimizer.clone(),
        };
        state.absorb(copy).map_err(|e| pipeline_err(e.into()))?;
        state.step = sft.train.steps;
    }

    let mut engine = match rank {
        0 => Some(PipelineRollouts::new(job).map_err(&rl_err)?),
        _ => None,
    };
    let tokenizer = Tokenizer::new();
    let mut steps = Vec::new();
    for step in 0..job.rl.steps {
        // Open this step's transports before the weight sync releases the step.
        let links = ctx.links();
        let synced = Instant::now();
        ctx.sync_weights(std::mem::take(&mut own), &mut state)?;
        let sync_seconds = synced.elapsed().as_secs_f64();
        let rolled = Instant::now();
        let (wire, figures) = match engine.as_mut() {
            Some(engine) => {
                let (wire, figures) =
                    rollout(job, &tokenizer, engine, &state.model, step).map_err(&rl_err)?;
                let bytes = frame::encode(&wire).map_err(|e| RlLaunchError::BadFrame {
                    rank,
                    peer: rank,
                    what: "rollouts",
                    reason: e.to_string(),
                })?;
                for peer in 1..world {
                    mesh.send(peer, RL_CHANNEL, &bytes)
                        .map_err(ctx.link_err(peer, "sending the rollouts"))?;
                }
                (wire, Some(figures))
            }
            None => {
                let bytes = mesh
                    .recv(0, RL_CHANNEL)
                    .map_err(ctx.link_err(0, "receiving the rollouts"))?;
                let wire: RolloutWire =
                    frame::decode(&bytes).map_err(|e| RlLaunchError::BadFrame {
                        rank,
                        peer: 0,
                        what: "rollouts",
                        reason: e.to_string(),
                    })?;
                (wire, None)
            }
        };
        let rollout_seconds = rolled.elapsed().as_secs_f64();
        let rollouts: Vec<Rollout> = wire
            .rollouts
            .into_iter()
            .map(|(prompt, generated)| Rollout { prompt, generated })
            .collect();
        let batches = update_batches(&rollouts, &wire.advantages).map_err(&rl_err)?;
        let feed = Arc::new(StepFeed::given([(state.step, batches)]));
        let updated = Instant::now();
        let (report, fin, log) =
            ctx.run(&update, plan, feed, state.step, 1, Some(&state), links)?;
        let update_seconds = updated.elapsed().as_secs_f64();
        own = fin.into();
        let copy = FinalWire {
            stages: own.stages.clone(),
            optimizer: own.optimizer.clone(),
        };
        state.absorb(copy).map_err(|e| pipeline_err(e.into()))?;
        state.step += 1;
        // The losses are known in the last stage's process only.
        let losses = match (rank, loss_rank(plan)) {
            (0, 0) => log,
            (0, from) => recv_metrics(mesh, from).map_err(|e| RlLaunchError::Peer {
                rank,
                reason: e.to_string(),
            })?,
            (r, from) if r == from => {
                send_metrics(mesh, &log).map_err(|e| RlLaunchError::Peer {
                    rank,
                    reason: e.to_string(),
                })?;
                Vec::new()
            }
            _ => Vec::new(),
        };
        if let Some(f) = figures {
            let m = losses.first();
            let line = RlLaunchStep {
                step,
                reward: f.reward,
                sequences: rollouts.len(),
                informative_groups: f.informative_groups,
                rollout_seconds: rollout_seconds - f.drafter_seconds,
                drafter_seconds: f.drafter_seconds,
                sync_seconds,
                update_seconds,
                speculation: f.speculation,
                acceptance_length: f.acceptance_length,
                surrogate_loss: m.map_or(f32::NAN, |m| m.loss),
                grad_norm: report
                    .steps
                    .first()
                    .map_or(f32::NAN, |s| s.grad_norm as f32),
                lr: m.map_or(f32::NAN, |m| m.lr),
            };
            on_step(&line);
            steps.push(line);
        }
    }
    // The last weight sync: rank 0 ends with the whole policy and optimizer.
    ctx.sync_weights(own, &mut state)?;
    if rank != 0 {
        // Leave only after rank 0 does: an exit now could reset the connection before rank
        // 0 has read this rank's weights.
        mesh.quiesce();
        if !mesh.wait_gone(0, FINAL_WAIT) {
            return Err(RlLaunchError::Peer {
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
    let checkpoint = Checkpoint::capture(&state.model, &optimizer, state.step, job.train.seed)
        .map_err(|e| rl_err(e.into()))?;
    Ok(Some(RlLaunchRun { checkpoint, steps }))
}

/// Rank 0's figures of a rollout.
struct RolloutFigures {
    reward: f64,
    informative_groups: usize,
    drafter_seconds: f64,
    speculation: bool,
    acceptance_length: Option<f64>,
}

/// RL step `step`'s prompts, rollouts under `policy`, rewards and advantages, as the
/// in-process trainer computes them.
fn rollout(
    job: &JobConfig,
    tok: &Tokenizer,
    engine: &mut PipelineRollouts,
    policy: &Gpt<CpuBackend>,
    step: u64,
) -> Result<(RolloutWire, RolloutFigures), RlError> {
    let rl = &job.rl;
    let (batch, rewards) = scored_rollouts(job, tok, engine, policy, step)?;
    let advantages = group_advantages(&rewards, rl.group)?;
    let figures = RolloutFigures {
        reward: rewards.iter().map(|&r| f64::from(r)).sum::<f64>() / rewards.len() as f64,
        informative_groups: advantages
            .chunks(rl.group)
            .filter(|g| g.iter().any(|&a| a != 0.0))
            .count(),
        drafter_seconds: batch.drafter_seconds,
        speculation: engine.speculative(),
        acceptance_length: batch.acceptance_length,
    };
    let wire = RolloutWire {
        rollouts: batch
            .rollouts
            .into_iter()
            .map(|r| (r.prompt, r.generated))
            .collect(),
        advantages,
    };
    Ok((wire, figures))
}
