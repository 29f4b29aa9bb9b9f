//! Hugging Face interop: read a Llama / Qwen2 / Mistral model directory (config.json and
//! safetensors weights) into pipefill's model, and write pipefill's model as one.
//!
//! - [`config`]: config.json ↔ [`GptConfig`] (unsupported options are one error naming the
//!   field).
//! - [`files`]: model.safetensors or the shards of model.safetensors.index.json; headers
//!   first, tensors on demand (a stage reads just its parameters).
//! - [`HfModel`]: an opened directory; [`HfModel::load_chunk`] fills a [`ModelChunk`] with
//!   the parameters it asks for, [`HfModel::gpt`] builds the whole model.
//! - [`export()`]: writes config.json, model.safetensors (f32 or bf16) and the source's
//!   tokenizer files.
//!
//! Names and layouts. pipefill computes `x·W` with `W: [in, out]`; Hugging Face's
//! `nn.Linear` stores `[out, in]`. So every projection is transposed on the way in and out:
//!
//! | pipefill | Hugging Face | |
//! |---|---|---|
//! | `embed.tok [vocab, d]` | `model.embed_tokens.weight` | same layout |
//! | `blocks.{i}.norm1.weight` | `model.layers.{i}.input_layernorm.weight` | |
//! | `blocks.{i}.attn.wq/wk/wv/wo` | `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight` | ᵀ |
//! | `blocks.{i}.attn.bq/bk/bv` | `model.layers.{i}.self_attn.{q,k,v}_proj.bias` | |
//! | `blocks.{i}.norm2.weight` | `model.layers.{i}.post_attention_layernorm.weight` | |
//! | `blocks.{i}.mlp.w1/w3/w2` | `model.layers.{i}.mlp.{gate,up,down}_proj.weight` | ᵀ |
//! | `final_norm.weight` | `model.norm.weight` | |
//! | `head.w [vocab, d]` | `lm_head.weight` | |
//!
//! The conventions match without any permutation of heads: pipefill's RoPE is
//! `rotate_half` on each head's two halves (Hugging Face's layout, not Meta's interleaved
//! one), its RMSNorm is `x / √(mean x² + eps) · g` (eps inside the root, as `LlamaRMSNorm`),
//! and query head `h` reads key/value head `h / (heads / kv_heads)` (`repeat_kv`). A tied
//! model (`tie_word_embeddings`) imports as `tie_embeddings = true`: `head.w` is read from
//! `model.embed_tokens.weight` (transposed; an `lm_head.weight` in the file is ignored), and
//! an export of a tied model writes `tie_word_embeddings: true` and no `lm_head.weight`, as
//! transformers does.

pub mod config;
pub mod files;

use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::TensorView;

pub use config::{Architecture, CONFIG_FILE, HfConfig, SEQ_LEN_CAP};
pub use files::WeightFiles;

use super::checkpoint::HostTensor;
use super::{Cut, Gpt, GptConfig, ModelChunk};
use crate::model::ModelError;
use crate::tensor::Backend;

/// Files an export copies from the source model directory when it has them.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
];

/// The Hugging Face name of pipefill parameter `name`, and whether its matrix is stored
/// transposed; `None` for a parameter the Llama family does not have (`embed.pos`).
pub fn hf_name(name: &str) -> Option<(String, bool)> {
    match name {
        "embed.tok" => return Some(("model.embed_tokens.weight".into(), false)),
        "final_norm.weight" => return Some(("model.norm.weight".into(), false)),
        "head.w" => return Some(("lm_head.weight".into(), false)),
        _ => {}
    }
    let rest = name.strip_prefix("blocks.")?;
    let (i, part) = rest.split_once('.')?;
    i.parse::<usize>().ok()?;
    let (hf, t) = match part {
        "norm1.weight" => ("input_layernorm.weight", false),
        "norm2.weight" => ("post_attention_layernorm.weight", false),
        "attn.wq" => ("self_attn.q_proj.weight", true),
        "attn.wk" => ("self_attn.k_proj.weight", true),
        "attn.wv" => ("self_attn.v_proj.weight", true),
        "attn.wo" => ("self_attn.o_proj.weight", true),
        "attn.bq" => ("self_attn.q_proj.bias", false),
        "attn.bk" => ("self_attn.k_proj.bias", false),
        "attn.bv" => ("self_attn.v_proj.bias", false),
        "mlp.w1" => ("mlp.gate_proj.weight", true),
        "mlp.w2" => ("mlp.down_proj.weight", true),
        "mlp.w3" => ("mlp.up_proj.weight", true),
        _ => return None,
    };
    Some((format!("model.layers.{i}.{hf}"), t))
}

