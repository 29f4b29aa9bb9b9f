//! The job file's `[optimizer]` section: how the optimizer's state is kept across the
//! data-parallel replicas (the AdamW hyper-parameters themselves are `[train]`'s).
//!
//! `shard = true` is ZeRO-1 (Megatron's distributed optimizer): each of the `dp` replicas
//! keeps the AdamW moments of a `1/dp` flat cut of every rank's parameters, the gradients
//! are reduce-scattered and the updated parameters all-gathered (see
//! `crate::pipeline::compute::zero`). With `dp = 1` there is nothing to shard and the
//! setting changes nothing, so one job file runs at any `dp`. Every gradient exchange has
//! those collectives (the ring over TCP or in-process links, and NCCL's between CUDA
//! ranks, `crate::comm::nccl_sync`), so any device and transport may shard.

use serde::{Deserialize, Serialize};

use super::JobConfig;
use super::error::ConfigError;

/// `[optimizer]`: where the optimizer's state lives.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// ZeRO-1: each data-parallel replica keeps `1/dp` of the AdamW state (a no-op at
    /// `dp = 1`). The parameters are bitwise the unsharded run's (over NCCL: at `dp = 2`).
    pub shard: bool,
}

impl OptimizerConfig {
    /// Whether `job` shards its optimizer state (on, and more than one replica).
    pub fn sharded(job: &JobConfig) -> bool {
        job.optimizer.shard && job.dp > 1
    }

    /// An in-process `pipefill rl` does not shard its update's optimizer (its replicas share
    /// one process's memory, so each holding a share would save nothing): refused rather
    /// than ignored. A launched one does (`pipefill launch -n N -- rl`, each replica its own
    /// processes), and is not checked here.
    pub fn check_rl(job: &JobConfig) -> Result<(), ConfigError> {
        match Self::sharded(job) {
            true => Err(ConfigError::Invalid {
                field: "optimizer.shard".into(),
                reason: "shards an RL update only in a launched run (`pipefill launch -n N -- \
                         rl`, each replica in its own processes): set optimizer.shard = false \
                         here"
                    .into(),
            }),
            false => Ok(()),
        }
    }
}
