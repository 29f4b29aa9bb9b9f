//! [`PipelineError`]: what can go wrong setting up or running a pipelined job.

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
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Train(#[from] crate::train::TrainError),
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    #[error(transparent)]
    Checkpoint(#[from] crate::model::checkpoint::CheckpointError),
    #[error(transparent)]
    Schedule(#[from] crate::schedules::ScheduleError),
    #[error(transparent)]
    Runtime(#[from] pipefill_actors::RuntimeError),
    #[error(transparent)]
    Drafter(#[from] crate::model::drafter::DrafterError),
    /// A job setting that cannot be used here (e.g. `device = "cuda"` without a GPU).
    #[error(transparent)]
    Job(#[from] crate::config::ConfigError),
}
