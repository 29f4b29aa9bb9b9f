//! Tests of the NCCL layer. Those that run anywhere check the library probe's errors and the
//! id exchange over an in-process link; those that need GPUs with NCCL check at run time
//! and skip with a printed reason where there is none ([`gpu_test_ready`]).

use super::*;
use crate::comm::frame;
use crate::comm::link::InProcessLink;
use crate::comm::rendezvous::Rendezvous;
use crate::tensor::TensorError;

fn sample_id(seed: u8) -> NcclId {
    let bytes: Vec<u8> = (0..NCCL_ID_BYTES as u8)
        .map(|i| i.wrapping_mul(seed))
        .collect();
    NcclId::from_bytes(&bytes).unwrap()
}

#[test]
fn missing_libraries_give_the_clear_device_errors() {
    assert_eq!(
        check_libraries(false, false).unwrap_err().to_string(),
        "no CUDA driver found; use --device cpu"
    );
    assert_eq!(
        check_libraries(false, true).unwrap_err().to_string(),
        "no CUDA driver found; use --device cpu"
    );
    let no_nccl = check_libraries(true, false).unwrap_err().to_string();
    assert!(no_nccl.contains("NCCL (libnccl)"), "{no_nccl}");
    assert!(no_nccl.ends_with("use --device cpu"), "{no_nccl}");
    assert!(check_libraries(true, true).is_ok());
}

#[test]
fn without_a_driver_every_entry_point_answers_the_clear_error_not_a_panic() {
    // SAFETY: only dlopen attempts.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    if driver {
        // A machine with a driver: the no-driver path is covered by the test above.
        return;
    }
    let text = "no CUDA driver found; use --device cpu";
    assert_eq!(probe().unwrap_err().to_string(), text);
    assert_eq!(NcclId::create().unwrap_err().to_string(), text);
    let err = NcclComm::new(0, 0, 2, sample_id(3)).unwrap_err();
    assert_eq!(err.to_string(), text);
    let links = InProcessLink::group(1);
    let err = NcclGradSync::connect(&links[0], 1, 1, 0).unwrap_err();
    assert_eq!(err.to_string(), text);
}

#[test]
fn id_bytes_round_trip_and_a_wrong_length_is_refused() {
    let id = sample_id(7);
    assert_eq!(NcclId::from_bytes(id.as_bytes()), Some(id));
    assert_eq!(NcclId::from_bytes(&[0; NCCL_ID_BYTES - 1]), None);
    assert_eq!(NcclId::from_bytes(&[0; NCCL_ID_BYTES + 1]), None);
    // The cudarc form keeps every bit (c_char may be signed).
    let back: Vec<u8> = id.to_cudarc().internal().iter().map(|&c| c as u8).collect();
    assert_eq!(back, id.as_bytes());
}

#[test]
fn the_leader_s_id_reaches_every_member_of_its_group_only() {
    // dp = 2 replicas of a pp = 2 pipeline: groups {0, 2} and {1, 3}, both on one channel.
    let links = InProcessLink::group(4);
    let handles: Vec<_> = links
        .into_iter()
        .map(|link| {
            std::thread::spawn(move || {
                let group = NcclGradSync::replica_group(link.rank(), 2, 2);
                let seed = 10 + link.rank() as u8;
                share_id(&link, &group, NCCL_ID_CHANNEL, || Ok(sample_id(seed)))
            })
        })
        .collect();
    let ids: Vec<NcclId> = handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    assert_eq!(ids[0], sample_id(10));
    assert_eq!(ids[2], sample_id(10));
    assert_eq!(ids[1], sample_id(11));
    assert_eq!(ids[3], sample_id(11));
}

#[test]
fn a_leader_that_cannot_create_the_id_fails_its_members_with_its_reason() {
    let links = InProcessLink::group(2);
    let member = links[1].clone();
    let waiting =
        std::thread::spawn(move || share_id(&member, &[0, 1], NCCL_ID_CHANNEL, || unreachable!()));
    let leader = share_id(&links[0], &[0, 1], NCCL_ID_CHANNEL, || {
        Err(TensorError::NoCudaDriver.into())
    });
    assert!(leader.is_err());
    let err = waiting.join().unwrap().unwrap_err();
    assert_eq!(
        err.to_string(),
        "rank 0 could not create the NCCL id: no CUDA driver found; use --device cpu"
    );
}

