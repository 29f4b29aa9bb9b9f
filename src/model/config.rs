//! [`GptConfig`]: the shape of the model, the `[model]` section of a job file.

use serde::{Deserialize, Serialize};

use super::ModelError;
use crate::tensor::Activation;

/// Shape and seed of a decoder-only GPT.
///
/// The default is small enough that a few hundred steps train in a minute or two on two
/// CPU cores, yet deep enough (8 blocks) to be cut into several pipeline stages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GptConfig {
    /// Vocabulary size (token ids are `0..vocab`); the default matches `data::Tokenizer`.
    pub vocab: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads; must divide `d_model`.
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Longest sequence (number of learned positions).
    pub seq_len: usize,
    /// MLP hidden width = `mlp_ratio · d_model`.
    pub mlp_ratio: usize,
    /// MLP non-linearity.
    pub activation: Activation,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// Seed of the initialisation; each parameter's stream is derived from (seed, name).
    pub seed: u64,
}

impl Default for GptConfig {
    fn default() -> Self {
        GptConfig {
            vocab: 50,
            d_model: 64,
            heads: 4,
            layers: 8,
            seq_len: 64,
            mlp_ratio: 4,
            activation: Activation::Gelu,
            norm_eps: 1e-5,
            seed: 0,
        }
    }
}

impl GptConfig {
    /// Checks that the shape is usable; the error names the field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |field: &'static str, reason: String| Err(ModelError::Config { field, reason });
        for (field, value) in [
            ("vocab", self.vocab),
            ("d_model", self.d_model),
            ("heads", self.heads),
            ("layers", self.layers),
            ("seq_len", self.seq_len),
            ("mlp_ratio", self.mlp_ratio),
        ] {
            if value == 0 {
                return bad(field, "must be at least 1".into());
            }
        }
        if !self.d_model.is_multiple_of(self.heads) {
            return bad(
                "heads",
                format!(
                    "{} heads do not divide d_model = {}",
                    self.heads, self.d_model
                ),
            );
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return bad(
                "norm_eps",
                format!("{} is not a positive number", self.norm_eps),
            );
        }
        Ok(())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }

    /// Hidden width of the MLP.
    pub fn mlp_hidden(&self) -> usize {
        self.mlp_ratio * self.d_model
    }

    /// Total number of parameters.
    pub fn param_count(&self) -> usize {
        let d = self.d_model;
        let block = 2 * d + 4 * d * d + 2 * d * self.mlp_hidden();
        self.vocab * d + self.seq_len * d + self.layers * block + d + d * self.vocab
    }
}
