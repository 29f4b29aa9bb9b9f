//! `config.json` of a Hugging Face Llama-family model ↔ [`GptConfig`].
//!
//! Read: `architectures` must be one of [`Architecture`]; the shape comes from
//! `hidden_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`,
//! `intermediate_size`, `vocab_size`, `rms_norm_eps`, `max_position_embeddings` (capped at
//! [`SEQ_LEN_CAP`]: pipefill's `seq_len` is the longest sequence it will be given, and it sizes
//! the memory estimate; rotary positions have no table, so the cap changes no parameter), and
//! the RoPE base and scaling from `rope_parameters` (transformers 5) or `rope_theta` +
//! `rope_scaling` (transformers 4). Anything pipefill's block cannot compute (a bias on
//! `o_proj` or the MLP, a head width other than `hidden_size / num_attention_heads`, an
//! activation other than SiLU, an active sliding window, a RoPE type other than `default` or
//! `llama3`, partial rotary) is one error naming the field.

use serde_json::{Map, Value, json};

use crate::model::GptConfig;
use crate::model::ModelError;
use crate::model::config::{DEFAULT_ROPE_THETA, Positions, RopeScaling};
use crate::tensor::Activation;

/// config.json's name.
pub const CONFIG_FILE: &str = "config.json";

/// The longest `seq_len` an import gives the model (`max_position_embeddings` above it is
/// cut to it); a caller that trains longer sequences sets `seq_len` itself.
pub const SEQ_LEN_CAP: usize = 4096;

/// The Hugging Face model classes pipefill reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Mistral,
}

impl Architecture {
    /// The `architectures` entry of config.json.
    pub fn class_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
        }
    }

    /// The `model_type` of config.json.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Mistral => "mistral",
        }
    }

    pub fn from_class_name(name: &str) -> Option<Self> {
        [Self::Llama, Self::Qwen2, Self::Mistral]
            .into_iter()
            .find(|a| a.class_name() == name)
    }

    /// The architecture that expresses a pipefill model: Qwen2 when it has biases on q, k, v
    /// (Llama's `attention_bias` would also put one on `o_proj`), Llama otherwise; or why
    /// none does.
    pub fn for_config(config: &GptConfig) -> Result<Self, String> {
        if config.positions != Positions::Rope {
            return Err(
                "`positions` is learned: Hugging Face's Llama family has rotary \
                        positions only (export a `positions = \"rope\"` model)"
                    .into(),
            );
        }
        if config.activation != Activation::Swiglu {
            return Err(format!(
                "`activation` is {:?}: the Llama family's MLP is SwiGLU",
                config.activation
            ));
        }
        Ok(if config.qkv_bias {
            Architecture::Qwen2
        } else {
            Architecture::Llama
        })
    }
}

/// What config.json says, as pipefill sees it.
#[derive(Clone, Debug)]
pub struct HfConfig {
    pub architecture: Architecture,
    /// The model's shape (`seed` 0: the weights come from the files).
    pub gpt: GptConfig,
    /// `tie_word_embeddings` (also `gpt.tie_embeddings`): the LM head is the embedding.
    pub tied: bool,
    /// The whole config.json, kept so an export writes back what pipefill does not model
    /// (token ids, `max_position_embeddings` above the cap, ...).
    pub raw: Map<String, Value>,
}

/// The largest config.json read (a real one is a few KB).
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Reads and parses `dir`'s config.json.
pub fn read(dir: &std::path::Path) -> Result<HfConfig, ModelError> {
    let path = dir.join(CONFIG_FILE);
    let text = crate::input::read(&path, MAX_CONFIG_BYTES, "a config.json")?;
    parse(&path, &text)
}

