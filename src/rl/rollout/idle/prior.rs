//! The router's priors for the drafter's idle work, measured once before the first rollout
//! ([`DrafterSlices::measure_priors`]).
//!
//! The router hands out no work of a kind before it has a cost estimate for it. With
//! `rl.advanced.drafter_work = "idle-then-after"` the first estimates come from the whole
//! slices run after a rollout; with `"idle"` nothing runs there, so the costs are measured
//! up front, on a scratch drafter of the same shape (the real one's weights, gradients,
//! optimizer and row sampler stay untouched) over synthetic rows (a slice's cost depends on
//! its shape, not its values): pieces of [`MIN_PIECE_ROWS`] and of [`LINE_UNITS`] times
//! that (the line's level and slope: the gaps only ever fit small pieces, and a whole slice
//! would cost several times more to measure), an optimizer step, and evaluations of rows of
//! as many positions. Each is the fastest of [`REPS`] runs, after one unmeasured piece that
//! warms the scratch drafter up, once per run (a fraction of a second at d_model 256:
//! docs/benchmarks.md, "Drafter training in the rollout's idle gaps"). The priors only have
//! to be about right: the router replaces them with its own measurements as the pieces run
//! (the level from the first piece, the slope once the sizes vary).

use std::time::Instant;

use pipefill_actors::FillerRouter;
use pipefill_actors::router::CostEstimate;

use super::eval::DRAFTER_EVAL;
use super::slices::{DRAFTER, DRAFTER_STEP, DrafterSlices, MIN_PIECE_ROWS, lock};
use crate::data::SplitMix64;
use crate::model::GptConfig;
use crate::model::ModelError;
use crate::model::drafter::{DraftBufferHandle, DraftRow, Drafter, DrafterTrainer};
use crate::tensor::Backend;

/// Timed runs per cost.
const REPS: usize = 3;
/// Synthetic rows in the scratch buffer.
const ROWS: usize = 4;
/// The larger measured piece (and evaluated row), in smallest pieces.
const LINE_UNITS: usize = 4;

/// What [`DrafterSlices::measure_priors`] measured, seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrafterPriors {
    /// Pieces of `small_rows` and `large_rows` layout rows.
    pub small_rows: usize,
    pub small: f64,
    pub large_rows: usize,
    pub large: f64,
    /// An optimizer step.
    pub step: f64,
    /// Evaluations of one row of `short_len` positions and one of `long_len`.
    pub short_len: usize,
    pub eval_short: f64,
    pub long_len: usize,
    pub eval_long: f64,
    /// The whole measurement, scratch drafter included.
    pub seconds: f64,
}

/// The fastest of `REPS` runs of `f`, seconds: on a busy machine one run may be
/// preempted for many times its cost, and a prior that high would keep a kind's pieces at
/// the smallest size, never measuring another.
fn fastest_of(mut f: impl FnMut() -> Result<(), ModelError>) -> Result<f64, ModelError> {
    let mut best = f64::INFINITY;
    for _ in 0..REPS {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// `n` rows of `len` positions with arbitrary hidden states and tokens.
fn synthetic_rows(target: &GptConfig, n: usize, len: usize) -> Vec<DraftRow> {
    let mut rng = SplitMix64::new(0x5eed);
    let vocab = target.vocab.max(1);
    (0..n)
        .map(|_| DraftRow {
            hidden: (0..len * target.d_model)
                .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
                .collect(),
            targets: (0..len).map(|_| rng.below(vocab as u64) as u32).collect(),
            step: 0,
        })
        .collect()
}

impl<B: Backend> DrafterSlices<B> {
    /// Measures the costs of the drafter's idle work on a scratch drafter and sets them as
    /// `router`'s priors (kept where the router measured its own); once: later calls return
    /// `None` and measure nothing.
    pub fn measure_priors(
        &self,
        router: &FillerRouter,
    ) -> Result<Option<DrafterPriors>, ModelError> {
        if !lock(&self.0.plan).priors.is_empty() {
            return Ok(None);
        }
        let started = Instant::now();
        let (target, config, backend) = {
            let t = lock(&self.0.trainer);
            (
                t.drafter().target_config().clone(),
                t.drafter().config().clone(),
                t.drafter().backend().clone(),
            )
        };
        let buffer = DraftBufferHandle::new(&target, &config);
        // A scratch drafter on the trainer's device: the priors are that device's costs.
        let drafter = Drafter::new(&target, &config, backend)?;
        let mut scratch = DrafterTrainer::new(drafter, buffer.clone(), 0, 1)?;
        let row_len = target.seq_len.max(2);
        {
            let mut b = buffer.lock();
            for row in synthetic_rows(&target, ROWS, row_len) {
                b.push(row)?;
            }
        }
        let small_rows = MIN_PIECE_ROWS.min(self.0.full);
        let large_rows = (LINE_UNITS * MIN_PIECE_ROWS).min(self.0.full);
        // The sizes a piece of that many rows really takes (whole windows).
        let (small_rows, large_rows) = (
            scratch.slice_size(small_rows),
            scratch.slice_size(large_rows),
        );
        // Unmeasured: the first piece pays for the scratch drafter's first allocations.
        scratch.accumulate_within(small_rows)?;
        let small = fastest_of(|| scratch.accumulate_within(small_rows).map(drop))?;
        let large = if large_rows > small_rows {
            fastest_of(|| scratch.accumulate_within(large_rows).map(drop))?
        } else {
            small
        };
        let step = fastest_of(|| scratch.step_accumulated().map(drop))?;
        let short_len = MIN_PIECE_ROWS.min(row_len);
        let long_len = (LINE_UNITS * MIN_PIECE_ROWS).min(row_len);
        let short = synthetic_rows(&target, 1, short_len);
        let long = synthetic_rows(&target, 1, long_len);
        let eval_short = fastest_of(|| scratch.evaluate(&short).map(drop))?;
        let eval_long = fastest_of(|| scratch.evaluate(&long).map(drop))?;
        let priors = vec![
            (
                DRAFTER,
                CostEstimate::prior_through(small_rows as f64, small, large_rows as f64, large),
            ),
            (DRAFTER_STEP, CostEstimate::prior(step)),
            (
                DRAFTER_EVAL,
                CostEstimate::prior_through(
                    short_len as f64,
                    eval_short,
                    long_len as f64,
                    eval_long,
                ),
            ),
        ];
        for &(kind, prior) in &priors {
            router.set_prior_line(kind, prior);
        }
        lock(&self.0.plan).priors = priors;
        Ok(Some(DrafterPriors {
            small_rows,
            small,
            large_rows,
            large,
            step,
            short_len,
            eval_short,
            long_len,
            eval_long,
            seconds: started.elapsed().as_secs_f64(),
        }))
    }
}
