//! DualPipeV (DeepSeek's DualPipe "cut in half", `ScheduleDualPipeV` in PyTorch's
//! `torch.distributed.pipelining`): two stages per rank in a V, steady rounds of overlapped
//! forward + backward pairs.
//!
//! DualPipe (DeepSeek-V3 report, section 3.2) runs two pipelines in opposite directions over
//! `PP` ranks; DualPipeV folds it onto `p = PP / 2` ranks: rank `r` holds stage `r` (chunk 0,
//! on the way down) and stage `2p − 1 − r` (chunk 1, on the way back), as ZB-V does. In its
//! steady state a rank runs a forward of one chunk overlapped with the full backward of the
//! other, `(F;B)OVERLAP_F_B`, so on a device the backward's communication hides behind the
//! forward's compute and the other way round. The warm-up's last steps and the cool-down
//! split backwards into `I` and `W` to fill the ramps, as the zero-bubble schedules do.
//!
//! Rank `r`'s list, with `a = p − 1 − r` (ranks below it) and `b = r + 1`:
//!
//! 1. `2a` chunk-0 forwards;
//! 2. `b` pairs (chunk-0 F, chunk-1 F);
//! 3. `a` triples (chunk-1 I, the oldest pending W, chunk-1 F);
//! 4. `m − 2p + b` rounds of `(chunk-0 F; chunk-1 B)` and `(chunk-1 F; chunk-0 B)`, except that
//!    the last rank runs its very first pair as a plain chunk-0 F then chunk-1 B (its chunk-1
//!    backward is ready at once, the turn of the V being on the same rank);
//! 5. `a` rounds of (chunk-1 B, `(chunk-1 F; chunk-0 B)`), the last forwards;
//! 6. `b` rounds of (chunk-1 backward, chunk-0 backward): full B's for the first half, split
//!    I's from round `⌊b/2⌋` on (from its chunk-1 backward on odd ranks, from its chunk-0
//!    backward on even ones);
//! 7. `a` rounds of (the oldest pending W, chunk-0 I);
//! 8. the `b` W's still pending.
//!
//! W's run in the order of their I's, and every stage runs its forwards and its backwards
//! in micro-batch order. Constraints (PyTorch's): `p ≥ 1`, exactly `v = 2` stages per rank,
//! and `m ≥ 2p` micro-batches (as many as stages), for otherwise rank 0's steady phase has
//! no round.
//!
//! DeepSeek's published figures: a bubble of `(PP/2 − 1)(F&B + B − 3W)`, i.e.
//! `(p − 1)(F&B + B − 3W)` in chunk costs with `F&B` the time of an overlapped pair, and
//! `PP + 1 = 2p + 1` chunk activations per rank. The simulator runs a pair as `T_F + T_B` (no
//! overlap gain); under it the worst rank's steady idle is exactly that bubble when
//! `T_F = T_I ≥ T_W` (tests/dualpipe_v.rs), and no rank holds more than `2p + 1` stashes.

use std::collections::VecDeque;

use super::{ScheduleKind, check_common};
use crate::action::{Action, ActionKind, StageMb};
use crate::error::{Result, ScheduleError};
use crate::plan::{Placement, Plan};

/// DualPipeV for `p ≥ 1` ranks, `m ≥ 2p` micro-batches and exactly `v = 2`.
pub fn generate(ranks: usize, microbatches: usize, chunks: usize) -> Result<Plan> {
    check_common(
        ScheduleKind::DualPipeV,
        ranks,
        microbatches,
        chunks,
        Some(2),
    )?;
    if microbatches < 2 * ranks {
        return Err(ScheduleError::Unsupported {
            schedule: ScheduleKind::DualPipeV.name().to_string(),
            reason: format!(
                "needs at least as many micro-batches as stages (m ≥ 2p = {}), \
                 not m = {microbatches}",
                2 * ranks
            ),
        });
    }
    let mut plan = Plan::new(ranks, 2 * ranks, microbatches, Placement::VShape);
    for (rank, list) in plan.ranks.iter_mut().enumerate() {
        *list = Rank::new(ranks, rank).order(microbatches);
    }
    Ok(plan)
}

/// The number of compute actions [`generate`] builds (an overlapped pair counts as one):
/// `p(2m + 4p − 1) + 1`, checked (`None` on overflow).
pub(super) fn compute_actions(ranks: usize, microbatches: usize) -> Option<u64> {
    let (p, m) = (ranks as u64, microbatches as u64);
    let per_rank = m.checked_mul(2)?.checked_add(p.checked_mul(4)?)?;
    p.checked_mul(per_rank.checked_sub(1)?)?.checked_add(1)
}

/// One rank's list under construction: per chunk, the next forward and the next backward
/// micro-batch (a full B counts as the backward, with its W), and the W's pending after
/// split I's, oldest first.
struct Rank {
    p: usize,
    r: usize,
    stage: [u32; 2],
    next_f: [u32; 2],
    next_b: [u32; 2],
    pending_w: VecDeque<StageMb>,
    out: Vec<Option<Action>>,
}

