//! The optimizer step across ranks: gradient statistics, the global decision (clip, skip)
//! and how the runtime reaches it without a barrier between iterations.
//!
//! Global gradient-norm clipping and the NaN/Inf check need every rank's gradients: the
//! global norm is `sqrt(Σ_r sq_norm_r)` and one non-finite gradient anywhere must skip the
//! step on every rank. Waiting for every rank before stepping is a barrier at the end of each
//! iteration ([`StepMode::Barrier`], the reference behaviour).
//!
//! [`StepMode::PostValidate`] (the default) is the zero-bubble paper's optimizer
//! post-validation. When a rank finishes its part of iteration k it publishes its
//! [`GradStats`] to every other rank (a [`crate::Flow::GradStats`] envelope tagged by
//! iteration), then steps *speculatively* with what it knows: its own statistics plus those
//! of the ranks that have already arrived (if that partial norm already exceeds
//! `max_grad_norm` it clips with it; if it already sees a non-finite gradient it skips). The
//! compute keeps a snapshot, and the rank goes on with iteration k+1:
//!
//! - forwards of the first stage (their input is the data) run on the speculative weights,
//!   and their outputs stay on the rank;
//! - before any other action that reads or writes the weights (F of a later stage, I, W,
//!   B) or ships a payload (SEND), the rank must hold every rank's statistics for k (a
//!   bubble if they are late); it computes the exact decision and, when it differs from
//!   the speculative one, rolls the step back, redoes it and recomputes the held forwards.
//!   It validates as soon as the statistics are there, so held outputs leave on time.
//!
//! No value computed from a wrong step ever leaves a rank, so every rank's result is exactly
//! the barrier's: both modes compute the decision with [`decide`], summing the ranks' squared
//! norms in rank order, so the float operations are the same. A compute that cannot roll
//! back ([`crate::StageCompute::can_roll_back`] is false) defers its step to the validation
//! point instead of speculating (and runs no forward early).
//!
//! What this buys against the barrier: the optimizer step leaves the critical path (a rank
//! steps while it would otherwise wait), and the first rank runs its warm-up forwards of
//! k+1 while later ranks still finish k. What it cannot buy while staying exact: a later
//! stage's forward of k+1 consumes an activation computed on stepped weights, so it waits
//! for every rank's statistics of k (letting it run speculatively would need the whole
//! downstream pipeline to replay on a rollback). [`StepMode::Unchecked`] (no clipping, no
//! NaN/Inf check, no agreement at all) is the bound: it reaches the schedule's steady bubble.
//!
//! [`RunReport::steps`](crate::RunReport::steps) holds one [`StepReport`] per iteration:
//! the global norm, the decision, and per rank the speculative guess and whether it was
//! rolled back.

use serde::{Deserialize, Serialize};

/// One rank's gradient statistics for one iteration, over every stage it holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GradStats {
    /// Σ of squared gradient entries on this rank.
    pub sq_norm: f64,
    /// Whether any gradient entry on this rank is NaN or ±Inf.
    pub nonfinite: bool,
}

/// What the optimizer step of one iteration does on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum StepDecision {
    /// Step with the gradients multiplied by `clip_scale` (1.0 when no clipping applies).
    Apply { clip_scale: f32 },
    /// Skip the step (a non-finite gradient): parameters and optimizer state stay as they
    /// are, and the iteration's gradients are discarded.
    Skip,
}

impl StepDecision {
    /// Applied without clipping.
    pub const UNCLIPPED: StepDecision = StepDecision::Apply { clip_scale: 1.0 };

    /// Bit-exact comparison (two decisions are the same step only if their scales are the
    /// same float).
    pub fn same_as(&self, other: &StepDecision) -> bool {
        match (self, other) {
            (StepDecision::Apply { clip_scale: a }, StepDecision::Apply { clip_scale: b }) => {
                a.to_bits() == b.to_bits()
            }
            (StepDecision::Skip, StepDecision::Skip) => true,
            _ => false,
        }
    }
}

/// How the ranks agree on each iteration's optimizer step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepMode {
    /// Every rank waits for every rank's statistics at the end of an iteration, then steps
    /// exactly: the reference behaviour.
    Barrier,
    /// Speculative step, validated (and rolled back if wrong) before the next iteration
    /// touches the weights. Gives the same result as [`StepMode::Barrier`].
    #[default]
    PostValidate,
    /// No statistics are exchanged: every rank steps at once, unclipped, and never skips
    /// (a NaN/Inf gradient reaches the weights). Iterations then overlap fully, which is the
    /// schedules' steady bubble; use it only when no clipping or NaN/Inf check is wanted
    /// (`max_grad_norm` must be `None`).
    Unchecked,
}

/// The job's optimizer-step policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepPolicy {
    /// Clip the global gradient norm to this value (`None`: never clip).
    pub max_grad_norm: Option<f64>,
    pub mode: StepMode,
}

