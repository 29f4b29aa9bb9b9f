//! The one executor: how the ranks a process owns are built and stepped.
//!
//! Every run goes through here, whatever it is: `pipefill train` with every rank in this
//! process (one replica or `dp` of them, each a group of threads), a launched rank, the RL
//! update in process or launched. What differs between them is only where the ranks are and
//! what carries their tensors, gradient statistics and gradient sums (their [`Links`]):
//! in-process channels, or the mesh (TCP, NCCL). So:
//!
//! - `RankCompute::start` is the one way a rank is built (`RankStart`: fresh, from a
//!   rebuilt model, or from a kept rank's parts);
//! - `Stepping::run` is the one place that builds the actor runtime's
//!   [`Pipeline`] and steps a replica's local ranks over their links;
//! - [`Links::in_process`] makes the links of `dp` replicas whose ranks all live here, so
//!   `dp × stages` runs in one process as it runs launched (the same ring all-reduce, over
//!   in-process links instead of the mesh: the same sums in the same order, bitwise);
//! - [`whole_batch`] merges the replicas' step logs into the whole batch's.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Duration;

use pipefill_actors::{
    BubbleFiller, Clock, GradStats, InProcess, IterationProfile, Pipeline, PlanSource, RunReport,
    RuntimeError, StageCompute, StepMode, Transport,
};

use super::compute::{RankCompute, RankJob, RankParts};
use super::shared::{Replica, Shared};
use crate::comm::collective::{GRAD_CHANNEL, GradSync, RingGradSync, TIE_CHANNEL};
use crate::comm::link::{InProcessLink, PeerLink};
use crate::config::JobConfig;
use crate::model::ModelError;
use crate::model::{Gpt, OptimizerState};
use crate::pipeline::error::PipelineError;
use crate::schedules::Plan;
use crate::tensor::{Backend, CpuBackend};
use crate::train::StepMetrics;

/// How a rank starts.
pub(crate) enum RankStart<'s, B: Backend, G: Backend = CpuBackend> {
    /// The job's initial model (its seed's random initialisation).
    Fresh,
    /// A model rebuilt from a checkpoint ([`crate::model::checkpoint::Checkpoint::rebuild`])
    /// and its optimizer moments: the rank takes its own stages of them.
    Resumed(&'s Gpt<G>, &'s OptimizerState),
    /// A kept rank of an earlier run ([`RankCompute::keep_into`]): its chunks and
    /// optimizer, moved, not copied.
    Kept(RankParts<B>),
}

impl<B: Backend> RankCompute<B> {
    /// Rank `rank` of `run.plan` on `backend`, from `start`: the only way a rank is built.
    pub(crate) fn start<G: Backend>(
        run: RankJob<'_>,
        rank: usize,
        backend: B,
        start: RankStart<'_, B, G>,
    ) -> Result<Self, PipelineError> {
        match start {
            RankStart::Fresh => Self::for_rank(run, rank, backend),
            RankStart::Resumed(model, state) => Self::resumed(run, rank, backend, (model, state)),
            RankStart::Kept(parts) => {
                if parts.rank != rank {
                    return Err(PipelineError::Config {
                        field: "schedule",
                        reason: format!("rank {rank} was handed rank {}'s kept parts", parts.rank),
                    });
                }
                Self::from_parts(run, parts)
            }
        }
    }
}

/// How every replica of a run steps: the runtime's settings that are the job's, not the
/// replica's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stepping {
    pub clock: Clock,
    pub steps: u64,
    pub step_mode: StepMode,
    /// The job's gradient clipping norm (`train.clip`; 0: none).
    pub clip: f32,
    /// A re-planning source agrees with the other processes itself (launched `auto`).
    pub replan_agrees: bool,
    /// The job shards its optimizer (`optimizer.shard`): every step is taken at the end of
    /// its iteration ([`StepMode::Barrier`]), whatever `step_mode` says. Post-validation
    /// defers a step whose statistics are late by the rank's own clock, and the runtime
    /// settles the last deferred steps rank by rank: a rank of one replica then waits in the
    /// step's all-gather for a rank of the other that waits to be settled after a rank
    /// that waits in turn for the first replica (seen as a hang at the last step).
    pub sharded: bool,
}

