//! [`RlError`]: what can go wrong in an RL run, in process or on a launched rank: the one
//! error of the `rl` layer (GRPO, the rollout engine and its proposers, the calibration of
//! step costs, a launched rank's exchanges).

use crate::comm::CommError;
use crate::config::ConfigError;
use crate::data::DataError;
use crate::model::ModelError;
use crate::pipeline::PipelineError;
use crate::profile::ProfileError;

/// What can go wrong in an RL run.
#[derive(Debug, thiserror::Error)]
pub enum RlError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("rl update: {0}")]
    Pipeline(#[from] PipelineError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Model(#[from] ModelError),
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

    // ---- group-relative advantages (`grpo`)
    #[error("grpo: {len} rewards do not split into groups of {group}")]
    Ragged { len: usize, group: usize },
    #[error("grpo: reward {index} is {value}, not a finite number")]
    NotFinite { index: usize, value: f32 },
    #[error(
        "grpo: sequence {sequence}: {what} has {got} values, the policy's log-probs {expected}"
    )]
    GrpoLength {
        sequence: usize,
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("grpo: {advantages} advantages for {sequences} sequences")]
    AdvantageCount { advantages: usize, sequences: usize },
    /// A packed update's rows do not hold every sequence exactly once.
    #[error("grpo: micro-batch layout: {0}")]
    Layout(String),

    // ---- a launched rank (`launched`)
    #[error("dp = {dp} replicas cannot take equal shares of {what} = {count}")]
    Shares {
        dp: usize,
        what: &'static str,
        count: usize,
    },
    #[error("rank {rank}: {error}")]
    Group { rank: usize, error: CommError },
    /// (Boxed, as the pipeline's error below: they would make every result of a rank's
    /// run as large as the largest of them.)
    #[error("rank {rank}: {error}")]
    OnRank { rank: usize, error: Box<RlError> },
    /// The rank's own pipeline failed (the error names the rank).
    #[error("{error}")]
    RankPipeline {
        rank: usize,
        error: Box<PipelineError>,
    },
    #[error("rank {rank}: {what} with rank {peer}: {source}")]
    RankLink {
        rank: usize,
        peer: usize,
        what: &'static str,
        #[source]
        source: CommError,
    },
    #[error("rank {rank}: rank {peer} sent an unreadable {what}: {error}")]
    BadFrame {
        rank: usize,
        peer: usize,
        what: &'static str,
        error: CommError,
    },
    /// The mesh failed: a peer died or broke the protocol (named in the text).
    #[error("rank {rank}: {reason}")]
    Peer { rank: usize, reason: String },
    #[error("rank {rank}: merging the update's profiles: {error}")]
    RankProfile { rank: usize, error: ProfileError },

    // ---- the rollout engine (`rollout`, `speculative`)
    #[error("rollout config: `{field}` {reason}")]
    RolloutConfig { field: &'static str, reason: String },
    #[error("request {index}: {reason}")]
    Request { index: usize, reason: String },
    #[error("stage threads stopped before the rollout finished")]
    Stopped,
    /// Why a proposer could not draft.
    #[error("proposer {proposer}: {reason}")]
    Propose {
        proposer: &'static str,
        reason: String,
    },

    // ---- the start-up calibration of step costs (`calibrate`)
    #[error("calibration: {0}")]
    CalibrationInput(String),
}

impl RlError {
    /// A proposer's failure not tied to its kind (what the engine or the trait's defaults
    /// find wrong).
    pub fn proposer(reason: impl Into<String>) -> Self {
        RlError::Propose {
            proposer: "proposer",
            reason: reason.into(),
        }
    }
}
