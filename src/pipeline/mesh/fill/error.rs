//! Why launched filling fails ([`FillError`]), and the mesh channel its frames use.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::comm::link::Channel;
use crate::model::checkpoint::CheckpointError;
use crate::model::drafter::DrafterError;

/// Channel of the drafter's seeds, rows and rounds between the ranks of replica 0.
pub const FILL_CHANNEL: Channel = u32::MAX - 19;

/// Why launched filling failed.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    #[error("rank {rank}: filler = \"drafter\": {reason}")]
    Plan { rank: usize, reason: String },
    #[error("rank {rank}: the drafter's exchange with rank {peer}: {reason}")]
    Peer {
        rank: usize,
        peer: usize,
        reason: String,
    },
    #[error("rank {rank}: drafter: {source}")]
    Drafter {
        rank: usize,
        #[source]
        source: DrafterError,
    },
    #[error("rank {rank}: the resumed checkpoint's drafter: {source}")]
    Checkpoint {
        rank: usize,
        #[source]
        source: CheckpointError,
    },
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
