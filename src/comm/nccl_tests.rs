//! Tests of the NCCL layer. Those that run anywhere check the library probe's errors and the
//! id exchange over an in-process link; those that need GPUs with NCCL (p2p, the all-reduce
//! and the sharded optimizer's collectives of `nccl_sync`) check at run time and skip with
//! a printed reason where there is none ([`gpu_test_ready`]).

use super::*;
use crate::comm::collective::{GradSync, chunk_cut, replica_group};
use crate::comm::frame;
use crate::comm::link::{InProcessLink, PeerLink};
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
                let group = replica_group(link.rank(), 2, 2);
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

/// The pipeline rank the syncs below are keyed by: not 0, so that a collective that took it
/// for the replica (the NCCL rank, which owns the chunk) would show.
const PIPE_RANK: usize = 3;

/// Runs `body` as each of `n` ranks of one new communicator, each on a thread of its own
/// (rank `r` on GPU `r % count`) with its [`NcclGradSync`] at [`PIPE_RANK`], and returns the
/// answers by rank; `None` (after printing why) without GPUs, or when NCCL refuses ranks
/// that share a GPU here.
fn on_ranks<T: Send + 'static>(
    test: &'static str,
    n: usize,
    body: fn(usize, NcclGradSync) -> T,
) -> Option<Vec<T>> {
    let count = gpu_test_ready(test)?;
    let id = NcclId::create().unwrap();
    let ranks: Vec<_> = (0..n)
        .map(|rank| {
            std::thread::spawn(move || {
                let comm = match NcclComm::new(rank % count, rank, n, id) {
                    Ok(comm) => comm,
                    Err(e) if skip_duplicate_gpu(test, &e) => return None,
                    Err(e) => panic!("{e}"),
                };
                Some(body(rank, NcclGradSync::from_comms([(PIPE_RANK, comm)])))
            })
        })
        .collect();
    ranks.into_iter().map(|r| r.join().unwrap()).collect()
}

/// Rank `rank`'s gradients: values whose sums round.
fn grads(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (i as f32 + 1.0) * 0.37 + rank as f32 * 1.1e-3)
        .collect()
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// What one rank saw of one buffer: its chunk, the chunk's values after the reduce-scatter,
/// the all-reduce's result and the all-gather's.
type Sharded = (std::ops::Range<usize>, Vec<f32>, Vec<f32>, Vec<f32>);

/// The reduce-scatter, the all-gather after it and the all-reduce, of `values`.
fn shard(sync: &NcclGradSync, values: Vec<f32>) -> Sharded {
    let mut reduced = values.clone();
    sync.all_reduce(PIPE_RANK, &mut reduced).unwrap();
    let mut buf = values;
    let own = sync.reduce_scatter(PIPE_RANK, &mut buf).unwrap();
    assert_eq!(sync.owned(PIPE_RANK, buf.len()).unwrap(), own);
    let chunk = buf[own.clone()].to_vec();
    sync.all_gather(PIPE_RANK, &mut buf).unwrap();
    (own, chunk, reduced, buf)
}

/// Two ranks: over uneven lengths (7 values in chunks of 4 and 3), fewer values than ranks,
/// none and an even cut, NCCL rank `r` owns chunk `r` of the trait's cut, its reduce-scatter
/// leaves it bitwise the sum there (what the all-reduce gives: one addition at dp = 2),
/// and the all-gather puts the whole sum on both.
#[test]
fn two_ranks_reduce_scatter_and_all_gather_give_the_all_reduce_s_sum() {
    const TEST: &str = "two_ranks_reduce_scatter_and_all_gather_give_the_all_reduce_s_sum";
    const LENS: [usize; 4] = [7, 1, 0, 8];
    let body = |rank, sync: NcclGradSync| LENS.map(|len| shard(&sync, grads(rank, len)));
    let Some(ranks) = on_ranks(TEST, 2, body) else {
        return;
    };
    for (i, len) in LENS.into_iter().enumerate() {
        let sum: Vec<f32> = (grads(0, len).iter().zip(grads(1, len)))
            .map(|(a, b)| a + b)
            .collect();
        for (rank, seen) in ranks.iter().enumerate() {
            let (own, chunk, reduced, gathered) = &seen[i];
            assert_eq!(*own, chunk_cut(len, 2)[rank], "len {len}, rank {rank}");
            assert_eq!(
                bits(chunk),
                bits(&sum[own.clone()]),
                "len {len}, rank {rank}"
            );
            assert_eq!(bits(reduced), bits(&sum), "len {len}, rank {rank}");
            assert_eq!(bits(gathered), bits(&sum), "len {len}, rank {rank}");
        }
    }
}

