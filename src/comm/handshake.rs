//! The first words on a mesh connection: the dialling rank's [`Hello`] (job token, rank,
//! world size) and the accepting rank's answer, which repeats the token, so both sides
//! know the other belongs to the job. Nothing else is read from a connection before its
//! hello, and the hello is read under the handshake cap and a read timeout.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::frame::{self, HANDSHAKE_CAP};
use super::tcp::{MeshError, MeshOptions};

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

/// Opens the connection to `peer` (retrying until `deadline`: it may not listen yet) and
/// runs the dialling side of the handshake.
pub(crate) fn dial(
    rank: usize,
    world: usize,
    peer: usize,
    addr: SocketAddr,
    deadline: Instant,
    opts: &MeshOptions,
) -> Result<TcpStream, MeshError> {
    let mut stream = loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(_) => {
                return Err(MeshError::Timeout {
                    rank,
                    missing: vec![peer],
                    timeout: opts.connect_timeout,
                });
            }
        }
    };
    let handshake = |reason: String| MeshError::Handshake { rank, peer, reason };
    let hello = Hello {
        token: opts.token.clone(),
        rank: rank as u32,
        world: world as u32,
    };
    let _ = stream.set_read_timeout(Some(opts.connect_timeout));
    frame::send_msg(&mut stream, &hello, HANDSHAKE_CAP).map_err(|e| handshake(e.to_string()))?;
    let answer: Hello =
        frame::recv_msg(&mut stream, HANDSHAKE_CAP).map_err(|e| handshake(e.to_string()))?;
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