#[test]
fn malformed_id_frames_and_outsiders_are_named() {
    let links = InProcessLink::group(3);
    let short = frame::encode(&Rendezvous::NcclId { id: vec![1, 2, 3] }).unwrap();
    links[0].send(1, NCCL_ID_CHANNEL, &short).unwrap();
    let err = share_id(&links[1], &[0, 1], NCCL_ID_CHANNEL, || unreachable!()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "NCCL id from rank 0: 3 bytes, expected 128"
    );
    let table = frame::encode(&Rendezvous::Table { addrs: vec![] }).unwrap();
    links[0].send(1, NCCL_ID_CHANNEL, &table).unwrap();
    let err = share_id(&links[1], &[0, 1], NCCL_ID_CHANNEL, || unreachable!()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "NCCL id from rank 0: an address table instead of an id"
    );
    links[0].send(1, NCCL_ID_CHANNEL, &[9]).unwrap();
    let err = share_id(&links[1], &[0, 1], NCCL_ID_CHANNEL, || unreachable!()).unwrap_err();
    assert!(
        err.to_string().starts_with("NCCL id from rank 0: "),
        "{err}"
    );
    let err = share_id(&links[2], &[0, 1], NCCL_ID_CHANNEL, || unreachable!()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "rank 2 is not a member of the NCCL group [0, 1]"
    );
}

#[test]
fn the_id_travels_in_a_rendezvous_message_bit_for_bit() {
    for seed in [0u8, 1, 7, 255] {
        let id = sample_id(seed);
        let bytes = frame::encode(&Rendezvous::NcclId {
            id: id.as_bytes().to_vec(),
        })
        .unwrap();
        assert_eq!(id_from_frame(0, &bytes).unwrap(), id);
    }
    let failed = frame::encode(&Rendezvous::NcclIdFailed {
        reason: "no GPU".into(),
    })
    .unwrap();
    assert_eq!(
        id_from_frame(4, &failed).unwrap_err().to_string(),
        "rank 4 could not create the NCCL id: no GPU"
    );
}

proptest::proptest! {
    #[test]
    fn any_128_bytes_round_trip_and_other_lengths_are_refused(
        bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)
    ) {
        let frame = frame::encode(&Rendezvous::NcclId { id: bytes.clone() }).unwrap();
        match id_from_frame(1, &frame) {
            Ok(id) => proptest::prop_assert_eq!(&id.as_bytes()[..], &bytes[..]),
            Err(e) => {
                proptest::prop_assert!(bytes.len() != NCCL_ID_BYTES);
                proptest::prop_assert!(e.to_string().contains("expected 128"));
            }
        }
    }

    #[test]
    fn arbitrary_frames_never_panic_the_id_decoder(
        bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)
    ) {
        let _ = id_from_frame(0, &bytes);
    }
}

/// Two ranks (on GPUs 0 and 1, or both on GPU 0 where NCCL allows it): a send/recv pair
/// and a sum all-reduce.
#[test]
fn two_ranks_send_recv_and_all_reduce() {
    const TEST: &str = "two_ranks_send_recv_and_all_reduce";
    let Some(count) = gpu_test_ready(TEST) else {
        return;
    };
    let id = NcclId::create().unwrap();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let comm = match NcclComm::new(rank % count, rank, 2, id) {
                    Ok(comm) => comm,
                    Err(e) if skip_duplicate_gpu(TEST, &e) => return None,
                    Err(e) => panic!("{e}"),
                };
                let s = comm.stream().clone();
                let sent = [1.0f32, 2.0, 3.0];
                let got = if rank == 0 {
                    let buf = comm.send(s.clone_htod(&sent).unwrap(), 1).unwrap();
                    s.clone_dtoh(&buf).unwrap()
                } else {
                    let buf = comm.recv(s.alloc_zeros::<f32>(3).unwrap(), 0).unwrap();
                    s.clone_dtoh(&buf).unwrap()
                };
                assert_eq!(got, sent);
                let mut grads = vec![rank as f32 + 1.0; 5];
                let sync = NcclGradSync::from_comms([(0, comm)]);
                sync.all_reduce(0, &mut grads).unwrap();
                Some(grads)
            })
        })
        .collect();
    for r in ranks {
        if let Some(grads) = r.join().unwrap() {
            assert_eq!(grads, vec![3.0; 5]);
        }
    }
}

/// One rank alone: the all-reduce is the identity and peers are checked.
#[test]
fn one_gpu_world_of_one() {
    if gpu_test_ready("one_gpu_world_of_one").is_none() {
        return;
    }
    let comm = NcclComm::new(0, 0, 1, NcclId::create().unwrap()).unwrap();
    let mut values = vec![1.5f32, -2.0];
    comm.all_reduce_sum_host(&mut values).unwrap();
    assert_eq!(values, vec![1.5, -2.0]);
    let s = comm.stream().clone();
    let err = comm.send(s.alloc_zeros::<f32>(1).unwrap(), 0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "NCCL rank 0: peer 0 is not another rank of a world of 1"
    );
}