/// Three ranks (where NCCL allows them on this machine's GPUs): the cut of 7 values is 3,
/// 2, 2 and of 2 values 1, 1, 0. Integer values, so every order of addition gives the sum.
#[test]
fn three_ranks_own_the_uneven_chunks_by_rank() {
    const TEST: &str = "three_ranks_own_the_uneven_chunks_by_rank";
    const LENS: [usize; 2] = [7, 2];
    let body = |rank: usize, sync: NcclGradSync| {
        LENS.map(|len| {
            let values = (0..len).map(|i| (i * 10 + rank) as f32).collect();
            shard(&sync, values)
        })
    };
    let Some(ranks) = on_ranks(TEST, 3, body) else {
        return;
    };
    for (i, len) in LENS.into_iter().enumerate() {
        let sum: Vec<f32> = (0..len).map(|i| (i * 30 + 3) as f32).collect();
        for (rank, (own, chunk, reduced, gathered)) in ranks.iter().map(|r| &r[i]).enumerate() {
            assert_eq!(*own, chunk_cut(len, 3)[rank], "len {len}, rank {rank}");
            assert_eq!(chunk, &sum[own.clone()], "len {len}, rank {rank}");
            assert_eq!((reduced, gathered), (&sum, &sum), "len {len}, rank {rank}");
        }
    }
}

/// Each case's frames, rank 0's then rank 1's: uneven, one empty, both empty, and one of
/// a mebibyte and more beside one byte.
fn frame_cases() -> Vec<[Vec<u8>; 2]> {
    let big: Vec<u8> = (0..(1 << 20) + 3).map(|i: u32| (i % 251) as u8).collect();
    vec![
        [vec![1, 2, 3], vec![9; 5]],
        [vec![], vec![4]],
        [vec![5, 6], vec![]],
        [vec![], vec![]],
        [vec![7], big],
    ]
}

/// Two ranks: every case's frames by chunk on both ranks (rank `r`'s frame at index `r`,
/// the chunk it owns), and on the first one only, its own left empty.
#[test]
fn two_ranks_gather_uneven_frames_by_chunk_and_to_the_first() {
    const TEST: &str = "two_ranks_gather_uneven_frames_by_chunk_and_to_the_first";
    type Gathered = (Vec<Vec<u8>>, Option<Vec<Vec<u8>>>);
    let body = |rank: usize, sync: NcclGradSync| -> Vec<Gathered> {
        (frame_cases().iter())
            .map(|case| {
                let frame = &case[rank];
                let by_chunk = sync.gather_by_chunk(PIPE_RANK, frame).unwrap();
                (by_chunk, sync.gather_to_first(PIPE_RANK, frame).unwrap())
            })
            .collect()
    };
    let Some(ranks) = on_ranks(TEST, 2, body) else {
        return;
    };
    for (i, case) in frame_cases().into_iter().enumerate() {
        for (rank, seen) in ranks.iter().enumerate() {
            let (by_chunk, to_first) = &seen[i];
            assert!(by_chunk[..] == case[..], "case {i}, rank {rank}");
            let expected = (rank == 0).then(|| vec![Vec::new(), case[1].clone()]);
            assert!(*to_first == expected, "case {i}, rank {rank}");
        }
    }
}

/// One rank: it owns the whole buffer, and every collective hands its input back.
#[test]
fn one_gpu_world_of_one_shards_nothing() {
    if gpu_test_ready("one_gpu_world_of_one_shards_nothing").is_none() {
        return;
    }
    let comm = NcclComm::new(0, 0, 1, NcclId::create().unwrap()).unwrap();
    let sync = NcclGradSync::from_comms([(PIPE_RANK, comm)]);
    assert_eq!(sync.owned(PIPE_RANK, 5).unwrap(), 0..5);
    let values = vec![1.5, -2.0, 3.0];
    let (own, chunk, reduced, gathered) = shard(&sync, values.clone());
    assert_eq!(
        (own, &chunk, &reduced, &gathered),
        (0..3, &values, &values, &values)
    );
    assert_eq!(
        sync.gather_by_chunk(PIPE_RANK, &[1, 2]).unwrap(),
        [vec![1, 2]]
    );
    assert_eq!(
        sync.gather_to_first(PIPE_RANK, &[1, 2]).unwrap(),
        Some(vec![vec![]])
    );
    let err = sync.owned(0, 5).unwrap_err();
    assert_eq!(err.to_string(), "rank 0 is not a member of the group [3]");
}