impl Rank {
    fn new(p: usize, r: usize) -> Self {
        Rank {
            p,
            r,
            stage: [r as u32, (2 * p - 1 - r) as u32],
            next_f: [0; 2],
            next_b: [0; 2],
            pending_w: VecDeque::new(),
            out: Vec::new(),
        }
    }

    /// The next forward of `chunk`, counted.
    fn take_f(&mut self, chunk: usize) -> StageMb {
        let mb = self.next_f[chunk];
        self.next_f[chunk] += 1;
        StageMb {
            stage: self.stage[chunk],
            microbatch: mb,
        }
    }

    /// The next backward of `chunk`, counted.
    fn take_b(&mut self, chunk: usize) -> StageMb {
        let mb = self.next_b[chunk];
        self.next_b[chunk] += 1;
        StageMb {
            stage: self.stage[chunk],
            microbatch: mb,
        }
    }

    fn push(&mut self, kind: ActionKind, at: StageMb) {
        self.out
            .push(Some(Action::new(kind, at.stage, at.microbatch)));
    }

    fn f(&mut self, chunk: usize) {
        let at = self.take_f(chunk);
        self.push(ActionKind::F, at);
    }

    /// A full backward of `chunk`.
    fn b(&mut self, chunk: usize) {
        let at = self.take_b(chunk);
        self.push(ActionKind::B, at);
    }

    /// An input-gradient backward of `chunk`; its W waits in the queue.
    fn i(&mut self, chunk: usize) {
        let at = self.take_b(chunk);
        self.push(ActionKind::I, at);
        self.pending_w.push_back(at);
    }

    /// The backward of `chunk`: split when `split`, else full.
    fn backward(&mut self, chunk: usize, split: bool) {
        if split { self.i(chunk) } else { self.b(chunk) }
    }

    /// The oldest pending W, if any.
    fn w(&mut self) {
        if let Some(at) = self.pending_w.pop_front() {
            self.push(ActionKind::W, at);
        }
    }

    /// `(forward of chunk f; full backward of the other chunk)OVERLAP_F_B`.
    fn overlap(&mut self, f: usize) {
        let fwd = self.take_f(f);
        let bwd = self.take_b(1 - f);
        self.out.push(Some(Action::overlap(fwd, bwd)));
    }

    /// The whole list for `m` micro-batches (see the module docs for the eight phases).
    fn order(mut self, m: usize) -> Vec<Option<Action>> {
        let (p, r) = (self.p, self.r);
        let (a, b) = (p - 1 - r, r + 1);
        self.out.reserve(2 * m + 4 * p);
        for _ in 0..2 * a {
            self.f(0);
        }
        for _ in 0..b {
            self.f(0);
            self.f(1);
        }
        for _ in 0..a {
            self.i(1);
            self.w();
            self.f(1);
        }
        for round in 0..m + b - 2 * p {
            if round == 0 && r == p - 1 {
                self.f(0);
                self.b(1);
            } else {
                self.overlap(0);
            }
            self.overlap(1);
        }
        for _ in 0..a {
            self.b(1);
            self.overlap(1);
        }
        let mut split = false;
        for round in 0..b {
            let half = round == b / 2;
            split |= half && r % 2 == 1;
            self.backward(1, split);
            split |= half;
            self.backward(0, split);
        }
        for _ in 0..a {
            self.w();
            self.i(0);
        }
        while !self.pending_w.is_empty() {
            self.w();
        }
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generators::rank_text;

    #[test]
    fn one_rank_turns_on_itself() {
        let plan = generate(1, 3, 2).unwrap();
        assert_eq!(plan.stage_rank, [0, 0]);
        let expected = [
            "0F0",
            "1F0",
            "0F1",
            "1B0",
            "(1F1;0B0)OVERLAP_F_B",
            "(0F2;1B1)OVERLAP_F_B",
            "(1F2;0B1)OVERLAP_F_B",
            "1B2",
            "0I2",
            "0W2",
        ];
        assert_eq!(rank_text(&plan, 0), expected);
    }

    #[test]
    fn compute_actions_is_the_generated_count() {
        for p in 1..=8 {
            for m in [2 * p, 2 * p + 1, 3 * p, 5 * p + 2] {
                let plan = generate(p, m, 2).unwrap();
                assert_eq!(
                    compute_actions(p, m),
                    Some(plan.num_actions() as u64),
                    "p={p} m={m}"
                );
            }
        }
        assert_eq!(compute_actions(usize::MAX, 2), None);
    }

    #[test]
    fn constraints_are_named() {
        let reason = |p, m, v| match generate(p, m, v) {
            Err(ScheduleError::Unsupported { schedule, reason }) => {
                assert_eq!(schedule, "dualpipe-v");
                reason
            }
            other => panic!("p={p} m={m} v={v}: {other:?}"),
        };
        assert_eq!(
            reason(4, 7, 2),
            "needs at least as many micro-batches as stages (m ≥ 2p = 8), not m = 7"
        );
        assert_eq!(
            reason(4, 8, 1),
            "places exactly 2 stage(s) per rank, not v = 1"
        );
        assert!(reason(4, 8, 3).contains("exactly 2 stage(s)"));
        assert!(generate(4, 8, 2).is_ok());
    }
}
