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

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::frame::{self, FrameError};
pub use super::handshake::Hello;
use super::handshake::{admit, dial};
use super::heartbeat::Heartbeat;
use super::link::{Channel, LinkError, PeerLink, check_peer};

/// A frame on an established connection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Wire {
    Data {
        channel: Channel,
        bytes: Vec<u8>,
    },
    /// Nothing to say; proves the peer is alive.
    Beat,
    /// The peer has sent everything and is leaving: its connection ending is not a failure.
    Bye,
    /// The peer's mesh failed for `reason` (which names the rank at fault) and it is about
    /// to exit: its connection ending next is a consequence, not the cause.
    Failed {
        reason: String,
    },
}

/// Settings of a mesh.
#[derive(Clone, Debug)]
pub struct MeshOptions {
    pub token: String,
    /// Cap on one frame (bytes).
    pub frame_cap: usize,
    /// How long setup may take before naming the ranks that did not connect.
    pub connect_timeout: Duration,
    /// Interval of heartbeats sent on every connection.
    pub beat: Duration,
    /// A peer silent for this long is declared dead.
    pub silence: Duration,
    /// How long an accepted connection may take to present its hello.
    pub handshake_timeout: Duration,
}

impl MeshOptions {
    pub fn new(token: impl Into<String>) -> Self {
        MeshOptions {
            token: token.into(),
            frame_cap: frame::DEFAULT_FRAME_CAP,
            connect_timeout: Duration::from_secs(60),
            beat: Duration::from_secs(1),
            silence: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a mesh could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("rank {rank}: {what}")]
    Io {
        rank: usize,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rank {rank}: ranks {missing:?} did not connect within {timeout:?}")]
    Timeout {
        rank: usize,
        missing: Vec<usize>,
        timeout: Duration,
    },
    #[error("rank {rank}: rank {peer} refused the connection or broke the handshake: {reason}")]
    Handshake {
        rank: usize,
        peer: usize,
        reason: String,
    },
    #[error("rank {rank}: {peers} peer addresses for a world of {world}")]
    Table {
        rank: usize,
        peers: usize,
        world: usize,
    },
}

/// Receives data frames of one channel as they arrive (on the peer's reader thread), and
/// is closed when the mesh fails.
pub trait Sink: Send + Sync {
    /// A frame from rank `from`. An error is a protocol violation by `from`: it fails the mesh.
    fn deliver(&self, from: usize, bytes: Vec<u8>) -> Result<(), String>;
    /// Nothing more will arrive; wake whoever waits.
    fn close(&self);
}

#[derive(Default)]
struct Boxes {
    queues: HashMap<(usize, Channel), VecDeque<Vec<u8>>>,
    /// Peers that said goodbye.
    gone: Vec<bool>,
    /// This rank closed its side.
    closed: bool,
    /// This rank's work is done: a peer's connection ending now means it left, not died
    /// (its goodbye may be lost when it exits with unread bytes and the kernel resets).
    quiet: bool,
    /// The first failure, naming the rank.
    failure: Option<String>,
}

pub(crate) struct Inner {
    rank: usize,
    world: usize,
    cap: usize,
    writers: Vec<Option<Mutex<TcpStream>>>,
    boxes: Mutex<Boxes>,
    arrived: Condvar,
    sinks: Mutex<HashMap<Channel, Arc<dyn Sink>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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
    pub(crate) fn send_wire(&self, to: usize, wire: &Wire) -> Result<(), LinkError> {
        let protocol = |e: FrameError| LinkError::Protocol {
            peer: to,
            reason: e.to_string(),
        };
        let payload = frame::encode(wire).map_err(protocol)?;
        let mut buf = Vec::with_capacity(payload.len() + 4);
        frame::write_frame(&mut buf, &payload, self.cap).map_err(protocol)?;
        let Some(Some(stream)) = self.writers.get(to) else {
            return Err(LinkError::NoSuchRank {
                rank: to,
                world: self.world,
            });
        };
        let written = lock(stream).write_all(&buf);
        let Err(source) = written else {
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
        Err(LinkError::Io { peer: to, source })
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
    fn fail_here(&self, reason: String) -> bool {
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

    fn reader(self: Arc<Self>, from: usize, mut stream: TcpStream, silence: Duration) {
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
                            FrameError::Eof => format!("rank {from} died: its connection closed"),
                            FrameError::Io(io)
                                if matches!(
                                    io.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) =>
                            {
                                format!("rank {from} died: no heartbeat for {silence:?}")
                            }
                            FrameError::Io(io) => format!("rank {from} died: {io}"),
                            other => format!("rank {from} sent a bad frame: {other}"),
                        });
                    }
                    return;
                }
            }
        }
    }
}

/// The TCP mesh of one rank (see the module docs).
pub struct TcpMesh {
    inner: Arc<Inner>,
    heartbeat: Mutex<Option<Heartbeat>>,
}

