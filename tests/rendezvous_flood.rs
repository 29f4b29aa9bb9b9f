//! Rank 0's rendezvous under a flood of silent connections (issue 19, item 7a): it starts
//! no thread per connection, keeps at most `pending_cap` of them open, and a real rank
//! that connects in the middle of the flood still joins at once. Its own test binary, so
//! that the process's thread count is the rendezvous's alone.

use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use pipefill::comm::rendezvous::{join, pending_cap, serve_with};

mod common;
use common::threads;

/// As many silent connections as the 905 (well within a 1024-descriptor limit
/// when rank 0 keeps only `pending_cap` of its ends open).
const FLOOD: usize = 900;

/// How many file descriptors this process holds open.
fn descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Whether rank 0 closed `s` (its end of stream is there to read).
fn closed_by_rank_0(s: &mut TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    match s.read(&mut [0u8; 1]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) if e.kind() == ErrorKind::WouldBlock => false,
        Err(_) => true,
    }
}

#[test]
fn a_flood_of_silent_connections_starts_no_threads_and_keeps_no_rank_out() {
    let master = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = master.local_addr().unwrap();
    let own: Vec<SocketAddr> = (0..3)
        .map(|r| format!("127.0.0.1:{}", 43000 + r).parse().unwrap())
        .collect();
    let joiner = |rank: usize| {
        let own = own[rank];
        std::thread::spawn(move || {
            let start = Instant::now();
            join(rank, 3, addr, own, "t", Duration::from_secs(20)).map(|t| (t, start.elapsed()))
        })
    };
    let (before, fds_before) = (threads(), descriptors());
    let server = {
        let own = own[0];
        std::thread::spawn(move || {
            let timeout = Duration::from_secs(30);
            serve_with(&master, 3, own, "t", timeout, timeout)
        })
    };
    let mut silent = Vec::with_capacity(FLOOD);
    let (mut peak, mut peak_fds) = (0, 0);
    let mut first = None;
    for i in 0..FLOOD {
        silent.push(TcpStream::connect(addr).unwrap());
        if i % 25 == 0 {
            peak = peak.max(threads());
            // Rank 0's ends of the connections open now, past this side's i + 1.
            peak_fds = peak_fds.max(descriptors().saturating_sub(fds_before + i + 1));
        }
        // Rank 1 registers half-way through the flood, which goes on around it.
        if i == FLOOD / 2 {
            first = Some(joiner(1));
        }
    }
    // Rank 2 once all of it is there (the rendezvous waits for it).
    let (table, took) = joiner(2).join().unwrap().unwrap();
    assert_eq!(table, own);
    assert!(
        took < Duration::from_secs(3),
        "rank 2 joined after {took:?}"
    );
    assert_eq!(first.unwrap().join().unwrap().unwrap().0, own);
    assert_eq!(server.join().unwrap().unwrap(), own);
    // Rank 0 kept at most its cap of silent connections open at any time (a few more
    // descriptors: the ranks' connections, the test's threads' own), and closed the rest
    // when the rendezvous ended.
    let cap = pending_cap(3);
    assert!(
        peak_fds <= cap + 8,
        "rank 0 held {peak_fds} connections open at once, over its cap of {cap}"
    );
    let closed = silent
        .iter_mut()
        .map(closed_by_rank_0)
        .filter(|&c| c)
        .count();
    assert_eq!(
        closed, FLOOD,
        "rank 0 left connections open after the rendezvous"
    );
    // The test's own threads: the server, the joiners; no thread per connection.
    let added = peak.saturating_sub(before);
    assert!(
        added <= 4,
        "{FLOOD} silent connections added {added} threads (from {before} to {peak})"
    );
    println!(
        "{FLOOD} silent connections: threads {before} before, at most {peak} during; at most {peak_fds} of them open on rank 0's side (cap {cap}); rank 2 joined in {took:?} after the flood"
    );
}
