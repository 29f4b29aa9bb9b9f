//! Hugging Face interop against transformers itself: the fixtures (tests/fixtures/hf/, built
//! by scripts/hf_fixtures.py with transformers 5.24 and torch 2.15, f32, eager attention) hold
//! tiny random Llama (GQA), Qwen2 (qkv biases, sharded), Mistral (bf16 weights) and Llama-3
//! (rope_scaling llama3) models, and transformers' logits, loss, gradients and one
//! torch.optim.AdamW step for a fixed batch. pipefill imports each model and must reproduce
//! them; an export must re-import to the same tensors (tests/hf_files.rs: bad directories give
//! named errors).

use std::collections::HashMap;
use std::path::Path;

use pipefill::model::checkpoint::HostTensor;
use pipefill::model::hf::{self, ExportDtype, ExportOptions, HfModel};
use pipefill::model::{AdamW, AdamWConfig, Cut, Gpt, GptConfig, Shape};
use pipefill::tensor::{Backend, CpuBackend, DType};
use safetensors::{Dtype, SafeTensors};

mod common;
use common::hf::{fixture, open};

/// The expected tensors of a fixture, as f32 (ids as u32), by name.
struct Expected {
    f32s: HashMap<String, (Vec<usize>, Vec<f32>)>,
    ids: Vec<u32>,
    targets: Vec<u32>,
    json: serde_json::Value,
}

fn expected(name: &str) -> Expected {
    let dir = fixture(name);
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut f32s = HashMap::new();
    let (mut ids, mut targets) = (vec![], vec![]);
    for (n, v) in st.tensors() {
        match v.dtype() {
            Dtype::F32 => {
                let data = v
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                f32s.insert(n, (v.shape().to_vec(), data));
            }
            Dtype::I64 => {
                let data: Vec<u32> = v
                    .data()
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
                    .collect();
                match n.as_str() {
                    "input_ids" => ids = data,
                    "targets" => targets = data,
                    other => panic!("unexpected {other}"),
                }
            }
            other => panic!("{n}: {other:?}"),
        }
    }
    let json = serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    Expected {
        f32s,
        ids,
        targets,
        json,
    }
}

fn shape(e: &Expected) -> Shape {
    Shape {
        batch: e.json["batch"].as_u64().unwrap() as usize,
        seq: e.json["seq"].as_u64().unwrap() as usize,
    }
}

/// `max |a − b|` and `max |b|`.
fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    (d, b.iter().map(|x| x.abs()).fold(0.0, f32::max))
}

/// pipefill parameter `name`'s values in Hugging Face's layout.
fn to_hf(name: &str, shape: &[usize], data: &[f32]) -> (String, Vec<f32>) {
    let (hf_name, t) = hf::hf_name(name).unwrap();
    let data = if t {
        hf::transpose(data, shape[0], shape[1])
    } else {
        data.to_vec()
    };
    (hf_name, data)
}

