//! Rendezvous on rank 0: every rank registers the address its mesh listens on, and once
//! all have, rank 0 sends every rank the whole table (index = rank).
//!
//! Rank 0 serves on the job's master address; the others dial it, retrying until the join
//! timeout (rank 0 may start later). Each connection's first frame must be a
//! [`Rendezvous::Register`] carrying the job token, read under the handshake cap and a
//! read timeout: anything else (a stranger, a wrong token, garbage) is dropped with a
//! logged error and the rendezvous goes on. Rank 0 reads every connection's registration
//! on the rendezvous's one thread as the bytes arrive (nonblocking), so a silent or slow connection
//! never delays the ranks behind it, and keeps at most [`pending_cap`] connections waiting
//! (a flood of silent ones costs no thread and a bounded number of sockets). A rank that
//! has not joined when the timeout expires is named in the error ("rank 3 did not join
//! within 60 s"), and the ranks that had joined are told so ([`Rendezvous::Abandoned`]).
//!
//! A rank that rank 0 dropped without a word finds out why from a new connection: nothing
//! listens (rank 0 exited) or rank 0 still serves, which means its registration did not
//! carry rank 0's job token; only then is a token mismatch named (see [`join`]).
//!
//! The same message enum carries the NCCL unique ids between the members of a GPU group
//! once the mesh stands ([`Rendezvous::NcclId`], see `comm::nccl`), so one decoder (and
//! one fuzz target) covers every message exchanged to set a job up.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::frame::{self, HANDSHAKE_CAP};
use super::handshake::{AfterClose, after_close, closed};
use crate::comm::CommError;

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
    /// Rank 0 gives up the rendezvous (a rank did not join in time), telling the ranks that
    /// had joined why.
    Abandoned { reason: String },
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
            Rendezvous::Abandoned { .. } => "a rendezvous given up",
        }
    }
}

/// How long rank 0 waits for a connection's registration.
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// The most connections rank 0 keeps waiting for their registration at once in a job of
/// `world` ranks: every rank's several times over, and room for strangers. A connection
/// that finds them all taken makes room by dropping the oldest one that has sent nothing
/// yet (else the oldest), so a flood of silent connections costs a bounded number of
/// sockets and no thread, and never keeps out a real rank, whose registration follows its
/// connection at once (and which registers again if it was dropped unread, see [`join`]).
pub fn pending_cap(world: usize) -> usize {
    world.saturating_mul(4).max(64)
}

/// How many times a rank registers again after rank 0 closed its connection unanswered
/// while still serving the rendezvous, before it concludes that its job token is wrong.
const REGISTER_ATTEMPTS: usize = 3;

