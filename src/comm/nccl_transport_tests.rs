//! Tests of the NCCL stage-link transport. Header checks and the no-GPU errors run
//! anywhere; the exchange between two ranks needs a GPU with NCCL and skips with a printed
//! reason elsewhere.

use pipefill_actors::Flow;

use super::*;
use crate::comm::CommError;
use crate::comm::nccl::{gpu_test_ready, skip_duplicate_gpu};
use crate::comm::tcp::MeshOptions;
use crate::tensor::cuda::CudaBackend;
use crate::tensor::{Backend, DType};

/// The meshes of `world` ranks on loopback.
fn meshes(world: usize) -> Vec<TcpMesh> {
    TcpMesh::loopback(world, &MeshOptions::new("nccl-test")).unwrap()
}

fn tag(flow: Flow, stage: u32, microbatch: u32) -> Tag {
    Tag {
        flow,
        stage,
        microbatch,
        iteration: 3,
    }
}

fn header(to: u32, from: u32, len: u64) -> NcclHeader {
    NcclHeader {
        to,
        from,
        tag: tag(Flow::Activation, to, 1),
        sent_at: 0.5,
        dtype: DType::Bf16,
        len,
    }
}

#[test]
fn headers_round_trip_and_misaddressed_or_oversized_ones_are_named() {
    let h = header(1, 0, 12);
    assert_eq!(
        frame::decode::<NcclHeader>(&frame::encode(&h).unwrap()).unwrap(),
        h
    );
    // Rank 1 of the group at mesh rank 2 (mesh rank 3), from group rank 0 (mesh rank 2).
    assert!(check_header(1, 2, 2, 2, &h).is_ok());
    assert_eq!(
        check_header(1, 2, 2, 4, &h).unwrap_err(),
        "header from rank 0 to rank 1 arrived at rank 1 from mesh rank 4"
    );
    assert!(check_header(0, 2, 2, 2, &h).is_err());
    assert_eq!(
        check_header(1, 0, 2, 1, &header(1, 1, 4)).unwrap_err(),
        "rank 1 sent itself a header"
    );
    assert_eq!(
        check_header(1, 0, 2, 0, &header(1, 0, MAX_ELEMENTS + 1)).unwrap_err(),
        format!(
            "activation for stage 1 micro-batch 1 (iteration 3) announces {} elements, over the cap of {MAX_ELEMENTS}",
            MAX_ELEMENTS + 1
        )
    );
}

proptest::proptest! {
    /// The header decoder and checks are what a peer's bytes reach first: never a panic.
    #[test]
    fn arbitrary_bytes_never_panic_the_header_decoder(
        bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..128)
    ) {
        if let Ok(h) = frame::decode::<NcclHeader>(&bytes) {
            let _ = check_header(1, 0, 2, 0, &h);
        }
    }
}

#[test]
fn a_bad_group_or_a_missing_gpu_is_a_clear_error_not_a_panic() {
    let mesh = meshes(1).pop().unwrap();
    let err = NcclTransport::group(&mesh, 0, 1, 1).unwrap_err();
    assert!(matches!(
        err,
        CommError::PastMesh {
            base: 1,
            size: 1,
            world: 1
        }
    ));
    // SAFETY: only a dlopen attempt.
    if unsafe { !cudarc::driver::sys::is_culib_present() } {
        let err = NcclTransport::group(&mesh, 0, 0, 1).unwrap_err();
        assert_eq!(err.to_string(), "no CUDA driver found; use --device cpu");
    }
}

/// Two ranks send to each other at once (an activation up, a gradient down, f32 and bf16,
/// and an empty buffer), and each receives by tag in the opposite order of arrival.
#[test]
fn two_ranks_exchange_buffers_both_ways_by_tag() {
    const TEST: &str = "two_ranks_exchange_buffers_both_ways_by_tag";
    let Some(count) = gpu_test_ready(TEST) else {
        return;
    };
    let values = |rank: usize, n: usize| -> Vec<f32> {
        (0..n).map(|i| (rank * 1000 + i) as f32 * 0.25).collect()
    };
    let ranks: Vec<_> = meshes(2)
        .into_iter()
        .enumerate()
        .map(|(rank, mesh)| {
            std::thread::spawn(move || {
                let ordinal = rank % count;
                let t = match NcclTransport::group(&mesh, ordinal, 0, 2) {
                    Ok(t) => t,
                    Err(e) if skip_duplicate_gpu(TEST, &e) => return false,
                    Err(e) => panic!("{e}"),
                };
                let be = CudaBackend::new(ordinal).unwrap();
                let (peer, flow) = if rank == 0 {
                    (1, Flow::Activation)
                } else {
                    (0, Flow::Gradient)
                };
                let sends = [
                    (0, DType::F32, 1000),
                    (1, DType::Bf16, 17),
                    (2, DType::F32, 0),
                ];
                for (mb, dtype, n) in sends {
                    let buf = be.from_host(&values(rank, n), dtype).unwrap();
                    let envelope = Envelope {
                        tag: tag(flow, peer as u32, mb),
                        from: rank,
                        sent_at: mb as f64,
                        payload: buf,
                    };
                    t.send(peer, envelope).unwrap();
                }
                let back = if rank == 0 {
                    Flow::Gradient
                } else {
                    Flow::Activation
                };
                for (mb, dtype, n) in sends.into_iter().rev() {
                    let got = t.recv(rank, &tag(back, rank as u32, mb)).unwrap();
                    assert_eq!((got.from, got.sent_at), (peer, mb as f64));
                    assert_eq!(be.dtype(&got.payload), dtype);
                    let expected = be
                        .to_host(&be.from_host(&values(peer, n), dtype).unwrap())
                        .unwrap();
                    assert_eq!(be.to_host(&got.payload).unwrap(), expected);
                }
                // Leave only after the peer has everything: dropping the mesh first would
                // look like a death to it.
                mesh.quiesce();
                true
            })
        })
        .collect();
    for r in ranks {
        r.join().unwrap();
    }
}
