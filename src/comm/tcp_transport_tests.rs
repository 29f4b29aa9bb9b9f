//! The transport's routing and groups, and [`BufCodec`]'s frames: their size per storage
//! type, a buffer crossing a real mesh, and malformed frames from a peer.

use std::time::{Duration, Instant};

use pipefill_actors::Flow;
use proptest::prelude::*;

use super::*;
use crate::comm::link::PeerLink;
use crate::comm::tcp::MeshOptions;
use crate::tensor::CpuBackend;

fn codec() -> BufCodec<CpuBackend> {
    BufCodec(CpuBackend::new(1).unwrap())
}

/// 1000 values that are not all representable in bf16 (so the f32 ones round when stored).
fn values() -> Vec<f32> {
    (0..1000).map(|i| (i as f32 * 0.37).sin() * 3.1).collect()
}

/// The bytes of a [`HostBuf`] frame as a sender would write them.
fn host_frame(dtype: DType, len: u64, bytes: &[u8]) -> Vec<u8> {
    frame::encode(&HostBuf { dtype, len, bytes }).unwrap()
}

#[test]
fn a_bf16_buffer_crosses_as_its_two_byte_values_and_an_f32_one_as_four() {
    let c = codec();
    for dtype in [DType::Bf16, DType::F32] {
        let buf = c.0.from_host(&values(), dtype).unwrap();
        let wire = c.encode(&buf).unwrap();
        // The values' bytes plus a header of at most 8 bytes (type, length, byte count).
        let header = wire.len() - 1000 * dtype.size();
        assert!(header <= 8, "{dtype:?}: {} bytes", wire.len());
        let back = c.decode(&wire).unwrap();
        assert_eq!(
            back, buf,
            "{dtype:?}: bitwise the same buffer, same storage"
        );
    }
    // The bf16 payload is the stored bits themselves, not widened values.
    let buf = c.0.from_host(&[1.5, -2.0], DType::Bf16).unwrap();
    let wire = c.encode(&buf).unwrap();
    assert!(wire.ends_with(&[0xc0, 0x3f, 0x00, 0xc0]), "{wire:?}");
}

#[test]
fn a_malformed_buffer_frame_is_one_clear_error() {
    let c = codec();
    let err = |bytes: &[u8]| c.decode(bytes).unwrap_err();
    // An odd number of bytes cannot be bf16 values.
    assert_eq!(
        err(&host_frame(DType::Bf16, 2, &[0; 5])),
        "the frame declares a bf16 buffer of 2 values (2 bytes each) but carries 5 bytes"
    );
    // Fewer values than declared (a truncated payload), and more.
    assert_eq!(
        err(&host_frame(DType::Bf16, 1000, &[0; 1998])),
        "the frame declares a bf16 buffer of 1000 values (2 bytes each) but carries 1998 bytes"
    );
    assert!(err(&host_frame(DType::F32, 1, &[0; 8])).contains("f32 buffer of 1 values"));
    // A declared length whose byte count overflows is refused, not multiplied past u64.
    assert!(err(&host_frame(DType::Bf16, u64::MAX, &[0; 2])).contains("18446744073709551615"));
    // A frame cut short inside its bytes: the byte count runs past the frame.
    let whole = host_frame(DType::Bf16, 4, &[0; 8]);
    assert!(err(&whole[..whole.len() - 3]).starts_with("undecodable frame"));
    // The same bytes declared as what they are decode.
    let ok = c.decode(&host_frame(DType::F32, 2, &[0; 8])).unwrap();
    assert_eq!((c.0.len(&ok), c.0.dtype(&ok)), (2, DType::F32));
}

proptest! {
    // Whatever a peer sends, decoding a buffer never panics.
    #[test]
    fn arbitrary_bytes_never_panic_the_buffer_codec(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = codec().decode(&bytes);
    }
}

fn tag(microbatch: u32) -> Tag {
    Tag {
        flow: Flow::Activation,
        stage: 1,
        microbatch,
        iteration: 0,
    }
}

/// Sends `buf` from rank 0 to rank 1 of a two-rank loopback mesh; what rank 1 received and
/// the bytes rank 0 wrote on the tensor channel.
fn across_a_mesh(dtype: DType) -> (Vec<u8>, Vec<u8>, u64) {
    let meshes = TcpMesh::loopback(2, &MeshOptions::new("t")).unwrap();
    let be = CpuBackend::new(1).unwrap();
    let ends: Vec<_> = meshes
        .iter()
        .map(|m| TcpTransport::new(m, TENSOR_CHANNEL, BufCodec(be.clone())))
        .collect();
    let buf = be.from_host(&values(), dtype).unwrap();
    let envelope = Envelope {
        tag: tag(0),
        from: 0,
        sent_at: 0.5,
        payload: buf.clone(),
    };
    ends[0].send(1, envelope).unwrap();
    let got = ends[1].recv(1, &tag(0)).unwrap();
    assert_eq!((got.from, got.sent_at), (0, 0.5));
    assert_eq!(be.dtype(&got.payload), dtype);
    let sent = meshes[0].sent().channels[&TENSOR_CHANNEL];
    assert_eq!(sent.frames, 1);
    (
        be.to_host_bytes(&buf).unwrap(),
        be.to_host_bytes(&got.payload).unwrap(),
        sent.bytes,
    )
}

