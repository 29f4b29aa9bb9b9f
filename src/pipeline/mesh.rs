//! Pipelined training of one rank in a multi-process job: [`train_rank`].
//!
//! Every process builds the same plan from the same job and runs only its own rank's
//! [`RankCompute`] through the one executor ([`super::executor`]); activations, gradients
//! and gradient statistics travel on the TCP mesh ([`TcpTransport`]). With `dp` > 1 the
//! world is `dp` replicas of the plan's ranks (global rank = replica × pp + pipeline
//! rank): each replica's pipeline runs its share of every step's micro-batches among its
//! own ranks, and every rank all-reduces its gradients with the same rank of the other
//! replicas ([`RingGradSync`](crate::comm::collective::RingGradSync) over the mesh) before the optimizer step. The computation of
//! each rank is the in-process pipeline's, action for action, so the parameters after K
//! steps are bitwise those of the in-process run of the same job (f32 on the CPU).
//!
//! Each rank computes on the job's `device` (the `device` module): the CPU, or (feature `cuda`) the
//! GPU of its local rank, where the ranks agree on the transport `transport` asks for
//! (`auto`: NCCL where every rank can use it) and replicas all-reduce over NCCL.
//!
//! After the last step every rank sends its final parameters and optimizer moments to rank
//! 0 on the control channel, and rank 0 assembles the checkpoint in the reference
//! trainer's format. Every rank then sends its profile (spans on its own clock, with the
//! offset to rank 0's measured at join) and the last stage's process its step log (only it
//! knows the losses); rank 0 merges them ([`profile`]) into the run
//! directory files a single-process run writes.
//!
//! Checkpoints (`shards`): every rank of replica 0 writes its own shard after every
//! `checkpoint_every`-th step and after the last one, under the run directory rank 0 chose
//! ([`RankRun::run_dir`]); rank 0 writes each manifest once every shard is acknowledged. A
//! resumed rank reads only its own shard ([`RankResume`]).

pub mod auto;
mod device;
mod fill;
pub mod profile;
mod shards;

use crate::comm::CommError;
use crate::pipeline::error::PipelineError;
pub use fill::{FILL_CHANNEL, LaunchFill, drafter_of};
pub use shards::{CHECKPOINT_CHANNEL, RankResume, agree_run_dir, layout};

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::channel;
use std::time::Duration;

use auto::{AutoChoice, AutoSwitch};
use pipefill_actors::{Clock, GradStats, RunReport, Transport};
use profile::{PROFILE_CHANNEL, loss_rank, rank_profile, recv_metrics, send_metrics, sync_clock};

use crate::comm::frame;
use crate::comm::link::PeerLink;
use crate::comm::tcp::TcpMesh;
use crate::comm::tcp_transport::{CONTROL_CHANNEL, STATS_CHANNEL, SerdeCodec, TcpTransport};
use crate::config::JobConfig;
use crate::data::StepData;
use crate::model::checkpoint::Checkpoint;
use crate::model::checkpoint::retain::Retention;
use crate::model::checkpoint::sharded::param_stages;
use crate::pipeline::executor::{Links, RankStart, ReplicaLinks, Stepping};
use crate::pipeline::feed::StepFeed;
use crate::pipeline::shared::{Checkpointing, RankCheckpointer, RankFinal, Shared};
use crate::pipeline::{RankCompute, RankJob};
use crate::profile::merge::{MergedProfile, gather_profiles, merge, send_profile};
use crate::schedules::Plan;
use crate::tensor::Backend;
use crate::tensor::device::Device;
use crate::train::StepMetrics;

/// How long a rank waits for rank 0 to have gathered every final state.
const FINAL_WAIT: Duration = Duration::from_secs(120);

/// That a launch of `world` processes runs `dp` replicas of a plan of `ranks` ranks, one
/// rank per process (global rank = replica × ranks + pipeline rank).
pub fn check_world(ranks: usize, dp: usize, world: usize) -> Result<(), PipelineError> {
    match ranks * dp == world {
        true => Ok(()),
        false => Err(PipelineError::World { ranks, dp, world }),
    }
}

