//! One rank's pieces of a launched RL run ([`super::rl_rank_on`]): its place in the job
//! ([`Ctx`]: replica and pipeline rank on the mesh), one pipelined run of its stages, the
//! weight sync to rank 0, and rank 0's rollouts with the KL reference's log-probs.

use std::sync::Arc;
use std::sync::mpsc::channel;

use pipefill_actors::{Clock, GradStats, PlanSource, RunReport, Transport};

use super::channel::RL_CHANNEL;
use super::state::{Ended, RankState, Start};
use crate::comm::CommError;
use crate::comm::frame;
use crate::comm::link::PeerLink;
use crate::comm::tcp::TcpMesh;
use crate::comm::tcp_transport::{
    BufCodec, STATS_CHANNEL, SerdeCodec, TENSOR_CHANNEL, TcpTransport,
};
use crate::config::JobConfig;
use crate::model::Gpt;
use crate::model::ModelError;
use crate::pipeline::PipelineError;
use crate::pipeline::executor::{Links, RankStart, ReplicaLinks, Stepping};
use crate::pipeline::feed::StepFeed;
use crate::pipeline::shared::{RankFinal, Shared};
use crate::pipeline::{RankCompute, RankJob};
use crate::rl::RlError;
use crate::rl::prompts::PromptSource;
use crate::rl::step::{RolloutFigures, StepRollouts, generate};
use crate::rl::trainer_spec::PipelineRollouts;
use crate::rl::update::GrpoTokenLoss;
use crate::schedules::Plan;
use crate::tensor::Backend;
use crate::tensor::device::RankBackend;
use crate::train::StepMetrics;

/// This rank on the mesh, and how its pipelines run: global rank `replica × pp + prank`.
pub(super) struct Ctx<'a, B: RankBackend> {
    pub mesh: &'a Arc<TcpMesh>,
    pub rank: usize,
    pub replica: usize,
    /// The rank in its replica's pipeline.
    pub prank: usize,
    pub pp: usize,
    pub dp: usize,
    pub clock: Clock,
    pub backend: B,
}

/// One pipeline's transports, opened (registered on the mesh) before the step is released.
pub(super) struct Transports<B: Backend> {
    tensors: Arc<dyn Transport<B::Buf>>,
    stats: Arc<dyn Transport<GradStats>>,
}