pub(crate) fn missing_text(missing: &[usize], timeout: &Duration) -> String {
    let secs = timeout.as_secs_f64();
    match missing {
        [one] => format!("rank {one} did not join within {secs} s"),
        many => format!("ranks {many:?} did not join within {secs} s"),
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CommError {
    let what = what.into();
    move |source| CommError::RendezvousIo { what, source }
}

/// Rank 0's side: serves on `listener` until all `world` ranks registered, then answers
/// each with the table. `own` is rank 0's own mesh address.
pub fn serve(
    listener: &TcpListener,
    world: usize,
    own: SocketAddr,
    token: &str,
    timeout: Duration,
) -> Result<Vec<SocketAddr>, CommError> {
    serve_with(listener, world, own, token, timeout, REGISTER_TIMEOUT)
}

/// [`serve`] with the wait for each connection's registration given. When the rendezvous
/// fails, the ranks that joined are told why before their connections close.
pub fn serve_with(
    listener: &TcpListener,
    world: usize,
    own: SocketAddr,
    token: &str,
    timeout: Duration,
    register_timeout: Duration,
) -> Result<Vec<SocketAddr>, CommError> {
    let mut table = Table {
        world,
        token,
        addrs: vec![None; world],
        joined: Vec::new(),
    };
    table.addrs[0] = Some(own);
    if let Err(e) = gather(listener, &mut table, timeout, register_timeout) {
        let reason = match &e {
            CommError::RendezvousTimeout { missing, timeout } => missing_text(missing, timeout),
            other => other.to_string(),
        };
        for (_, stream) in &mut table.joined {
            let msg = Rendezvous::Abandoned {
                reason: reason.clone(),
            };
            let _ = frame::send_msg(stream, &msg, HANDSHAKE_CAP);
        }
        return Err(e);
    }
    let addrs: Vec<SocketAddr> = table
        .addrs
        .into_iter()
        .map(|a| a.expect("all joined"))
        .collect();
    let answer = Rendezvous::Table {
        addrs: addrs.iter().map(ToString::to_string).collect(),
    };
    for (rank, mut stream) in table.joined {
        frame::send_msg(&mut stream, &answer, HANDSHAKE_CAP).map_err(|e| {
            CommError::RendezvousProtocol(format!("sending rank {rank} the table: {e}"))
        })?;
    }
    Ok(addrs)
}

/// The rendezvous so far: who registered where, and their connections.
struct Table<'a> {
    world: usize,
    token: &'a str,
    addrs: Vec<Option<SocketAddr>>,
    joined: Vec<(usize, TcpStream)>,
}

impl Table<'_> {
    fn complete(&self) -> bool {
        self.addrs.iter().all(Option::is_some)
    }

    /// Takes a connection's first message (or why there is none).
    fn admit(&mut self, mut stream: TcpStream, from: SocketAddr, msg: Result<Rendezvous, String>) {
        let outcome = msg
            .map_err(|reason| (reason, false))
            .and_then(|msg| check_registration(msg, self.world, self.token, &self.addrs));
        let outcome = outcome.and_then(|(rank, addr)| {
            // Answered (with the table or why not) by blocking writes, as a rank reads.
            stream
                .set_nonblocking(false)
                .and_then(|()| stream.set_write_timeout(Some(Duration::from_secs(10))))
                .map(|()| (rank, addr))
                .map_err(|e| (format!("rank {rank}'s connection: {e}"), false))
        });
        match outcome {
            Ok((rank, addr)) => {
                self.addrs[rank] = Some(addr);
                self.joined.push((rank, stream));
            }
            Err((reason, tell)) => {
                tracing::error!("rendezvous: refused connection from {from}: {reason}");
                if tell {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                    let _ = frame::send_msg(
                        &mut stream,
                        &Rendezvous::Refused { reason },
                        HANDSHAKE_CAP,
                    );
                }
            }
        }
    }
}

