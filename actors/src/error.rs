//! Errors of the actor runtime: each names the rank, the action and the cause.
//!
//! A failing stage must stop the whole job with one message that says where it failed
//! (`rank 2: 1I3 (iteration 0): ...`), so every error a stage can raise carries the rank
//! and the action it was running.

use pipefill_schedules::{Action, ScheduleError};

use crate::transport::Tag;

/// Why a link between two stage actors failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LinkError {
    /// The transport was closed (the job is stopping): nothing more will arrive.
    #[error("link closed")]
    Closed,
    /// The destination rank does not exist on this transport.
    #[error("no rank {to} on this transport ({ranks} ranks)")]
    NoSuchRank { to: usize, ranks: usize },
    /// A second payload with the same tag arrived before the first was taken.
    #[error("duplicate payload {tag} for rank {to}")]
    Duplicate { to: usize, tag: Tag },
    /// A transport-specific failure (socket, NCCL, ...), as text.
    #[error("{0}")]
    Other(String),
}

/// Everything that can stop a run.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A stage's compute returned an error, or the plan asked something impossible of it.
    #[error("rank {rank}: {action} (iteration {iteration}) failed: {cause}")]
    Stage {
        rank: usize,
        iteration: u64,
        action: Action,
        cause: String,
    },
    /// A stage's compute panicked.
    #[error("rank {rank}: {action} (iteration {iteration}) panicked: {cause}")]
    Panic {
        rank: usize,
        iteration: u64,
        action: Action,
        cause: String,
    },
    /// Sending or receiving a payload failed.
    #[error("rank {rank}: {action} (iteration {iteration}): {source}")]
    Link {
        rank: usize,
        iteration: u64,
        action: Action,
        #[source]
        source: LinkError,
    },
    /// The optimizer step after an iteration failed or panicked.
    #[error("rank {rank}: optimizer step of iteration {iteration} failed: {cause}")]
    Optimizer {
        rank: usize,
        iteration: u64,
        cause: String,
    },
    /// Exchanging gradient statistics for the optimizer step's decision failed.
    #[error("rank {rank}: gradient statistics of iteration {iteration}: {source}")]
    StepSync {
        rank: usize,
        iteration: u64,
        #[source]
        source: LinkError,
    },
    /// The plan could not be built, lowered, validated or simulated.
    #[error("plan: {0}")]
    Plan(#[from] ScheduleError),
    /// No rank finished an iteration within the stall timeout.
    #[error(
        "stalled: no progress for {timeout:?}; ranks {waiting:?} have not finished iteration {iteration}"
    )]
    Stalled {
        iteration: u64,
        waiting: Vec<usize>,
        timeout: std::time::Duration,
    },
    /// The run was configured inconsistently (e.g. one compute per rank is needed).
    #[error("configuration: {0}")]
    Config(String),
    /// An actor stopped or could not be reached.
    #[error("actor system: {0}")]
    Actor(String),
}

impl RuntimeError {
    /// True when this error is only the echo of another failure (a link closed because the
    /// job is stopping), not a cause in its own right.
    pub fn is_shutdown_echo(&self) -> bool {
        matches!(
            self,
            RuntimeError::Link {
                source: LinkError::Closed,
                ..
            } | RuntimeError::StepSync {
                source: LinkError::Closed,
                ..
            }
        )
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