impl<B: RankBackend> Ctx<'_, B> {
    pub fn link_err(&self, peer: usize, what: &'static str) -> impl Fn(CommError) -> RlError {
        let (rank, mesh) = (self.rank, Arc::clone(self.mesh));
        move |source| match mesh.failure() {
            Some(reason) => RlError::Peer { rank, reason },
            None => RlError::RankLink {
                rank,
                peer,
                what,
                source,
            },
        }
    }

    pub fn rl_err(&self) -> impl Fn(RlError) -> RlError {
        let rank = self.rank;
        move |error| RlError::OnRank {
            rank,
            error: Box::new(error),
        }
    }

    pub fn pipeline_err(&self) -> impl Fn(PipelineError) -> RlError {
        let rank = self.rank;
        move |error| RlError::RankPipeline {
            rank,
            error: Box::new(error),
        }
    }

    fn bad_frame(&self, peer: usize, what: &'static str) -> impl Fn(CommError) -> RlError {
        let rank = self.rank;
        move |error| RlError::BadFrame {
            rank,
            peer,
            what,
            error,
        }
    }

    /// The transports of this rank's replica's pipeline (mesh ranks `replica × pp ..`).
    pub fn transports(&self) -> Result<Transports<B>, RlError> {
        let base = self.replica * self.pp;
        let err = |error| RlError::Group {
            rank: self.rank,
            error,
        };
        let codec = BufCodec(self.backend.clone());
        Ok(Transports {
            tensors: Arc::new(
                TcpTransport::group(self.mesh, TENSOR_CHANNEL, codec, base, self.pp)
                    .map_err(err)?,
            ),
            stats: Arc::new(
                TcpTransport::group(self.mesh, STATS_CHANNEL, SerdeCodec, base, self.pp)
                    .map_err(err)?,
            ),
        })
    }

    /// Runs `steps` optimizer steps of `plan` (one replica's pipeline) from `first_step` as
    /// this rank, from `start`, on `links`; `feed` holds the whole batch of each step, of
    /// which a replica runs its share and all-reduces its gradients with the other replicas
    /// (launch train's [`RingGradSync`]). With `keep` the run ends with the rank alive
    /// ([`Ended::Kept`]), else with host copies of its stages. Returns the rank's report,
    /// what the run left and the step log.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        job: &JobConfig,
        plan: &Plan,
        feed: Arc<StepFeed>,
        (first_step, steps): (u64, u64),
        start: Start<'_, B>,
        keep: bool,
        transports: Transports<B>,
    ) -> Result<(RunReport, Ended<B>, Vec<StepMetrics>), RlError> {
        let (rank, prank) = (self.rank, self.prank);
        let err = self.pipeline_err();
        feed.prefetch(first_step);
        let (progress, step_log) = channel();
        let collectives = Links::mesh(
            self.mesh,
            job,
            plan,
            self.replica,
            Links::mesh_ring(self.mesh, self.dp, self.pp),
        );
        let shared = Arc::new(
            Shared::new(self.pp, feed, progress)
                .local_ranks(1)
                .with_replica(collectives.replica)
                .with_tie(collectives.tie),
        );
        let run = RankJob::new(job, plan, &shared, (first_step, steps));
        let start = match start {
            Start::Fresh => RankStart::Fresh,
            Start::Host(s) => RankStart::Resumed(&s.model, &s.optimizer),
            Start::Kept(parts) => RankStart::Kept(parts),
        };
        let mut compute =
            RankCompute::start(run, prank, self.backend.clone(), start).map_err(&err)?;
        let kept = keep.then(|| {
            let (tx, rx) = channel();
            compute.keep_into(tx);
            rx
        });
        let links = ReplicaLinks {
            tensors: Some(transports.tensors),
            stats: Some(transports.stats),
            ..ReplicaLinks::default()
        };
        let report = Stepping::of_job(job, self.clock, steps)
            .run(
                PlanSource::Given(plan.clone()),
                vec![(prank, compute)],
                links,
            )
            .map_err(|e| match self.mesh.failure() {
                Some(reason) => RlError::Peer { rank, reason },
                None => err(e.into()),
            })?;
        let ended = match kept {
            Some(rx) => rx.try_recv().ok().map(Ended::Kept),
            None => shared.take_own_final(prank).map(Ended::Exported),
        };
        let ended = ended.ok_or_else(|| err(PipelineError::NoFinalState))?;
        Ok((report, ended, step_log.try_iter().collect()))
    }

    /// The weight sync: every rank sends rank 0 its stages (replica 0's ranks; the other
    /// replicas hold the same bits and send an empty frame, which tells rank 0 they have
    /// opened the step's transports), and rank 0 takes them into `state`. Mid-run a kept
    /// rank sends its parameters only; the `last` sync sends the moments too (see
    /// [`super::state`]).
    pub fn sync_weights(&self, state: &mut RankState<B>, last: bool) -> Result<(), RlError> {
        let model_err = |e: ModelError| self.pipeline_err()(e.into());
        if self.rank != 0 {
            let own = if self.replica == 0 {
                state.sync_wire(last).map_err(model_err)?
            } else {
                RankFinal::default()
            };
            let bytes = frame::encode(&own).map_err(self.bad_frame(0, "weights"))?;
            return self
                .mesh
                .send(0, RL_CHANNEL, &bytes)
                .map_err(self.link_err(0, "sending the weights"));
        }
        state.refresh_own(last).map_err(model_err)?;
        for peer in 1..self.mesh.world() {
            let bytes = self
                .mesh
                .recv(peer, RL_CHANNEL)
                .map_err(self.link_err(peer, "receiving the weights"))?;
            let shard: RankFinal =
                frame::decode(&bytes).map_err(self.bad_frame(peer, "weights"))?;
            state.absorb(shard).map_err(model_err)?;
        }
        Ok(())
    }

    /// Step `step`'s rollouts: rank 0 (`engine` and its prompts) generates them under
    /// `policy` with the reference's log-probs when given ([`generate`]) and sends them to
    /// every rank, which receives them here. Rank 0 also returns their figures.
    pub fn exchange_rollouts(
        &self,
        job: &JobConfig,
        engine: Option<(&mut PipelineRollouts<B>, &PromptSource)>,
        models: (&Gpt<B>, Option<&mut Gpt<B>>),
        step: u64,
    ) -> Result<(StepRollouts, Option<RolloutFigures>), RlError> {
        let Some((engine, prompts)) = engine else {
            let bytes = self
                .mesh
                .recv(0, RL_CHANNEL)
                .map_err(self.link_err(0, "receiving the rollouts"))?;
            let rollouts = frame::decode(&bytes).map_err(self.bad_frame(0, "rollouts"))?;
            return Ok((rollouts, None));
        };
        let (rollouts, figures) =
            generate(job, prompts, engine, models, step, &mut |_| {}).map_err(self.rl_err())?;
        let bytes = frame::encode(&rollouts).map_err(self.bad_frame(0, "rollouts"))?;
        for peer in 1..self.mesh.world() {
            self.mesh
                .send(peer, RL_CHANNEL, &bytes)
                .map_err(self.link_err(peer, "sending the rollouts"))?;
        }
        Ok((rollouts, Some(figures)))
    }

    /// The mean k3 KL of the update over every replica (`own`: this rank's hook, whose
    /// forwards are its replica's when this is a last-stage rank): each replica's last
    /// stage sends its mean to rank 0, which weighs them by their `shares`' tokens.
    pub fn gather_kl(
        &self,
        own: Option<&GrpoTokenLoss>,
        loss_rank: usize,
        shares: &[Share],
    ) -> Result<Option<f64>, RlError> {
        let Some(own) = own else {
            return Ok(None);
        };
        if self.rank != 0 {
            if self.prank == loss_rank {
                let bytes =
                    frame::encode(&own.mean_kl()).map_err(self.bad_frame(0, "KL figure"))?;
                self.mesh
                    .send(0, RL_CHANNEL, &bytes)
                    .map_err(self.link_err(0, "sending the KL figure"))?;
            }
            return Ok(None);
        }
        let (mut sum, mut tokens) = (0.0, 0usize);
        for (d, share) in shares.iter().enumerate() {
            let mean = match d * self.pp + loss_rank {
                0 => own.mean_kl(),
                from => {
                    let bytes = self
                        .mesh
                        .recv(from, RL_CHANNEL)
                        .map_err(self.link_err(from, "receiving the KL figure"))?;
                    frame::decode::<Option<f64>>(&bytes)
                        .map_err(self.bad_frame(from, "KL figure"))?
                }
            };
            sum += mean.unwrap_or(0.0) * share.tokens as f64;
            tokens += share.tokens;
        }
        Ok((tokens > 0).then(|| sum / tokens as f64))
    }
}

/// One replica's share of an update step: the sum of its loss scales (as the runtime sums
/// them) and its completion tokens.
pub(super) struct Share {
    pub scale_sum: f32,
    /// Whether any scale is non-zero (else the share's loss term is 0).
    pub informative: bool,
    pub tokens: usize,
}

/// Each of `dp` replicas' [`Share`] of the step's micro-batches and loss scales.
pub(super) fn shares(batches: &[crate::data::MicroBatch], scales: &[f32], dp: usize) -> Vec<Share> {
    let per = batches.len() / dp;
    (0..dp)
        .map(|d| {
            let own = d * per..(d + 1) * per;
            Share {
                scale_sum: scales[own.clone()].iter().sum::<f32>(),
                informative: scales[own.clone()].iter().any(|&s| s != 0.0),
                tokens: batches[own]
                    .iter()
                    .map(|mb| {
                        let counted = mb.targets.iter();
                        counted
                            .filter(|&&t| t != crate::tensor::IGNORE_TARGET)
                            .count()
                    })
                    .sum(),
            }
        })
        .collect()
}
