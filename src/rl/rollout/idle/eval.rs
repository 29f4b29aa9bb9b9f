//! The drafter's held-out evaluation in the rollout's idle gaps: the `"drafter eval"` source
//! of [`super::DrafterSlices`] (with `rl.advanced.drafter_work = "idle"`).
//!
//! Each step holds its first finished sequences' rows out of training
//! ([`super::RolloutRouter::with_rows`]) to measure the drafter's top-1 agreement and
//! per-token acceptance α (what the `"auto"` threshold is derived from) on rows it never
//! trained on. Evaluated after the rollout, that is on the step's critical path; here a
//! held-out row waits in [`super::DrafterSlices::hold`]'s queue until a gap fits its
//! forward (the router sizes a piece in positions, whole rows only), and goes to training
//! right after. The figures are the pairs-weighted mean over the rows evaluated, so α keeps
//! its meaning (acceptance on rows not trained on), measured on the drafter as it stood when
//! each row was evaluated (between this step's optimizer steps rather than after the last);
//! rows the gaps did not reach go to training unevaluated ([`super::DrafterSlices::defer`]).

use std::time::Instant;

use pipefill_actors::{FillerSource, Slice};
use serde::Serialize;

use super::slices::{DrafterSlices, lock};
use crate::model::drafter::{DraftRow, EvalStats};
use crate::tensor::Backend;

/// Kind (and label prefix) of the held-out evaluation pieces.
pub const DRAFTER_EVAL: &str = "drafter eval";
/// Most held-out rows one evaluation piece takes.
const MAX_EVAL_ROWS: usize = 4;

/// What the held-out evaluation did in one part of a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct EvalWork {
    /// Evaluation pieces run.
    pub pieces: usize,
    /// Held-out rows evaluated.
    pub rows: usize,
    /// Seconds spent.
    pub seconds: f64,
}

/// `a` and `b` as one evaluation over both their pairs (each mean weighted by its pairs).
pub fn merge_eval(a: Option<EvalStats>, b: EvalStats) -> EvalStats {
    let Some(a) = a else {
        return b;
    };
    let n = (a.pairs + b.pairs).max(1) as f64;
    let (wa, wb) = (a.pairs as f64 / n, b.pairs as f64 / n);
    EvalStats {
        agreement: wa * a.agreement + wb * b.agreement,
        ce: wa * a.ce + wb * b.ce,
        hidden: wa * a.hidden + wb * b.hidden,
        overlap: wa * a.overlap + wb * b.overlap,
        pairs: a.pairs + b.pairs,
    }
}

/// The `"drafter eval"` source: the oldest held-out rows that fit the gap (units:
/// positions, i.e. the rows' lengths).
pub(super) struct Evals<B: Backend>(pub(super) DrafterSlices<B>);

impl<B: Backend> FillerSource for Evals<B> {
    fn kind(&self) -> &str {
        DRAFTER_EVAL
    }

    fn sizes(&self) -> (u64, u64) {
        (1, (MAX_EVAL_ROWS * self.0.0.seq_len).max(1) as u64)
    }

    fn next(&mut self, _rank: usize, units: u64) -> Option<Slice> {
        let shared = &self.0.0;
        let mut plan = self.0.claim()?;
        let room = usize::try_from(units).unwrap_or(usize::MAX);
        let mut positions = 0;
        let mut take = 0;
        for row in plan.held.iter().take(MAX_EVAL_ROWS) {
            if positions + row.len() > room {
                break;
            }
            positions += row.len();
            take += 1;
        }
        // The oldest row first: none when it alone does not fit.
        if take == 0 || shared.trainer.try_lock().is_err() {
            return None;
        }
        let rows: Vec<DraftRow> = plan.held.drain(..take).collect();
        plan.busy = true;
        drop(plan);
        let slices = self.0.clone();
        Some(Slice {
            label: format!("{DRAFTER_EVAL} ({take} rows)"),
            units: positions.max(1) as u64,
            run: Box::new(move || {
                let shared = &slices.0;
                let t = Instant::now();
                let mut trainer = lock(&shared.trainer);
                // Rows without a training pair hold nothing to measure (the buffer drops
                // them too).
                let scored: Vec<DraftRow> =
                    rows.iter().filter(|r| r.pairs() > 0).cloned().collect();
                let result = if scored.is_empty() {
                    Ok(None)
                } else {
                    trainer.evaluate(&scored).map(Some)
                };
                // Measured (or failed): the rows train from now on.
                let buffer = trainer.buffer().clone();
                drop(trainer);
                {
                    let mut b = buffer.lock();
                    for row in rows {
                        if let Err(e) = b.push(row) {
                            tracing::warn!("held-out drafter row refused: {e}");
                        }
                    }
                }
                let seconds = t.elapsed().as_secs_f64();
                let mut plan = lock(&shared.plan);
                plan.busy = false;
                plan.eval_idle.pieces += 1;
                plan.eval_idle.seconds += seconds;
                let stats = result.map_err(|e| e.to_string())?;
                plan.eval_idle.rows += take;
                if let Some(stats) = stats {
                    plan.eval = Some(merge_eval(plan.eval, stats));
                }
                Ok(())
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_figures_weigh_each_evaluation_by_its_pairs() {
        let a = EvalStats {
            agreement: 1.0,
            ce: 2.0,
            hidden: 0.0,
            overlap: 0.5,
            pairs: 1,
        };
        let b = EvalStats {
            agreement: 0.0,
            ce: 4.0,
            hidden: 3.0,
            overlap: 0.9,
            pairs: 3,
        };
        let m = merge_eval(Some(a), b);
        assert_eq!(m.pairs, 4);
        assert!((m.agreement - 0.25).abs() < 1e-12);
        assert!((m.ce - 3.5).abs() < 1e-12);
        assert!((m.hidden - 2.25).abs() < 1e-12);
        assert!((m.overlap - 0.8).abs() < 1e-12);
        assert_eq!(merge_eval(None, b), b);
    }
}
