//! 1F1B (PipeDream-flush): warm-up forwards, then alternate one forward and one full
//! backward, then drain the remaining backwards.
//!
//! Rank `r` of `p` holds stage `r` and runs `min(p − 1 − r, m)` warm-up forwards, so it never
//! holds more than `p − r` micro-batches' activations (GPipe holds `m`); the steady bubble
//! is the same as GPipe's, `(p − 1)(T_F + T_B)` of idle on every rank.

use super::{ScheduleKind, check_common};
use crate::action::Action;
use crate::error::Result;
use crate::plan::{Placement, Plan};

/// 1F1B for `p ≥ 1` ranks, any `m ≥ 1` micro-batches (with `m < p` the warm-up is simply
/// cut short) and `v = 1`.
pub fn generate(ranks: usize, microbatches: usize, chunks: usize) -> Result<Plan> {
    check_common(ScheduleKind::OneFOneB, ranks, microbatches, chunks, Some(1))?;
    let mut plan = Plan::new(ranks, ranks, microbatches, Placement::Contiguous);
    for (rank, list) in plan.ranks.iter_mut().enumerate() {
        let stage = rank as u32;
        let m = microbatches as u32;
        let warmup = (ranks - 1 - rank).min(microbatches) as u32;
        list.reserve(2 * microbatches);
        list.extend((0..warmup).map(|mb| Some(Action::f(stage, mb))));
        for mb in 0..m - warmup {
            list.push(Some(Action::f(stage, mb + warmup)));
            list.push(Some(Action::b(stage, mb)));
        }
        list.extend((m - warmup..m).map(|mb| Some(Action::b(stage, mb))));
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generators::rank_text;

    fn text(plan: &Plan) -> Vec<Vec<String>> {
        (0..plan.num_ranks()).map(|r| rank_text(plan, r)).collect()
    }

    #[test]
    fn two_ranks_three_microbatches() {
        let plan = generate(2, 3, 1).unwrap();
        let t = text(&plan);
        assert_eq!(t[0], ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]);
        assert_eq!(t[1], ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]);
    }

    #[test]
    fn fewer_microbatches_than_ranks_cuts_the_warmup() {
        let plan = generate(4, 2, 1).unwrap();
        let t = text(&plan);
        assert_eq!(t[0], ["0F0", "0F1", "0B0", "0B1"]);
        assert_eq!(t[2], ["2F0", "2F1", "2B0", "2B1"]);
        assert_eq!(t[3], ["3F0", "3B0", "3F1", "3B1"]);
    }
}