impl Stepping {
    /// `steps` steps of `job` timed by `clock`, with the runtime's default step mode.
    pub(crate) fn of_job(job: &JobConfig, clock: Clock, steps: u64) -> Self {
        Stepping {
            clock,
            steps,
            step_mode: StepMode::default(),
            clip: job.train.clip,
            replan_agrees: false,
            sharded: crate::config::optimizer::OptimizerConfig::sharded(job),
        }
    }

    /// Steps one replica's `local` ranks (`(pipeline rank, compute)`) over `links` from
    /// `source`: the one place the actor runtime's [`Pipeline`] is built.
    pub(crate) fn run<C: StageCompute>(
        &self,
        source: PlanSource,
        local: Vec<(usize, C)>,
        links: ReplicaLinks<C::Tensor>,
    ) -> Result<RunReport, RuntimeError> {
        let mode = match self.sharded {
            true => StepMode::Barrier,
            false => self.step_mode,
        };
        let mut pipeline = Pipeline::new(source, self.clock)
            .iterations(self.steps)
            .step_mode(mode);
        if self.clip > 0.0 {
            pipeline = pipeline.max_grad_norm(f64::from(self.clip));
        }
        if self.replan_agrees {
            pipeline = pipeline.replanner_agrees();
        }
        if let Some(stats) = links.stats {
            pipeline = pipeline.stats_transport(stats);
        }
        if !links.fillers.is_empty() {
            pipeline = pipeline.fillers(links.fillers);
        }
        if let Some(listener) = links.listener {
            pipeline = pipeline.on_iteration(listener);
        }
        let tensors = links
            .tensors
            .unwrap_or_else(|| Arc::new(InProcess::new(local.len())));
        pipeline.run_local_blocking(local, tensors)
    }
}

/// What one replica's local ranks step over, beside their computes.
pub(crate) struct ReplicaLinks<T> {
    /// Activations and gradients between the replica's ranks (`None`: every rank is local,
    /// in-process channels).
    pub tensors: Option<Arc<dyn Transport<T>>>,
    /// The ranks' gradient statistics (`None`: in-process).
    pub stats: Option<Arc<dyn Transport<GradStats>>>,
    /// One bubble filler per local rank, or none.
    pub fillers: Vec<Box<dyn BubbleFiller>>,
    /// Where each iteration's measured profile goes.
    pub listener: Option<Sender<IterationProfile>>,
}

impl<T> Default for ReplicaLinks<T> {
    fn default() -> Self {
        ReplicaLinks {
            tensors: None,
            stats: None,
            fillers: Vec::new(),
            listener: None,
        }
    }
}

/// The collectives of one replica: its place among the replicas with their gradient
/// all-reduce, and the tied embedding's sum between its first and last stage.
#[derive(Clone, Default)]
pub struct Links {
    pub replica: Option<Replica>,
    pub tie: Option<Arc<dyn GradSync>>,
    /// The replica's ends of the in-process links the all-reduce runs over: closed when
    /// the replica fails, so that no other replica waits for it.
    pub ends: Vec<Arc<dyn PeerLink>>,
}

