//! Interleaved 1F1B (Megatron-LM's "virtual pipeline"): `v` looped stages per rank.
//!
//! Rank `r` of `p` holds stages `r, r + p, …, r + (v − 1)p`. Its work is a sequence of
//! `m·v` *virtual* micro-batches taken in groups of `p`: virtual index `k` is micro-batch
//! `(k / pv)·p + k % p` on the rank's chunk `(k % pv) / p` for forwards, and on the mirrored
//! chunk `v − 1 − (k % pv) / p` for backwards. The rank runs
//! `min(2(p − 1 − r) + (v − 1)p, m·v)` warm-up forwards, then alternates one forward and
//! one backward, then drains the backwards. Each chunk is `1/v` of a 1F1B stage, so the
//! idle time per rank is `1/v` of 1F1B's for the same model.

use super::{ScheduleKind, check_common};
use crate::action::Action;
use crate::error::{Result, ScheduleError};
use crate::plan::{Placement, Plan};

/// Interleaved 1F1B for `p ≥ 1` ranks, `v ≥ 1` stages per rank and `m` a positive multiple
/// of `p` (Megatron's order walks micro-batches in groups of `p`; `v = 1` is plain 1F1B).
pub fn generate(ranks: usize, microbatches: usize, chunks: usize) -> Result<Plan> {
    check_common(
        ScheduleKind::Interleaved1F1B,
        ranks,
        microbatches,
        chunks,
        None,
    )?;
    if !microbatches.is_multiple_of(ranks) {
        return Err(ScheduleError::Unsupported {
            schedule: ScheduleKind::Interleaved1F1B.name().to_string(),
            reason: format!(
                "Megatron's interleaved order needs m to be a multiple of p: m = {microbatches} \
                 is not a multiple of p = {ranks} (try m = {})",
                microbatches.div_ceil(ranks) * ranks
            ),
        });
    }
    let (p, v) = (ranks, chunks);
    let mut plan = Plan::new(p, p * v, microbatches, Placement::Looped);
    let total = microbatches * v;
    // Virtual index → (chunk, micro-batch), the same walk for every rank.
    let mb_of = |k: usize| ((k / (p * v)) * p + k % p) as u32;
    let fwd_chunk = |k: usize| (k % (p * v)) / p;
    for (rank, list) in plan.ranks.iter_mut().enumerate() {
        let stage = |chunk: usize| (chunk * p + rank) as u32;
        let forward = |k: usize| Some(Action::f(stage(fwd_chunk(k)), mb_of(k)));
        let backward = |k: usize| Some(Action::b(stage(v - 1 - fwd_chunk(k)), mb_of(k)));
        let warmup = (2 * (p - 1 - rank) + (v - 1) * p).min(total);
        list.reserve(2 * total);
        list.extend((0..warmup).map(forward));
        for k in 0..total - warmup {
            list.push(forward(k + warmup));
            list.push(backward(k));
        }
        list.extend((total - warmup..total).map(backward));
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generators::rank_text;

    #[test]
    fn megatron_order_two_ranks_two_chunks() {
        // p = 2, v = 2, m = 4: stages 0, 2 on rank 0 and 1, 3 on rank 1.
        let plan = generate(2, 4, 2).unwrap();
        // Rank 0: warm-up 2·1 + 1·2 = 4 forwards, then 1F1B over the virtual order.
        assert_eq!(
            rank_text(&plan, 0),
            [
                "0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2", "0B0", "2F3", "0B1",
                "2B2", "2B3", "0B2", "0B3"
            ]
        );
        // Rank 1: warm-up (v − 1)p = 2 forwards.
        assert_eq!(
            rank_text(&plan, 1),
            [
                "1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1F2", "1B0", "1F3", "1B1", "3F2", "3B2",
                "3F3", "3B3", "1B2", "1B3"
            ]
        );
    }

    #[test]
    fn microbatches_must_be_a_multiple_of_ranks() {
        let err = generate(4, 6, 2).unwrap_err().to_string();
        assert!(err.contains("multiple of p"), "{err}");
        assert!(generate(4, 8, 3).is_ok());
    }
}
