//! Starting a multi-process job: who this process is ([`env`](mod@env)), and joining the others
//! ([`join`]): rendezvous on rank 0, then the authenticated TCP mesh. Nothing here runs a
//! rank: a launched training rank is [`crate::pipeline::mesh`], a launched RL rank
//! [`crate::rl::launched`], both over the pipeline's one executor.
//!
//! `pipefill launch` (src/cli/launch.rs) spawns local ranks with pipefill's variables, and
//! arms each one's parent-death signal as it spawns it, so its ranks never outlive it; any
//! other launcher (torchrun, mpirun, srun) works through its own variables, and its ranks
//! live by its rules (a rank arms nothing itself: under another launcher its parent is
//! that launcher's agent, whose lifetime, signals and restarts are its own business).
//! Every rank of a job must be given the same job token (`PIPEFILL_TOKEN`; `pipefill
//! launch` makes one).
//! Sockets listen on loopback unless `PIPEFILL_LISTEN_ADDR` (or `--listen-addr`) says
//! otherwise; the rendezvous listens on the master address. `pipefill launch` binds that
//! listener itself and hands it to rank 0 as an open descriptor ([`MASTER_FD`]); a port
//! chosen by the launcher and bound again by rank 0 could be taken in between.
//! Everything here fails as one [`LaunchError`] (`error`).

pub mod env;
pub mod error;

use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::time::Duration;

pub use env::{Launcher, RankEnv};
pub use error::LaunchError;

use crate::comm::rendezvous::{self};
use crate::comm::tcp::{MeshOptions, TcpMesh};

/// The environment variable through which `pipefill launch` hands rank 0 the rendezvous
/// listener it bound (an open descriptor number), so that the port cannot be taken by
/// another process between the launcher choosing it and rank 0 listening on it.
pub const MASTER_FD: &str = "PIPEFILL_MASTER_FD";

/// Default time every rank has to join the rendezvous and the mesh.
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(60);

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

/// The longest join timeout: a day (the timeout is added to clocks and multiplied, so it
/// must stay far from `Duration`'s limit).
pub const MAX_JOIN_TIMEOUT: Duration = Duration::from_secs(86_400);

