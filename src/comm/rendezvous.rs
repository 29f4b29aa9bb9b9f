//! Rendezvous on rank 0: every rank registers the address its mesh listens on, and once
//! all have, rank 0 sends every rank the whole table (index = rank).
//!
//! Rank 0 serves on the job's master address; the others dial it, retrying until the join
//! timeout (rank 0 may start later). Each connection's first frame must be a
//! [`Rendezvous::Register`] carrying the job token, read under the handshake cap and a
//! read timeout: anything else (a stranger, a wrong token, garbage) is dropped with a
//! logged error and the rendezvous goes on. Each connection's registration is read on a
//! thread of its own, so a silent or slow connection never delays the ranks behind it.
//! A rank that has not joined when the timeout expires is named in the error ("rank 3 did
//! not join within 60 s").
//!
//! The same message enum carries the NCCL unique ids between the members of a GPU group
//! once the mesh stands ([`Rendezvous::NcclId`], see `comm::nccl`), so one decoder (and
//! one fuzz target) covers every message exchanged to set a job up.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::frame::{self, HANDSHAKE_CAP};

/// The messages of the rendezvous.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Rendezvous {
    /// A rank joins: the job token, who it is, where its mesh listens.
    Register {
        token: String,
        rank: u32,
        world: u32,
        addr: String,
    },
    /// Rank 0's answer once every rank joined: where each rank listens.
    Table { addrs: Vec<String> },
    /// Rank 0 refuses this registration (duplicate rank, wrong world size).
    Refused { reason: String },
    /// A GPU group's leader hands its members the NCCL unique id (128 bytes).
    NcclId { id: Vec<u8> },
    /// A GPU group's leader could not create the NCCL id, and why.
    NcclIdFailed { reason: String },
}

impl Rendezvous {
    /// What kind of message this is, for errors about an unexpected one.
    pub fn kind(&self) -> &'static str {
        match self {
            Rendezvous::Register { .. } => "a registration",
            Rendezvous::Table { .. } => "an address table",
            Rendezvous::Refused { .. } => "a refusal",
            Rendezvous::NcclId { .. } => "an NCCL id",
            Rendezvous::NcclIdFailed { .. } => "an NCCL id failure",
        }
    }
}

/// A connection, where it came from, and its first message (or why there is none).
type Registration = (TcpStream, SocketAddr, Result<Rendezvous, (String, bool)>);

/// How long rank 0 waits for a connection's registration.
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rendezvous: {what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rendezvous: {}", missing_text(.missing, .timeout))]
    Timeout {
        missing: Vec<usize>,
        timeout: Duration,
    },
    #[error("rendezvous: rank 0 at {master} did not answer within {timeout:?}")]
    NoMaster {
        master: SocketAddr,
        timeout: Duration,
    },
    #[error("rendezvous: rank 0 refused rank {rank}: {reason}")]
    Refused { rank: usize, reason: String },
    #[error("rendezvous: {0}")]
    Protocol(String),
}

