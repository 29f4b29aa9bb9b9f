//! The mesh channel of a launched RL rank's own frames.

use crate::comm::link::Channel;

/// Channel of the weight sync (ranks → rank 0) and of the rollouts (rank 0 → ranks).
pub const RL_CHANNEL: Channel = u32::MAX - 8;
