//! [`RlError`]: what can go wrong in an RL run, in process or on a launched rank.

use super::grpo::GrpoError;
use crate::config::ConfigError;
use crate::data::DataError;
use crate::model::ModelError;
use crate::pipeline::PipelineError;

/// What can go wrong in an RL run.
#[derive(Debug, thiserror::Error)]
pub enum RlError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("rl update: {0}")]
    Pipeline(#[from] PipelineError),
    #[error("grpo: {0}")]
    Grpo(#[from] GrpoError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Checkpoint(#[from] crate::model::checkpoint::CheckpointError),
    /// The task stream has too few prompts short enough for the token budget.
    #[error(
        "step {step}: only {found} of {wanted} prompts fit model.seq_len = {seq_len} with \
         rl.max_new_tokens = {max_new} (lower rl.max_new_tokens or data.max_size)"
    )]
    NoPrompts {
        step: u64,
        found: usize,
        wanted: usize,
        seq_len: usize,
        max_new: usize,
    },
    /// An earlier update failed and took the policy's optimizer state with it.
    #[error(
        "update: an earlier step's update failed and lost the optimizer state; restart from \
         the last saved checkpoint"
    )]
    UpdateLost,
    /// A rollout engine returned something the update cannot use.
    #[error("rollout: {0}")]
    Rollout(String),
    /// The update was asked to pack its sequences into a count of micro-batches that
    /// cannot hold the ones with a gradient, or more than one per prompt.
    #[error(
        "update: {micro_batches} micro-batches asked for; the sequences with a gradient need \
         {needed} to {prompts} (rl.prompts)"
    )]
    Packing {
        micro_batches: usize,
        needed: usize,
        prompts: usize,
    },
}
