//! The host-side layouts of NCCL's collectives for the sharded optimizer (used by
//! `nccl_sync`), free of cudarc so that they compile and are tested without the `cuda`
//! feature.
//!
//! NCCL's reduce-scatter and all-gather move the same count to and from every rank, while
//! the trait's cut ([`chunk_cut`]) gives chunks whose sizes differ by one (the longer
//! first). So chunk `c` travels in slot `c` of `n` slots of [`slot`] values each
//! (`ceil(len / n)`), zero-padded: [`pack`] and [`pack_chunk`] lay them out, [`unpack`] and
//! [`unpack_chunk`] take them back. The cut stays the trait's, so the chunk a replica owns
//! (and a sharded checkpoint) is the same whatever the exchange.
//!
//! The gathers of byte frames exchange the frames' lengths first: [`frame_lengths`] checks
//! each against a cap before anything is allocated for it, and the frames then lie back to
//! back ([`frame_ranges`], [`split_frames`]).

use std::ops::Range;

use super::collective::chunk_cut;

/// A layout that does not fit its buffer (a length from another rank, or a bug here).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PadError {
    #[error("there is no chunk {chunk} in a cut into {n}")]
    NoChunk { chunk: usize, n: usize },
    #[error("{got} padded values for {n} slots of {slot}: expected {}", .n * .slot)]
    Slots { got: usize, n: usize, slot: usize },
    #[error("{got} values in one slot, expected {slot}")]
    Slot { got: usize, slot: usize },
    #[error("NCCL rank {member}'s frame of {len} bytes is over the cap of {cap} bytes")]
    FrameTooLarge { member: usize, len: u64, cap: usize },
    #[error("the frames' lengths {lens:?} do not add up in memory")]
    FramesOverflow { lens: Vec<usize> },
    #[error("{got} bytes for frames of {expected} bytes in all")]
    FrameBytes { got: usize, expected: usize },
}

/// The values of one slot of a buffer of `len` values cut into `n` chunks: the longest
/// chunk's, `ceil(len / n)` (`n = 0` counts as one).
pub fn slot(len: usize, n: usize) -> usize {
    len.div_ceil(n.max(1))
}

/// Chunk `c` of [`chunk_cut`]`(len, n)`.
pub fn chunk(len: usize, n: usize, c: usize) -> Result<Range<usize>, PadError> {
    (chunk_cut(len, n).into_iter().nth(c)).ok_or(PadError::NoChunk { chunk: c, n })
}

/// `values` as `n` slots, chunk `c` of its cut in slot `c`, zero-padded: what each rank
/// hands NCCL's reduce-scatter.
pub fn pack<T: Copy + Default>(values: &[T], n: usize) -> Vec<T> {
    let slot = slot(values.len(), n);
    let mut out = vec![T::default(); n.max(1) * slot];
    for (c, r) in chunk_cut(values.len(), n).into_iter().enumerate() {
        // A chunk is never longer than its slot.
        out[c * slot..c * slot + r.len()].copy_from_slice(&values[r]);
    }
    out
}

/// Chunk `c` of `values` in one slot, zero-padded: what rank `c` hands NCCL's all-gather.
pub fn pack_chunk<T: Copy + Default>(values: &[T], n: usize, c: usize) -> Result<Vec<T>, PadError> {
    let r = chunk(values.len(), n, c)?;
    let mut out = vec![T::default(); slot(values.len(), n)];
    out[..r.len()].copy_from_slice(&values[r]);
    Ok(out)
}

/// Every chunk of `out` from its slot of `padded` (the `n` slots [`pack`] lays out for a
/// buffer of `out.len()` values): what NCCL's all-gather leaves, back in place.
pub fn unpack<T: Copy>(padded: &[T], n: usize, out: &mut [T]) -> Result<(), PadError> {
    let slot = slot(out.len(), n);
    let expected = n.max(1) * slot;
    if padded.len() != expected {
        return Err(PadError::Slots {
            got: padded.len(),
            n: n.max(1),
            slot,
        });
    }
    for (c, r) in chunk_cut(out.len(), n).into_iter().enumerate() {
        let len = r.len();
        out[r].copy_from_slice(&padded[c * slot..c * slot + len]);
    }
    Ok(())
}