impl Links {
    /// The collectives of `dp` replicas of `plan` whose ranks all live in this process
    /// (global rank = replica × pp + pipeline rank): the ring all-reduce between replicas
    /// and the tied embedding's sum, over in-process links.
    pub fn in_process(job: &JobConfig, plan: &Plan, dp: usize) -> Vec<Links> {
        let pp = plan.num_ranks();
        let ends: Vec<Arc<dyn PeerLink>> = InProcessLink::group(dp * pp)
            .into_iter()
            .map(|l| Arc::new(l) as Arc<dyn PeerLink>)
            .collect();
        (0..dp)
            .map(|d| Links {
                replica: (dp > 1).then(|| Replica {
                    index: d,
                    count: dp,
                    sync: Arc::new(RingGradSync::new(
                        ends[d * pp..(d + 1) * pp].to_vec(),
                        dp,
                        pp,
                        GRAD_CHANNEL,
                    )),
                }),
                tie: Shared::tie_in_process(&job.model, plan),
                ends: ends[d * pp..(d + 1) * pp].to_vec(),
            })
            .collect()
    }
}

impl Links {
    /// The collectives of replica `replica` of the job's `dp` pipelines of `plan` whose
    /// ranks are the mesh's (global rank = replica × pp + pipeline rank): `sync` between the
    /// replicas (the device's: NCCL's, or the ring over the mesh), and the tied embedding's
    /// sum between the first and last stage over the mesh.
    pub fn mesh(
        mesh: &Arc<crate::comm::tcp::TcpMesh>,
        job: &JobConfig,
        plan: &Plan,
        replica: usize,
        sync: Option<Arc<dyn GradSync>>,
    ) -> Links {
        let link = || vec![Arc::clone(mesh) as Arc<dyn PeerLink>];
        let pp = plan.num_ranks();
        Links {
            replica: sync.map(|sync| Replica {
                index: replica,
                count: job.dp,
                sync,
            }),
            tie: super::shared::tie_ranks(&job.model, plan).map(|pair| {
                Arc::new(RingGradSync::tied(link(), pp, pair, TIE_CHANNEL)) as Arc<dyn GradSync>
            }),
            ends: Vec::new(),
        }
    }

    /// The ring all-reduce between `dp` replicas of `pp` ranks over the mesh (`None` for one).
    pub fn mesh_ring(
        mesh: &Arc<crate::comm::tcp::TcpMesh>,
        dp: usize,
        pp: usize,
    ) -> Option<Arc<dyn GradSync>> {
        (dp > 1).then(|| {
            let link = vec![Arc::clone(mesh) as Arc<dyn PeerLink>];
            Arc::new(RingGradSync::new(link, dp, pp, GRAD_CHANNEL)) as Arc<dyn GradSync>
        })
    }
}

/// The whole batch's step log from each replica's (`logs[d]`: replica `d`'s, in step
/// order): each step's loss weighted by the replicas' tokens. The gradient norm is every
/// replica's (they all-reduce before they measure it).
pub fn whole_batch(logs: Vec<Vec<StepMetrics>>) -> Vec<StepMetrics> {
    let mut logs = logs.into_iter();
    let Some(mut whole) = logs.next() else {
        return Vec::new();
    };
    let rest: Vec<Vec<StepMetrics>> = logs.collect();
    for (i, m) in whole.iter_mut().enumerate() {
        let replicas: Vec<&StepMetrics> = rest.iter().filter_map(|l| l.get(i)).collect();
        *m = whole_step(m, &replicas);
    }
    whole
}

/// One step of the whole batch from its replicas' (`first`, then `rest`).
pub(crate) fn whole_step(first: &StepMetrics, rest: &[&StepMetrics]) -> StepMetrics {
    let mut weighted = f64::from(first.loss) * first.tokens as f64;
    let mut tokens = first.tokens;
    for other in rest {
        weighted += f64::from(other.loss) * other.tokens as f64;
        tokens += other.tokens;
    }
    StepMetrics {
        loss: (weighted / tokens.max(1) as f64) as f32,
        tokens,
        ..first.clone()
    }
}

