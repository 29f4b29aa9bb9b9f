//! Training loops. [`reference`](mod@reference) holds the single-device reference trainer: the
//! whole model on one backend, no pipeline. It is the oracle every pipeline schedule must
//! reproduce, so its data order and micro-batching are explicit functions of the step.
//!
//! [`eval`] scores greedy completions of held-out tasks by exact match.
//!
//! This module also holds the per-step [`StepMetrics`] written to `metrics.jsonl`; the
//! `[train]` section of a job file is [`crate::config::TrainConfig`].

pub mod eval;
pub mod reference;

use serde::{Deserialize, Serialize};

pub use reference::Trainer;

use crate::config::ConfigError;
use crate::data::DataError;
use crate::model::ModelError;

/// Errors of a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A `[train]` value that cannot be used.
    #[error(transparent)]
    Job(#[from] ConfigError),
    /// The step data was built for another value of a job setting.
    #[error("`{field}` is {job}, but the step data was built for {data}")]
    StepData {
        field: &'static str,
        job: u64,
        data: u64,
    },
    /// The loss stopped being a number: training diverged.
    #[error("step {step}: the loss is {loss} (training diverged; try a lower train.lr)")]
    Diverged { step: u64, loss: f32 },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Data(#[from] DataError),
}

/// What one step reports (one line of `metrics.jsonl`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// 0-based step index.
    pub step: u64,
    /// Mean cross-entropy over the step's target tokens (before the update).
    pub loss: f32,
    /// Learning rate used by the update.
    pub lr: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Target tokens in the step's mini-batch.
    pub tokens: usize,
    /// Wall-clock seconds of the step (data, forward, backward, update).
    pub seconds: f64,
}

impl StepMetrics {
    /// Training throughput of the step.
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.seconds.max(1e-9)
    }
}