/// Chunk `c` of `out` from its slot alone (what NCCL's reduce-scatter leaves rank `c`);
/// the rest of `out` is left as it is. Returns the chunk's range.
pub fn unpack_chunk<T: Copy>(
    slot_values: &[T],
    n: usize,
    c: usize,
    out: &mut [T],
) -> Result<Range<usize>, PadError> {
    let r = chunk(out.len(), n, c)?;
    let slot = slot(out.len(), n);
    if slot_values.len() != slot {
        return Err(PadError::Slot {
            got: slot_values.len(),
            slot,
        });
    }
    let len = r.len();
    out[r.clone()].copy_from_slice(&slot_values[..len]);
    Ok(r)
}

/// The frames' lengths as every rank announced them (rank by rank), each checked against
/// `cap` before anything is allocated for it.
pub fn frame_lengths(lens: &[u64], cap: usize) -> Result<Vec<usize>, PadError> {
    lens.iter()
        .enumerate()
        .map(|(member, &len)| match usize::try_from(len) {
            Ok(n) if n <= cap => Ok(n),
            _ => Err(PadError::FrameTooLarge { member, len, cap }),
        })
        .collect()
}

/// Where each frame lies when the frames of `lens` bytes are laid back to back.
pub fn frame_ranges(lens: &[usize]) -> Result<Vec<Range<usize>>, PadError> {
    let mut start = 0usize;
    lens.iter()
        .map(|&len| {
            let end = start
                .checked_add(len)
                .ok_or_else(|| PadError::FramesOverflow {
                    lens: lens.to_vec(),
                })?;
            Ok(std::mem::replace(&mut start, end)..end)
        })
        .collect()
}