/// The global norm and the decision from the statistics of the ranks known so far.
///
/// `stats[r]` is rank `r`'s statistics or `None` when not known; the squared norms are
/// summed in rank order, so the result with every rank known is the same float whoever
/// computes it. A non-finite gradient (or a sum that overflows) skips the step; a norm
/// above `max_grad_norm` clips with scale `max / norm` (the same factor as the
/// single-device trainer's clipping, so pipelined and reference runs agree).
pub fn decide(stats: &[Option<GradStats>], max_grad_norm: Option<f64>) -> (f64, StepDecision) {
    let mut sq = 0.0f64;
    let mut nonfinite = false;
    for s in stats.iter().flatten() {
        sq += s.sq_norm;
        nonfinite |= s.nonfinite;
    }
    let norm = sq.sqrt();
    if nonfinite || !norm.is_finite() {
        let norm = if nonfinite { f64::NAN } else { norm };
        return (norm, StepDecision::Skip);
    }
    match max_grad_norm {
        Some(max) if norm > max => {
            let clip_scale = (max / norm) as f32;
            (norm, StepDecision::Apply { clip_scale })
        }
        _ => (norm, StepDecision::UNCLIPPED),
    }
}

/// One rank's side of one iteration's step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankStep {
    pub rank: usize,
    /// The decision this rank stepped with before it knew every rank's statistics (`None`
    /// when it waited for them: barrier mode, a deferred step, or every rank was known).
    pub speculative: Option<StepDecision>,
    /// The speculative step was wrong: rolled back and redone with the exact decision.
    pub rolled_back: bool,
    /// First-stage forwards of the next iteration that had run on the wrong weights and
    /// were recomputed after the rollback. The rollback, the second step and these
    /// recomputations advance the rank's clock without an action record of their own, so
    /// the timeline shows them as idle time before the next action.
    pub recomputed: usize,
    /// Time the rank waited for other ranks' statistics (seconds, the run's clock).
    pub waited: f64,
}

/// The optimizer step of one iteration, over every rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    pub iteration: u64,
    /// `sqrt(Σ_r sq_norm_r)`; NaN when a gradient was non-finite, or not computed
    /// ([`StepMode::Unchecked`]).
    pub grad_norm: f64,
    /// The exact decision every rank ended up with.
    pub decision: StepDecision,
    /// One entry per rank, in rank order.
    pub ranks: Vec<RankStep>,
}

impl StepReport {
    /// How many ranks rolled back a speculative step in this iteration.
    pub fn rollbacks(&self) -> usize {
        self.ranks.iter().filter(|r| r.rolled_back).count()
    }

    /// Whether clipping applied.
    pub fn clipped(&self) -> bool {
        matches!(self.decision, StepDecision::Apply { clip_scale } if clip_scale != 1.0)
    }
}

impl std::fmt::Display for StepReport {
    /// One line: `iteration 2: grad norm 105.594, clipped x0.5054, rolled back on ranks [1, 3]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "iteration {}: ", self.iteration)?;
        match self.decision {
            StepDecision::Skip => write!(f, "non-finite gradient, step skipped")?,
            StepDecision::Apply { clip_scale } => {
                write!(f, "grad norm {:.6}", self.grad_norm)?;
                if self.clipped() {
                    write!(f, ", clipped x{clip_scale:.4}")?;
                }
            }
        }
        let rolled: Vec<usize> = self
            .ranks
            .iter()
            .filter(|r| r.rolled_back)
            .map(|r| r.rank)
            .collect();
        if !rolled.is_empty() {
            write!(f, ", rolled back on ranks {rolled:?}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(sq_norm: f64, nonfinite: bool) -> Option<GradStats> {
        Some(GradStats { sq_norm, nonfinite })
    }

    #[test]
    fn clips_above_the_limit_and_skips_non_finite() {
        let (norm, d) = decide(&[s(9.0, false), s(16.0, false)], Some(10.0));
        assert_eq!(norm, 5.0);
        assert!(d.same_as(&StepDecision::UNCLIPPED));
        let (norm, d) = decide(&[s(9.0, false), s(16.0, false)], Some(2.5));
        assert_eq!(norm, 5.0);
        assert!(d.same_as(&StepDecision::Apply {
            clip_scale: (2.5 / 5.0) as f32
        }));
        let (norm, d) = decide(&[s(9.0, false), s(1.0, true)], Some(2.5));
        assert!(norm.is_nan());
        assert_eq!(d, StepDecision::Skip);
        let (_, d) = decide(&[s(f64::MAX, false), s(f64::MAX, false)], None);
        assert_eq!(d, StepDecision::Skip, "an overflowing norm is not finite");
    }

    #[test]
    fn a_step_report_reads_as_one_line() {
        let rank = |rank, rolled_back| RankStep {
            rank,
            speculative: Some(StepDecision::UNCLIPPED),
            rolled_back,
            recomputed: 0,
            waited: 0.0,
        };
        let mut report = StepReport {
            iteration: 2,
            grad_norm: 10.0,
            decision: StepDecision::Apply { clip_scale: 0.5 },
            ranks: vec![rank(0, false), rank(1, true)],
        };
        assert_eq!(
            report.to_string(),
            "iteration 2: grad norm 10.000000, clipped x0.5000, rolled back on ranks [1]"
        );
        report.decision = StepDecision::Skip;
        report.ranks = vec![rank(0, false)];
        assert_eq!(
            report.to_string(),
            "iteration 2: non-finite gradient, step skipped"
        );
    }

    #[test]
    fn partial_knowledge_can_be_wrong_but_full_knowledge_is_exact() {
        let full = [s(1.0, false), s(30.0, false)];
        let partial = [s(1.0, false), None];
        let (_, exact) = decide(&full, Some(5.0));
        let (_, guess) = decide(&partial, Some(5.0));
        assert!(!guess.same_as(&exact));
        assert!(decide(&full, Some(5.0)).1.same_as(&exact));
    }
}