/// Logits within 1e-4 (absolute) of transformers', loss and every gradient within 1e-4
/// relative (to the tensor's largest magnitude), and one AdamW step within 1e-4 relative.
fn matches_transformers(name: &str) {
    let e = expected(name);
    let (model, mut gpt) = open(name);
    let shape = shape(&e);
    let logits = gpt.logits(shape, &e.ids).unwrap();
    let (d, scale) = diff(&logits, &e.f32s["logits"].1);
    println!("{name}: logits max abs diff {d:.3e} (max |logit| {scale:.2})");
    assert!(d <= 1e-4, "{name}: logits differ by {d}");

    // The same model cut into two stages, each reading only its own parameters.
    let be = CpuBackend::new(1).unwrap();
    let cut = Cut::Even(2);
    let chunks: Vec<_> = (0..2)
        .map(|s| model.chunk(be.clone(), &cut, s).unwrap())
        .collect();
    assert!(!chunks[1].param_names().contains(&"embed.tok".to_string()));
    let mut staged = Gpt::blank(model.config(), be.clone(), &cut).unwrap();
    for (dst, src) in staged.chunks_mut().iter_mut().zip(&chunks) {
        for n in src.param_names() {
            dst.set_param(&n, &src.param_values(&n).unwrap()).unwrap();
        }
    }
    assert_eq!(staged.logits(shape, &e.ids).unwrap(), logits);

    let loss = gpt
        .forward_backward(0, shape, &e.ids, &e.targets, 1.0)
        .unwrap();
    let want = e.json["loss"].as_f64().unwrap() as f32;
    let rel = (loss - want).abs() / want.abs();
    println!("{name}: loss {loss} vs {want}, rel diff {rel:.3e}");
    assert!(rel <= 1e-4, "{name}: loss {loss} vs {want}");

    // A tied model's two copies get the sum of their gradients (what transformers computes
    // for its one shared matrix).
    let tied = model.config().tie_embeddings;
    pipefill::model::tie::sum_local(&be, gpt.chunks_mut().iter_mut()).unwrap();
    let mut worst = (0.0f32, String::new());
    for p in gpt.params() {
        if tied && p.name == "head.w" {
            let embed = gpt.grad_values("embed.tok").unwrap();
            let head = gpt.grad_values("head.w").unwrap();
            assert_eq!(head, embed);
            continue;
        }
        let (hf_name, g) = to_hf(&p.name, &p.shape, &gpt.grad_values(&p.name).unwrap());
        let (_, want) = &e.f32s[&format!("grad.{hf_name}")];
        let (d, scale) = diff(&g, want);
        let rel = d / scale.max(f32::MIN_POSITIVE);
        assert!(
            rel <= 1e-4,
            "{name}: gradient of {hf_name} off by {rel:.3e}"
        );
        if rel > worst.0 {
            worst = (rel, hf_name);
        }
    }
    println!(
        "{name}: {} gradients, worst rel diff {:.3e} ({})",
        gpt.params().len(),
        worst.0,
        worst.1
    );

    if let Some(hp) = e.json.get("adamw") {
        let f = |k: &str| hp[k].as_f64().unwrap() as f32;
        let mut opt = AdamW::new(AdamWConfig {
            beta1: f("beta1"),
            beta2: f("beta2"),
            eps: f("eps"),
            weight_decay: f("weight_decay"),
            max_grad_norm: 0.0,
        });
        // The step starts from transformers' own gradients, so what is compared is the
        // optimizer alone: from pipefill's (equal within 1e-6), an element whose gradient is
        // near eps moves by lr·g/(|g| + eps), which turns the gradients' last-bit
        // differences into a ~1e-4 relative difference of the step.
        let be = CpuBackend::new(1).unwrap();
        for p in gpt.params_mut() {
            let (hf_name, t) = hf::hf_name(&p.name).unwrap();
            let (_, g) = &e.f32s[&format!("grad.{hf_name}")];
            let g = if t {
                hf::transpose(g, p.shape[1], p.shape[0])
            } else {
                g.clone()
            };
            p.grad = be.from_host(&g, DType::F32).unwrap();
        }
        opt.step(&be, gpt.params_mut(), f("lr"), 1.0).unwrap();
        let mut worst = (0.0f32, String::new());
        for p in gpt.params() {
            let (hf_name, v) = to_hf(&p.name, &p.shape, &gpt.param_values(&p.name).unwrap());
            let (_, want) = &e.f32s[&format!("adamw.{hf_name}")];
            let (d, scale) = diff(&v, want);
            let rel = d / scale;
            assert!(
                rel <= 1e-4,
                "{name}: AdamW step of {hf_name} off by {rel:.3e}"
            );
            if rel > worst.0 {
                worst = (rel, hf_name);
            }
        }
        println!(
            "{name}: AdamW step, worst rel diff {:.3e} ({})",
            worst.0, worst.1
        );
    }
}

#[test]
fn llama_gqa_matches_transformers() {
    matches_transformers("llama");
}

#[test]
fn qwen2_sharded_matches_transformers() {
    matches_transformers("qwen2");
}

#[test]
fn qwen2_tied_matches_transformers() {
    matches_transformers("qwen2_tied");
}

/// The model `pipefill rl --model` runs on (vocabulary 300, the data fixtures' tokenizer).
#[test]
fn qwen2_rl_matches_transformers() {
    matches_transformers("qwen2_rl");
}

#[test]
fn mistral_bf16_matches_transformers() {
    matches_transformers("mistral");
}

#[test]
fn llama3_rope_scaling_matches_transformers() {
    matches_transformers("llama3");
}

#[test]
fn configs_read_as_expected() {
    let (q, _) = open("qwen2");
    assert_eq!(q.hf_config().architecture, hf::Architecture::Qwen2);
    assert!(q.config().qkv_bias);
    assert_eq!(q.config().kv_heads, Some(2));
    assert_eq!(q.config().rope_theta, 1_000_000.0);
    let (l3, _) = open("llama3");
    let s = l3.config().rope_scaling.unwrap();
    assert_eq!((s.factor, s.original_max_position_embeddings), (8.0, 64));
    let (m, _) = open("mistral");
    assert_eq!(m.hf_config().architecture, hf::Architecture::Mistral);
    assert_eq!(m.config().norm_eps, 1e-6);
}

