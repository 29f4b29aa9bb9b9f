//! [`GptConfig`]: the shape of the model, the `[model]` section of a job file.

use serde::{Deserialize, Serialize};

use crate::model::ModelError;
use crate::tensor::Activation;

/// The RoPE base of Llama 2 (and the default of `rope_theta`).
pub const DEFAULT_ROPE_THETA: f32 = 10_000.0;

fn is_default_theta(theta: &f32) -> bool {
    *theta == DEFAULT_ROPE_THETA
}

/// How the model encodes positions. The new fields of [`GptConfig`] are left out of its
/// serialized form while they hold their defaults, so a default model serializes (and
/// fingerprints) exactly as before they existed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Positions {
    /// A learned `[seq_len, d_model]` table added to the token embedding.
    #[default]
    Learned,
    /// Rotary position embeddings on queries and keys (Llama's `rotate_half` convention).
    Rope,
}

impl Positions {
    fn is_learned(&self) -> bool {
        *self == Positions::Learned
    }
}

/// Llama 3's RoPE scaling (Hugging Face's `rope_scaling` with `rope_type = "llama3"`): low
/// frequencies (wavelengths above `original_max_position_embeddings / low_freq_factor`) are
/// divided by `factor`, high ones (below `… / high_freq_factor`) kept, and the band between
/// interpolated smoothly.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

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
    /// MLP hidden width = `mlp_ratio · d_model`, unless `intermediate` is given.
    pub mlp_ratio: usize,
    /// MLP hidden width (Llama's `intermediate_size`); `None` (absent): `mlp_ratio · d_model`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intermediate: Option<usize>,
    /// MLP non-linearity: `gelu` or `silu` for `act(x·W1)·W2`, or `swiglu` for Llama's gated
    /// MLP `(silu(x·W1) ∘ (x·W3))·W2` (W1 gate, W3 up, W2 down).
    pub activation: Activation,
    /// How positions enter: `learned` (a table added to the embedding) or `rope` (rotary
    /// embeddings applied to the queries and keys inside attention; no position table).
    #[serde(skip_serializing_if = "Positions::is_learned")]
    pub positions: Positions,
    /// RoPE base: frequency `i` of a head of width `h` is `rope_theta^(−2i/h)`.
    #[serde(skip_serializing_if = "is_default_theta")]
    pub rope_theta: f32,
    /// Llama 3's RoPE scaling of those frequencies (a `[model.rope_scaling]` table); `None`
    /// (absent): unscaled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// Key/value heads (grouped-query attention); `None` (absent): one per query head. Must
    /// divide `heads`; query head `h` reads key/value head `h / (heads / kv_heads)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<usize>,
    /// Biases on the query, key and value projections (Qwen2).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub qkv_bias: bool,
    /// The LM head reuses the token embedding (`tie_word_embeddings`): the last stage holds
    /// a copy of `embed.tok` as `head.w`, and the two copies' gradients are
    /// summed before every optimizer step, so they stay bitwise equal (as Megatron-LM keeps
    /// a first and a last stage's shared embedding); see [`crate::model::tie`].
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub tie_embeddings: bool,
    /// A Hugging Face model directory (Llama, Qwen2, Mistral) the model is imported from:
    /// its config.json gives every shape field above except `seq_len` (the training
    /// sequence length, at most the model's positions), and every chunk starts from the
    /// directory's weights, reading only its own tensors ([`crate::model::hf`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<std::path::PathBuf>,
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
            intermediate: None,
            activation: Activation::Gelu,
            positions: Positions::Learned,
            rope_theta: DEFAULT_ROPE_THETA,
            rope_scaling: None,
            kv_heads: None,
            qkv_bias: false,
            tie_embeddings: false,
            from: None,
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
        if let Some(kv) = self.kv_heads
            && (kv == 0 || !self.heads.is_multiple_of(kv))
        {
            return bad(
                "kv_heads",
                format!("{kv} key/value heads do not divide heads = {}", self.heads),
            );
        }
        if self.intermediate == Some(0) {
            return bad("intermediate", "must be at least 1".into());
        }
        if self.positions == Positions::Rope {
            if !self.head_dim().is_multiple_of(2) {
                return bad(
                    "positions",
                    format!("rope needs an even head width, not {}", self.head_dim()),
                );
            }
            if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
                return bad(
                    "rope_theta",
                    format!("{} is not a positive number", self.rope_theta),
                );
            }
            if let Some(s) = self.rope_scaling {
                let positive = |v: f32| v > 0.0 && v.is_finite();
                if !(positive(s.factor)
                    && positive(s.low_freq_factor)
                    && s.high_freq_factor > s.low_freq_factor
                    && s.high_freq_factor.is_finite()
                    && s.original_max_position_embeddings > 0)
                {
                    return bad(
                        "rope_scaling",
                        format!(
                            "{s:?} needs factor > 0, 0 < low_freq_factor < high_freq_factor \
                             and original_max_position_embeddings ≥ 1"
                        ),
                    );
                }
            }
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
        self.intermediate.unwrap_or(self.mlp_ratio * self.d_model)
    }

    /// The `head_dim / 2` RoPE frequencies `rope_theta^(−2i/head_dim)` (in `f32`, as Hugging
    /// Face computes them), Llama-3 scaled when `rope_scaling` is set.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let hd = self.head_dim();
        let base: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f32 / hd as f32))
            .collect();
        let Some(s) = self.rope_scaling else {
            return base;
        };
        let old = s.original_max_position_embeddings as f32;
        let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
        base.into_iter()
            .map(|f| {
                let wavelen = 2.0 * std::f32::consts::PI / f;
                if wavelen < high_wavelen {
                    f
                } else if wavelen > low_wavelen {
                    f / s.factor
                } else {
                    let smooth = (old / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * f / s.factor + smooth * f
                }
            })
            .collect()
    }

    /// Key/value heads (`heads` unless grouped-query attention is asked for).
    pub fn kv_heads(&self) -> usize {
        self.kv_heads.unwrap_or(self.heads)
    }

    /// Width of the key and value projections: `kv_heads · head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads() * self.head_dim()
    }

    /// Total number of parameters, saturating at `usize::MAX` (see
    /// [`checked_param_count`](Self::checked_param_count)); a job that passed
    /// `JobConfig::validate` never gets there, since validation counts a bound of it.
    pub fn param_count(&self) -> usize {
        self.checked_param_count().unwrap_or(usize::MAX)
    }

    /// Total number of parameters, or `None` where the count (or a width it needs: the MLP's
    /// `mlp_ratio · d_model`, the key/value projections') overflows `usize`, or `heads` is 0.
    pub fn checked_param_count(&self) -> Option<usize> {
        let d = self.d_model;
        let mul = |xs: &[usize]| xs.iter().try_fold(1usize, |a, &x| a.checked_mul(x));
        let add = |xs: &[Option<usize>]| xs.iter().try_fold(0usize, |a, x| a.checked_add((*x)?));
        let hidden = match self.intermediate {
            Some(width) => width,
            None => self.mlp_ratio.checked_mul(d)?,
        };
        let kv = self.kv_heads().checked_mul(d.checked_div(self.heads)?)?;
        let bias = if self.qkv_bias {
            add(&[Some(d), mul(&[2, kv])])?
        } else {
            0
        };
        let mlp_mats = if self.activation.is_gated() { 3 } else { 2 };
        let block = add(&[
            mul(&[2, d]),
            mul(&[2, d, d]),
            mul(&[2, d, kv]),
            Some(bias),
            mul(&[mlp_mats, d, hidden]),
        ])?;
        let pos = match self.positions {
            Positions::Learned => mul(&[self.seq_len, d])?,
            Positions::Rope => 0,
        };
        add(&[
            mul(&[self.vocab, d]),
            Some(pos),
            mul(&[self.layers, block]),
            Some(d),
            mul(&[d, self.vocab]),
        ])
    }
}