/// The join timeout: `PIPEFILL_JOIN_TIMEOUT` seconds, else [`DEFAULT_JOIN_TIMEOUT`].
pub fn join_timeout() -> Result<Duration, LaunchError> {
    match std::env::var("PIPEFILL_JOIN_TIMEOUT") {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| *s > 0.0)
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .filter(|d| *d <= MAX_JOIN_TIMEOUT)
            .ok_or_else(|| LaunchError::Setting {
                var: "PIPEFILL_JOIN_TIMEOUT",
                value: v.clone(),
                reason: format!(
                    "not a positive number of seconds up to {}",
                    MAX_JOIN_TIMEOUT.as_secs()
                ),
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
        let server = match inherited_master(master)? {
            Some(server) => server,
            None => TcpListener::bind(master).map_err(|source| LaunchError::Listen {
                rank,
                addr: master_text.clone(),
                source,
            })?,
        };
        rendezvous::serve(&server, env.world, own, &token, timeout).map_err(rendezvous)?
    } else {
        rendezvous::join(rank, env.world, master, own, &token, timeout).map_err(rendezvous)?
    };
    let mut opts = MeshOptions::new(token);
    opts.connect_timeout = timeout;
    Ok(TcpMesh::connect(rank, listener, &table, &opts)?)
}

/// The rendezvous listener named by [`MASTER_FD`], if set: it must be an open TCP socket
/// bound to the master port, or the variable is refused (a stray number must not be taken
/// for someone else's descriptor).
fn inherited_master(master: SocketAddr) -> Result<Option<TcpListener>, LaunchError> {
    match std::env::var(MASTER_FD) {
        Ok(value) => adopt_master(value, master).map(Some),
        Err(_) => Ok(None),
    }
}

/// Takes ownership of the listening socket whose descriptor number is `value`.
fn adopt_master(value: String, master: SocketAddr) -> Result<TcpListener, LaunchError> {
    use std::os::fd::FromRawFd;
    let refuse = |reason: String| LaunchError::Setting {
        var: MASTER_FD,
        value: value.clone(),
        reason,
    };
    let fd: libc::c_int = value
        .trim()
        .parse()
        .ok()
        .filter(|fd| *fd > 2)
        .ok_or_else(|| refuse("not a descriptor number above 2".into()))?;
    // SAFETY: fstat and getsockopt only read the descriptor's state into local values.
    let listening = unsafe {
        let mut stat: libc::stat = std::mem::zeroed();
        let mut accepting: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        libc::fstat(fd, &mut stat) == 0
            && stat.st_mode & libc::S_IFMT == libc::S_IFSOCK
            && libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ACCEPTCONN,
                (&mut accepting as *mut libc::c_int).cast(),
                &mut len,
            ) == 0
            && accepting != 0
    };
    if !listening {
        return Err(refuse("not an open, listening socket".into()));
    }
    // SAFETY: the descriptor is open and a listening socket; the launcher handed it to this
    // process alone, and nothing else in it takes ownership of that number.
    let listener = unsafe { TcpListener::from_raw_fd(fd) };
    // Not passed on to anything this rank starts.
    // SAFETY: fcntl on the descriptor `listener` now owns.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    match listener.local_addr() {
        Ok(addr) if addr.port() == master.port() => Ok(listener),
        Ok(addr) => Err(refuse(format!(
            "listens on {addr}, not on the master port {}",
            master.port()
        ))),
        Err(e) => Err(refuse(format!("not a TCP socket ({e})"))),
    }
}

/// Ends the process a few seconds after `mesh` fails, whatever the rank is doing then (a
/// compute action runs to its end before the runtime notices): a dead peer must end every
/// rank within 10 s. The reason goes to stderr as the process's last line.
pub fn watchdog(mesh: &TcpMesh) {
    let failure = mesh.failure_watch();
    std::thread::spawn(move || {
        let reason = failure();
        std::thread::sleep(Duration::from_secs(3));
        eprintln!("error: {reason}");
        std::process::exit(1);
    });
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, IntoRawFd};

    use super::*;

    fn refusal(value: &str, master: SocketAddr) -> String {
        adopt_master(value.into(), master).unwrap_err().to_string()
    }

    #[test]
    fn the_handed_down_listener_is_adopted_only_when_it_listens_on_the_master_port() {
        // Handed over whole (into_raw_fd): the refusal closes it.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let fd = listener.into_raw_fd().to_string();
        let elsewhere = SocketAddr::from(([127, 0, 0, 1], 1));
        assert!(refusal(&fd, elsewhere).contains("not on the master port 1"));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let master = listener.local_addr().unwrap();
        let fd = listener.into_raw_fd();
        let adopted = adopt_master(fd.to_string(), master).unwrap();
        assert_eq!(adopted.local_addr().unwrap(), master);
        assert_eq!(adopted.as_raw_fd(), fd);
    }

    #[test]
    fn a_stray_descriptor_number_is_refused_naming_the_variable() {
        let master = SocketAddr::from(([127, 0, 0, 1], 29500));
        for value in ["", "x", "-4", "2"] {
            let e = refusal(value, master);
            assert!(
                e.contains(MASTER_FD) && e.contains("not a descriptor number"),
                "{e}"
            );
        }
        let file = tempfile::tempfile().unwrap();
        let e = refusal(&file.as_raw_fd().to_string(), master);
        assert!(e.contains("not an open, listening socket"), "{e}");
        // A socket bound but not listening is not a rendezvous.
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let e = refusal(&socket.as_raw_fd().to_string(), master);
        assert!(e.contains("not an open, listening socket"), "{e}");
    }
}
