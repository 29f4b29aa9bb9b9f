//! Measuring the drafter off the pipeline's timeline: the slice and step costs the router
//! starts from ([`calibrate`], before the run) and the top-1 agreement on held-out rows
//! ([`HeldOutEval`], on the caller's thread).

use pipefill_actors::router::CostEstimate;
use pipefill_actors::thread_cpu_time;

use super::{DrafterFill, HELD_OUT_ROWS};
use crate::data::SplitMix64;
use crate::model::ModelError;
use crate::model::drafter::{DraftBufferHandle, DraftRow, Drafter, DrafterConfig, DrafterTrainer};
use crate::model::{GptConfig, Shape};
use crate::tensor::{Backend, CpuBackend};

/// Measures, on this thread and `backend` (the replicas' device), what a full and a one-row
/// slice and a two-replica step cost, on synthetic rows of the target's shape: the router's
/// priors (a cost line through the two slice sizes, and the step's cost) until real slices
/// are measured. Medians of three: a device's one-off costs (its first slice) stay out.
pub(super) fn calibrate<B: Backend>(
    target: &GptConfig,
    config: &DrafterConfig,
    backend: B,
) -> Result<(CostEstimate, f64), ModelError> {
    let buffer = DraftBufferHandle::new(target, config);
    let (d, v) = (target.d_model, target.vocab);
    let shape = Shape {
        batch: config.batch_rows,
        seq: target.seq_len,
    };
    let n = shape.tokens();
    let mut rng = SplitMix64::new(config.seed);
    let hidden: Vec<f32> = (0..n * d).map(|_| rng.next_f64() as f32 - 0.5).collect();
    let targets: Vec<u32> = (0..n).map(|_| (rng.next_u64() % v as u64) as u32).collect();
    buffer.begin_step(0);
    buffer.push_micro_batch(shape, &hidden, &targets)?;
    // Two replicas over one set of tables, as the run's replicas share theirs.
    let first = Drafter::new(target, config, backend.clone())?;
    let second = Drafter::sharing(target, config, backend, &first.frozen())?;
    let mut trainers = [first, second]
        .into_iter()
        .enumerate()
        .map(|(r, drafter)| DrafterTrainer::new(drafter, buffer.clone(), r, 2))
        .collect::<Result<Vec<_>, _>>()?;
    let full = trainers[0].max_slice_rows();
    // The median of three of each size.
    let mut median = |rows: usize| -> Result<f64, ModelError> {
        let mut costs = Vec::new();
        for _ in 0..3 {
            costs.push(trainers[0].slice_within(rows)?.cpu_seconds);
        }
        costs.sort_by(f64::total_cmp);
        Ok(costs[1])
    };
    let (large, small) = (median(full)?, median(1)?);
    trainers[1].slice()?;
    let grads = vec![trainers[0].take_grads()?, trainers[1].take_grads()?];
    let t0 = thread_cpu_time();
    trainers[0].step_with(&grads)?;
    trainers[0].weights()?;
    let step = (thread_cpu_time() - t0).max(0.0);
    // A full slice of one row is the only size: the line's slope is never used.
    Ok((
        CostEstimate::prior_through(1.0, small, full as f64, large),
        step,
    ))
}

/// Measures the drafter on held-out rows from the weights it was handed and the frozen
/// tables the replicas read (the caller's thread, off the pipeline's timeline).
pub struct HeldOutEval {
    trainer: DrafterTrainer<CpuBackend>,
    version: Option<u64>,
}

impl HeldOutEval {
    /// The evaluation of `fill`'s drafter, reading its replicas' tables (shared where
    /// those are on the CPU).
    pub fn new(
        target: &GptConfig,
        config: &DrafterConfig,
        fill: &DrafterFill,
    ) -> Result<Self, ModelError> {
        let be = CpuBackend::new(1)?;
        let drafter = match fill.cpu_tables(&be) {
            Some(tables) => Drafter::sharing(target, config, be, &tables)?,
            None => Drafter::new(target, config, be)?,
        };
        let buffer = DraftBufferHandle::new(target, config);
        Ok(HeldOutEval {
            trainer: DrafterTrainer::new(drafter, buffer, 0, 1)?,
            version: None,
        })
    }

    /// `(drafter version, top-1 agreement)` of the newest published weights on the newest
    /// held-out rows; `None` before the first drafter step or the first held-out rows.
    pub fn measure(&mut self, fill: &DrafterFill) -> Result<Option<(u64, f64)>, ModelError> {
        let Some(latest) = fill.board().latest() else {
            return Ok(None);
        };
        if self.version != Some(latest.version) {
            self.trainer.load_weights(&latest.value)?;
            self.version = Some(latest.version);
        }
        // The weights carry no tables: the replicas' newest, shared where they are on the CPU.
        fill.share_tables(&mut self.trainer)?;
        let rows: Vec<DraftRow> = {
            let held = fill.held_out().lock();
            let all: Vec<&DraftRow> = held.rows().collect();
            let from = all.len().saturating_sub(HELD_OUT_ROWS);
            all[from..].iter().map(|r| (*r).clone()).collect()
        };
        if rows.is_empty() {
            return Ok(None);
        }
        let stats = self.trainer.evaluate(&rows)?;
        Ok(Some((latest.version, stats.agreement)))
    }
}
