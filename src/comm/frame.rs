//! The one wire format between processes: a 4-byte little-endian length, then that many
//! bytes of a bincode-2 (serde) encoding.
//!
//! Every reader is given a size cap before it reads a frame, and checks the length against
//! it before allocating, so a peer (or a stranger, before it has shown the job token) cannot
//! make a process allocate more than the cap. A frame over the cap, a truncated one and one
//! whose bytes do not decode as the expected message are all [`CommError`]s, never panics:
//! the connection that carried it is closed by its owner with a logged error.
//! Large byte fields (a channel's frame, a tensor's bytes) are written as one byte string
//! ([`byte_string`]) and read back as a view of the frame or in one copy ([`byte_vec`]),
//! not byte by byte; on the wire that is the same as a sequence of `u8`s.
//! `tests` fuzzes the decoder with arbitrary bytes (proptest).

use std::io::{self, Read, Write};

use serde::de::{DeserializeOwned, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::comm::CommError;

/// Default cap on one frame's payload: 1 GiB (an activation of a large micro-batch fits).
pub const DEFAULT_FRAME_CAP: usize = 1 << 30;

/// Cap for messages read before a connection is authenticated (hello, rendezvous).
pub const HANDSHAKE_CAP: usize = 64 * 1024;

fn config() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// The bincode-2 bytes of `msg` (no length prefix).
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, CommError> {
    bincode::serde::encode_to_vec(msg, config()).map_err(|e| CommError::Encode(e.to_string()))
}

/// Serializes a byte field as one byte string (`#[serde(serialize_with = ...)]`): bincode
/// writes it exactly as a sequence of `u8`s (the length, then the bytes), in one copy instead
/// of a call per byte.
pub fn byte_string<B: AsRef<[u8]>, S: Serializer>(bytes: &B, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(bytes.as_ref())
}

/// Deserializes a byte field written by [`byte_string`] (`#[serde(deserialize_with = ...)]`)
/// in one copy. It asks for borrowed bytes, which bincode checks against the frame's length
/// before anything is allocated (an owned byte buffer would be allocated at its claimed
/// length first).
pub fn byte_vec<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    struct Bytes;
    impl<'de> Visitor<'de> for Bytes {
        type Value = Vec<u8>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a byte string")
        }
        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }
    }
    d.deserialize_bytes(Bytes)
}

/// Decodes one message from exactly `bytes` (trailing bytes are an error: a frame holds one
/// message). Collections inside are bounded by the frame's own length (bincode checks
/// each claimed length against the bytes left), so a lying length cannot allocate more. A
/// message may borrow from `bytes` (a `&[u8]` field is a view of the frame, not a copy).
pub fn decode<'de, T: Deserialize<'de>>(bytes: &'de [u8]) -> Result<T, CommError> {
    let (msg, used) = bincode::serde::borrow_decode_from_slice::<T, _>(
        bytes,
        config().with_limit::<{ DEFAULT_FRAME_CAP }>(),
    )
    .map_err(|e| CommError::Decode(e.to_string()))?;
    if used != bytes.len() {
        return Err(CommError::Decode(format!(
            "{} trailing bytes after the message",
            bytes.len() - used
        )));
    }
    Ok(msg)
}

/// Writes `payload` as one frame (length prefix, then the bytes), refusing one over `cap`.
pub fn write_frame(w: &mut impl Write, payload: &[u8], cap: usize) -> Result<(), CommError> {
    if payload.len() > cap || payload.len() > u32::MAX as usize {
        return Err(CommError::TooLarge {
            len: payload.len(),
            cap,
        });
    }
    w.write_all(&(payload.len() as u32).to_le_bytes())?;
    w.write_all(payload)?;
    Ok(())
}

