//! Tests of the ring collectives over in-process links.

use std::thread;

use super::*;
use crate::comm::CommError;
use crate::comm::link::InProcessLink;

/// Runs the all-reduce on every member of a group of `n` with inputs `inputs[r]`.
fn run(inputs: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
    let n = inputs.len();
    let links = InProcessLink::group(n);
    let group: Vec<usize> = (0..n).collect();
    let handles: Vec<_> = links
        .into_iter()
        .zip(inputs)
        .map(|(link, mut buf)| {
            let group = group.clone();
            thread::spawn(move || {
                all_reduce_sum(&link, &group, 5, &mut buf).unwrap();
                buf
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Deterministic pseudo-random values in [-1, 1) (a 64-bit LCG).
fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn sums_equal_the_direct_sum_for_1_to_5_members_and_odd_lengths() {
    for n in 1..=5 {
        for len in [0, 1, 2, 3, 7, 13, 64, 101] {
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|r| values(r as u64 * 31 + len as u64, len))
                .collect();
            let direct: Vec<f64> = (0..len)
                .map(|i| inputs.iter().map(|v| f64::from(v[i])).sum())
                .collect();
            let out = run(inputs);
            for (r, got) in out.iter().enumerate() {
                assert_eq!(
                    got, &out[0],
                    "n={n} len={len}: rank {r} differs from rank 0"
                );
            }
            for (i, (&g, &d)) in out[0].iter().zip(&direct).enumerate() {
                // n f32 additions of values in [-1, 1): error below n ulps of n.
                assert!(
                    (f64::from(g) - d).abs() <= 1e-6 * n as f64,
                    "n={n} len={len} [{i}]: {g} vs direct {d}"
                );
            }
        }
    }
}

#[test]
fn integer_valued_sums_are_exact() {
    // Small integers add exactly in f32 in any order, so the ring must equal the direct
    // sum bit for bit: a misplaced or doubled chunk would show.
    let n = 4;
    let len = 11;
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| (0..len).map(|i| (r * 100 + i) as f32).collect())
        .collect();
    let out = run(inputs);
    let expected: Vec<f32> = (0..len)
        .map(|i| (0..n).map(|r| (r * 100 + i) as f32).sum())
        .collect();
    for got in out {
        assert_eq!(got, expected);
    }
}

#[test]
fn a_subgroup_reduces_only_among_its_members() {
    // World of 4 = 2 replicas × 2 stages; each stage's group is {s, 2 + s}.
    let links = InProcessLink::group(4);
    let handles: Vec<_> = links
        .into_iter()
        .map(|link| {
            thread::spawn(move || {
                let r = link.rank();
                let group = [r % 2, 2 + r % 2];
                let mut buf = vec![r as f32; 3];
                all_reduce_sum(&link, &group, 1, &mut buf).unwrap();
                buf
            })
        })
        .collect();
    let out: Vec<Vec<f32>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(out[0], vec![2.0; 3]);
    assert_eq!(out[2], vec![2.0; 3]);
    assert_eq!(out[1], vec![4.0; 3]);
    assert_eq!(out[3], vec![4.0; 3]);
}

#[test]
fn replica_groups_hold_the_same_pipeline_rank_of_every_replica() {
    assert_eq!(replica_group(5, 3, 2), vec![1, 3, 5]);
    assert_eq!(replica_group(0, 1, 4), vec![0]);
}

#[test]
fn bad_groups_and_mismatched_lengths_are_refused() {
    let links = InProcessLink::group(3);
    let mut buf = vec![0.0; 4];
    assert!(matches!(
        all_reduce_sum(&links[0], &[1, 2], 0, &mut buf),
        Err(CommError::NotMember { rank: 0, .. })
    ));
    assert!(matches!(
        all_reduce_sum(&links[0], &[0, 1, 1], 0, &mut buf),
        Err(CommError::Duplicate { rank: 1, .. })
    ));
    // Rank 1 sends a chunk of the wrong length for rank 0's buffer of 4.
    links[1].send(0, 0, &[0; 12]).unwrap();
    let err = all_reduce_sum(&links[0], &[0, 1], 0, &mut buf).unwrap_err();
    assert!(
        matches!(
            err,
            CommError::Length {
                peer: 1,
                expected: 8,
                got: 12,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn all_gather_gives_every_member_every_frame_in_group_order() {
    // A subgroup in a non-sorted order, next to a rank that takes no part.
    let group = vec![3, 0, 2];
    let handles: Vec<_> = InProcessLink::group(4)
        .into_iter()
        .filter(|l| group.contains(&l.rank()))
        .map(|link| {
            let group = group.clone();
            thread::spawn(move || {
                let own = vec![link.rank() as u8; link.rank() + 1];
                all_gather(&link, &group, 9, &own).unwrap()
            })
        })
        .collect();
    let expected = vec![vec![3u8; 4], vec![0u8; 1], vec![2u8; 3]];
    for h in handles {
        assert_eq!(h.join().unwrap(), expected);
    }
    let links = InProcessLink::group(2);
    assert!(matches!(
        all_gather(&links[0], &[1], 0, b"x"),
        Err(CommError::NotMember { rank: 0, .. })
    ));
}

#[test]
fn gather_to_first_hands_the_first_member_every_other_frame_in_group_order() {
    let group = vec![2, 0, 1];
    let handles: Vec<_> = InProcessLink::group(3)
        .into_iter()
        .map(|link| {
            let group = group.clone();
            thread::spawn(move || {
                let own = vec![link.rank() as u8; link.rank() + 1];
                (
                    link.rank(),
                    gather_to_first(&link, &group, 4, &own).unwrap(),
                )
            })
        })
        .collect();
    for h in handles {
        match h.join().unwrap() {
            (2, got) => assert_eq!(got, Some(vec![vec![], vec![0u8], vec![1u8, 1]])),
            (_, got) => assert_eq!(got, None),
        }
    }
}

#[test]
fn a_reduce_scatter_then_an_all_gather_is_the_all_reduce_and_owns_the_cut() {
    let inputs: Vec<Vec<f32>> = (0..3).map(|r| values(r + 40, 11)).collect();
    let reduced = run(inputs.clone());
    let links = InProcessLink::group(3);
    let handles: Vec<_> = links
        .into_iter()
        .zip(inputs)
        .map(|(link, mut buf)| {
            thread::spawn(move || {
                let group = [0, 1, 2];
                let own = reduce_scatter_sum(&link, &group, 6, &mut buf).unwrap();
                assert_eq!(own, owned_chunk(11, 3, link.rank()));
                let chunk = buf[own.clone()].to_vec();
                all_gather_chunks(&link, &group, 6, &mut buf).unwrap();
                (own, chunk, buf)
            })
        })
        .collect();
    for h in handles {
        let (own, chunk, buf) = h.join().unwrap();
        assert_eq!(buf, reduced[0]);
        assert_eq!(
            chunk,
            reduced[0][own].to_vec(),
            "the chunk is summed before the gather"
        );
    }
}
