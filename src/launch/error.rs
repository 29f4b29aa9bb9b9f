//! `LaunchError`: what can go wrong starting a rank of a launched job: reading the
//! launcher's environment (own launcher, mpirun, srun, torchrun), the job token, the
//! rendezvous and the mesh.

use crate::comm::CommError;

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(
        "rank {rank} of a {world}-rank job has no job token: set PIPEFILL_TOKEN to the same secret on every rank (pipefill launch does)"
    )]
    NoToken { rank: usize, world: usize },
    #[error("rank {rank}: cannot listen on {addr}")]
    Listen {
        rank: usize,
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rank {rank}: master address {addr}: {reason}")]
    Master {
        rank: usize,
        addr: String,
        reason: String,
    },
    #[error("environment variable {var}={value:?}: {reason}")]
    Setting {
        var: &'static str,
        value: String,
        reason: String,
    },
    #[error("rank {rank}: {error}")]
    Rendezvous { rank: usize, error: CommError },
    #[error(transparent)]
    Comm(#[from] CommError),

    // ---- the launcher's environment (`env`)
    #[error("environment variable {var}={value:?} is not a {what}")]
    Invalid {
        var: &'static str,
        value: String,
        what: &'static str,
    },
    #[error("{rank_var} is set but {world_var} is not")]
    NoWorld {
        rank_var: &'static str,
        world_var: &'static str,
    },
    #[error("{rank_var}={rank} is not below {world_var}={world}")]
    RankOutOfRange {
        rank_var: &'static str,
        world_var: &'static str,
        rank: usize,
        world: usize,
    },
}