/// What a resumed rank starts from, rebuilt from `checkpoint` (one copy of the model on the
/// host, from which each rank takes its stages): with `whole` every parameter of the job's
/// model, checked against the job (model, data seed, each tensor); else a rank's own shard
/// (its stages' parameters only: the manifest's fingerprint has checked the job). The
/// optimizer moments go to the ranks as they are (each rank's optimizer checks its share).
pub(crate) fn rebuild(
    job: &JobConfig,
    checkpoint: &crate::model::checkpoint::Checkpoint,
    whole: bool,
) -> Result<(Gpt<CpuBackend>, OptimizerState), PipelineError> {
    use crate::model::Cut;
    use crate::model::checkpoint::{ADAM_M_PREFIX, ADAM_V_PREFIX, MASTER_PREFIX};
    let be = CpuBackend::new(1).map_err(ModelError::from)?;
    // Blank: every parameter the rank uses is set from the checkpoint.
    let mut gpt = Gpt::blank(&job.model, be, &Cut::Even(1))?;
    if whole {
        checkpoint.restore_model(&mut gpt, job.train.seed)?;
    } else {
        let moment = |n: &str| {
            [ADAM_M_PREFIX, ADAM_V_PREFIX, MASTER_PREFIX]
                .iter()
                .any(|p| n.starts_with(p))
        };
        for t in checkpoint.tensors.iter().filter(|t| !moment(&t.name)) {
            gpt.set_param(&t.name, &t.data)?;
        }
    }
    Ok((gpt, checkpoint.optimizer_state()?))
}

/// The step logs of a process's replicas, merged as they arrive: a step is handed over
/// once every replica has closed it ([`whole_step`]; one replica's passes as it is).
pub(crate) struct ReplicaSteps {
    receivers: Vec<Receiver<StepMetrics>>,
    /// Step → each replica's metrics, by replica.
    pending: BTreeMap<u64, Vec<Option<StepMetrics>>>,
}

impl ReplicaSteps {
    /// Over each replica's progress channel, replica 0's first.
    pub(crate) fn new(receivers: Vec<Receiver<StepMetrics>>) -> Self {
        ReplicaSteps {
            receivers,
            pending: BTreeMap::new(),
        }
    }

    /// Waits up to `timeout` for a step of the first replica, takes what every replica has
    /// sent, and hands over the steps now whole (`None`: none).
    pub(crate) fn wait(&mut self, timeout: Duration) -> Option<Vec<StepMetrics>> {
        let first = self.receivers.first()?.recv_timeout(timeout).ok();
        let mut arrived: Vec<(usize, StepMetrics)> = first.map(|m| (0, m)).into_iter().collect();
        for (d, rx) in self.receivers.iter().enumerate() {
            arrived.extend(rx.try_iter().map(|m| (d, m)));
        }
        let dp = self.receivers.len();
        for (d, m) in arrived {
            // By replica: the whole step's loss is summed replica by replica.
            let step = m.step;
            self.pending.entry(step).or_insert_with(|| vec![None; dp])[d] = Some(m);
        }
        let whole: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, s)| s.iter().all(Option::is_some))
            .map(|(&step, _)| step)
            .collect();
        let steps: Vec<StepMetrics> = whole
            .into_iter()
            .filter_map(|step| merged(self.pending.remove(&step)?))
            .collect();
        (!steps.is_empty()).then_some(steps)
    }

    /// The steps still pending after every replica has ended (a replica that stopped early
    /// leaves its steps partial: they are handed over as far as they are known).
    pub(crate) fn drain(&mut self) -> Vec<StepMetrics> {
        let mut steps = self.wait(Duration::ZERO).unwrap_or_default();
        steps.extend(
            std::mem::take(&mut self.pending)
                .into_values()
                .filter_map(merged),
        );
        steps
    }
}

/// One step from the replicas' metrics that arrived (`None`: none did).
fn merged(replicas: Vec<Option<StepMetrics>>) -> Option<StepMetrics> {
    let mut known = replicas.into_iter().flatten();
    let first = known.next()?;
    let rest: Vec<StepMetrics> = known.collect();
    Some(match rest.is_empty() {
        true => first,
        false => whole_step(&first, &rest.iter().collect::<Vec<_>>()),
    })
}
