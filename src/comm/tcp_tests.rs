use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::comm::CommError;
use crate::comm::frame::{self, HANDSHAKE_CAP};

#[test]
fn frames_flow_between_every_pair_in_order_per_channel() {
    let m = TcpMesh::loopback(3, &MeshOptions::new("tok")).unwrap();
    m[0].send(2, 7, b"a").unwrap();
    m[0].send(2, 9, b"x").unwrap();
    m[0].send(2, 7, b"b").unwrap();
    m[1].send(2, 7, b"c").unwrap();
    m[2].send(0, 1, b"back").unwrap();
    assert_eq!(m[2].recv(0, 9).unwrap(), b"x");
    assert_eq!(m[2].recv(1, 7).unwrap(), b"c");
    assert_eq!(m[2].recv(0, 7).unwrap(), b"a");
    assert_eq!(m[2].recv(0, 7).unwrap(), b"b");
    assert_eq!(m[0].recv(2, 1).unwrap(), b"back");
    assert!(matches!(
        m[0].send(0, 1, b""),
        Err(CommError::ToSelf {
            rank: 0,
            channel: 1
        })
    ));
}

#[test]
fn a_goodbye_ends_receives_from_that_peer_without_failing_the_mesh() {
    let m = TcpMesh::loopback(2, &MeshOptions::new("tok")).unwrap();
    m[1].send(0, 3, b"last").unwrap();
    m[1].close().unwrap();
    assert_eq!(m[0].recv(1, 3).unwrap(), b"last");
    assert!(matches!(
        m[0].recv(1, 3),
        Err(CommError::Closed {
            peer: 1,
            channel: 3
        })
    ));
    assert_eq!(m[0].failure(), None);
}

#[test]
fn a_peer_that_dies_fails_the_mesh_naming_it() {
    let m = TcpMesh::loopback(3, &MeshOptions::new("tok")).unwrap();
    let start = Instant::now();
    // Shuts rank 2's sockets without a goodbye, as a killed process's kernel does.
    m[2].abort("test kill".into());
    let err = m[0].recv(1, 0).unwrap_err();
    assert!(err.to_string().contains("rank 2 died"), "{err}");
    while m[1].failure().is_none() {
        assert!(start.elapsed() < Duration::from_secs(2));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(m[1].failure().unwrap().contains("rank 2 died"));
    assert!(start.elapsed() < Duration::from_secs(2));
}

/// A rank that witnessed a death tells its peers before its own connections end, so a
/// peer that had not seen the death itself names the dead rank, not the witness.
#[test]
fn a_witness_of_a_death_passes_the_cause_on_before_it_exits() {
    let m = TcpMesh::loopback(3, &MeshOptions::new("tok")).unwrap();
    m[1].inner()
        .fail("rank 7 died: its connection closed".into());
    // The witness's process exits: its sockets end without a goodbye.
    for s in m[1].inner().writers.iter().flatten() {
        let _ = lock(s).shutdown(Shutdown::Both);
    }
    let err = m[0].recv(2, 0).unwrap_err();
    let failure = m[0].failure().unwrap();
    assert!(
        failure.contains("rank 7 died") && failure.contains("reported by rank 1"),
        "{failure} / {err}"
    );
    assert!(!failure.contains("rank 1 died"), "{failure}");
}

#[test]
fn a_silent_peer_is_declared_dead_after_the_silence_window() {
    let mut opts = MeshOptions::new("tok");
    opts.beat = Duration::from_secs(3600);
    opts.silence = Duration::from_millis(300);
    let m = TcpMesh::loopback(2, &opts).unwrap();
    let start = Instant::now();
    // Both ranks are silent: the first to notice fails its mesh (closing its sockets), so
    // the other sees the connection end instead. One of them must name the silence.
    assert!(m[0].recv(1, 0).is_err());
    while m[1].failure().is_none() {
        assert!(start.elapsed() < Duration::from_secs(3));
        std::thread::sleep(Duration::from_millis(5));
    }
    let failures = [m[0].failure().unwrap(), m[1].failure().unwrap()];
    assert!(
        failures
            .iter()
            .any(|f| f.contains("no heartbeat for 300ms")),
        "{failures:?}"
    );
}

#[test]
fn heartbeats_keep_an_idle_mesh_alive() {
    let mut opts = MeshOptions::new("tok");
    opts.beat = Duration::from_millis(50);
    opts.silence = Duration::from_millis(400);
    let m = TcpMesh::loopback(2, &opts).unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(m[0].failure(), None);
    assert_eq!(m[1].failure(), None);
}

#[test]
fn a_wrong_token_is_refused_before_anything_else_is_read() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut opts = MeshOptions::new("right");
    opts.connect_timeout = Duration::from_millis(1500);
    let peers = vec![addr, "127.0.0.1:9".parse().unwrap()];
    let server = std::thread::spawn(move || TcpMesh::connect(0, listener, &peers, &opts));
    // An intruder with the wrong token, then one sending an oversized length prefix.
    let mut wrong = TcpStream::connect(addr).unwrap();
    let hello = Hello {
        token: "wrong".into(),
        rank: 1,
        world: 2,
    };
    frame::send_msg(&mut wrong, &hello, HANDSHAKE_CAP).unwrap();
    let mut huge = TcpStream::connect(addr).unwrap();
    huge.write_all(&u32::MAX.to_le_bytes()).unwrap();
    // Both connections are closed without an answer.
    let _ = wrong.set_read_timeout(Some(Duration::from_secs(5)));
    assert!(matches!(
        frame::read_frame(&mut wrong, HANDSHAKE_CAP),
        Err(CommError::Eof) | Err(CommError::Io(_))
    ));
    let err = server.join().unwrap().err().unwrap();
    assert!(
        err.to_string().contains("ranks [1] did not connect"),
        "{err}"
    );
}

