//! [`PipelineError`]: what can go wrong setting up or running a pipelined job, in process or
//! on a launched rank (its mesh, its final state, the drafter in its bubbles).

use crate::comm::CommError;
use crate::model::ModelError;
use crate::profile::ProfileError;

/// What can go wrong setting up or running a pipelined job.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The job and the plan do not fit together; names the field or figure.
    #[error("pipeline setup: `{field}` {reason}")]
    Config { field: &'static str, reason: String },
    /// A plan action names a stage this rank does not hold.
    #[error("rank {rank} holds no stage {stage}")]
    NotHere { rank: usize, stage: u32 },
    /// A plan action names a micro-batch the step does not have.
    #[error("micro-batch {microbatch} does not exist: the step has {have}")]
    NoMicroBatch { microbatch: u32, have: usize },
    /// A stage produced something the pipeline cannot use.
    #[error("stage {stage}: {reason}")]
    Stage { stage: u32, reason: String },
    /// The sharded optimizer's exchange between replicas failed, or its state does not fit.
    #[error("sharded optimizer (optimizer.shard) of rank {rank}: {reason}")]
    Shard { rank: usize, reason: String },
    /// The runtime ran a rank's optimizer steps out of order.
    #[error("rank {rank}: optimizer step of iteration {got}, expected iteration {expected}")]
    OutOfOrder {
        rank: usize,
        expected: u64,
        got: u64,
    },
    /// The run was stopped (a periodic checkpoint could not be written, or the caller
    /// asked): the rank ended at the end of its step.
    #[error(
        "rank {rank} stopped: the run was stopped (a checkpoint or metrics write failed, or \
         the caller asked)"
    )]
    Stopped { rank: usize },
    /// A rank never handed over its final parameters.
    #[error("the run ended without every rank's final parameters")]
    NoFinalState,
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Train(#[from] crate::train::TrainError),
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    #[error(transparent)]
    Schedule(#[from] crate::schedules::ScheduleError),
    #[error(transparent)]
    Runtime(#[from] pipefill_actors::RuntimeError),
    /// A job setting that cannot be used here (e.g. `device = "cuda"` without a GPU).
    #[error(transparent)]
    Job(#[from] crate::config::ConfigError),

    // ---- a launched rank (`mesh`)
    /// The plan's ranks × dp are not the launched processes: one rank per process.
    #[error(
        "the plan has {ranks} ranks × dp = {dp} but {world} processes were launched: one rank per \
         process (set stages × dp = {world})"
    )]
    World {
        ranks: usize,
        dp: usize,
        world: usize,
    },
    /// The rank's own pipeline failed (the error names the rank; it is shown whole, not as
    /// a chain, so that the one-line CLI error does not repeat it).
    #[error("{error}")]
    OnRank {
        rank: usize,
        error: Box<PipelineError>,
    },
    #[error("rank {rank}: gathering the final state")]
    Gather {
        rank: usize,
        #[source]
        source: CommError,
    },
    #[error("rank {rank}: the final state of rank {from} is undecodable: {error}")]
    BadFinal {
        rank: usize,
        from: usize,
        error: CommError,
    },
    #[error("rank {rank}: merging the profiles: {error}")]
    Profile { rank: usize, error: ProfileError },
    /// The mesh failed: a peer died or broke the protocol (named in the text).
    #[error("rank {rank}: {reason}")]
    Peer { rank: usize, reason: String },
    /// The transport between the ranks cannot be set up (`transport` in the job).
    #[error("rank {rank}: {error}")]
    Transport { rank: usize, error: CommError },
    /// The rank's device (`device` in the job) cannot be used.
    #[error("rank {rank}: {device}: {error}")]
    Device {
        rank: usize,
        device: crate::tensor::device::Device,
        error: crate::tensor::TensorError,
    },

    // ---- the drafter in a launched run's bubbles (`mesh::fill`)
    #[error("rank {rank}: filler = \"drafter\": {reason}")]
    FillPlan { rank: usize, reason: String },
    #[error("rank {rank}: the drafter's exchange with rank {peer}: {reason}")]
    FillPeer {
        rank: usize,
        peer: usize,
        reason: String,
    },
    #[error("rank {rank}: drafter: {source}")]
    FillDrafter {
        rank: usize,
        #[source]
        source: ModelError,
    },
    #[error("rank {rank}: the resumed checkpoint's drafter: {source}")]
    FillCheckpoint {
        rank: usize,
        #[source]
        source: ModelError,
    },
}
