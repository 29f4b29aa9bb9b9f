//! The shared state of one rank's mesh ([`Inner`]): the writers to every peer, the
//! per-(peer, channel) inboxes and the registered sinks, the failure and goodbye flags, and
//! the reader loop each peer's thread runs. It is its own module because the mesh, its
//! heartbeat and the transports all act on it, while only [`super::TcpMesh`] is public.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::net::TcpStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::traffic::Sent;
use super::wire::{Sink, Wire};
use crate::comm::CommError;
use crate::comm::frame::{self};
use crate::comm::link::Channel;

#[derive(Default)]
pub(super) struct Boxes {
    pub(super) queues: HashMap<(usize, Channel), VecDeque<Vec<u8>>>,
    /// Peers that said goodbye.
    pub(super) gone: Vec<bool>,
    /// This rank closed its side.
    pub(super) closed: bool,
    /// This rank's work is done: a peer's connection ending now means it left, not died
    /// (its goodbye may be lost when it exits with unread bytes and the kernel resets).
    pub(super) quiet: bool,
    /// The first failure, naming the rank.
    pub(super) failure: Option<String>,
}

pub(crate) struct Inner {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) cap: usize,
    pub(super) writers: Vec<Option<Mutex<TcpStream>>>,
    pub(super) boxes: Mutex<Boxes>,
    pub(super) arrived: Condvar,
    pub(super) sinks: Mutex<HashMap<Channel, Arc<dyn Sink>>>,
    /// What this rank has written, for measuring a job's traffic.
    pub(super) sent: Mutex<Sent>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks is a single push, pop or flag: still consistent.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Inner {
    /// The ranks this mesh is connected to and that have not said goodbye.
    pub(crate) fn peers(&self) -> Vec<usize> {
        let boxes = lock(&self.boxes);
        (0..self.world)
            .filter(|&p| self.writers[p].is_some() && !boxes.gone[p])
            .collect()
    }

    /// Sends one wire frame to `to` as one write (length prefix and payload together).
    pub(crate) fn send_wire(&self, to: usize, wire: &Wire) -> Result<(), CommError> {
        let protocol = |e: CommError| CommError::Protocol {
            peer: to,
            reason: e.to_string(),
        };
        let payload = frame::encode(wire).map_err(protocol)?;
        let mut buf = Vec::with_capacity(payload.len() + 4);
        frame::write_frame(&mut buf, &payload, self.cap).map_err(protocol)?;
        let Some(Some(stream)) = self.writers.get(to) else {
            return Err(CommError::NoSuchRank {
                rank: to,
                world: self.world,
            });
        };
        let written = lock(stream).write_all(&buf);
        let Err(source) = written else {
            lock(&self.sent).add(wire, buf.len());
            return Ok(());
        };
        // A peer that said goodbye and exited is not dead; its goodbye may still be on its
        // way to the reader, so give it a moment before calling the peer dead.
        let mut boxes = lock(&self.boxes);
        let deadline = Instant::now() + Duration::from_millis(500);
        while !boxes.gone[to] && boxes.failure.is_none() && !boxes.closed && !boxes.quiet {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            boxes = self
                .arrived
                .wait_timeout(boxes, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let gone = boxes.gone[to] || boxes.quiet;
        drop(boxes);
        if !gone {
            self.fail(format!("rank {to} died: sending to it failed: {source}"));
        }
        Err(CommError::LinkIo { peer: to, source })
    }

    /// The first failure, naming the rank that caused it.
    pub(crate) fn failure(&self) -> Option<String> {
        lock(&self.boxes).failure.clone()
    }

    /// Fails the mesh (first failure wins): logs it, closes every sink, wakes receivers
    /// and tells the peers why.
    pub(crate) fn fail(&self, reason: String) {
        if self.fail_here(reason.clone()) {
            // The sockets stay open, and every peer hears the reason first: when this
            // rank's process exits its connections end, and a peer that had not yet seen
            // the cause itself would otherwise blame this rank for a death it only
            // witnessed.
            self.tell_peers(&Wire::Failed { reason });
        }
    }

    /// [`Inner::fail`] without telling the peers; whether this was the first failure.
    pub(super) fn fail_here(&self, reason: String) -> bool {
        let mut boxes = lock(&self.boxes);
        if boxes.failure.is_some() || boxes.closed {
            return false;
        }
        tracing::error!("rank {}: {reason}", self.rank);
        boxes.failure = Some(reason);
        drop(boxes);
        self.arrived.notify_all();
        for sink in lock(&self.sinks).values() {
            sink.close();
        }
        true
    }

    /// Best effort, never blocking on a busy link: a writer held by a send in progress
    /// (perhaps to the dead rank) is skipped.
    fn tell_peers(&self, wire: &Wire) {
        let Ok(payload) = frame::encode(wire) else {
            return;
        };
        let mut buf = Vec::with_capacity(payload.len() + 4);
        if frame::write_frame(&mut buf, &payload, self.cap).is_err() {
            return;
        }
        for (peer, writer) in self.writers.iter().enumerate() {
            let Some(writer) = writer else { continue };
            if peer == self.rank {
                continue;
            }
            if let Ok(mut stream) = writer.try_lock() {
                let _ = stream.write_all(&buf);
            }
        }
    }

    pub(super) fn reader(self: Arc<Self>, from: usize, mut stream: TcpStream, silence: Duration) {
        let _ = stream.set_read_timeout(Some(silence));
        loop {
            let wire = frame::read_frame(&mut stream, self.cap).and_then(|b| frame::decode(&b));
            match wire {
                Ok(Wire::Data { channel, bytes }) => {
                    // The sinks lock is held while a frame without a sink is queued, so a
                    // sink registered meanwhile (which drains the queue under that lock)
                    // cannot miss it.
                    let sinks = lock(&self.sinks);
                    if let Some(sink) = sinks.get(&channel).cloned() {
                        drop(sinks);
                        if let Err(e) = sink.deliver(from, bytes) {
                            self.fail(format!(
                                "rank {from} sent a bad frame on channel {channel}: {e}"
                            ));
                            return;
                        }
                    } else {
                        lock(&self.boxes)
                            .queues
                            .entry((from, channel))
                            .or_default()
                            .push_back(bytes);
                        drop(sinks);
                        self.arrived.notify_all();
                    }
                }
                Ok(Wire::Beat) => {}
                Ok(Wire::Bye) => {
                    lock(&self.boxes).gone[from] = true;
                    self.arrived.notify_all();
                    return;
                }
                Ok(Wire::Failed { reason }) => {
                    if !lock(&self.boxes).quiet {
                        self.fail(format!("{reason} (reported by rank {from})"));
                    }
                    return;
                }
                Err(e) => {
                    let mut boxes = lock(&self.boxes);
                    if boxes.quiet {
                        boxes.gone[from] = true;
                        drop(boxes);
                        self.arrived.notify_all();
                        return;
                    }
                    let closed = boxes.closed;
                    drop(boxes);
                    if !closed {
                        self.fail(match e {
                            CommError::Eof => format!("rank {from} died: its connection closed"),
                            CommError::Io(io)
                                if matches!(
                                    io.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) =>
                            {
                                format!("rank {from} died: no heartbeat for {silence:?}")
                            }
                            CommError::Io(io) => format!("rank {from} died: {io}"),
                            other => format!("rank {from} sent a bad frame: {other}"),
                        });
                    }
                    return;
                }
            }
        }
    }
}
