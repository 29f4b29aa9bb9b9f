//! The first words on a mesh connection: the dialling rank's [`Hello`] (job token, rank,
//! world size) and the accepting rank's answer, which repeats the token, so both sides
//! know the other belongs to the job. Nothing else is read from a connection before its
//! hello, and the hello is read under the handshake cap and a read timeout. A peer that
//! closes the connection before answering is told apart by a new connection
//! (`after_close`): it no longer listens (it exited) or it lives and dropped the hello
//! (a job token or world size not its own).

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::frame::{self, HANDSHAKE_CAP};
use super::tcp::options::MeshOptions;
use crate::comm::CommError;

/// What a rank says first on a connection it opened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub token: String,
    pub rank: u32,
    pub world: u32,
}

/// Compares two tokens in time independent of where they differ.
pub(crate) fn same_token(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// Whether a frame could not be read or written because the other end closed the
/// connection (an end of stream, a reset, a broken pipe).
pub(crate) fn closed(e: &CommError) -> bool {
    match e {
        CommError::Eof => true,
        CommError::Io(e) => matches!(
            e.kind(),
            ErrorKind::UnexpectedEof
                | ErrorKind::ConnectionReset
                | ErrorKind::ConnectionAborted
                | ErrorKind::BrokenPipe
        ),
        _ => false,
    }
}

/// What a process that closed a connection unanswered has left where it listened, found
/// out by opening a new connection there (closed at once, so the process sees a connection
/// that ends without a word, which it drops).
pub(crate) enum AfterClose {
    /// It still accepts connections: it lives, and dropped the one it closed on purpose.
    Listening,
    /// Nothing listens there any more: it exited, or gave up and closed its listener.
    Gone,
    /// A new connection fails otherwise (why).
    Unreachable(String),
}

/// Finds out [`AfterClose`] at `addr`. Two connections a moment apart: a process that is
/// exiting may close the connection an instant before its listener.
pub(crate) fn after_close(addr: SocketAddr) -> AfterClose {
    let probe = || TcpStream::connect_timeout(&addr, Duration::from_secs(1)).map(drop);
    let outcome = probe().and_then(|()| {
        std::thread::sleep(Duration::from_millis(50));
        probe()
    });
    match outcome {
        Ok(()) => AfterClose::Listening,
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => AfterClose::Gone,
        Err(e) => AfterClose::Unreachable(e.to_string()),
    }
}

/// Why `peer` at `addr` closed the connection before answering this rank's hello.
fn closed_reason(peer: usize, addr: SocketAddr) -> String {
    match after_close(addr) {
        AfterClose::Listening => "it closed the connection without answering the hello while still listening: it does that to a hello whose job token or world size is not its own (PIPEFILL_TOKEN must be the same on every rank)".into(),
        AfterClose::Gone => format!(
            "it closed the connection before answering the hello and nothing listens at {addr} any more: rank {peer} exited or gave up (its own error says why)"
        ),
        AfterClose::Unreachable(e) => format!(
            "it closed the connection before answering the hello, and a new connection to {addr} fails ({e}): rank {peer} exited or cannot be reached"
        ),
    }
}

/// Opens the connection to `peer` (retrying until `deadline`: it may not listen yet) and
/// runs the dialling side of the handshake.
pub(crate) fn dial(
    rank: usize,
    world: usize,
    peer: usize,
    addr: SocketAddr,
    deadline: Instant,
    opts: &MeshOptions,
) -> Result<TcpStream, CommError> {
    let mut stream = loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(_) => {
                return Err(CommError::MeshTimeout {
                    rank,
                    missing: vec![peer],
                    timeout: opts.connect_timeout,
                });
            }
        }
    };
    let handshake = |reason: String| CommError::Handshake { rank, peer, reason };
    let hello = Hello {
        token: opts.token.clone(),
        rank: rank as u32,
        world: world as u32,
    };
    let _ = stream.set_read_timeout(Some(opts.connect_timeout));
    let failed = |e: CommError| match closed(&e) {
        true => handshake(closed_reason(peer, addr)),
        false => handshake(e.to_string()),
    };
    frame::send_msg(&mut stream, &hello, HANDSHAKE_CAP).map_err(failed)?;
    let answer: Hello = frame::recv_msg(&mut stream, HANDSHAKE_CAP).map_err(failed)?;
    if !same_token(&answer.token, &opts.token) || answer.rank as usize != peer {
        return Err(handshake(format!(
            "answered as rank {} with {} token",
            answer.rank,
            if same_token(&answer.token, &opts.token) {
                "the job's"
            } else {
                "a wrong"
            }
        )));
    }
    Ok(stream)
}

/// The accepting side of the handshake: reads the [`Hello`] (nothing before it), checks it
/// and answers. Returns the peer's rank, or why the connection is refused.
pub(crate) fn admit(
    rank: usize,
    world: usize,
    mut stream: TcpStream,
    opts: &MeshOptions,
) -> Result<(usize, TcpStream), String> {
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    let _ = stream.set_read_timeout(Some(opts.handshake_timeout));
    let hello: Hello = frame::recv_msg(&mut stream, HANDSHAKE_CAP).map_err(|e| e.to_string())?;
    if !same_token(&hello.token, &opts.token) {
        return Err("wrong job token".into());
    }
    if hello.world as usize != world || hello.rank as usize >= world {
        return Err(format!(
            "it claims rank {} of {} ranks, this job has {world}",
            hello.rank, hello.world
        ));
    }
    let answer = Hello {
        token: opts.token.clone(),
        rank: rank as u32,
        world: world as u32,
    };
    frame::send_msg(&mut stream, &answer, HANDSHAKE_CAP).map_err(|e| e.to_string())?;
    Ok((hello.rank as usize, stream))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Dials rank 0 at a listener that takes the hello and closes the connection unanswered,
    /// then (when `exit`) closes its listener too, as an exiting process does.
    fn dial_one_that_closes(exit: bool) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let _: Hello = frame::recv_msg(&mut stream, HANDSHAKE_CAP).unwrap();
            if exit {
                drop(listener);
                drop(stream);
                None
            } else {
                drop(stream);
                // Still listening while the dialler finds out.
                std::thread::sleep(Duration::from_millis(500));
                Some(listener)
            }
        });
        let mut opts = MeshOptions::new("tok");
        opts.connect_timeout = Duration::from_secs(5);
        let deadline = Instant::now() + opts.connect_timeout;
        let err = dial(1, 2, 0, addr, deadline, &opts)
            .unwrap_err()
            .to_string();
        let _ = peer.join();
        err
    }

    #[test]
    fn a_peer_that_exited_is_named_as_gone_not_as_a_token_mismatch() {
        let err = dial_one_that_closes(true);
        assert!(
            err.contains("nothing listens at") && err.contains("rank 0 exited"),
            "{err}"
        );
        assert!(!err.contains("token"), "{err}");
    }

    #[test]
    fn a_peer_that_drops_the_hello_and_lives_points_at_the_token() {
        let err = dial_one_that_closes(false);
        assert!(
            err.contains("without answering the hello while still listening"),
            "{err}"
        );
        assert!(err.contains("PIPEFILL_TOKEN"), "{err}");
    }
}