#[test]
fn over_a_mesh_a_bf16_buffer_arrives_bitwise_in_half_the_bytes() {
    let (sent, got, bf16_bytes) = across_a_mesh(DType::Bf16);
    assert_eq!(got, sent);
    let (sent, got, f32_bytes) = across_a_mesh(DType::F32);
    assert_eq!(got, sent);
    // Each frame: the values, plus the envelope and framing (well under 100 bytes).
    assert!(bf16_bytes > 2000 && bf16_bytes < 2100, "{bf16_bytes}");
    assert!(f32_bytes > 4000 && f32_bytes < 4100, "{f32_bytes}");
    assert_eq!(f32_bytes - bf16_bytes, 2000);
}

#[test]
fn a_peer_that_sends_a_malformed_buffer_fails_the_mesh_naming_it() {
    let meshes = TcpMesh::loopback(2, &MeshOptions::new("t")).unwrap();
    let receiver = TcpTransport::new(&meshes[0], TENSOR_CHANNEL, codec());
    // Rank 1 writes a well-formed envelope around an odd-length bf16 payload.
    let payload = host_frame(DType::Bf16, 3, &[0; 5]);
    let wire = WireEnvelope {
        to: 0,
        from: 1,
        tag: tag(0),
        sent_at: 0.0,
        payload: &payload,
    };
    meshes[1]
        .send(0, TENSOR_CHANNEL, &frame::encode(&wire).unwrap())
        .unwrap();
    let err = receiver.recv(0, &tag(0)).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "rank 1 sent a bad frame on channel {TENSOR_CHANNEL}: the frame declares a bf16 \
             buffer of 3 values (2 bytes each) but carries 5 bytes"
        )
    );
    // The sender hears why (the mesh tells its peers) rather than blaming rank 0.
    let start = Instant::now();
    while meshes[1].failure().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "rank 1 never heard"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        meshes[1]
            .failure()
            .unwrap()
            .contains("rank 1 sent a bad frame")
    );
}

#[test]
fn sends_stay_local_or_are_refused_past_the_world_or_after_a_failure() {
    let none = || None;
    assert_eq!(route(1, 4, 1, || Some("x".into())).unwrap(), Route::Local);
    assert_eq!(route(1, 4, 3, none).unwrap(), Route::Remote);
    assert!(matches!(
        route(1, 4, 4, none),
        Err(LinkError::NoSuchRank { to: 4, ranks: 4 })
    ));
    let failed = route(1, 4, 2, || Some("rank 2 died".into())).unwrap_err();
    assert_eq!(
        failed.to_string(),
        LinkError::Other("rank 2 died".into()).to_string()
    );
    let closed = explain_closed(LinkError::Closed, Some("rank 3 died".into()));
    assert!(matches!(closed, LinkError::Other(r) if r == "rank 3 died"));
    assert!(matches!(
        explain_closed(LinkError::Closed, None),
        LinkError::Closed
    ));
}

#[test]
fn a_group_is_numbered_from_its_base() {
    assert_eq!(group_rank(5, 8, 4, 2).unwrap(), 1);
    assert_eq!(group_rank(0, 1, 0, 1).unwrap(), 0);
}

#[test]
fn a_wrong_group_is_a_typed_error_naming_the_range() {
    let err = group_rank(1, 4, 2, 2).unwrap_err();
    assert_eq!(
        err.to_string(),
        "transport group of mesh ranks 2..4: this process is mesh rank 1, not one of them"
    );
    assert_eq!(
        group_rank(3, 4, 2, 3).unwrap_err().to_string(),
        "transport group of mesh ranks 2..5: it runs past the mesh's 4 ranks"
    );
    assert_eq!(
        group_rank(0, 4, 0, 0).unwrap_err().to_string(),
        "transport group at mesh rank 0: the group is empty"
    );
    assert!(matches!(
        group_rank(0, 4, usize::MAX, 2),
        Err(CommError::PastMesh { .. })
    ));
}

#[test]
fn group_on_a_mesh_refuses_a_range_without_this_rank_instead_of_panicking() {
    let mesh = TcpMesh::loopback(1, &MeshOptions::new("t"))
        .unwrap()
        .pop()
        .unwrap();
    let codec = BufCodec(CpuBackend::new(1).unwrap());
    let err = TcpTransport::group(&mesh, TENSOR_CHANNEL, codec, 1, 1).err();
    assert!(matches!(
        err,
        Some(CommError::PastMesh {
            base: 1,
            size: 1,
            world: 1
        })
    ));
    let ok = TcpTransport::group(&mesh, STATS_CHANNEL, SerdeCodec, 0, 1);
    assert_eq!(Transport::<u32>::ranks(&ok.unwrap()), 1);
}
