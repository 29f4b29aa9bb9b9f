//! Setting a mesh up: [`TcpMesh::connect`] (dial the ranks below, admit the ranks above,
//! each admission's handshake on its own thread, at most [`pending_cap`] at once; see the
//! module docs of [`super`]) and
//! [`TcpMesh::loopback`], every rank of a mesh on this machine's loopback, as the tests
//! build it.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::TcpMesh;
use super::inner::{Boxes, Inner};
use super::options::MeshOptions;
use crate::comm::CommError;
use crate::comm::handshake::{admit, dial};
use crate::comm::heartbeat::Heartbeat;
use crate::comm::rendezvous::pending_cap;

/// Counts a handshake thread for as long as it lives (a panic included).
struct Admitting(Arc<AtomicUsize>);

impl Drop for Admitting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl TcpMesh {
    /// Connects rank `rank` to every other rank: `listener` is this rank's bound listener,
    /// `peers[r]` where rank r listens (this rank's own entry is ignored).
    pub fn connect(
        rank: usize,
        listener: TcpListener,
        peers: &[SocketAddr],
        opts: &MeshOptions,
    ) -> Result<TcpMesh, CommError> {
        let world = peers.len();
        if rank >= world {
            return Err(CommError::Table {
                rank,
                peers: world,
                world: rank + 1,
            });
        }
        let deadline = Instant::now() + opts.connect_timeout;
        let io = |what: String| move |source| CommError::MeshIo { rank, what, source };
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
        // A flood of connections that never finish their handshake starts no more than
        // `cap` threads: past it the next connection waits in the listen backlog until a
        // handshake ends (each is bounded by the handshake's own timeout).
        let (admitting, cap) = (Arc::new(AtomicUsize::new(0)), pending_cap(world));
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
            let accepted = match admitting.load(Ordering::Acquire) < cap {
                true => listener.accept(),
                false => Err(std::io::ErrorKind::WouldBlock.into()),
            };
            match accepted {
                Ok((stream, from)) => {
                    let (admitted, opts) = (admitted.clone(), opts.clone());
                    admitting.fetch_add(1, Ordering::AcqRel);
                    let guard = Admitting(Arc::clone(&admitting));
                    let dispatch = tracing::dispatcher::get_default(Clone::clone);
                    std::thread::Builder::new()
                        .name(format!("pipefill-handshake-{from}"))
                        .spawn(move || {
                            let _counted = guard;
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
                        return Err(CommError::MeshTimeout {
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
            sent: Mutex::default(),
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

    /// The meshes of `world` ranks on loopback (127.0.0.1, ports the OS picks), in rank
    /// order, each end connected on a thread of its own as separate processes would
    /// connect theirs: for tests and single-machine experiments.
    pub fn loopback(world: usize, opts: &MeshOptions) -> Result<Vec<TcpMesh>, CommError> {
        let io = |rank: usize, what: &str| {
            let what = what.to_string();
            move |source| CommError::MeshIo { rank, what, source }
        };
        let listeners = (0..world)
            .map(|rank| TcpListener::bind("127.0.0.1:0").map_err(io(rank, "listener on 127.0.0.1")))
            .collect::<Result<Vec<_>, _>>()?;
        let addrs = listeners
            .iter()
            .enumerate()
            .map(|(rank, l)| l.local_addr().map_err(io(rank, "listener address")))
            .collect::<Result<Vec<_>, _>>()?;
        let ends: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let (addrs, opts) = (addrs.clone(), opts.clone());
                std::thread::spawn(move || TcpMesh::connect(rank, l, &addrs, &opts))
            })
            .collect();
        ends.into_iter()
            .map(|end| {
                end.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    }
}
