//! ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6): two stages per rank
//! in a V.
//!
//! Rank `r` of `p` holds stage `r` (chunk 0, on the way down) and stage `2p − 1 − r`
//! (chunk 1, on the way back), so a micro-batch's forward turns around on rank `p − 1` and
//! its backward on rank 0. Backwards are split into `I` and `W`. Rank `r`'s list, with
//! `n = max(m, 2p − 1)` micro-batches per chunk:
//!
//! 1. warm-up: `2(p − r) − 1` chunk-0 forwards; then `r` pairs (chunk-1 F, chunk-0 F);
//!    then `p − r` triples (chunk-1 F, I, W), the first backwards turning around on rank 0;
//! 2. steady: repeat (chunk-0 F while any is left, chunk-0 I, chunk-0 W, chunk-1 F,
//!    chunk-1 I, chunk-1 W) until every forward is issued;
//! 3. cool-down: `r` pairs (chunk-0 I, chunk-1 I) with their W's deferred, then `p − r`
//!    pairs (chunk-0 I, the oldest deferred chunk-0 W), then the remaining W's, chunk 1 first.
//!
//! With `m < 2p − 1` the order is built for `2p − 1` micro-batches and the actions of the
//! missing ones are dropped. Each chunk is half a 1F1B stage, and rank 0 holds at most `2p`
//! chunk activations, 1F1B's peak `p M_B`; with `T_F = T_I = T_W` and `m ≥ 2p` the steady
//! bubble is zero.

use super::{ScheduleKind, check_common};
use crate::action::{Action, ActionKind};
use crate::error::Result;
use crate::plan::{Placement, Plan};

/// ZB-V for `p ≥ 1` ranks, any `m ≥ 1` micro-batches and exactly `v = 2`.
pub fn generate(ranks: usize, microbatches: usize, chunks: usize) -> Result<Plan> {
    check_common(ScheduleKind::ZbV, ranks, microbatches, chunks, Some(2))?;
    let mut plan = Plan::new(ranks, 2 * ranks, microbatches, Placement::VShape);
    for (rank, list) in plan.ranks.iter_mut().enumerate() {
        *list = rank_order(ranks, rank, microbatches);
    }
    Ok(plan)
}

/// Issues one chunk's actions in micro-batch order: each kind keeps its own counter.
struct Chunk {
    stage: u32,
    f: usize,
    i: usize,
    w: usize,
}

impl Chunk {
    fn new(stage: usize) -> Self {
        Chunk {
            stage: stage as u32,
            f: 0,
            i: 0,
            w: 0,
        }
    }

    fn next(&mut self, kind: ActionKind) -> Action {
        let counter = match kind {
            ActionKind::F => &mut self.f,
            ActionKind::I => &mut self.i,
            _ => &mut self.w,
        };
        *counter += 1;
        Action::new(kind, self.stage, (*counter - 1) as u32)
    }
}

/// Rank `r`'s list (see the module docs for the three phases).
fn rank_order(p: usize, r: usize, m: usize) -> Vec<Option<Action>> {
    use ActionKind::{F, I, W};
    let n = m.max(2 * p - 1);
    let (mut c0, mut c1) = (Chunk::new(r), Chunk::new(2 * p - 1 - r));
    let mut out = Vec::with_capacity(6 * n);
    // Warm-up.
    for _ in 0..2 * (p - r) - 1 {
        out.push(c0.next(F));
    }
    for _ in 0..r {
        out.push(c1.next(F));
        out.push(c0.next(F));
    }
    for _ in 0..p - r {
        out.push(c1.next(F));
        out.push(c1.next(I));
        out.push(c1.next(W));
    }
    // Steady: one F, I, W per chunk per round.
    while c1.f < c0.f || c0.f < n {
        if c0.f < n {
            out.push(c0.next(F));
        }
        out.push(c0.next(I));
        out.push(c0.next(W));
        out.push(c1.next(F));
        out.push(c1.next(I));
        out.push(c1.next(W));
    }
    // Cool-down: the deferred W's fill the wait for the last input-gradients.
    for _ in 0..r {
        out.push(c0.next(I));
        out.push(c1.next(I));
    }
    for _ in 0..p - r {
        out.push(c0.next(I));
        out.push(c0.next(W));
    }
    while c1.w < c1.i {
        out.push(c1.next(W));
    }
    while c0.w < c0.i {
        out.push(c0.next(W));
    }
    // Drop the padding micro-batches of a short iteration (m < 2p − 1).
    out.into_iter()
        .filter(|a| (a.microbatch as usize) < m)
        .map(Some)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_ranks_four_microbatches_rank_0() {
        let plan = generate(2, 4, 2).unwrap();
        assert_eq!(plan.stage_rank, [0, 1, 1, 0]);
        let t: Vec<String> = plan.ranks[0]
            .iter()
            .flatten()
            .map(|a| a.to_string())
            .collect();
        let expected = [
            // warm-up: 3 chunk-0 forwards, then 2 (F, I, W) on chunk 1 (stage 3)
            "0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "3I1", "3W1",
            // steady rounds
            "0F3", "0I0", "0W0", "3F2", "3I2", "3W2", "0I1", "0W1", "3F3", "3I3", "3W3",
            // cool-down
            "0I2", "0W2", "0I3", "0W3",
        ];
        assert_eq!(t, expected);
    }

    #[test]
    fn short_iterations_drop_the_padding_microbatches() {
        let plan = generate(4, 3, 2).unwrap();
        assert_eq!(plan.num_actions(), 8 * 3 * 3);
        assert!(plan.iter().all(|(_, _, a)| a.microbatch < 3));
    }

    #[test]
    fn needs_two_chunks() {
        assert!(generate(4, 8, 1).is_err());
        assert!(generate(4, 8, 3).is_err());
    }
}