/// What one rank's run produced.
#[derive(Debug)]
pub struct RankRun {
    pub rank: usize,
    /// This process's ranks' measured timelines and optimizer steps.
    pub report: RunReport,
    /// What the ranks of an auto-scheduled run measured and switched to.
    pub auto: Option<AutoChoice>,
    /// The whole model's final checkpoint (rank 0 only).
    pub checkpoint: Option<Checkpoint>,
    /// Every rank's spans on rank 0's clock (rank 0 only).
    pub merged: Option<MergedProfile>,
    /// The step log with the losses (rank 0 only; the gradient norm is the global one).
    pub metrics: Vec<StepMetrics>,
    /// The run directory every rank agreed on (rank 0's choice).
    pub run_dir: PathBuf,
    /// The sharded checkpoints this rank wrote its shard of, in step order (on rank 0: the
    /// checkpoints completed, manifest written); empty on the ranks of other replicas.
    pub checkpoints: Vec<PathBuf>,
    /// This rank's drafter replica after the run (replica 0's ranks, `filler = "drafter"`).
    pub drafter: Option<crate::model::drafter::DrafterWeights>,
}

/// Runs `steps` optimizer steps of `job`'s `plan` as the mesh's rank on `device` (the
/// job's `device` on this process's local rank), from `resume` when given, saving sharded
/// checkpoints under the run directory (`job.out_dir`, as rank 0 chooses it). Every
/// process of the job calls it with the same job and plan.
pub fn train_rank(
    job: &JobConfig,
    plan: &Plan,
    mesh: &Arc<TcpMesh>,
    clock: Clock,
    steps: u64,
    resume: Option<&RankResume>,
    device: Device,
) -> Result<RankRun, PipelineError> {
    let (rank, world, pp, dp) = (mesh.rank(), mesh.world(), plan.num_ranks(), job.dp);
    check_world(pp, dp, world)?;
    // Global rank = replica × pp + pipeline rank (RingGradSync's numbering).
    let at = device::MeshRank {
        rank,
        replica: rank / pp,
        pp,
        dp,
    };
    let asked = Asked {
        job,
        plan,
        mesh,
        clock,
        steps,
        resume,
    };
    match device {
        Device::Cpu { threads } => {
            let links = device::cpu_links(mesh, job.transport, at, threads, job.train.precision)?;
            run_rank(asked, links)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda { ordinal } => {
            let links = device::cuda_links(mesh, job.transport, at, ordinal, job.train.precision)?;
            run_rank(asked, links)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { ordinal } => Err(device::cuda_unavailable(at, ordinal)),
    }
}

/// What [`train_rank`] was asked, handed on to its backend-generic part.
struct Asked<'a> {
    job: &'a JobConfig,
    plan: &'a Plan,
    mesh: &'a Arc<TcpMesh>,
    clock: Clock,
    steps: u64,
    resume: Option<&'a RankResume>,
}

/// [`train_rank`] on `links`' backend and transports.
fn run_rank<B: Backend>(
    asked: Asked<'_>,
    links: device::RankLinks<B>,
) -> Result<RankRun, PipelineError> {
    let Asked {
        job, plan, mesh, ..
    } = asked;
    let (clock, steps, resume) = (asked.clock, asked.steps, asked.resume);
    let device::MeshRank {
        rank,
        replica,
        pp,
        dp,
    } = links.at;
    let (world, prank) = (mesh.world(), rank % pp);
    let pipeline_err = |error: PipelineError| PipelineError::OnRank {
        rank,
        error: Box::new(error),
    };
    let first_step = resume.map_or(0, RankResume::step);
    let peer_err = |e: CommError| PipelineError::Peer {
        rank,
        reason: mesh.failure().unwrap_or_else(|| e.to_string()),
    };
    let run_dir = agree_run_dir(mesh, job.out_dir.as_deref()).map_err(peer_err)?;
    let data = StepData::new(job.data.clone(), job.model.seq_len, job.train.seed)
        .map_err(|e| pipeline_err(e.into()))?;
    let feed = Arc::new(StepFeed::new(data, job.train.clone()));
    feed.prefetch(first_step);
    // The step log needs every rank's losses and norms, which stay in their processes;
    // this rank's steps are reported by the runtime instead (see the module docs).
    let (progress, step_log) = channel();
    let device::RankLinks {
        backend,
        tensors,
        sync,
        ..
    } = links;
    let collectives = Links::mesh(mesh, job, plan, replica, sync);
    let config_hash = job.fingerprint();
    // As in-process: a resumed run keeps the newest checkpoints across the resume.
    let retention = match first_step {
        0 => Retention::new(job.checkpoint_keep),
        step => Retention::continuing(job.checkpoint_keep, &run_dir, &config_hash, step)
            .map_err(|e| pipeline_err(e.into()))?,
    };
    let checkpointing = Checkpointing {
        every: job.checkpoint_every,
        run_dir: run_dir.clone(),
        model: job.model.clone(),
        data_seed: job.train.seed,
        layout: layout(job, plan),
        stage_of: param_stages(&job.model, plan.stages).map_err(|e| pipeline_err(e.into()))?,
        config_hash,
        retention: Arc::new(retention),
    };
    // Replica 0's ranks write the shards; the others hold the same state.
    let saver = (replica == 0).then(|| {
        Arc::new(shards::MeshCheckpointer::start(
            Arc::clone(mesh),
            checkpointing.clone(),
        ))
    });
    // Only this rank steps here: its step log closes when it has stepped (with the losses
    // in the last stage's process; the norm of own gradients only, replaced by the global one).
    let mut shared = Shared::new(pp, feed, progress)
        .local_ranks(1)
        .with_replica(collectives.replica)
        .with_tie(collectives.tie)
        .with_checkpoints(Some(checkpointing));
    if let Some(saver) = &saver {
        shared = shared.with_rank_checkpointer(Arc::clone(saver) as Arc<dyn RankCheckpointer>);
    }
    let shared = Arc::new(shared);
    let resumed = resume
        .map(|r| r.rebuilt(job))
        .transpose()
        .map_err(pipeline_err)?;
    let start = match &resumed {
        Some((gpt, state)) => RankStart::Resumed(gpt, state),
        None => RankStart::Fresh,
    };
    let run = RankJob::new(job, plan, &shared, (first_step, steps));
    let mut compute = RankCompute::start(run, prank, backend, start).map_err(pipeline_err)?;
    drop(resumed);
    // The drafter lives in replica 0's pipeline ([`fill`]).
    let filling = match (job.filler, replica) {
        (crate::config::Filler::Drafter, 0) => Some(LaunchFill::join(
            job,
            plan,
            mesh,
            &mut compute,
            first_step,
            resume,
        )?),
        _ => None,
    };
    if let (Some(saver), Some(filling)) = (&saver, &filling) {
        saver.save_drafter(Arc::clone(filling));
    }

    let transport_err = |error| PipelineError::Transport { rank, error };
    let stats: Arc<dyn Transport<GradStats>> = Arc::new(
        TcpTransport::group(mesh, STATS_CHANNEL, SerdeCodec, replica * pp, pp)
            .map_err(transport_err)?,
    );
    // schedule = "auto": ZB-H1, then the plan of the costs every rank measured (super::auto).
    let auto = AutoSwitch::for_job(job, plan, clock);
    let link = Arc::clone(mesh) as Arc<dyn PeerLink>;
    let (source, compute) = auto::plan_source(auto.as_ref(), plan, link, compute)
        .map_err(|e| pipeline_err(e.into()))?;
    let stepping = Stepping {
        replan_agrees: true,
        ..Stepping::of_job(job, clock, steps)
    };
    let links = ReplicaLinks {
        tensors: Some(tensors),
        stats: Some(stats),
        fillers: filling.iter().map(|f| f.filler()).collect(),
        listener: None,
    };
    let profile_err = |error| PipelineError::Profile { rank, error };
    let mut clock_sync = sync_clock(mesh, clock.is_virtual()).map_err(profile_err)?;
    clock_sync.at_run_start();
    let report = stepping
        .run(source, vec![(prank, compute)], links)
        .map_err(|e| {
            // A failed checkpoint write stopped the run: its error names the file and the
            // last complete checkpoint.
            if saver.as_ref().is_some_and(|s| s.failed())
                && let Err(write) = shared.join_checkpoints()
            {
                return pipeline_err(write);
            }
            match mesh.failure() {
                // The mesh's failure names the rank that died; the runtime's error only
                // says which action noticed.
                Some(reason) => PipelineError::Peer { rank, reason },
                None => pipeline_err(e.into()),
            }
        })?;

    let own = shared
        .take_own_final(prank)
        .ok_or_else(|| pipeline_err(PipelineError::NoFinalState))?;
    let drafter = filling.as_ref().map(|f| f.finish()).transpose()?;
    // The final checkpoint, unless the last step was a periodic one.
    let last_step = first_step + steps - 1;
    if let Some(saver) = saver.as_ref().filter(|_| !shared.checkpoint_due(last_step)) {
        saver.deposit(last_step, prank, own.clone());
    }
    let checkpoints = shared
        .join_checkpoints()
        .map_err(|e| match mesh.failure() {
            Some(reason) => PipelineError::Peer { rank, reason },
            None => pipeline_err(e),
        })?;
    let gather = |source| PipelineError::Gather { rank, source };
    if rank != 0 {
        let bytes = frame::encode(&own).map_err(|e| {
            gather(CommError::Protocol {
                peer: 0,
                reason: e.to_string(),
            })
        })?;
        // Replicas end bitwise equal: replica 0's ranks stand for the others.
        if replica == 0 {
            mesh.send(0, CONTROL_CHANNEL, &bytes).map_err(gather)?;
        }
        // Every replica's ranks are profiled (one row per mesh rank in the merged trace).
        send_profile(
            mesh.as_ref(),
            PROFILE_CHANNEL,
            &rank_profile(rank, prank, &report, &clock_sync),
        )
        .map_err(profile_err)?;
        if prank == loss_rank(plan) {
            let log: Vec<StepMetrics> = step_log.try_iter().collect();
            send_metrics(mesh, &log).map_err(profile_err)?;
        }
        // Leave only after rank 0 does (it leaves once it holds every final state): an
        // exit now could reset the connection before rank 0 has read this rank's state.
        mesh.quiesce();
        if !mesh.wait_gone(0, FINAL_WAIT) {
            return Err(PipelineError::Peer {
                rank,
                reason: mesh.failure().unwrap_or_else(|| {
                    format!("rank 0 did not confirm the final state within {FINAL_WAIT:?}")
                }),
            });
        }
        return Ok(RankRun {
            rank,
            report,
            auto: auto.as_ref().and_then(AutoSwitch::choice),
            checkpoint: None,
            merged: None,
            metrics: Vec::new(),
            run_dir,
            checkpoints,
            drafter,
        });
    }
    let mut finals = vec![own];
    for from in 1..pp {
        let bytes = mesh.recv(from, CONTROL_CHANNEL).map_err(gather)?;
        let fin: RankFinal =
            frame::decode(&bytes).map_err(|error| PipelineError::BadFinal { rank, from, error })?;
        finals.push(fin);
    }
    let own_profile = rank_profile(rank, prank, &report, &clock_sync);
    let profiles =
        gather_profiles(mesh.as_ref(), PROFILE_CHANNEL, own_profile).map_err(profile_err)?;
    let mut logs = Vec::with_capacity(dp);
    for d in 0..dp {
        logs.push(match d * pp + loss_rank(plan) {
            0 => step_log.try_iter().collect(),
            from => recv_metrics(mesh, from).map_err(profile_err)?,
        });
    }
    let mut metrics = crate::pipeline::executor::whole_batch(logs);
    // Every rank's work is done: say goodbye, which lets the others exit.
    mesh.close().map_err(gather)?;
    for m in &mut metrics {
        if let Some(s) = report.steps.get((m.step - first_step) as usize) {
            m.grad_norm = s.grad_norm as f32;
        }
    }
    let mut merged = merge(&profiles, world)
        .map_err(profile_err)?
        .with_pipeline(plan);
    if filling.is_some() {
        merged.filling = Some(LaunchFill::measure(&merged));
    }
    let (params, optimizer) = RankFinal::merge(finals);
    let checkpoint = crate::model::checkpoint::sharded::from_owned_state(
        job.model.clone(),
        job.train.seed,
        first_step + steps,
        params,
        optimizer,
    );
    Ok(RankRun {
        rank,
        report,
        auto: auto.as_ref().and_then(AutoSwitch::choice),
        checkpoint: Some(checkpoint),
        merged: Some(merged),
        metrics,
        run_dir,
        checkpoints,
        drafter,
    })
}