/// Parses config.json's text; `path` only names the file in errors.
pub fn parse(path: &std::path::Path, text: &[u8]) -> Result<HfConfig, ModelError> {
    let bad = |field: &str, reason: String| ModelError::HfConfig {
        path: path.to_path_buf(),
        field: field.to_string(),
        reason,
    };
    let raw: Map<String, Value> = match serde_json::from_slice(text) {
        Ok(Value::Object(map)) => map,
        Ok(_) => return Err(bad("(file)", "is not a JSON object".into())),
        Err(e) => return Err(bad("(file)", format!("is not JSON: {e}"))),
    };
    let field = |name: &str| raw.get(name).filter(|v| !v.is_null());
    let uint = |name: &str| -> Result<usize, ModelError> {
        match field(name) {
            None => Err(bad(name, "is missing".into())),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(name, format!("{v} is not a positive integer"))),
        }
    };
    let float = |name: &str, v: &Value| -> Result<f32, ModelError> {
        v.as_f64()
            .map(|x| x as f32)
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| bad(name, format!("{v} is not a positive number")))
    };
    let flag = |name: &str| -> Result<bool, ModelError> {
        match field(name) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(bad(name, format!("{v} is not true or false"))),
        }
    };

    let architecture = match field("architectures") {
        None => return Err(bad("architectures", "is missing".into())),
        Some(Value::Array(list)) if list.len() == 1 => {
            let name = list[0].as_str().unwrap_or_default();
            Architecture::from_class_name(name).ok_or_else(|| {
                bad(
                    "architectures",
                    format!(
                        "{} is not supported (LlamaForCausalLM, Qwen2ForCausalLM, \
                         MistralForCausalLM are)",
                        list[0]
                    ),
                )
            })?
        }
        Some(v) => return Err(bad("architectures", format!("{v} is not one class name"))),
    };

    let d_model = uint("hidden_size")?;
    let heads = uint("num_attention_heads")?;
    let layers = uint("num_hidden_layers")?;
    let vocab = uint("vocab_size")?;
    let intermediate = uint("intermediate_size")?;
    let kv_heads = match field("num_key_value_heads") {
        None => heads,
        Some(_) => uint("num_key_value_heads")?,
    };
    let max_pos = uint("max_position_embeddings")?;
    if let Some(v) = field("head_dim") {
        let hd = uint("head_dim")?;
        if !d_model.is_multiple_of(heads) || hd != d_model / heads {
            return Err(bad(
                "head_dim",
                format!(
                    "{v} differs from hidden_size / num_attention_heads = {d_model} / {heads}: \
                     pipefill's heads are hidden_size / num_attention_heads wide"
                ),
            ));
        }
    }
    match field("hidden_act").and_then(Value::as_str) {
        Some("silu") => {}
        None if field("hidden_act").is_none() => {}
        _ => {
            let v = field("hidden_act").cloned().unwrap_or(Value::Null);
            return Err(bad(
                "hidden_act",
                format!("{v} is not supported (the SwiGLU MLP needs \"silu\")"),
            ));
        }
    }
    for name in ["attention_bias", "mlp_bias"] {
        if flag(name)? {
            return Err(bad(
                name,
                "is true: pipefill's attention has no o_proj bias and its MLP no biases".into(),
            ));
        }
    }
    let sliding = match architecture {
        Architecture::Qwen2 => flag("use_sliding_window")?,
        Architecture::Mistral => match field("sliding_window") {
            None => false,
            Some(v) => {
                let w = uint("sliding_window")?;
                // A window at least as long as any sequence never masks anything.
                if w < max_pos.min(SEQ_LEN_CAP) {
                    true
                } else {
                    let _ = v;
                    false
                }
            }
        },
        Architecture::Llama => false,
    };
    if sliding {
        let name = match architecture {
            Architecture::Qwen2 => "use_sliding_window",
            _ => "sliding_window",
        };
        return Err(bad(
            name,
            format!(
                "{}: sliding-window attention is not supported",
                field(name).cloned().unwrap_or(Value::Null)
            ),
        ));
    }
    let norm_eps = match field("rms_norm_eps") {
        None => return Err(bad("rms_norm_eps", "is missing".into())),
        Some(v) => float("rms_norm_eps", v)?,
    };
    let (rope_theta, rope_scaling) = rope(&raw, &bad, &float)?;
    let tied = flag("tie_word_embeddings")?;

    let gpt = GptConfig {
        vocab,
        d_model,
        heads,
        layers,
        seq_len: max_pos.min(SEQ_LEN_CAP),
        mlp_ratio: 4,
        intermediate: Some(intermediate),
        activation: Activation::Swiglu,
        positions: Positions::Rope,
        rope_theta,
        rope_scaling,
        kv_heads: (kv_heads != heads).then_some(kv_heads),
        qkv_bias: architecture == Architecture::Qwen2,
        tie_embeddings: tied,
        from: None,
        norm_eps,
        seed: 0,
    };
    gpt.validate().map_err(|e| bad("(shape)", e.to_string()))?;
    if gpt.checked_param_count().is_none() {
        return Err(bad(
            "(shape)",
            "the parameter count overflows: sizes are not plausible".into(),
        ));
    }
    Ok(HfConfig {
        architecture,
        gpt,
        tied,
        raw,
    })
}

