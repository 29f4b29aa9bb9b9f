//! What a launched RL rank's part can fail with ([`RlLaunchError`]), and the mesh channel
//! its own frames use ([`RL_CHANNEL`]).

use crate::comm::CommError;
use crate::comm::link::Channel;
use crate::pipeline::PipelineError;
use crate::pipeline::mesh::WorldMismatch;
use crate::profile::ProfileError;
use crate::rl::config::UntrainedPolicy;
use crate::rl::error::RlError;

/// Channel of the weight sync (ranks → rank 0) and of the rollouts (rank 0 → ranks).
pub const RL_CHANNEL: Channel = u32::MAX - 8;

/// Why a rank's part of a multi-process RL run failed; each names the rank.
#[derive(Debug, thiserror::Error)]
pub enum RlLaunchError {
    #[error(transparent)]
    World(#[from] WorldMismatch),
    #[error("dp = {dp} replicas cannot take equal shares of {what} = {count}")]
    Shares {
        dp: usize,
        what: &'static str,
        count: usize,
    },
    #[error("rank {rank}: {error}")]
    Group { rank: usize, error: CommError },
    #[error(transparent)]
    Untrained(#[from] UntrainedPolicy),
    /// (Boxed, as the pipeline's error below: they would make every result of a rank's
    /// run as large as the largest of them.)
    #[error("rank {rank}: {error}")]
    Rl { rank: usize, error: Box<RlError> },
    /// The rank's own pipeline failed (the error names the rank).
    #[error("{error}")]
    Pipeline {
        rank: usize,
        error: Box<PipelineError>,
    },
    #[error("rank {rank}: {what} with rank {peer}: {source}")]
    Link {
        rank: usize,
        peer: usize,
        what: &'static str,
        #[source]
        source: CommError,
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
    #[error("rank {rank}: merging the update's profiles: {error}")]
    Profile { rank: usize, error: ProfileError },
}