/// Accepts connections and reads their registrations until every rank joined. It all runs
/// on this thread: each connection is nonblocking and read as its bytes arrive, so a silent
/// or slow one never delays the ranks behind it, and at most [`pending_cap`] wait at once.
fn gather(
    listener: &TcpListener,
    table: &mut Table,
    timeout: Duration,
    register_timeout: Duration,
) -> Result<(), CommError> {
    let deadline = Instant::now() + timeout;
    listener
        .set_nonblocking(true)
        .map_err(io("rendezvous listener"))?;
    let cap = pending_cap(table.world);
    let mut pending: VecDeque<Pending> = VecDeque::new();
    let mut evicted = 0usize;
    let outcome = loop {
        let mut busy = false;
        // A bounded burst of new connections, then a read of every waiting one.
        let mut accept_error = None;
        for _ in 0..cap {
            match listener.accept() {
                Ok((stream, from)) => {
                    busy = true;
                    if pending.len() >= cap {
                        make_room(&mut pending, cap, evicted == 0);
                        evicted += 1;
                    }
                    match Pending::new(stream, from, register_timeout) {
                        Ok(p) => pending.push_back(p),
                        Err(e) => {
                            tracing::error!("rendezvous: refused connection from {from}: {e}")
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted
                            | ErrorKind::ConnectionAborted
                            | ErrorKind::ConnectionReset
                    ) => {}
                Err(e) => {
                    accept_error = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = accept_error {
            break Err(io("accepting a rank")(e));
        }
        let mut i = 0;
        while i < pending.len() {
            match pending[i].poll() {
                None => i += 1,
                Some(msg) => {
                    busy = true;
                    let p = pending.remove(i).expect("index in range");
                    table.admit(p.stream, p.from, msg);
                }
            }
        }
        if table.complete() {
            break Ok(());
        }
        if Instant::now() > deadline {
            let missing = (0..table.world)
                .filter(|&r| table.addrs[r].is_none())
                .collect();
            break Err(CommError::RendezvousTimeout { missing, timeout });
        }
        if !busy {
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    for p in pending {
        tracing::error!(
            "rendezvous: dropped connection from {}: the rendezvous ended before it registered",
            p.from
        );
    }
    if evicted > 1 {
        tracing::error!(
            "rendezvous: dropped {evicted} unregistered connections in all to keep at most {cap} waiting"
        );
    }
    outcome
}

/// Drops the oldest waiting connection that has sent nothing (else the oldest) to make room
/// for a new one; logs it when `log` (the first of a flood; [`gather`] counts the rest).
fn make_room(pending: &mut VecDeque<Pending>, cap: usize, log: bool) {
    let oldest_silent = pending.iter().position(|p| p.bytes.is_empty()).unwrap_or(0);
    let dropped = pending.remove(oldest_silent);
    if let Some(p) = dropped
        && log
    {
        tracing::error!(
            "rendezvous: dropped connection from {}: {cap} connections are waiting to register, the most rank 0 keeps; the oldest silent one makes room",
            p.from
        );
    }
}

/// A connection whose registration is being read, and the bytes of it read so far.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    bytes: Vec<u8>,
    deadline: Instant,
    timeout: Duration,
}

impl Pending {
    fn new(stream: TcpStream, from: SocketAddr, timeout: Duration) -> std::io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(Pending {
            stream,
            from,
            bytes: Vec::new(),
            deadline: Instant::now() + timeout,
            timeout,
        })
    }

    /// Reads what has arrived: the first message once it is whole (a frame under the
    /// handshake cap), why there is none (the connection ended, broke, sent too much or
    /// nothing in time), or `None` while it is still coming. Never reads past the frame.
    fn poll(&mut self) -> Option<Result<Rendezvous, String>> {
        loop {
            let want = match self.bytes.get(..4) {
                None => 4,
                Some(prefix) => {
                    let len = u32::from_le_bytes(prefix.try_into().expect("four bytes")) as usize;
                    if len > HANDSHAKE_CAP {
                        let e = CommError::TooLarge {
                            len,
                            cap: HANDSHAKE_CAP,
                        };
                        return Some(Err(e.to_string()));
                    }
                    4 + len
                }
            };
            if self.bytes.len() >= 4 && self.bytes.len() == want {
                return Some(frame::decode(&self.bytes[4..]).map_err(|e| e.to_string()));
            }
            let mut chunk = [0u8; 4096];
            let room = (want - self.bytes.len()).min(chunk.len());
            match self.stream.read(&mut chunk[..room]) {
                Ok(0) if self.bytes.is_empty() => {
                    return Some(Err("it closed the connection without registering".into()));
                }
                Ok(0) => {
                    return Some(Err(format!(
                        "it closed the connection after {} bytes of a registration",
                        self.bytes.len()
                    )));
                }
                Ok(n) => self.bytes.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    return (Instant::now() > self.deadline).then(|| {
                        Err(format!(
                            "no registration within {:?} ({} bytes of one)",
                            self.timeout,
                            self.bytes.len()
                        ))
                    });
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Some(Err(e.to_string())),
            }
        }
    }
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
///
/// When rank 0 closes the connection unanswered, what it means is found out by a new
/// connection (`after_close`): nothing listens any more (rank 0 exited, its own error
/// says why) or rank 0 still serves. A rank that did not show the job token is dropped
/// without a word, but so is one dropped unread under a flood of connections
/// ([`pending_cap`]), so it registers again, `REGISTER_ATTEMPTS` times in all, before
/// it names a wrong token.
pub fn join(
    rank: usize,
    world: usize,
    master: SocketAddr,
    own: SocketAddr,
    token: &str,
    timeout: Duration,
) -> Result<Vec<SocketAddr>, CommError> {
    let deadline = Instant::now() + timeout;
    let msg = Rendezvous::Register {
        token: token.to_string(),
        rank: rank as u32,
        world: world as u32,
        addr: own.to_string(),
    };
    let gone = |after: String| CommError::MasterGone { after };
    let exited = || {
        format!(
            "nothing listens at {master} any more: rank 0 exited or gave up (its own error says why)"
        )
    };
    let mut attempt = 0;
    let answer = loop {
        attempt += 1;
        match register(&msg, master, deadline, attempt == 1) {
            Ok(Some(answer)) => break answer,
            Err(Exchange::Timeout) => return Err(CommError::NoMaster { master, timeout }),
            Err(Exchange::Protocol(what)) => return Err(CommError::RendezvousProtocol(what)),
            Err(Exchange::Closed) => return Err(gone(exited())),
            Ok(None) => match after_close(master) {
                AfterClose::Listening if attempt < REGISTER_ATTEMPTS => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                AfterClose::Listening => {
                    return Err(CommError::WrongToken {
                        master,
                        attempts: attempt,
                    });
                }
                AfterClose::Gone => return Err(gone(exited())),
                AfterClose::Unreachable(e) => {
                    return Err(gone(format!(
                        "a new connection to {master} fails ({e}): rank 0 exited or cannot be reached"
                    )));
                }
            },
        }
    };
    match answer {
        Rendezvous::Table { addrs } if addrs.len() == world => addrs
            .iter()
            .map(|a| {
                a.parse()
                    .map_err(|e| CommError::RendezvousProtocol(format!("address {a:?}: {e}")))
            })
            .collect(),
        Rendezvous::Table { addrs } => Err(CommError::RendezvousProtocol(format!(
            "a table of {} addresses for {world} ranks",
            addrs.len()
        ))),
        Rendezvous::Refused { reason } => Err(CommError::Refused { rank, reason }),
        Rendezvous::Abandoned { reason } => Err(CommError::Abandoned { reason }),
        other => Err(CommError::RendezvousProtocol(format!(
            "rank 0 answered with {}",
            other.kind()
        ))),
    }
}

/// Why one registration got no answer.
enum Exchange {
    /// Rank 0 did not accept or answer before the deadline.
    Timeout,
    /// A later attempt's connection was refused: rank 0 no longer listens.
    Closed,
    Protocol(String),
}

/// One registration: connects (retrying until `deadline` when `first`, as rank 0 may not
/// listen yet), sends `msg` and reads rank 0's answer; `None` when rank 0 closed the
/// connection without one.
fn register(
    msg: &Rendezvous,
    master: SocketAddr,
    deadline: Instant,
    first: bool,
) -> Result<Option<Rendezvous>, Exchange> {
    let mut stream = loop {
        match TcpStream::connect_timeout(&master, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(e) if !first && e.kind() == ErrorKind::ConnectionRefused => {
                return Err(Exchange::Closed);
            }
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(_) => return Err(Exchange::Timeout),
        }
    };
    match frame::send_msg(&mut stream, msg, HANDSHAKE_CAP) {
        Ok(()) => {}
        Err(e) if closed(&e) => return Ok(None),
        Err(e) => return Err(Exchange::Protocol(e.to_string())),
    }
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = stream.set_read_timeout(Some(left.max(Duration::from_secs(1))));
    match frame::recv_msg(&mut stream, HANDSHAKE_CAP) {
        Ok(answer) => Ok(Some(answer)),
        Err(e) if closed(&e) => Ok(None),
        Err(CommError::Io(e))
            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
        {
            Err(Exchange::Timeout)
        }
        Err(e) => Err(Exchange::Protocol(e.to_string())),
    }
}

#[cfg(test)]
mod tests;