/// `(rope_theta, rope_scaling)` from `rope_parameters` or `rope_theta` + `rope_scaling`.
fn rope(
    raw: &Map<String, Value>,
    bad: &dyn Fn(&str, String) -> ModelError,
    float: &dyn Fn(&str, &Value) -> Result<f32, ModelError>,
) -> Result<(f32, Option<RopeScaling>), ModelError> {
    let get = |m: &Map<String, Value>, k: &str| m.get(k).filter(|v| !v.is_null()).cloned();
    let (params, prefix) = match get(raw, "rope_parameters") {
        Some(Value::Object(m)) => (m, "rope_parameters"),
        Some(v) => return Err(bad("rope_parameters", format!("{v} is not an object"))),
        None => {
            let mut m = match get(raw, "rope_scaling") {
                Some(Value::Object(m)) => m,
                Some(v) => return Err(bad("rope_scaling", format!("{v} is not an object"))),
                None => Map::new(),
            };
            if let Some(t) = get(raw, "rope_theta") {
                m.insert("rope_theta".into(), t);
            }
            (m, "rope_scaling")
        }
    };
    let name = |k: &str| {
        if k == "rope_theta" && prefix == "rope_scaling" {
            "rope_theta".to_string()
        } else {
            format!("{prefix}.{k}")
        }
    };
    let theta = match get(&params, "rope_theta") {
        Some(v) => float(&name("rope_theta"), &v)?,
        None => DEFAULT_ROPE_THETA,
    };
    if let Some(v) = get(&params, "partial_rotary_factor")
        && v.as_f64() != Some(1.0)
    {
        return Err(bad(
            &name("partial_rotary_factor"),
            format!("{v}: partial rotary embeddings are not supported"),
        ));
    }
    let kind = get(&params, "rope_type").or_else(|| get(&params, "type"));
    let kind = match &kind {
        None => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(v) => return Err(bad(&name("rope_type"), format!("{v} is not a string"))),
    };
    match kind {
        "default" => Ok((theta, None)),
        "llama3" => {
            let num = |k: &str| -> Result<f32, ModelError> {
                match get(&params, k) {
                    Some(v) => float(&name(k), &v),
                    None => Err(bad(
                        &name(k),
                        "is missing (rope_type llama3 needs it)".into(),
                    )),
                }
            };
            let original = match get(&params, "original_max_position_embeddings") {
                Some(v) => v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n > 0)
                    .ok_or_else(|| {
                        bad(
                            &name("original_max_position_embeddings"),
                            format!("{v} is not a positive integer"),
                        )
                    })?,
                None => {
                    return Err(bad(
                        &name("original_max_position_embeddings"),
                        "is missing (rope_type llama3 needs it)".into(),
                    ));
                }
            };
            Ok((
                theta,
                Some(RopeScaling {
                    factor: num("factor")?,
                    low_freq_factor: num("low_freq_factor")?,
                    high_freq_factor: num("high_freq_factor")?,
                    original_max_position_embeddings: original,
                }),
            ))
        }
        other => Err(bad(
            &name("rope_type"),
            format!("\"{other}\" is not supported (\"default\" and \"llama3\" are)"),
        )),
    }
}

/// config.json for `config` as `architecture`, on top of `base` (the source model's
/// config.json, whose other fields are kept) when there is one. `dtype` is the weights'
/// (`"float32"` or `"bfloat16"`).
pub fn to_json(
    config: &GptConfig,
    architecture: Architecture,
    base: Option<&Map<String, Value>>,
    dtype: &str,
) -> Map<String, Value> {
    let mut m = base.cloned().unwrap_or_default();
    // Keep a source's longer context (the import capped it); otherwise seq_len.
    let max_pos = match m.get("max_position_embeddings").and_then(Value::as_u64) {
        Some(n) if n as usize >= config.seq_len => n as usize,
        _ => config.seq_len,
    };
    for stale in [
        "torch_dtype",
        "rope_scaling",
        "rope_parameters",
        "rope_theta",
    ] {
        m.remove(stale);
    }
    let rope = match &config.rope_scaling {
        None => json!({ "rope_type": "default", "rope_theta": short(config.rope_theta) }),
        Some(s) => json!({
            "rope_type": "llama3",
            "rope_theta": short(config.rope_theta),
            "factor": short(s.factor),
            "low_freq_factor": short(s.low_freq_factor),
            "high_freq_factor": short(s.high_freq_factor),
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }),
    };
    let fields = [
        ("architectures", json!([architecture.class_name()])),
        ("model_type", json!(architecture.model_type())),
        ("hidden_size", json!(config.d_model)),
        ("intermediate_size", json!(config.mlp_hidden())),
        ("num_hidden_layers", json!(config.layers)),
        ("num_attention_heads", json!(config.heads)),
        ("num_key_value_heads", json!(config.kv_heads())),
        ("head_dim", json!(config.head_dim())),
        ("hidden_act", json!("silu")),
        ("vocab_size", json!(config.vocab)),
        ("max_position_embeddings", json!(max_pos)),
        ("rms_norm_eps", json!(short(config.norm_eps))),
        ("rope_parameters", rope),
        ("tie_word_embeddings", json!(config.tie_embeddings)),
        ("dtype", json!(dtype)),
    ];
    for (k, v) in fields {
        m.insert(k.to_string(), v);
    }
    match architecture {
        Architecture::Llama => {
            m.insert("attention_bias".into(), json!(false));
            m.insert("mlp_bias".into(), json!(false));
        }
        Architecture::Qwen2 => {
            m.insert("use_sliding_window".into(), json!(false));
        }
        Architecture::Mistral => {
            m.insert("sliding_window".into(), Value::Null);
        }
    }
    m
}

/// `x` as the `f64` its shortest decimal form names (`1e-6`, not `9.99999997e-7`).
fn short(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}