impl TcpMesh {
    /// Connects rank `rank` to every other rank: `listener` is this rank's bound listener,
    /// `peers[r]` where rank r listens (this rank's own entry is ignored).
    pub fn connect(
        rank: usize,
        listener: TcpListener,
        peers: &[SocketAddr],
        opts: &MeshOptions,
    ) -> Result<TcpMesh, MeshError> {
        let world = peers.len();
        if rank >= world {
            return Err(MeshError::Table {
                rank,
                peers: world,
                world: rank + 1,
            });
        }
        let deadline = Instant::now() + opts.connect_timeout;
        let io = |what: String| move |source| MeshError::Io { rank, what, source };
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for (peer, addr) in peers.iter().enumerate().take(rank) {
            streams[peer] = Some(dial(rank, world, peer, *addr, deadline, opts)?);
        }
        listener
            .set_nonblocking(true)
            .map_err(io("listener".into()))?;
        // Handshakes run on threads of their own (see the module docs); admitted
        // connections come back here, where duplicates are refused in arrival order.
        let (admitted, handshakes) =
            std::sync::mpsc::channel::<(SocketAddr, Result<(usize, TcpStream), String>)>();
        while streams[rank + 1..].iter().any(Option::is_none) {
            while let Ok((from, outcome)) = handshakes.try_recv() {
                match outcome {
                    Ok((peer, stream)) if peer > rank && streams[peer].is_none() => {
                        streams[peer] = Some(stream)
                    }
                    Ok((peer, _)) => tracing::error!(
                        "rank {rank}: refused a second or unexpected connection claiming rank {peer} from {from}"
                    ),
                    Err(reason) => {
                        tracing::error!("rank {rank}: refused connection from {from}: {reason}")
                    }
                }
            }
            if !streams[rank + 1..].iter().any(Option::is_none) {
                break;
            }
            match listener.accept() {
                Ok((stream, from)) => {
                    let (admitted, opts) = (admitted.clone(), opts.clone());
                    let dispatch = tracing::dispatcher::get_default(Clone::clone);
                    std::thread::Builder::new()
                        .name(format!("pipefill-handshake-{from}"))
                        .spawn(move || {
                            tracing::dispatcher::with_default(&dispatch, || {
                                let outcome = admit(rank, world, stream, &opts);
                                if let Err(returned) = admitted.send((from, outcome)) {
                                    // Setup is over (done or failed): nobody reads this one.
                                    if let (from, Err(reason)) = returned.0 {
                                        tracing::error!(
                                            "rank {rank}: dropped connection from {from}: {reason}"
                                        );
                                    }
                                }
                            })
                        })
                        .map_err(io("handshake thread".into()))?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing = (rank + 1..world)
                            .filter(|&r| streams[r].is_none())
                            .collect();
                        return Err(MeshError::Timeout {
                            rank,
                            missing,
                            timeout: opts.connect_timeout,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(io("accepting a peer".into())(e)),
            }
        }
        let mut writers = Vec::with_capacity(world);
        let mut readers = Vec::new();
        for (peer, stream) in streams.into_iter().enumerate() {
            match stream {
                Some(s) => {
                    s.set_nonblocking(false)
                        .map_err(io(format!("socket to rank {peer}")))?;
                    let _ = s.set_nodelay(true);
                    let _ = s.set_write_timeout(Some(opts.silence.max(Duration::from_secs(10))));
                    let r = s
                        .try_clone()
                        .map_err(io(format!("socket to rank {peer}")))?;
                    readers.push((peer, r));
                    writers.push(Some(Mutex::new(s)));
                }
                None => writers.push(None),
            }
        }
        let inner = Arc::new(Inner {
            rank,
            world,
            cap: opts.frame_cap,
            writers,
            boxes: Mutex::new(Boxes {
                gone: vec![false; world],
                ..Boxes::default()
            }),
            arrived: Condvar::new(),
            sinks: Mutex::new(HashMap::new()),
        });
        for (peer, stream) in readers {
            let inner = Arc::clone(&inner);
            let silence = opts.silence;
            std::thread::Builder::new()
                .name(format!("pipefill-rx-{peer}"))
                .spawn(move || inner.reader(peer, stream, silence))
                .map_err(io("reader thread".into()))?;
        }
        let heartbeat = Heartbeat::start(Arc::clone(&inner), opts.beat);
        Ok(TcpMesh {
            inner,
            heartbeat: Mutex::new(Some(heartbeat)),
        })
    }

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

    fn send(&self, to: usize, channel: Channel, frame: &[u8]) -> Result<(), LinkError> {
        check_peer(self.inner.rank, self.inner.world, to, channel)?;
        {
            let boxes = lock(&self.inner.boxes);
            if boxes.closed || boxes.failure.is_some() || boxes.gone[to] {
                return Err(LinkError::Closed { peer: to, channel });
            }
        }
        let wire = Wire::Data {
            channel,
            bytes: frame.to_vec(),
        };
        self.inner.send_wire(to, &wire)
    }

    fn recv(&self, from: usize, channel: Channel) -> Result<Vec<u8>, LinkError> {
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
                return Err(LinkError::Protocol {
                    peer: from,
                    reason: reason.clone(),
                });
            }
            if boxes.gone[from] || boxes.closed {
                return Err(LinkError::Closed {
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
    fn close(&self) -> Result<(), LinkError> {
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
        self.inner.arrived.notify_all();
        Ok(())
    }
}

#[cfg(test)]
#[path = "tcp_tests.rs"]
mod tests;
