//! [`TcpMesh`]: one authenticated TCP connection between every pair of ranks of a job, and
//! numbered channels of byte frames over it (the [`PeerLink`] seam).
//!
//! Setup ([`TcpMesh::connect`]), after the rendezvous has told every rank where the others
//! listen: rank r dials every rank below it and accepts one connection from every rank
//! above it. The dialling side speaks first with a [`Hello`] (job token, its rank, the
//! world size); the accepting side reads nothing else before it, under the small handshake
//! cap and a read timeout, and drops a connection whose token is wrong with a logged error
//! (`handshake.rs`).
//! The answer repeats the token, so both sides know the other belongs to the job. Each
//! accepted connection's handshake runs on a thread of its own, so a connection that
//! stays silent (or is slow) until its handshake timeout never delays the ranks behind it.
//!
//! Then one reader thread per peer reads [`Wire`] frames: data frames go to the channel's
//! sink when one is registered (the runtime's transports, [`super::tcp_transport`]), else
//! into a FIFO per (peer, channel) that [`PeerLink::recv`] waits on. Heartbeats
//! ([`super::heartbeat`]) keep an idle connection alive; a peer that disconnects without
//! saying goodbye, sends nothing for the silence timeout, or sends a bad frame fails the
//! whole mesh with an error naming that rank: every sink is closed and every receiver wakes.
//!
//! The parts: `setup` builds a mesh ([`TcpMesh::connect`], [`TcpMesh::loopback`]);
//! `inner` holds the state every thread of the mesh shares and the reader loop; `traffic`
//! counts what the mesh writes; this module the wire frame, the options and errors, and
//! the mesh's API.

use std::collections::VecDeque;
use std::net::Shutdown;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

pub use super::handshake::Hello;
use super::heartbeat::Heartbeat;
use super::link::{Channel, PeerLink, check_peer};
use crate::comm::CommError;

pub(crate) mod inner;
pub mod options;
mod setup;
pub mod traffic;
pub(crate) mod wire;

pub(crate) use inner::Inner;
use inner::lock;
pub use options::MeshOptions;
pub use traffic::{Sent, Traffic};
pub use wire::{Sink, Wire};

/// The TCP mesh of one rank (see the module docs).
pub struct TcpMesh {
    inner: Arc<Inner>,
    heartbeat: Mutex<Option<Heartbeat>>,
}

impl TcpMesh {
    /// Routes every data frame of `channel` to `sink` from now on, starting with those that
    /// arrived before (a peer may send before this rank registers), in arrival order.
    pub fn register(&self, channel: Channel, sink: Arc<dyn Sink>) {
        let mut sinks = lock(&self.inner.sinks);
        let (failed, early) = {
            let mut boxes = lock(&self.inner.boxes);
            let keys: Vec<_> = boxes
                .queues
                .keys()
                .filter(|(_, c)| *c == channel)
                .copied()
                .collect();
            let early: Vec<_> = keys
                .into_iter()
                .filter_map(|k| boxes.queues.remove(&k).map(|q| (k.0, q)))
                .collect();
            (boxes.failure.is_some(), early)
        };
        for (from, frames) in early {
            for bytes in frames {
                if let Err(e) = sink.deliver(from, bytes) {
                    drop(sinks);
                    self.inner.fail(format!(
                        "rank {from} sent a bad frame on channel {channel}: {e}"
                    ));
                    sink.close();
                    return;
                }
            }
        }
        if failed {
            sink.close();
        }
        sinks.insert(channel, sink);
    }

    /// The first failure (naming the rank that caused it), if the mesh failed.
    pub fn failure(&self) -> Option<String> {
        self.inner.failure()
    }

    /// A wait for the mesh's failure, to run on another thread: returns the failure once
    /// there is one (never, if the mesh closes cleanly first).
    pub fn failure_watch(&self) -> impl FnOnce() -> String + Send + 'static {
        let inner = Arc::clone(&self.inner);
        move || {
            let mut boxes = lock(&inner.boxes);
            loop {
                if let Some(reason) = &boxes.failure {
                    return reason.clone();
                }
                boxes = inner
                    .arrived
                    .wait(boxes)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
    }

    /// This rank's work is done but its mesh stays open to hear the others leave: from now
    /// on a peer's connection ending is its leaving, not its death.
    pub fn quiesce(&self) {
        lock(&self.inner.boxes).quiet = true;
    }

    /// Waits until `peer` has left (goodbye or, once quiesced, end of connection), the mesh
    /// failed, or `timeout` passed; true when it left.
    pub fn wait_gone(&self, peer: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut boxes = lock(&self.inner.boxes);
        loop {
            if boxes.gone.get(peer).copied().unwrap_or(true) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || boxes.failure.is_some() {
                return false;
            }
            boxes = self
                .inner
                .arrived
                .wait_timeout(boxes, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// What this rank has written to its peers so far.
    pub fn sent(&self) -> Sent {
        lock(&self.inner.sent).clone()
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    /// Fails the mesh on purpose (a local error) and shuts its sockets: peers see this
    /// rank die (the fault is this rank's, so they are not told another cause).
    pub fn abort(&self, reason: String) {
        self.inner.fail_here(reason);
        for s in self.inner.writers.iter().flatten() {
            let _ = lock(s).shutdown(Shutdown::Both);
        }
    }
}

impl Drop for TcpMesh {
    fn drop(&mut self) {
        let _ = PeerLink::close(self);
    }
}

impl PeerLink for TcpMesh {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world(&self) -> usize {
        self.inner.world
    }

    fn send(&self, to: usize, channel: Channel, frame: &[u8]) -> Result<(), CommError> {
        check_peer(self.inner.rank, self.inner.world, to, channel)?;
        {
            let boxes = lock(&self.inner.boxes);
            if boxes.closed || boxes.failure.is_some() || boxes.gone[to] {
                return Err(CommError::Closed { peer: to, channel });
            }
        }
        let wire = Wire::Data {
            channel,
            bytes: frame.to_vec(),
        };
        self.inner.send_wire(to, &wire)
    }

    fn recv(&self, from: usize, channel: Channel) -> Result<Vec<u8>, CommError> {
        check_peer(self.inner.rank, self.inner.world, from, channel)?;
        let mut boxes = lock(&self.inner.boxes);
        loop {
            if let Some(f) = boxes
                .queues
                .get_mut(&(from, channel))
                .and_then(VecDeque::pop_front)
            {
                return Ok(f);
            }
            if let Some(reason) = &boxes.failure {
                return Err(CommError::Protocol {
                    peer: from,
                    reason: reason.clone(),
                });
            }
            if boxes.gone[from] || boxes.closed {
                return Err(CommError::Closed {
                    peer: from,
                    channel,
                });
            }
            boxes = self
                .inner
                .arrived
                .wait(boxes)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Says goodbye to every peer (after everything already sent) and stops the heartbeat.
    fn close(&self) -> Result<(), CommError> {
        let already = std::mem::replace(&mut lock(&self.inner.boxes).closed, true);
        if already {
            return Ok(());
        }
        if let Some(hb) = lock(&self.heartbeat).take() {
            hb.stop();
        }
        for peer in (0..self.inner.world).filter(|&p| p != self.inner.rank) {
            // A peer that already left cannot hear it; that is fine.
            let _ = self.inner.send_wire(peer, &Wire::Bye);
        }
        tracing::info!("rank {} sent {}", self.inner.rank, self.sent());
        self.inner.arrived.notify_all();
        Ok(())
    }
}

#[cfg(test)]
#[path = "tcp_tests.rs"]
mod tests;