/// The frames of `lens` bytes laid back to back in `bytes`, one by one.
pub fn split_frames(bytes: &[u8], lens: &[usize]) -> Result<Vec<Vec<u8>>, PadError> {
    let ranges = frame_ranges(lens)?;
    let expected = ranges.last().map_or(0, |r| r.end);
    if bytes.len() != expected {
        return Err(PadError::FrameBytes {
            got: bytes.len(),
            expected,
        });
    }
    Ok(ranges.into_iter().map(|r| bytes[r].to_vec()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (len, n) the tests sweep: len < n, n = 1, len = 0, even and uneven cuts.
    fn shapes() -> impl Iterator<Item = (usize, usize)> {
        (0..=13).flat_map(|len| (1..=6).map(move |n| (len, n)))
    }

    fn values(len: usize, seed: f32) -> Vec<f32> {
        (0..len).map(|i| seed + i as f32 * 0.5).collect()
    }

    #[test]
    fn an_uneven_cut_fills_its_slots_longer_chunks_first_and_pads_with_zeros() {
        let v = [1.0f32, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(slot(5, 2), 3);
        assert_eq!(pack(&v, 2), [1.0, 2.0, 3.0, 4.0, 5.0, 0.0]);
        // 5 into 3: sizes 2, 2, 1.
        assert_eq!(pack(&v, 3), [1.0, 2.0, 3.0, 4.0, 5.0, 0.0]);
        // 5 into 4: sizes 2, 1, 1, 1 in slots of 2.
        assert_eq!(pack(&v, 4), [1.0, 2.0, 3.0, 0.0, 4.0, 0.0, 5.0, 0.0]);
        assert_eq!(pack_chunk(&v, 4, 0).unwrap(), [1.0, 2.0]);
        assert_eq!(pack_chunk(&v, 4, 3).unwrap(), [5.0, 0.0]);
        // Fewer values than ranks: slots of one, the last ones all padding.
        assert_eq!(pack(&[7u8, 8], 4), [7, 8, 0, 0]);
        assert_eq!(pack_chunk(&[7u8, 8], 4, 3).unwrap(), [0]);
        // One rank: the buffer itself. No values: no slots' worth.
        assert_eq!(pack(&v, 1), v);
        assert!(pack::<f32>(&[], 3).is_empty());
    }

    #[test]
    fn pack_then_unpack_is_the_identity_for_every_shape() {
        for (len, n) in shapes() {
            let v = values(len, 1.0);
            let padded = pack(&v, n);
            assert_eq!(padded.len(), n * slot(len, n), "len {len}, n {n}");
            let mut out = vec![f32::NAN; len];
            unpack(&padded, n, &mut out).unwrap();
            assert_eq!(out, v, "len {len}, n {n}");
        }
    }

    /// What NCCL does with the slots, on the host: the reduce-scatter sums slot `c` of every
    /// rank's packed buffer into rank `c`, the all-gather concatenates every rank's slot.
    #[test]
    fn a_simulated_reduce_scatter_and_all_gather_give_each_rank_the_sum_of_its_chunk() {
        for (len, n) in shapes() {
            let ranks: Vec<Vec<f32>> = (0..n).map(|r| values(len, r as f32 * 10.0)).collect();
            let sum: Vec<f32> = (0..len).map(|i| ranks.iter().map(|v| v[i]).sum()).collect();
            let packed: Vec<Vec<f32>> = ranks.iter().map(|v| pack(v, n)).collect();
            let s = slot(len, n);
            let mut gathered = Vec::new();
            for (c, rank) in ranks.iter().enumerate() {
                let summed: Vec<f32> = (0..s)
                    .map(|i| packed.iter().map(|p| p[c * s + i]).sum())
                    .collect();
                let mut grads = rank.clone();
                let own = unpack_chunk(&summed, n, c, &mut grads).unwrap();
                assert_eq!(own, chunk_cut(len, n)[c]);
                assert_eq!(grads[own.clone()], sum[own.clone()], "len {len}, n {n}");
                // The rest of the buffer is the rank's own, untouched.
                assert_eq!(grads[..own.start], rank[..own.start]);
                assert_eq!(grads[own.end..], rank[own.end..]);
                gathered.extend(pack_chunk(&grads, n, c).unwrap());
            }
            let mut out = vec![f32::NAN; len];
            unpack(&gathered, n, &mut out).unwrap();
            assert_eq!(out, sum, "len {len}, n {n}");
        }
    }

    #[test]
    fn buffers_of_the_wrong_size_and_missing_chunks_are_errors() {
        let mut out = [0.0f32; 5];
        assert_eq!(
            unpack(&[0.0; 5], 2, &mut out),
            Err(PadError::Slots {
                got: 5,
                n: 2,
                slot: 3
            })
        );
        assert_eq!(
            unpack_chunk(&[0.0; 2], 2, 0, &mut out),
            Err(PadError::Slot { got: 2, slot: 3 })
        );
        assert_eq!(
            unpack_chunk(&[0.0; 3], 2, 2, &mut out),
            Err(PadError::NoChunk { chunk: 2, n: 2 })
        );
        assert_eq!(
            pack_chunk(&out, 3, 3),
            Err(PadError::NoChunk { chunk: 3, n: 3 })
        );
        assert_eq!(out, [0.0; 5]);
    }

    #[test]
    fn frame_lengths_over_the_cap_are_refused_naming_the_rank() {
        assert_eq!(frame_lengths(&[3, 0, 16], 16).unwrap(), [3, 0, 16]);
        assert_eq!(
            frame_lengths(&[3, 17, 1 << 62], 16),
            Err(PadError::FrameTooLarge {
                member: 1,
                len: 17,
                cap: 16
            })
        );
        // A garbled length far past the cap: refused before anything is allocated for it.
        let err = frame_lengths(&[0, u64::MAX], 1 << 30).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "NCCL rank 1's frame of {} bytes is over the cap of 1073741824 bytes",
                u64::MAX
            )
        );
    }

    #[test]
    fn frames_lie_back_to_back_and_split_back_whatever_their_lengths() {
        let frames: Vec<Vec<u8>> = vec![vec![1, 2, 3], vec![], vec![4], vec![]];
        let lens: Vec<usize> = frames.iter().map(Vec::len).collect();
        assert_eq!(frame_ranges(&lens).unwrap(), [0..3, 3..3, 3..4, 4..4]);
        let bytes: Vec<u8> = frames.concat();
        assert_eq!(split_frames(&bytes, &lens).unwrap(), frames);
        assert_eq!(
            split_frames(&[], &[0, 0]).unwrap(),
            [Vec::<u8>::new(), vec![]]
        );
        assert_eq!(
            split_frames(&bytes[..3], &lens),
            Err(PadError::FrameBytes {
                got: 3,
                expected: 4
            })
        );
        assert!(matches!(
            frame_ranges(&[usize::MAX, 1]),
            Err(PadError::FramesOverflow { .. })
        ));
    }

    proptest::proptest! {
        #[test]
        fn any_buffer_round_trips_through_its_slots(
            v in proptest::collection::vec(proptest::prelude::any::<u32>(), 0..200),
            n in 1usize..20,
        ) {
            let padded = pack(&v, n);
            proptest::prop_assert_eq!(padded.len(), n * slot(v.len(), n));
            let mut out = vec![0; v.len()];
            unpack(&padded, n, &mut out).unwrap();
            proptest::prop_assert_eq!(&out, &v);
            for c in 0..n {
                let mut one = vec![0; v.len()];
                let own = unpack_chunk(&pack_chunk(&v, n, c).unwrap(), n, c, &mut one).unwrap();
                proptest::prop_assert_eq!(&one[own.clone()], &v[own]);
            }
        }
    }
}
