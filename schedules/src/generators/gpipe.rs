//! GPipe: every micro-batch's forward, then every micro-batch's backward.
//!
//! The simplest flush schedule: rank `r` holds stage `r` (contiguous placement, `v = 1`),
//! runs `F(r, 0..m)` then `B(r, 0..m)`. Its steady bubble is `(p − 1)(T_F + T_B)` of idle
//! per rank like 1F1B's, but every rank holds the activations of all `m` micro-batches.

use super::{ScheduleKind, check_common};
use crate::action::Action;
use crate::error::Result;
use crate::plan::{Placement, Plan};

/// GPipe for `p ≥ 1` ranks, `m ≥ 1` micro-batches and `v = 1` (one stage per rank).
pub fn generate(ranks: usize, microbatches: usize, chunks: usize) -> Result<Plan> {
    check_common(ScheduleKind::GPipe, ranks, microbatches, chunks, Some(1))?;
    let mut plan = Plan::new(ranks, ranks, microbatches, Placement::Contiguous);
    let m = microbatches as u32;
    for (rank, list) in plan.ranks.iter_mut().enumerate() {
        let stage = rank as u32;
        list.reserve(2 * microbatches);
        list.extend((0..m).map(|mb| Some(Action::f(stage, mb))));
        list.extend((0..m).map(|mb| Some(Action::b(stage, mb))));
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_forwards_then_all_backwards() {
        let plan = generate(2, 3, 1).unwrap();
        let text: Vec<Vec<String>> = plan
            .ranks
            .iter()
            .map(|l| l.iter().flatten().map(|a| a.to_string()).collect())
            .collect();
        assert_eq!(text[0], ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"]);
        assert_eq!(text[1], ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]);
        assert_eq!(plan.stage_rank, [0, 1]);
    }

    #[test]
    fn rejects_more_than_one_chunk() {
        assert!(generate(2, 3, 2).is_err());
    }
}