#[test]
fn a_sink_receives_its_channel_and_is_closed_on_failure() {
    use std::sync::Mutex;
    #[derive(Default)]
    struct Rec(Mutex<(Vec<Vec<u8>>, bool)>);
    impl Sink for Rec {
        fn deliver(&self, _from: usize, bytes: Vec<u8>) -> Result<(), String> {
            self.0.lock().unwrap().0.push(bytes);
            Ok(())
        }
        fn close(&self) {
            self.0.lock().unwrap().1 = true;
        }
    }
    let m = TcpMesh::loopback(2, &MeshOptions::new("tok")).unwrap();
    // A frame sent before the sink is registered reaches it first.
    m[1].send(0, 5, b"early").unwrap();
    m[1].send(0, 6, b"p").unwrap();
    assert_eq!(m[0].recv(1, 6).unwrap(), b"p");
    let rec = Arc::new(Rec::default());
    m[0].register(5, Arc::clone(&rec) as Arc<dyn Sink>);
    m[1].send(0, 5, b"s").unwrap();
    m[1].send(0, 6, b"q").unwrap();
    assert_eq!(m[0].recv(1, 6).unwrap(), b"q");
    assert_eq!(
        rec.0.lock().unwrap().0,
        vec![b"early".to_vec(), b"s".to_vec()]
    );
    m[1].abort("test kill".into());
    let t = Instant::now();
    while !rec.0.lock().unwrap().1 {
        assert!(t.elapsed() < Duration::from_secs(2), "sink not closed");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn once_quiesced_a_peer_ending_its_connection_has_left_not_died() {
    let m = TcpMesh::loopback(3, &MeshOptions::new("tok")).unwrap();
    m[0].quiesce();
    assert!(!m[0].wait_gone(2, Duration::from_millis(50)));
    // Rank 2 vanishes without a goodbye: rank 0, whose work is done, sees it leave;
    // rank 1, still working, sees it die.
    m[2].abort("test kill".into());
    assert!(m[0].wait_gone(2, Duration::from_secs(2)));
    assert_eq!(m[0].failure(), None);
    assert!(!m[1].wait_gone(2, Duration::from_secs(2)));
    assert!(m[1].failure().unwrap().contains("rank 2 died"));
}

#[test]
fn a_silent_connection_does_not_delay_a_real_rank_and_is_dropped_with_a_logged_error() {
    let listeners: Vec<TcpListener> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let mut opts = MeshOptions::new("tok");
    opts.handshake_timeout = Duration::from_secs(3);
    // It connects before the real rank and never says a word.
    let mut silent = TcpStream::connect(addrs[0]).unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let log = crate::comm::test_log::LogBuf::default();
    let start = Instant::now();
    let mut listeners = listeners.into_iter();
    let (l0, l1) = (listeners.next().unwrap(), listeners.next().unwrap());
    let rank0 = {
        let (addrs, opts, log) = (addrs.clone(), opts.clone(), log.clone());
        std::thread::spawn(move || {
            tracing::subscriber::with_default(log.subscriber(), || {
                TcpMesh::connect(0, l0, &addrs, &opts)
            })
        })
    };
    let rank1 = std::thread::spawn(move || TcpMesh::connect(1, l1, &addrs, &opts));
    let (m0, m1) = (
        rank0.join().unwrap().unwrap(),
        rank1.join().unwrap().unwrap(),
    );
    // Well before the silent connection's 3 s handshake timeout.
    let joined = start.elapsed();
    assert!(joined < Duration::from_secs(2), "joined after {joined:?}");
    m1.send(0, 4, b"hi").unwrap();
    assert_eq!(m0.recv(1, 4).unwrap(), b"hi");
    // The silent connection is closed once its handshake times out, with a logged error.
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert!(matches!(
        frame::read_frame(&mut silent, HANDSHAKE_CAP),
        Err(CommError::Eof) | Err(CommError::Io(_))
    ));
    let needle = format!("dropped connection from {silent_addr}");
    let line = log.wait_for(&needle, Duration::from_secs(5));
    assert!(line.is_some(), "no {needle:?} in the log:\n{}", log.text());
}