/// Every parameter of `config`'s whole model, in model order, with its pipefill shape (what
/// [`Gpt::params`] holds, computed without building it). Lazy, one layer at a time: a
/// config.json's layer count is checked against the files by walking this, so a count that
/// no file backs costs nothing before the first missing tensor.
pub fn param_shapes(config: &GptConfig) -> impl Iterator<Item = (String, Vec<usize>)> + use<> {
    let (d, kv, h, v) = (
        config.d_model,
        config.kv_dim(),
        config.mlp_hidden(),
        config.vocab,
    );
    let (bias, gated) = (config.qkv_bias, config.activation.is_gated());
    let pos = (config.positions == super::config::Positions::Learned)
        .then(|| ("embed.pos".to_string(), vec![config.seq_len, d]));
    let layer = move |i: usize| {
        let p = |s: &str, shape: Vec<usize>| (format!("blocks.{i}.{s}"), shape);
        let mut out = vec![
            p("norm1.weight", vec![d]),
            p("attn.wq", vec![d, d]),
            p("attn.wk", vec![d, kv]),
            p("attn.wv", vec![d, kv]),
            p("attn.wo", vec![d, d]),
        ];
        if bias {
            out.extend([
                p("attn.bq", vec![d]),
                p("attn.bk", vec![kv]),
                p("attn.bv", vec![kv]),
            ]);
        }
        out.push(p("norm2.weight", vec![d]));
        out.extend([p("mlp.w1", vec![d, h]), p("mlp.w2", vec![h, d])]);
        if gated {
            out.push(p("mlp.w3", vec![d, h]));
        }
        out
    };
    std::iter::once(("embed.tok".to_string(), vec![v, d]))
        .chain(pos)
        .chain((0..config.layers).flat_map(layer))
        .chain([
            ("final_norm.weight".into(), vec![d]),
            ("head.w".into(), vec![v, d]),
        ])
}

/// `[rows, cols]` row-major → `[cols, rows]` (a linear weight between Hugging Face's
/// `[out, in]` and this crate's `[in, out]`, one helper).
pub use super::tie::transpose;

