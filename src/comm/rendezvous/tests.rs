use super::*;
use proptest::prelude::*;

use crate::comm::CommError;

fn local() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").unwrap()
}

#[test]
fn every_rank_gets_the_same_table() {
    let master = local();
    let addr = master.local_addr().unwrap();
    let own: Vec<SocketAddr> = (0..3)
        .map(|r| format!("127.0.0.1:{}", 40000 + r).parse().unwrap())
        .collect();
    let joiners: Vec<_> = (1..3)
        .map(|r| {
            let own = own[r];
            std::thread::spawn(move || join(r, 3, addr, own, "t", Duration::from_secs(10)))
        })
        .collect();
    let table = serve(&master, 3, own[0], "t", Duration::from_secs(10)).unwrap();
    assert_eq!(table, own);
    for j in joiners {
        assert_eq!(j.join().unwrap().unwrap(), own);
    }
}

#[test]
fn a_wrong_token_and_garbage_are_refused_and_a_missing_rank_is_named() {
    let master = local();
    let addr = master.local_addr().unwrap();
    let own: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let intruder = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        use std::io::Write;
        s.write_all(&[5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff])
            .unwrap();
        join(1, 3, addr, own, "wrong", Duration::from_secs(10))
    });
    let err = serve(&master, 3, own, "right", Duration::from_millis(1500)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "rendezvous: ranks [1, 2] did not join within 1.5 s"
    );
    // Dropped unanswered each time while rank 0 went on serving: a wrong token, said so.
    let err = intruder.join().unwrap().unwrap_err();
    assert!(
        matches!(err, CommError::WrongToken { attempts: 3, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("job token is not its own"),
        "{err}"
    );
}

#[test]
fn a_rank_whose_rank_0_exited_is_told_so_and_not_about_its_token() {
    let master = local();
    let addr = master.local_addr().unwrap();
    let own: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let joiner = std::thread::spawn(move || join(1, 2, addr, own, "t", Duration::from_secs(10)));
    // Rank 0 reads the registration, then exits: its listener and the connection close.
    let (mut stream, _) = master.accept().unwrap();
    let registration: Rendezvous = frame::recv_msg(&mut stream, HANDSHAKE_CAP).unwrap();
    assert_eq!(registration.kind(), "a registration");
    drop(master);
    drop(stream);
    let err = joiner.join().unwrap().unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, CommError::MasterGone { .. }), "{text}");
    assert!(text.contains("rank 0 exited"), "{text}");
    assert!(!text.contains("token"), "{text}");
}

#[test]
fn the_ranks_that_joined_are_told_why_rank_0_gave_up() {
    let master = local();
    let addr = master.local_addr().unwrap();
    let own: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let joiner = std::thread::spawn(move || join(1, 3, addr, own, "t", Duration::from_secs(10)));
    let err = serve(&master, 3, own, "t", Duration::from_millis(800)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "rendezvous: rank 2 did not join within 0.8 s"
    );
    let err = joiner.join().unwrap().unwrap_err().to_string();
    assert_eq!(
        err,
        "rendezvous: rank 0 gave up the rendezvous: rank 2 did not join within 0.8 s"
    );
}

#[test]
fn a_silent_connection_does_not_delay_the_ranks_and_is_dropped_with_a_logged_error() {
    let master = local();
    let addr = master.local_addr().unwrap();
    let own: Vec<SocketAddr> = (0..2)
        .map(|r| format!("127.0.0.1:{}", 41000 + r).parse().unwrap())
        .collect();
    // It connects first and never says a word.
    let mut silent = TcpStream::connect(addr).unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let start = Instant::now();
    let joiner = {
        let own = own[1];
        std::thread::spawn(move || join(1, 2, addr, own, "t", Duration::from_secs(10)))
    };
    let log = crate::comm::test_log::LogBuf::default();
    let table = tracing::subscriber::with_default(log.subscriber(), || {
        serve_with(
            &master,
            2,
            own[0],
            "t",
            Duration::from_secs(10),
            Duration::from_secs(3),
        )
    })
    .unwrap();
    assert_eq!(table, own);
    assert_eq!(joiner.join().unwrap().unwrap(), own);
    // Well before the silent connection's 3 s registration timeout.
    let joined = start.elapsed();
    assert!(joined < Duration::from_secs(2), "joined after {joined:?}");
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert!(frame::recv_msg::<Rendezvous>(&mut silent, HANDSHAKE_CAP).is_err());
    let needle = format!("dropped connection from {silent_addr}");
    let line = log.wait_for(&needle, Duration::from_secs(5));
    assert!(line.is_some(), "no {needle:?} in the log:\n{}", log.text());
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_the_rendezvous_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = frame::decode::<Rendezvous>(&bytes);
    }

    #[test]
    fn registrations_round_trip(token in ".{0,32}", rank in any::<u32>(), world in any::<u32>(), addr in ".{0,24}") {
        let msg = Rendezvous::Register { token, rank, world, addr };
        prop_assert_eq!(frame::decode::<Rendezvous>(&frame::encode(&msg).unwrap()).unwrap(), msg);
    }

    #[test]
    fn nccl_ids_round_trip_bit_for_bit(id in proptest::collection::vec(any::<u8>(), 128..=128), reason in ".{0,40}") {
        for msg in [Rendezvous::NcclId { id: id.clone() }, Rendezvous::NcclIdFailed { reason: reason.clone() }] {
            prop_assert_eq!(frame::decode::<Rendezvous>(&frame::encode(&msg).unwrap()).unwrap(), msg);
        }
    }
}
