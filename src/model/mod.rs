//! The GPT model, with every backward split into I (input gradient) and W (weight gradient).
//!
//! - [`config`]: [`GptConfig`], the model's shape.
//! - [`layers`]: embedding, RMSNorm, attention, MLP, LM head + loss, and the residual
//!   [`layers::Block`]; each has `forward`, `backward_input` and `backward_weight`.
//! - [`chunk`]: [`ModelChunk`], one pipeline stage's share of the model (the calls the
//!   pipeline runtime makes per micro-batch) and the [`Cut`] that decides it.
//! - [`hf`]: Hugging Face model directories (Llama, Qwen2, Mistral) read and written.
//! - [`gpt`]: [`Gpt`], every chunk of one model on one device (the reference trainer's).
//! - [`optim`]: [`AdamW`] with decoupled weight decay, global-norm clipping and
//!   [`LrSchedule`] (warmup + cosine).
//! - [`infer`]: KV-cache inference stages (generation, no backward stash).
//! - [`recompute`]: activation recomputation, what each mode keeps and recomputes.
//! - [`tie`]: tied input and output embeddings (the head's copy of `embed.tok`).
//! - [`init`]: the deterministic initialisation, one RNG stream per (seed, parameter name).
//! - [`drafter`]: the EAGLE-style drafter (one block over the target's hidden states), its
//!   training buffer, trainer and speculative proposals.
//!
//! The model: token embedding + learned positions, `layers` blocks of
//! `x + Attn(RMSNorm(x))` then `h + MLP(RMSNorm(h))`, a final RMSNorm, a linear LM head and
//! the cross-entropy loss. The loss of a micro-batch is the **mean over its counted target
//! tokens** (targets equal to [`crate::tensor::IGNORE_TARGET`] do not count). The backward
//! starts from `scale = d objective / d loss`: with `M` micro-batches of equal token counts,
//! `scale = 1/M` makes the accumulated gradients exactly those of the mean loss over the
//! whole mini-batch (with unequal counts use `count_mb / total_count`).

pub mod checkpoint;
pub mod chunk;
pub mod config;
mod cut;
pub mod drafter;
pub mod error;
pub mod gpt;
pub mod hf;
pub mod infer;
pub mod init;
pub mod layers;
pub mod optim;
pub mod recompute;
#[cfg(test)]
mod tests;
pub mod tie;

pub use chunk::{ChunkGrad, ChunkInput, ChunkOutput, Cut, ModelChunk, Shape};
pub use config::GptConfig;
pub use error::ModelError;
pub use gpt::Gpt;
pub use optim::{AdamW, AdamWConfig, LrSchedule, OptimizerState, SlotPart, SlotState, clip_scale};
pub use recompute::{Recompute, RecomputeSetting};

use crate::tensor::{Backend, DType};

/// Result of a model operation.
pub type Result<T> = std::result::Result<T, ModelError>;

/// One named parameter with its gradient (same length; the gradient is always `f32`).
pub struct Param<B: Backend> {
    /// Stable name, independent of the cut (e.g. `blocks.3.attn.wq`).
    pub name: String,
    /// Logical shape, row-major (e.g. `[d_model, d_model]`).
    pub shape: Vec<usize>,
    /// The value, in the backend's storage type.
    pub value: B::Buf,
    /// The accumulated gradient.
    pub grad: B::Buf,
    /// Whether AdamW applies weight decay (not on norm gains).
    pub decay: bool,
    /// A copy of a parameter held elsewhere too (the tied LM head's copy of `embed.tok`):
    /// its gradient is summed with the original's before each step, and the gradient norm
    /// counts the original only.
    pub tied: bool,
}

impl<B: Backend> Param<B> {
    /// A parameter initialised from `values`.
    pub(crate) fn new(
        be: &B,
        name: String,
        shape: Vec<usize>,
        values: &[f32],
        decay: bool,
    ) -> Result<Self> {
        Ok(Param {
            value: be.from_host(values, be.storage_dtype())?,
            grad: be.zeros(values.len(), DType::F32)?,
            name,
            shape,
            decay,
            tied: false,
        })
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}