/// Tensors an old checkpoint may carry that are not parameters (recomputed buffers).
fn ignorable(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

/// An opened Hugging Face model directory: its config, checked, and its weight files'
/// headers, checked against the model the config describes (every tensor present with its
/// shape, none left over). No tensor is read until asked for.
pub struct HfModel {
    dir: PathBuf,
    config: HfConfig,
    files: WeightFiles,
}

impl HfModel {
    /// Opens `dir`: config.json and the headers of its weight files.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let config = config::read(dir)?;
        let files = WeightFiles::open(dir)?;
        let model = HfModel {
            dir: dir.to_path_buf(),
            config,
            files,
        };
        model.check_tensors()?;
        Ok(model)
    }

    /// Every tensor the config implies is in the files with its shape, and nothing else is.
    fn check_tensors(&self) -> Result<(), ModelError> {
        let somewhere = || {
            self.files
                .names()
                .next()
                .and_then(|n| self.files.file_of(n))
                .unwrap_or(&self.dir)
                .to_path_buf()
        };
        let mut expected = std::collections::BTreeSet::new();
        for (name, shape) in param_shapes(&self.config.gpt) {
            let (hf, t) = hf_name(&name).expect("a Llama-family config has HF names");
            let hf_shape: Vec<usize> = if t {
                shape.iter().rev().copied().collect()
            } else {
                shape
            };
            expected.insert(hf.clone());
            let meta = match self.files.meta(&hf) {
                Some(m) => m,
                None if hf == "lm_head.weight" && self.config.tied => continue,
                None => {
                    // A layer the files lack says which config.json field implied it.
                    let reason = match name.starts_with("blocks.") {
                        true => format!(
                            "is missing (config.json: num_hidden_layers = {})",
                            self.config.gpt.layers
                        ),
                        false => "is missing".into(),
                    };
                    return Err(ModelError::HfTensor {
                        path: somewhere(),
                        tensor: hf,
                        reason,
                    });
                }
            };
            if meta.shape != hf_shape {
                return Err(ModelError::HfTensor {
                    path: self.files.file_of(&hf).unwrap_or(&self.dir).to_path_buf(),
                    tensor: hf,
                    reason: format!(
                        "has shape {:?}; config.json implies {hf_shape:?}",
                        meta.shape
                    ),
                });
            }
        }
        if let Some(extra) = self
            .files
            .names()
            .find(|n| !expected.contains(*n) && !ignorable(n))
        {
            return Err(ModelError::HfTensor {
                path: self.files.file_of(extra).unwrap_or(&self.dir).to_path_buf(),
                tensor: extra.to_string(),
                reason: "is not a parameter of the model config.json describes".into(),
            });
        }
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed config.json.
    pub fn hf_config(&self) -> &HfConfig {
        &self.config
    }

    /// The model's shape.
    pub fn config(&self) -> &GptConfig {
        &self.config.gpt
    }

    /// The weight files (tensor names, sizes, and the bytes read from them so far).
    pub fn files(&self) -> &WeightFiles {
        &self.files
    }

    /// Pipefill parameter `name` in pipefill's layout (transposed where it must be; `head.w`
    /// from the embedding when the model is tied, in its layout).
    pub fn read(&self, name: &str) -> Result<HostTensor, ModelError> {
        let shape = param_shapes(&self.config.gpt)
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s)
            .ok_or_else(|| ModelError::UnknownParam(name.to_string()))?;
        let (mut hf, t) = hf_name(name).ok_or_else(|| ModelError::UnknownParam(name.into()))?;
        if name == "head.w" && self.config.tied {
            hf = "model.embed_tokens.weight".into();
        }
        let data = self.files.read_f32(&hf)?;
        let data = if t {
            // The file holds [shape[1], shape[0]].
            transpose(&data, shape[1], shape[0])
        } else {
            data
        };
        Ok(HostTensor {
            name: name.to_string(),
            shape,
            data,
        })
    }

    /// Sets every parameter of `chunk` from the files, reading only those.
    pub fn load_chunk<B: Backend>(&self, chunk: &mut ModelChunk<B>) -> Result<(), ModelError> {
        for name in chunk.param_names() {
            let t = self.read(&name)?;
            let have = &chunk.param(&name)?.shape;
            if *have != t.shape {
                return Err(ModelError::HfTensor {
                    path: self.dir.clone(),
                    tensor: name,
                    reason: format!("has shape {:?}, the chunk's is {have:?}", t.shape),
                });
            }
            chunk.set_param(&t.name, &t.data)?;
        }
        Ok(())
    }

    /// Chunk `stage` of the model cut by `cut`, with the imported parameters.
    pub fn chunk<B: Backend>(
        &self,
        backend: B,
        cut: &Cut,
        stage: usize,
    ) -> Result<ModelChunk<B>, ModelError> {
        let mut chunk = ModelChunk::blank(&self.config.gpt, backend, cut, stage)?;
        self.load_chunk(&mut chunk)?;
        Ok(chunk)
    }

    /// The whole model, cut by `cut`, with the imported parameters.
    pub fn gpt<B: Backend>(&self, backend: B, cut: &Cut) -> Result<Gpt<B>, ModelError> {
        let mut gpt = Gpt::blank(&self.config.gpt, backend, cut)?;
        for chunk in gpt.chunks_mut() {
            self.load_chunk(chunk)?;
        }
        Ok(gpt)
    }
}