fn params(gpt: &Gpt<CpuBackend>) -> Vec<HostTensor> {
    gpt.params()
        .iter()
        .map(|p| HostTensor {
            name: p.name.clone(),
            shape: p.shape.clone(),
            data: gpt.param_values(&p.name).unwrap(),
        })
        .collect()
}

#[test]
fn export_reimports_to_the_same_tensors() {
    for name in ["llama", "qwen2", "qwen2_tied", "mistral", "llama3"] {
        let (model, gpt) = open(name);
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let opts = ExportOptions {
            source: Some(fixture(name)),
            ..ExportOptions::default()
        };
        hf::export_gpt(&gpt, &out, &opts).unwrap();
        // For scripts/hf_fixtures.py --check: transformers loads the export.
        if let Some(dir) = std::env::var_os("PIPEFILL_HF_EXPORT") {
            let keep = Path::new(&dir).join(name);
            let keep_opts = ExportOptions {
                overwrite: true,
                ..opts.clone()
            };
            hf::export_gpt(&gpt, &keep, &keep_opts).unwrap();
        }
        let back = HfModel::open(&out).unwrap();
        assert_eq!(
            back.hf_config().architecture,
            model.hf_config().architecture
        );
        assert_eq!(back.config(), model.config(), "{name}");
        let again = back
            .gpt(CpuBackend::new(1).unwrap(), &Cut::Even(1))
            .unwrap();
        assert_eq!(params(&again), params(&gpt), "{name}");
        // The source's generation_config.json comes along.
        assert!(out.join("generation_config.json").is_file());

        // Writing into it again needs --overwrite.
        let err = hf::export_gpt(&gpt, &out, &opts).unwrap_err();
        assert!(err.to_string().contains("not empty"), "{err}");
        let over = ExportOptions {
            overwrite: true,
            dtype: ExportDtype::Bf16,
            ..opts.clone()
        };
        hf::export_gpt(&gpt, &out, &over).unwrap();
        let bf = HfModel::open(&out).unwrap();
        let bf = bf.gpt(CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
        for (a, b) in params(&bf).iter().zip(params(&gpt)) {
            let rounded: Vec<f32> = b
                .data
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect();
            assert_eq!(a.data, rounded, "{name}: {}", a.name);
        }
    }
}

#[test]
fn a_pipefill_model_exports_as_llama_and_learned_positions_do_not() {
    let config = GptConfig {
        positions: pipefill::model::config::Positions::Rope,
        activation: pipefill::tensor::Activation::Swiglu,
        kv_heads: Some(2),
        layers: 2,
        ..GptConfig::default()
    };
    let gpt = Gpt::new(&config, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    hf::export_gpt(&gpt, tmp.path(), &ExportOptions::default()).unwrap();
    if let Some(dir) = std::env::var_os("PIPEFILL_HF_EXPORT") {
        let keep = Path::new(&dir).join("native");
        let opts = ExportOptions {
            overwrite: true,
            ..ExportOptions::default()
        };
        hf::export_gpt(&gpt, &keep, &opts).unwrap();
        let ids: Vec<u32> = (0..8).collect();
        let shape = Shape { batch: 1, seq: 8 };
        let logits = Gpt::new(&config, CpuBackend::new(1).unwrap(), &Cut::Even(1))
            .unwrap()
            .logits(shape, &ids)
            .unwrap();
        let json = serde_json::to_vec(&logits).unwrap();
        std::fs::write(keep.join("pipefill_logits.json"), json).unwrap();
    }
    let back = HfModel::open(tmp.path()).unwrap();
    assert_eq!(back.hf_config().architecture, hf::Architecture::Llama);
    assert_eq!(back.config().d_model, config.d_model);
    let again = back
        .gpt(CpuBackend::new(1).unwrap(), &Cut::Even(1))
        .unwrap();
    assert_eq!(params(&again), params(&gpt));

    let learned = Gpt::new(
        &GptConfig::default(),
        CpuBackend::new(1).unwrap(),
        &Cut::Even(1),
    )
    .unwrap();
    let err =
        hf::export_gpt(&learned, &tmp.path().join("x"), &ExportOptions::default()).unwrap_err();
    assert!(err.to_string().contains("positions"), "{err}");
}
