//! Starting a multi-process job: who this process is ([`env`]), and joining the others
//! ([`join`]): rendezvous on rank 0, then the authenticated TCP mesh; and one rank's part
//! of pipelined training over that mesh ([`train`]), where `schedule = "auto"` switches
//! every rank to the plan of the costs they measured and all-gathered ([`auto`]).
//!
//! `pipefill launch` (src/cli/launch.rs) spawns local ranks with pipefill's variables, and
//! arms each one's parent-death signal as it spawns it, so its ranks never outlive it; any
//! other launcher (torchrun, mpirun, srun) works through its own variables, and its ranks
//! live by its rules (a rank arms nothing itself: under another launcher its parent is
//! that launcher's agent, whose lifetime, signals and restarts are its own business).
//! Every rank of a job must be given the same job token (`PIPEFILL_TOKEN`; `pipefill
//! launch` makes one).
//! Sockets listen on loopback unless `PIPEFILL_LISTEN_ADDR` (or `--listen-addr`) says
//! otherwise; the rendezvous listens on the master address.

pub mod auto;
pub mod env;
pub mod profile;
pub mod rl;
pub mod train;

use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::time::Duration;

pub use env::{EnvError, Launcher, RankEnv};

use crate::comm::rendezvous::{self, RendezvousError};
use crate::comm::tcp::{MeshError, MeshOptions, TcpMesh};

/// Default time every rank has to join the rendezvous and the mesh.
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Env(#[from] EnvError),
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
    Rendezvous { rank: usize, error: RendezvousError },
    #[error(transparent)]
    Mesh(#[from] MeshError),
}

/// Where this rank's mesh listens: `PIPEFILL_LISTEN_ADDR` (an IP address), else loopback.
pub fn listen_ip() -> Result<IpAddr, LaunchError> {
    match std::env::var("PIPEFILL_LISTEN_ADDR") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().map_err(|e| LaunchError::Setting {
            var: "PIPEFILL_LISTEN_ADDR",
            value: v.clone(),
            reason: format!("not an IP address ({e})"),
        }),
        _ => Ok(IpAddr::from([127, 0, 0, 1])),
    }
}

/// The join timeout: `PIPEFILL_JOIN_TIMEOUT` seconds, else [`DEFAULT_JOIN_TIMEOUT`].
pub fn join_timeout() -> Result<Duration, LaunchError> {
    match std::env::var("PIPEFILL_JOIN_TIMEOUT") {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| LaunchError::Setting {
                var: "PIPEFILL_JOIN_TIMEOUT",
                value: v.clone(),
                reason: "not a positive number of seconds".into(),
            }),
        _ => Ok(DEFAULT_JOIN_TIMEOUT),
    }
}

/// Joins the job `env` describes: binds this rank's listener on `listen`, meets the other
/// ranks at rank 0's rendezvous and connects the mesh. Every rank calls it.
pub fn join(env: &RankEnv, listen: IpAddr, timeout: Duration) -> Result<TcpMesh, LaunchError> {
    let rank = env.rank;
    let token = env.token.clone().ok_or(LaunchError::NoToken {
        rank,
        world: env.world,
    })?;
    let listener = TcpListener::bind((listen, 0)).map_err(|source| LaunchError::Listen {
        rank,
        addr: format!("{listen}:0"),
        source,
    })?;
    let own = listener
        .local_addr()
        .map_err(|source| LaunchError::Listen {
            rank,
            addr: format!("{listen}:0"),
            source,
        })?;
    let master_text = format!("{}:{}", env.master_addr, env.master_port);
    let master: SocketAddr = master_text
        .to_socket_addrs()
        .map_err(|e| e.to_string())
        .and_then(|mut a| a.next().ok_or_else(|| "resolves to nothing".to_string()))
        .map_err(|reason| LaunchError::Master {
            rank,
            addr: master_text.clone(),
            reason,
        })?;
    let rendezvous = |error| LaunchError::Rendezvous { rank, error };
    let table = if rank == 0 {
        let server = TcpListener::bind(master).map_err(|source| LaunchError::Listen {
            rank,
            addr: master_text.clone(),
            source,
        })?;
        rendezvous::serve(&server, env.world, own, &token, timeout).map_err(rendezvous)?
    } else {
        rendezvous::join(rank, env.world, master, own, &token, timeout).map_err(rendezvous)?
    };
    let mut opts = MeshOptions::new(token);
    opts.connect_timeout = timeout;
    Ok(TcpMesh::connect(rank, listener, &table, &opts)?)
}