/// Writes `tensors` (pipefill's parameters of `config`, by name) as a Hugging Face model
/// directory `out`: config.json, model.safetensors, and the source's tokenizer files.
pub fn export(
    out: &Path,
    config: &GptConfig,
    tensors: &[HostTensor],
    opts: &ExportOptions,
) -> Result<(), ModelError> {
    let fail = |reason: String| ModelError::Export {
        path: out.to_path_buf(),
        reason,
    };
    let fitting = Architecture::for_config(config).map_err(&fail)?;
    config.validate()?;
    // Before any work: an output directory the export may not write is refused at once.
    check_out_dir(out, opts)?;
    let source = match &opts.source {
        Some(dir) => Some(config::read(dir)?),
        None => None,
    };
    // The source's class when it expresses the model (a Mistral stays a Mistral).
    let architecture = match &source {
        Some(s) if (s.architecture == Architecture::Qwen2) == config.qkv_bias => s.architecture,
        _ => fitting,
    };
    // Every parameter, with its shape, in file (HF) layout.
    let mut named: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, shape) in param_shapes(config) {
        let t = tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| fail(format!("parameter `{name}` is missing")))?;
        if t.shape != shape || t.data.len() != shape.iter().product::<usize>() {
            return Err(fail(format!(
                "parameter `{name}` has shape {:?}, the config implies {shape:?}",
                t.shape
            )));
        }
        if name == "head.w" && config.tie_embeddings {
            // transformers ties it to model.embed_tokens.weight on load.
            continue;
        }
        let (hf, tr) = hf_name(&name).expect("exportable configs have HF names");
        let (data, hf_shape) = if tr {
            (
                transpose(&t.data, shape[0], shape[1]),
                vec![shape[1], shape[0]],
            )
        } else {
            (t.data.clone(), shape)
        };
        let bytes = match opts.dtype {
            ExportDtype::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ExportDtype::Bf16 => data
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        };
        named.push((hf, hf_shape, bytes));
    }
    let known: Vec<String> = param_shapes(config).map(|(n, _)| n).collect();
    if let Some(extra) = tensors.iter().find(|t| !known.contains(&t.name)) {
        return Err(fail(format!("`{}` is not a model parameter", extra.name)));
    }

    export_dir::prepare_dir(out, opts)?;
    let dtype = match opts.dtype {
        ExportDtype::F32 => (Dtype::F32, "float32"),
        ExportDtype::Bf16 => (Dtype::BF16, "bfloat16"),
    };
    let views = named
        .iter()
        .map(|(n, s, b)| {
            TensorView::new(dtype.0, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| fail(format!("tensor `{n}`: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes =
        safetensors::serialize(views, Some(meta)).map_err(|e| fail(format!("safetensors: {e}")))?;
    write(&out.join(files::SINGLE_FILE), &bytes)?;
    let json = config::to_json(
        config,
        architecture,
        source.as_ref().map(|s| &s.raw),
        dtype.1,
    );
    let mut text = serde_json::to_vec_pretty(&serde_json::Value::Object(json))
        .expect("a JSON map always serializes");
    text.push(b'\n');
    write(&out.join(CONFIG_FILE), &text)?;
    if let Some(dir) = &opts.source {
        for name in TOKENIZER_FILES {
            let from = dir.join(name);
            // Regular files only: a symlink is not followed out of the source.
            match std::fs::symlink_metadata(&from) {
                Ok(m) if m.file_type().is_file() => {
                    let bytes = std::fs::read(&from).map_err(|e| ModelError::File {
                        path: from.clone(),
                        reason: format!("cannot be read: {e}"),
                    })?;
                    write(&out.join(name), &bytes)?;
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// Every parameter of `gpt` exported as [`export()`] does.
pub fn export_gpt<B: Backend>(
    gpt: &Gpt<B>,
    out: &Path,
    opts: &ExportOptions,
) -> Result<(), ModelError> {
    let mut tensors = Vec::new();
    for p in gpt.params() {
        tensors.push(HostTensor {
            name: p.name.clone(),
            shape: p.shape.clone(),
            data: gpt.param_values(&p.name)?,
        });
    }
    export(out, gpt.config(), &tensors, opts)
}

mod export_dir;
pub use export_dir::{ExportDtype, ExportOptions, check_out_dir};

fn write(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    super::checkpoint::write_atomic(path, bytes).map_err(|e| ModelError::File {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::CpuBackend;

    #[test]
    fn param_shapes_are_the_models() {
        let mut config = GptConfig {
            positions: super::super::config::Positions::Rope,
            activation: crate::tensor::Activation::Swiglu,
            kv_heads: Some(2),
            qkv_bias: true,
            layers: 3,
            intermediate: Some(96),
            ..GptConfig::default()
        };
        for bias in [true, false] {
            config.qkv_bias = bias;
            let gpt = Gpt::blank(&config, CpuBackend::new(1).unwrap(), &Cut::Even(2)).unwrap();
            let have: Vec<_> = gpt
                .params()
                .iter()
                .map(|p| (p.name.clone(), p.shape.clone()))
                .collect();
            assert_eq!(have, param_shapes(&config).collect::<Vec<_>>());
            assert!(have.iter().all(|(n, _)| hf_name(n).is_some()));
        }
    }

    #[test]
    fn transpose_round_trips() {
        let x: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let t = transpose(&x, 2, 3);
        assert_eq!(t, [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_eq!(transpose(&t, 3, 2), x);
        // Sizes that are not whole tiles, element by element.
        let (rows, cols) = (70, 45);
        let x: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let t = transpose(&x, rows, cols);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(t[c * rows + r], x[r * cols + c]);
            }
        }
    }
}
