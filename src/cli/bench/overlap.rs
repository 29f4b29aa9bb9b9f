//! How much faster the rollout engine's groups can run their steps at once than one after
//! another, measured for `bench rollout`'s per-bucket predictions ([`super::costs`]): with
//! several groups in flight the stage threads run different groups' steps at the same time,
//! sharing the machine's cores, memory bandwidth and the backend's threads. The engine's
//! threshold is decided in the tail, one group at a time, so only the bench uses it.
//!
//! Measured and looked up by the rows a step carries (a decode: one per sequence; a
//! verification: K+1 per sequence), not by its sequences: a step's products run on its own
//! thread up to `ROWMUL_MAX_ROWS` rows and on the backend's pool beyond, where one step
//! already keeps every core busy and another group's step can only wait for it. A
//! verification of 5 positions of 32 sequences is a 160-row step on the pool: keyed by its
//! sequences it would be predicted to overlap as 32-row decodes do (1.9x on the 2-core
//! box), against 1.2x for steps of that many rows.

use std::time::Instant;

use pipefill::model::infer::{InferStage, Span, run_stages};
use pipefill::model::{Cut, Gpt};
use pipefill::rl::RlError;
use pipefill::tensor::Backend;

use super::costs::linear;

/// How much faster the steps of `groups` groups of `rows` rows each run started together
/// than one after another ([`overlaps`]).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub(super) struct Overlap {
    pub rows: usize,
    pub groups: usize,
    pub speedup: f64,
}

/// How much faster a step of `rows` rows runs with `in_flight` groups in flight than
/// alone, by `overlaps`: at the most groups measured up to `in_flight`, linear in the rows
/// between measured sizes and flat beyond them (never below 1: a step cannot lose by
/// another group's being in flight, whose wait is its own). 1 with one group in flight.
pub(super) fn overlap_at(overlaps: &[Overlap], rows: usize, in_flight: usize) -> f64 {
    let Some(groups) = overlaps
        .iter()
        .map(|o| o.groups)
        .filter(|&g| g <= in_flight)
        .max()
    else {
        return 1.0;
    };
    let pts: Vec<(f64, f64)> = overlaps
        .iter()
        .filter(|o| o.groups == groups)
        .map(|o| (o.rows as f64, o.speedup))
        .collect();
    let (lo, hi) = (pts[0], pts[pts.len() - 1]);
    let rows = (rows as f64).clamp(lo.0, hi.0);
    linear(&pts, rows).max(1.0)
}

/// [`Overlap`]s of `model` for steps of 1, 2, 4, … up to `max_rows` rows and 2 up to
/// `max_groups` groups: `n` steps of those rows at a cache of `past` positions, started
/// together on `n` threads, each on its own copy of the whole model (as the engine's stage
/// threads read each their own stage's weights), against one such step alone; each the
/// fastest of `reps`, timed in turn. A step of `r` rows is a decode of `r` sequences up to
/// `max_seqs` of them, and beyond that a verification-like step of `r / max_seqs` positions
/// of each (the engine's own shapes: K+1 positions of a group's sequences). The speedup is
/// `n · alone / together`: 1 where the steps gain nothing from running at once, `n` where
/// nothing is shared (cores, memory bandwidth, the backend's threads).
pub(super) fn overlaps<B: Backend>(
    model: &Gpt<B>,
    past: usize,
    max_rows: usize,
    max_seqs: usize,
    max_groups: usize,
    reps: usize,
) -> Result<Vec<Overlap>, RlError> {
    if max_groups < 2 {
        return Ok(Vec::new());
    }
    let max_seqs = max_seqs.max(1);
    // Room in the cache for the longest step's positions after `past`.
    let per_most = max_rows.max(1).div_ceil(max_seqs);
    let room = model.config().seq_len.saturating_sub(per_most + 1).max(1);
    let past = past.clamp(1, room);
    let mut sets = (0..max_groups)
        .map(|_| InferStage::stages_of(model, &Cut::Even(1)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = Vec::new();
    let mut rows = 1;
    while rows <= max_rows.max(1) {
        let seqs = rows.min(max_seqs);
        let per = rows.div_ceil(seqs);
        let ids = vec![5u32; seqs * (past + per)];
        for set in &mut sets {
            run_stages(set, &Span::each(seqs, 0, past + per), &ids)?;
        }
        // Each step rolls the cache back to `past` and appends its positions again.
        let step = |set: &mut Vec<InferStage<B>>| {
            run_stages(set, &Span::each(seqs, past, per), &ids[..seqs * per]).map(drop)
        };
        let mut alone = f64::MAX;
        let mut together = vec![f64::MAX; max_groups + 1];
        for _ in 0..reps.max(1) {
            let t = Instant::now();
            step(&mut sets[0])?;
            alone = alone.min(t.elapsed().as_secs_f64());
            for (n, best) in together.iter_mut().enumerate().skip(2) {
                let t = Instant::now();
                std::thread::scope(|scope| {
                    let steps: Vec<_> = sets[..n]
                        .iter_mut()
                        .map(|set| scope.spawn(move || step(set)))
                        .collect();
                    steps.into_iter().try_for_each(|h| {
                        // A step that panicked panics here too, as it would have alone.
                        let ran = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
                        ran.map_err(RlError::from)
                    })
                })?;
                *best = best.min(t.elapsed().as_secs_f64());
            }
        }
        out.extend((2..=max_groups).map(|n| Overlap {
            rows: seqs * per,
            groups: n,
            speedup: n as f64 * alone / together[n],
        }));
        rows *= 2;
    }
    Ok(out)
}

/// One line per measured step size: the [`Overlap`] speedups of its group counts.
pub(super) fn overlap_lines(overlaps: &[Overlap]) -> Vec<String> {
    let mut sizes: Vec<usize> = overlaps.iter().map(|o| o.rows).collect();
    sizes.dedup();
    sizes
        .into_iter()
        .map(|rows| {
            let each: Vec<String> = overlaps
                .iter()
                .filter(|o| o.rows == rows)
                .map(|o| format!("{} groups {:.2}x", o.groups, o.speedup))
                .collect();
            format!(
                "overlap: {rows:>3} rows a step, steps started together against one after another: {}",
                each.join(", ")
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_overlaps_as_its_group_count_and_size_measured() {
        let o = |rows, groups, speedup| Overlap {
            rows,
            groups,
            speedup,
        };
        let overlaps = [o(1, 2, 1.6), o(4, 2, 1.2), o(1, 3, 1.8), o(4, 3, 0.9)];
        // Alone, or with nothing measured: no overlap.
        assert_eq!(overlap_at(&overlaps, 1, 1), 1.0);
        assert_eq!(overlap_at(&[], 2, 4), 1.0);
        // Between sizes, and flat beyond them.
        assert!((overlap_at(&overlaps, 2, 2) - 1.6 + 0.4 / 3.0).abs() < 1e-12);
        assert_eq!(overlap_at(&overlaps, 16, 2), 1.2);
        // More groups in flight than measured: the most measured; never below 1.
        assert_eq!(overlap_at(&overlaps, 1, 8), 1.8);
        assert_eq!(overlap_at(&overlaps, 4, 3), 1.0);
    }
}