fn missing_text(missing: &[usize], timeout: &Duration) -> String {
    let secs = timeout.as_secs_f64();
    match missing {
        [one] => format!("rank {one} did not join within {secs} s"),
        many => format!("ranks {many:?} did not join within {secs} s"),
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RendezvousError {
    let what = what.into();
    move |source| RendezvousError::Io { what, source }
}

/// Rank 0's side: serves on `listener` until all `world` ranks registered, then answers
/// each with the table. `own` is rank 0's own mesh address.
pub fn serve(
    listener: &TcpListener,
    world: usize,
    own: SocketAddr,
    token: &str,
    timeout: Duration,
) -> Result<Vec<SocketAddr>, RendezvousError> {
    serve_with(listener, world, own, token, timeout, REGISTER_TIMEOUT)
}

/// [`serve`] with the wait for each connection's registration given.
pub fn serve_with(
    listener: &TcpListener,
    world: usize,
    own: SocketAddr,
    token: &str,
    timeout: Duration,
    register_timeout: Duration,
) -> Result<Vec<SocketAddr>, RendezvousError> {
    let deadline = Instant::now() + timeout;
    let mut addrs: Vec<Option<SocketAddr>> = vec![None; world];
    addrs[0] = Some(own);
    let mut joined: Vec<(usize, TcpStream)> = Vec::new();
    listener
        .set_nonblocking(true)
        .map_err(io("rendezvous listener"))?;
    // Registrations are read on threads of their own (see the module docs) and come back
    // here, where the table is checked and filled in arrival order.
    let (read, registrations) = std::sync::mpsc::channel::<Registration>();
    while addrs.iter().any(Option::is_none) {
        while let Ok((mut stream, from, msg)) = registrations.try_recv() {
            let outcome = msg.and_then(|msg| check_registration(msg, world, token, &addrs));
            match outcome {
                Ok((rank, addr)) => {
                    addrs[rank] = Some(addr);
                    joined.push((rank, stream));
                }
                Err((reason, tell)) => {
                    tracing::error!("rendezvous: refused connection from {from}: {reason}");
                    if tell {
                        let _ = frame::send_msg(
                            &mut stream,
                            &Rendezvous::Refused { reason },
                            HANDSHAKE_CAP,
                        );
                    }
                }
            }
        }
        if !addrs.iter().any(Option::is_none) {
            break;
        }
        match listener.accept() {
            Ok((stream, from)) => {
                let read = read.clone();
                let dispatch = tracing::dispatcher::get_default(Clone::clone);
                let spawned = std::thread::Builder::new()
                    .name("pipefill-rendezvous-register".into())
                    .spawn(move || {
                        tracing::dispatcher::with_default(&dispatch, || {
                            let mut stream = stream;
                            let msg = read_registration(&mut stream, register_timeout);
                            if let Err(returned) = read.send((stream, from, msg)) {
                                // The rendezvous is over: nobody will read this one.
                                if let Err((reason, _)) = returned.0.2 {
                                    tracing::error!(
                                        "rendezvous: dropped connection from {from}: {reason}"
                                    );
                                }
                            }
                        })
                    });
                if let Err(e) = spawned {
                    return Err(io("starting a registration reader")(e));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing = (0..world).filter(|&r| addrs[r].is_none()).collect();
                    return Err(RendezvousError::Timeout { missing, timeout });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(io("accepting a rank")(e)),
        }
    }
    let table: Vec<SocketAddr> = addrs.into_iter().map(|a| a.expect("all joined")).collect();
    let answer = Rendezvous::Table {
        addrs: table.iter().map(ToString::to_string).collect(),
    };
    for (rank, mut stream) in joined {
        frame::send_msg(&mut stream, &answer, HANDSHAKE_CAP).map_err(|e| {
            RendezvousError::Protocol(format!("sending rank {rank} the table: {e}"))
        })?;
    }
    Ok(table)
}

/// Reads a connection's first message under the handshake cap and `timeout`. The error
/// says why, and whether the peer may be told (never: it has not shown the token).
fn read_registration(
    stream: &mut TcpStream,
    timeout: Duration,
) -> Result<Rendezvous, (String, bool)> {
    stream
        .set_nonblocking(false)
        .map_err(|e| (e.to_string(), false))?;
    let _ = stream.set_read_timeout(Some(timeout));
    frame::recv_msg(stream, HANDSHAKE_CAP).map_err(|e| (e.to_string(), false))
}

/// Checks one registration against the table so far. The error says why, and whether the
/// peer showed the token (only then is it told: a stranger learns nothing).
fn check_registration(
    msg: Rendezvous,
    world: usize,
    token: &str,
    addrs: &[Option<SocketAddr>],
) -> Result<(usize, SocketAddr), (String, bool)> {
    let Rendezvous::Register {
        token: theirs,
        rank,
        world: their_world,
        addr,
    } = msg
    else {
        return Err(("the first message is not a registration".into(), false));
    };
    if !super::handshake::same_token(&theirs, token) {
        return Err(("wrong job token".into(), false));
    }
    let rank = rank as usize;
    if their_world as usize != world {
        return Err((
            format!("rank {rank} says the job has {their_world} ranks, rank 0 says {world}"),
            true,
        ));
    }
    if rank == 0 || rank >= world || addrs[rank].is_some() {
        return Err((
            format!("rank {rank} is out of range or already joined"),
            true,
        ));
    }
    let addr = addr
        .parse()
        .map_err(|e| (format!("rank {rank}'s address {addr:?}: {e}"), true))?;
    Ok((rank, addr))
}

/// A rank other than 0: registers `own` with rank 0 at `master` and waits for the table.
pub fn join(
    rank: usize,
    world: usize,
    master: SocketAddr,
    own: SocketAddr,
    token: &str,
    timeout: Duration,
) -> Result<Vec<SocketAddr>, RendezvousError> {
    let deadline = Instant::now() + timeout;
    let mut stream = loop {
        match TcpStream::connect_timeout(&master, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(_) => return Err(RendezvousError::NoMaster { master, timeout }),
        }
    };
    let msg = Rendezvous::Register {
        token: token.to_string(),
        rank: rank as u32,
        world: world as u32,
        addr: own.to_string(),
    };
    frame::send_msg(&mut stream, &msg, HANDSHAKE_CAP)
        .map_err(|e| RendezvousError::Protocol(e.to_string()))?;
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = stream.set_read_timeout(Some(left.max(Duration::from_secs(1))));
    let answer: Rendezvous = frame::recv_msg(&mut stream, HANDSHAKE_CAP).map_err(|e| match e {
        frame::FrameError::Io(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            RendezvousError::NoMaster { master, timeout }
        }
        frame::FrameError::Eof => RendezvousError::Refused {
            rank,
            reason: "rank 0 closed the connection (wrong job token?)".into(),
        },
        other => RendezvousError::Protocol(other.to_string()),
    })?;
    match answer {
        Rendezvous::Table { addrs } if addrs.len() == world => addrs
            .iter()
            .map(|a| {
                a.parse()
                    .map_err(|e| RendezvousError::Protocol(format!("address {a:?}: {e}")))
            })
            .collect(),
        Rendezvous::Table { addrs } => Err(RendezvousError::Protocol(format!(
            "a table of {} addresses for {world} ranks",
            addrs.len()
        ))),
        Rendezvous::Refused { reason } => Err(RendezvousError::Refused { rank, reason }),
        other => Err(RendezvousError::Protocol(format!(
            "rank 0 answered with {}",
            other.kind()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn local() -> TcpListener {
        TcpListener::bind("127.0.0.1:0").unwrap()
    }

    #[test]
    fn every_rank_gets_the_same_table() {
        let master = local();
        let addr = master.local_addr().unwrap();
        let own: Vec<SocketAddr> = (0..3)
            .map(|r| format!("127.0.0.1:{}", 40000 + r).parse().unwrap())
            .collect();
        let joiners: Vec<_> = (1..3)
            .map(|r| {
                let own = own[r];
                std::thread::spawn(move || join(r, 3, addr, own, "t", Duration::from_secs(10)))
            })
            .collect();
        let table = serve(&master, 3, own[0], "t", Duration::from_secs(10)).unwrap();
        assert_eq!(table, own);
        for j in joiners {
            assert_eq!(j.join().unwrap().unwrap(), own);
        }
    }

    #[test]
    fn a_wrong_token_and_garbage_are_refused_and_a_missing_rank_is_named() {
        let master = local();
        let addr = master.local_addr().unwrap();
        let own: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let intruder = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            use std::io::Write;
            s.write_all(&[5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff])
                .unwrap();
            join(1, 3, addr, own, "wrong", Duration::from_secs(10))
        });
        let err = serve(&master, 3, own, "right", Duration::from_millis(1500)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "rendezvous: ranks [1, 2] did not join within 1.5 s"
        );
        assert!(matches!(
            intruder.join().unwrap(),
            Err(RendezvousError::Refused { rank: 1, .. })
        ));
    }

    #[test]
    fn a_silent_connection_does_not_delay_the_ranks_and_is_dropped_with_a_logged_error() {
        let master = local();
        let addr = master.local_addr().unwrap();
        let own: Vec<SocketAddr> = (0..2)
            .map(|r| format!("127.0.0.1:{}", 41000 + r).parse().unwrap())
            .collect();
        // It connects first and never says a word.
        let mut silent = TcpStream::connect(addr).unwrap();
        let silent_addr = silent.local_addr().unwrap();
        let start = Instant::now();
        let joiner = {
            let own = own[1];
            std::thread::spawn(move || join(1, 2, addr, own, "t", Duration::from_secs(10)))
        };
        let log = crate::comm::test_log::LogBuf::default();
        let table = tracing::subscriber::with_default(log.subscriber(), || {
            serve_with(
                &master,
                2,
                own[0],
                "t",
                Duration::from_secs(10),
                Duration::from_secs(3),
            )
        })
        .unwrap();
        assert_eq!(table, own);
        assert_eq!(joiner.join().unwrap().unwrap(), own);
        // Well before the silent connection's 3 s registration timeout.
        let joined = start.elapsed();
        assert!(joined < Duration::from_secs(2), "joined after {joined:?}");
        silent
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert!(frame::recv_msg::<Rendezvous>(&mut silent, HANDSHAKE_CAP).is_err());
        let needle = format!("dropped connection from {silent_addr}");
        let line = log.wait_for(&needle, Duration::from_secs(5));
        assert!(line.is_some(), "no {needle:?} in the log:\n{}", log.text());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_rendezvous_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = frame::decode::<Rendezvous>(&bytes);
        }

        #[test]
        fn registrations_round_trip(token in ".{0,32}", rank in any::<u32>(), world in any::<u32>(), addr in ".{0,24}") {
            let msg = Rendezvous::Register { token, rank, world, addr };
            prop_assert_eq!(frame::decode::<Rendezvous>(&frame::encode(&msg).unwrap()).unwrap(), msg);
        }

        #[test]
        fn nccl_ids_round_trip_bit_for_bit(id in proptest::collection::vec(any::<u8>(), 128..=128), reason in ".{0,40}") {
            for msg in [Rendezvous::NcclId { id: id.clone() }, Rendezvous::NcclIdFailed { reason: reason.clone() }] {
                prop_assert_eq!(frame::decode::<Rendezvous>(&frame::encode(&msg).unwrap()).unwrap(), msg);
            }
        }
    }
}
