//! The zero-bubble paper's handcrafted schedules ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble
//! Pipeline Parallelism", ICLR 2024, section 3), one stage per rank.
//!
//! Both are 1F1B with every backward split into its input-gradient part `I` (the previous
//! stage waits for it) and its weight-gradient part `W` (nobody waits for it). Rank `r` runs
//! `w_r` warm-up forwards, then steady rounds (F, I, and the oldest pending W once more than
//! `d_r` are pending), then cool-down rounds (I and the oldest pending W), then the W's
//! still pending. Holding `d_r` W's back lets a rank run its I's back to back while the
//! pipeline fills downstream of it, and gives it W's to fill the cool-down, where it would
//! otherwise wait for input-gradients.
//!
//! - **ZB-H1**: `w_r = p − 1 − r` (1F1B's warm-up) and `d_r = r`. Every rank holds at most `p`
//!   micro-batches between F and W, so no rank exceeds 1F1B's peak `p M_B`; the steady idle
//!   per rank is `(p − 1)(T_F + T_I − T_W)`, a third of 1F1B's when the three costs are equal.
//! - **ZB-H2**: `w_r = 2(p − 1 − r)` and `d_r = 2r`: the extra warm-up forwards cover the
//!   wait for the first `I`, for a peak of `2p − 1` micro-batches on rank 0; the steady
//!   idle is `max(0, (p − 1)(T_F + T_I − 2T_W))`, zero once `m ≥ 2p` and `T_F + T_I ≤ 2T_W`.

use std::collections::VecDeque;

use super::{ScheduleKind, check_common};
use crate::action::Action;
use crate::error::Result;
use crate::plan::{Placement, Plan};

/// ZB-H1 for `p ≥ 1` ranks, any `m ≥ 1` micro-batches and `v = 1`.
pub fn generate_h1(ranks: usize, microbatches: usize, chunks: usize) -> Result<Plan> {
    check_common(ScheduleKind::ZbH1, ranks, microbatches, chunks, Some(1))?;
    Ok(split_backward_1f1b(ranks, microbatches, |r| {
        (ranks - 1 - r, r)
    }))
}

/// ZB-H2 for `p ≥ 1` ranks, any `m ≥ 1` micro-batches and `v = 1`. Its bubble only
/// vanishes once `m ≥ 2p` (with fewer micro-batches the extra warm-up cannot be filled).
pub fn generate_h2(ranks: usize, microbatches: usize, chunks: usize) -> Result<Plan> {
    check_common(ScheduleKind::ZbH2, ranks, microbatches, chunks, Some(1))?;
    Ok(split_backward_1f1b(ranks, microbatches, |r| {
        (2 * (ranks - 1 - r), 2 * r)
    }))
}

/// 1F1B with split backwards; `shape(r)` gives rank `r`'s (warm-up forwards, deferred W's).
fn split_backward_1f1b(ranks: usize, m: usize, shape: impl Fn(usize) -> (usize, usize)) -> Plan {
    let mut plan = Plan::new(ranks, ranks, m, Placement::Contiguous);
    for (rank, list) in plan.ranks.iter_mut().enumerate() {
        let stage = rank as u32;
        let (warmup, defer) = shape(rank);
        let warmup = warmup.min(m);
        let mut pending = VecDeque::with_capacity(defer + 1);
        let mut push = |a: Action| list.push(Some(a));
        for mb in 0..warmup {
            push(Action::f(stage, mb as u32));
        }
        for mb in 0..m {
            if mb + warmup < m {
                push(Action::f(stage, (mb + warmup) as u32));
            }
            push(Action::i(stage, mb as u32));
            pending.push_back(mb as u32);
            // Steady rounds keep `defer` W's back; cool-down rounds (no forward left) spend
            // one per round, and whatever is left runs at the end.
            let keep = if mb + warmup < m { defer } else { 0 };
            if pending.len() > keep
                && let Some(w) = pending.pop_front()
            {
                push(Action::w(stage, w));
            }
        }
        for w in pending {
            push(Action::w(stage, w));
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generators::rank_text;

    #[test]
    fn zb_h1_two_ranks() {
        let plan = generate_h1(2, 3, 1).unwrap();
        // Rank 0: 1F1B's warm-up, every W right after its I.
        assert_eq!(
            rank_text(&plan, 0),
            [
                "0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0I2", "0W2"
            ]
        );
        // Rank 1 (last): one W held back, so its I's reach rank 0 sooner.
        assert_eq!(
            rank_text(&plan, 1),
            [
                "1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1W2"
            ]
        );
    }

    #[test]
    fn zb_h2_warms_up_deeper() {
        let plan = generate_h2(3, 6, 1).unwrap();
        let t = rank_text(&plan, 0);
        // 2(p − 1) = 4 warm-up forwards, then the first steady round.
        assert_eq!(&t[..7], ["0F0", "0F1", "0F2", "0F3", "0F4", "0I0", "0W0"]);
        // The last rank holds 2r = 4 W's back before its first one.
        let last = rank_text(&plan, 2);
        let first_w = last.iter().position(|a| a.contains('W')).unwrap();
        assert_eq!(
            &last[..first_w],
            [
                "2F0", "2I0", "2F1", "2I1", "2F2", "2I2", "2F3", "2I3", "2F4", "2I4"
            ]
        );
    }

    #[test]
    fn rejects_chunks() {
        assert!(generate_h1(4, 8, 2).is_err());
        assert!(generate_h2(4, 8, 2).is_err());
    }
}
