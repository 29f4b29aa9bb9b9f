//! A rank's mesh setup under a flood of silent connections (issue 19, item 7a's neighbour:
//! the rendezvous was bounded, the mesh listener still started one handshake thread per
//! accepted connection): at most `pending_cap` handshakes run at once, the rest wait in the
//! listen backlog, and the real peer behind the flood still connects. Its own test binary,
//! so that the process's thread count is the mesh setup's alone.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use pipefill::comm::rendezvous::pending_cap;
use pipefill::comm::tcp::{MeshOptions, TcpMesh};

mod common;
use common::threads;

/// Silent connections: more than the cap, fewer than the listen backlog (128) holds.
const FLOOD: usize = 120;

#[test]
fn a_flood_of_silent_connections_starts_at_most_the_cap_of_handshake_threads() {
    let listeners: Vec<TcpListener> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let peers: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let opts = MeshOptions {
        handshake_timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_secs(30),
        ..MeshOptions::new("t")
    };
    let cap = pending_cap(2);
    assert!(FLOOD > cap);
    let before = threads();
    let mut listeners = listeners.into_iter();
    let (l0, l1) = (listeners.next().unwrap(), listeners.next().unwrap());
    let rank0 = {
        let (peers, opts) = (peers.clone(), opts.clone());
        std::thread::spawn(move || TcpMesh::connect(0, l0, &peers, &opts))
    };
    let mut silent = Vec::with_capacity(FLOOD);
    let mut peak = 0;
    for _ in 0..FLOOD {
        silent.push(TcpStream::connect(peers[0]).unwrap());
        peak = peak.max(threads());
    }
    // The real rank 1 dials behind the flood and waits for its turn.
    let started = Instant::now();
    let rank1 = std::thread::spawn(move || TcpMesh::connect(1, l1, &peers, &opts));
    while !rank1.is_finished() {
        peak = peak.max(threads());
        std::thread::sleep(Duration::from_millis(20));
    }
    rank1
        .join()
        .unwrap()
        .expect("rank 1 connects behind the flood");
    rank0.join().unwrap().expect("rank 0 connects");
    println!(
        "peak {peak} threads ({before} before), rank 1 connected after {:?}",
        started.elapsed()
    );
    // The test's own threads: rank 0's and rank 1's setups, and the meshes' readers.
    assert!(
        peak <= before + cap + 8,
        "{peak} threads at the peak, {before} before, cap {cap}"
    );
}
