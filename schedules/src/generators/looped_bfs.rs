//! Looped breadth-first (BFS) schedule: looped placement, and every micro-batch goes through
//! a rank's chunk `c` before any goes through its chunk `c + 1`.
//!
//! Rank `r` of `p` holds stages `r, r + p, …, r + (v − 1)p`. Forwards run chunk by chunk,
//! each over all `m` micro-batches; backwards then run the chunks in reverse order. Like
//! GPipe it holds every micro-batch's activations, but a rank's later chunks keep it busy
//! while earlier ranks fill, so with many micro-batches the bubble shrinks by about `v`.

use super::{ScheduleKind, check_common};
use crate::action::Action;
use crate::error::Result;
use crate::plan::{Placement, Plan};

/// Looped BFS for `p ≥ 1` ranks, `m ≥ 1` micro-batches and `v ≥ 1` stages per rank.
pub fn generate(ranks: usize, microbatches: usize, chunks: usize) -> Result<Plan> {
    check_common(ScheduleKind::LoopedBfs, ranks, microbatches, chunks, None)?;
    let stages = ranks * chunks;
    let mut plan = Plan::new(ranks, stages, microbatches, Placement::Looped);
    let m = microbatches as u32;
    for (rank, list) in plan.ranks.iter_mut().enumerate() {
        let own: Vec<u32> = (0..chunks).map(|c| (c * ranks + rank) as u32).collect();
        list.reserve(2 * chunks * microbatches);
        for &stage in &own {
            list.extend((0..m).map(|mb| Some(Action::f(stage, mb))));
        }
        for &stage in own.iter().rev() {
            list.extend((0..m).map(|mb| Some(Action::b(stage, mb))));
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_by_chunk_then_reverse() {
        let plan = generate(2, 2, 2).unwrap();
        let t: Vec<String> = plan.ranks[1]
            .iter()
            .flatten()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(t, ["1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"]);
        assert_eq!(plan.stage_rank, [0, 1, 0, 1]);
    }
}
