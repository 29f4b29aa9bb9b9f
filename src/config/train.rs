//! [`TrainConfig`]: the `[train]` section of a job file (optimisation, batch shape,
//! threads, recomputation, precision), and its checks.

use serde::{Deserialize, Serialize};

use crate::config::error::ConfigError;
use crate::model::RecomputeSetting;
use crate::tensor::DType;

/// The most compute threads `train.threads` may ask for.
pub const MAX_THREADS: usize = 1024;

/// The `[train]` section: optimisation hyper-parameters and the batch shape.
///
/// A step's mini-batch is `micro_batches × micro_batch_size` sequences; the gradient is
/// accumulated over the micro-batches and equals the gradient of the mean loss over the
/// whole mini-batch, so changing `micro_batches` (at a fixed product) does not change
/// the update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: u64,
    /// Micro-batches per step (the pipeline's micro-batches).
    pub micro_batches: usize,
    /// Sequences per micro-batch.
    pub micro_batch_size: usize,
    /// Peak learning rate (after warmup; cosine decay to a tenth of it at the last step).
    pub lr: f32,
    /// Linear warmup steps.
    pub warmup: u64,
    /// AdamW decoupled weight decay (not applied to norm gains).
    pub weight_decay: f32,
    /// Global gradient-norm clipping threshold (0 disables clipping).
    pub clip: f32,
    /// Seed of the data stream (the model's initialisation has `[model] seed`).
    pub seed: u64,
    /// CPU threads for the compute backend (0: all available cores; at most
    /// [`MAX_THREADS`]).
    pub threads: usize,
    /// Held-out tasks whose greedy completions are scored by exact match after training
    /// (0: none).
    pub eval_tasks: usize,
    /// Activation recomputation: `"none"`, `"selective"` (attention's probabilities) or
    /// `"full"` (each block's input only), or a list with one per pipeline rank; the
    /// reference trainer uses the list's strongest. Training is bitwise the same in every
    /// mode ([`crate::model::recompute`]).
    #[serde(skip_serializing_if = "RecomputeSetting::is_default")]
    pub recompute: RecomputeSetting,
    /// Storage type of the parameters the layers compute with, the activations and the
    /// stashes: `"f32"` or `"bf16"`. Products and reductions accumulate in f32 either way,
    /// and gradients, the AdamW moments and (in bf16) the master weights stay f32.
    #[serde(skip_serializing_if = "is_f32")]
    pub precision: DType,
}

fn is_f32(dtype: &DType) -> bool {
    *dtype == DType::F32
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 400,
            micro_batches: 4,
            micro_batch_size: 4,
            lr: 3e-3,
            warmup: 20,
            weight_decay: 0.1,
            clip: 1.0,
            seed: 0,
            threads: 0,
            eval_tasks: 32,
            recompute: RecomputeSetting::default(),
            precision: DType::F32,
        }
    }
}

impl TrainConfig {
    /// Checks the values a deserializer cannot; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &str, reason: String| {
            Err(ConfigError::Invalid {
                field: format!("train.{field}"),
                reason,
            })
        };
        if self.steps == 0 {
            return bad("steps", "must be at least 1".into());
        }
        if self.micro_batches == 0 {
            return bad("micro_batches", "must be at least 1".into());
        }
        if self.micro_batch_size == 0 {
            return bad("micro_batch_size", "must be at least 1".into());
        }
        // Each thread is a pool worker with its own stack, started before the first step:
        // past this, starting them alone took seconds and memory the estimate does not
        // count, for no speed-up on any CPU this runs on.
        if self.threads > MAX_THREADS {
            return bad(
                "threads",
                format!(
                    "is {}, more than {MAX_THREADS} (0 uses every available core)",
                    self.threads
                ),
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", format!("must be a positive number, got {}", self.lr));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(
                "weight_decay",
                format!("must be zero or positive, got {}", self.weight_decay),
            );
        }
        if !(self.clip.is_finite() && self.clip >= 0.0) {
            return bad(
                "clip",
                format!("must be zero (off) or positive, got {}", self.clip),
            );
        }
        Ok(())
    }

    /// Sequences per optimizer step.
    pub fn batch_size(&self) -> usize {
        self.micro_batches * self.micro_batch_size
    }
}