/// Reads one frame's payload, checking its length against `cap` before allocating.
/// A clean end of stream before the length is [`CommError::Eof`].
pub fn read_frame(r: &mut impl Read, cap: usize) -> Result<Vec<u8>, CommError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(CommError::Eof),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > cap {
        return Err(CommError::TooLarge { len, cap });
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Encodes `msg` and writes it as one frame.
pub fn send_msg<T: Serialize>(w: &mut impl Write, msg: &T, cap: usize) -> Result<(), CommError> {
    write_frame(w, &encode(msg)?, cap)
}

/// Reads one frame and decodes it as `T`.
pub fn recv_msg<T: DeserializeOwned>(r: &mut impl Read, cap: usize) -> Result<T, CommError> {
    decode(&read_frame(r, cap)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Msg {
        rank: u32,
        name: String,
        data: Vec<f32>,
    }

    #[test]
    fn a_message_round_trips_through_a_frame() {
        let msg = Msg {
            rank: 3,
            name: "activation".into(),
            data: vec![1.5, -0.0, f32::MIN_POSITIVE],
        };
        let mut wire = Vec::new();
        send_msg(&mut wire, &msg, 1024).unwrap();
        assert_eq!(
            u32::from_le_bytes(wire[..4].try_into().unwrap()) as usize,
            wire.len() - 4
        );
        let back: Msg = recv_msg(&mut wire.as_slice(), 1024).unwrap();
        assert_eq!(back, msg);
    }

    #[test]
    fn frames_over_the_cap_are_refused_both_ways() {
        let mut wire = Vec::new();
        assert!(matches!(
            write_frame(&mut wire, &[0; 17], 16),
            Err(CommError::TooLarge { len: 17, cap: 16 })
        ));
        assert!(wire.is_empty());
        // A length prefix claiming 4 GiB is refused before anything is allocated.
        let lying = u32::MAX.to_le_bytes();
        assert!(matches!(
            read_frame(&mut lying.as_slice(), 1 << 20),
            Err(CommError::TooLarge { cap: 1048576, .. })
        ));
    }

    #[test]
    fn truncated_and_empty_streams_are_errors() {
        assert!(matches!(
            read_frame(&mut [].as_slice(), 16),
            Err(CommError::Eof)
        ));
        let short = [8u8, 0, 0, 0, 1, 2];
        assert!(matches!(
            read_frame(&mut short.as_slice(), 16),
            Err(CommError::Io(_))
        ));
        let trailing = {
            let mut b = encode(&7u32).unwrap();
            b.push(0);
            b
        };
        assert!(matches!(
            decode::<u32>(&trailing),
            Err(CommError::Decode(_))
        ));
    }

    #[test]
    fn a_byte_string_is_written_as_a_byte_sequence_and_read_back_as_a_view() {
        #[derive(Serialize, Deserialize)]
        struct View<'a> {
            #[serde(serialize_with = "byte_string")]
            bytes: &'a [u8],
        }
        let data = vec![1u8, 0, 255, 7];
        let wire = encode(&View { bytes: &data }).unwrap();
        assert_eq!(wire, encode(&data).unwrap());
        let view: View = decode(&wire).unwrap();
        assert_eq!(view.bytes, data);
        #[derive(Deserialize)]
        struct Owned {
            #[serde(deserialize_with = "byte_vec")]
            bytes: Vec<u8>,
        }
        assert_eq!(decode::<Owned>(&wire).unwrap().bytes, data);
        // A length claiming more than the frame holds is refused before it is allocated.
        let mut lying = encode(&(u32::MAX as u64)).unwrap();
        lying.push(0);
        assert!(matches!(decode::<Owned>(&lying), Err(CommError::Decode(_))));
        // The view is of the frame itself: nothing was copied.
        assert!(wire.as_ptr_range().contains(&view.bytes.as_ptr()));
        // A length past the frame's end is an error, not a read past it.
        assert!(matches!(
            decode::<View>(&wire[..wire.len() - 1]),
            Err(CommError::Decode(_))
        ));
    }

    proptest! {
        // The decoder never panics and never allocates past the cap, whatever the bytes.
        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = read_frame(&mut bytes.as_slice(), 256).map(|p| decode::<Msg>(&p));
            let _ = decode::<Msg>(&bytes);
        }

        #[test]
        fn every_message_round_trips(rank in any::<u32>(), name in ".{0,40}", data in proptest::collection::vec(any::<f32>(), 0..64)) {
            let msg = Msg { rank, name, data };
            let mut wire = Vec::new();
            send_msg(&mut wire, &msg, DEFAULT_FRAME_CAP).unwrap();
            let back: Msg = recv_msg(&mut wire.as_slice(), DEFAULT_FRAME_CAP).unwrap();
            prop_assert_eq!(back.rank, msg.rank);
            prop_assert_eq!(back.name, msg.name);
            prop_assert!(back.data.iter().zip(&msg.data).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
