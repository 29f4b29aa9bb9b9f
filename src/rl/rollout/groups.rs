//! How the live batch is split into groups: how many the engine keeps in flight
//! ([`groups_in_flight`]), which sequences each launch takes ([`take_groups`]), and the
//! live-batch threshold a per-group threshold becomes ([`live_threshold`]).

use std::collections::VecDeque;

/// Fewest positions (rows) a group step should carry, unless fewer are live: the live batch
/// is split into no more groups than that allows, and groups that shrink below it merge.
///
/// Why: a group step reads every stage's weights once, whatever its size, and on a
/// memory-bound target that read is most of a small step's cost, and stages reading weights
/// at once share the memory bandwidth: groups of one sequence read the weights once per token
/// where one group of several reads them once for all. A verification carries K+1 rows per
/// sequence, so speculation keeps more, smaller groups than plain decoding. On the bench's
/// `d_model` 512 target 32 rows kept the long tail about as fast as larger groups and far
/// faster than single sequences (docs/benchmarks.md, "Fewest rows per group step"). A target
/// whose weights sit in the cache gains the other way: more groups in flight use more cores
/// (`RolloutTuning::min_group_rows`, which defaults to 1). So this is the engine's and
/// `bench rollout`'s default, not `pipefill rl`'s.
pub const MIN_GROUP_ROWS: usize = 32;

/// Groups the engine keeps in flight while `live` sequences are live and each step carries
/// `rows_per_seq` positions per sequence: at most `groups`, none with fewer than
/// `min_rows` positions, at least one.
pub fn groups_in_flight(live: usize, rows_per_seq: f64, groups: usize, min_rows: usize) -> usize {
    let rows = live as f64 * rows_per_seq / min_rows.max(1) as f64;
    (rows.floor() as usize).clamp(1, groups.max(1))
}

/// The live-batch threshold at which speculation still runs at most `per_group` sequences
/// per group, verifying `rows_per_seq` positions per sequence with up to `groups` groups
/// of at least `min_rows` positions ([`groups_in_flight`]): how a threshold per group,
/// which step costs decide, becomes the engine's.
pub fn live_threshold(
    per_group: usize,
    rows_per_seq: f64,
    groups: usize,
    min_rows: usize,
) -> usize {
    (1..=per_group * groups.max(1))
        .take_while(|&live| {
            let g = groups_in_flight(live, rows_per_seq, groups, min_rows);
            live.div_ceil(g) <= per_group
        })
        .last()
        .unwrap_or(0)
}

/// The groups to launch from the front of `waiting` into `slots` free places in flight,
/// each of at most `size` sequences (the live batch over the groups it keeps in flight):
/// as few as hold them, their sizes differing by at most one. Sequences beyond `slots`
/// groups of `size` wait for the next free place.
///
/// Balanced groups keep the stages balanced: a group twice the others' size takes twice
/// as long at every stage, and the smaller ones queued behind it wait there, so the
/// stages run it as a convoy and the cores idle (docs/benchmarks.md, "Balanced groups").
/// Merging every returning group into the one waiting made such groups as the live batch
/// shrank.
pub(super) fn take_groups(
    waiting: &mut VecDeque<usize>,
    slots: usize,
    size: usize,
) -> Vec<Vec<usize>> {
    let size = size.max(1);
    let n = waiting.len().min(slots * size);
    let pieces = n.div_ceil(size).min(slots);
    (0..pieces)
        .map(|p| {
            // Sizes n / pieces, the first n % pieces one larger.
            let len = n / pieces + usize::from(p < n % pieces);
            waiting.drain(..len).collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Groups follow the rows a step carries: one group until the live batch fills two of
    /// `min_rows`, then more up to `groups`; a threshold per group becomes the live batch up
    /// to which the groups stay that small.
    #[test]
    fn groups_in_flight_follow_the_rows_and_thresholds_follow_the_groups() {
        assert_eq!(groups_in_flight(1, 1.0, 4, 32), 1);
        assert_eq!(groups_in_flight(63, 1.0, 4, 32), 1);
        assert_eq!(groups_in_flight(64, 1.0, 4, 32), 2);
        assert_eq!(groups_in_flight(128, 1.0, 4, 32), 4);
        assert_eq!(groups_in_flight(13, 5.0, 4, 32), 2, "verifying 5 rows each");
        assert_eq!(groups_in_flight(500, 1.0, 4, 1), 4);
        assert_eq!(groups_in_flight(0, 1.0, 0, 0), 1);
        // 4 per group: one group of 4 verifying 20 rows; 5 would be one group of 5.
        assert_eq!(live_threshold(4, 5.0, 4, MIN_GROUP_ROWS), 4);
        // 8 per group at 5 rows each: two groups from 13 live, at most 8 each up to 16.
        assert_eq!(live_threshold(8, 5.0, 4, MIN_GROUP_ROWS), 8);
        assert_eq!(live_threshold(0, 5.0, 4, MIN_GROUP_ROWS), 0);
    }

    fn take(waiting: usize, slots: usize, size: usize) -> (Vec<usize>, usize) {
        let mut w: VecDeque<usize> = (0..waiting).collect();
        let groups = take_groups(&mut w, slots, size);
        let flat: Vec<usize> = groups.iter().flatten().copied().collect();
        assert_eq!(flat, (0..flat.len()).collect::<Vec<_>>(), "in order");
        (groups.iter().map(Vec::len).collect(), w.len())
    }

    #[test]
    fn groups_are_balanced_and_no_larger_than_their_share() {
        // Ten sequences over four groups (the first launch): 3, 3, 2, 2.
        assert_eq!(take(10, 4, 3), (vec![3, 3, 2, 2], 0));
        // Two groups' survivors and one free place: a group of its share, the rest waits
        // (merged whole they would be a group twice the others').
        assert_eq!(take(12, 1, 8), (vec![8], 4));
        // Fewer than a share: one group, however many places are free.
        assert_eq!(take(7, 3, 8), (vec![7], 0));
        // Speculation starts (more, smaller groups): a returning group splits in shares.
        assert_eq!(take(32, 3, 16), (vec![16, 16], 0));
        assert_eq!(take(33, 3, 16), (vec![11, 11, 11], 0));
        // No free place, or nobody waiting: nothing launches.
        assert_eq!(take(5, 0, 8), (vec![], 5));
        assert_eq!(take(0, 4, 8), (vec![], 0));
    }
}
