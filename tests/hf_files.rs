//! A Hugging Face directory's files, checked before they are trusted: configs pipefill
//! cannot express and broken or hostile weight files are one error naming the field, the
//! tensor or the file; shard names stay inside the directory; tied models import tied and
//! export without `lm_head`; f16 weights read as their values.

use std::path::Path;

use pipefill::model::hf::{self, ExportOptions, HfModel};
use safetensors::{Dtype, SafeTensors};

mod common;
use common::hf::{copy, edit_config, open};

fn open_err(dir: &Path) -> String {
    match HfModel::open(dir) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_configs_name_the_field() {
    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        (
            "architectures",
            serde_json::json!(["GPT2LMHeadModel"]),
            "`architectures` \"GPT2LMHeadModel\" is not supported",
        ),
        ("head_dim", serde_json::json!(32), "`head_dim` 32 differs"),
        (
            "hidden_act",
            serde_json::json!("gelu"),
            "`hidden_act` \"gelu\"",
        ),
        (
            "attention_bias",
            serde_json::json!(true),
            "`attention_bias`",
        ),
        ("hidden_size", serde_json::json!(0), "`hidden_size` 0"),
        (
            "num_key_value_heads",
            serde_json::json!(3),
            "key/value heads do not divide",
        ),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "yarn", "rope_theta": 10000.0}),
            "`rope_parameters.rope_type` \"yarn\"",
        ),
    ];
    for (field, value, want) in cases {
        let (_tmp, dir) = copy("llama");
        edit_config(&dir, |m| {
            m.insert(field.into(), value.clone());
        });
        let err = open_err(&dir);
        assert!(err.contains(want), "{field}: {err}");
        assert!(err.contains("config.json"), "{err}");
    }
    let (_tmp, dir) = copy("mistral");
    edit_config(&dir, |m| {
        m.insert("sliding_window".into(), serde_json::json!(4));
    });
    assert!(open_err(&dir).contains("`sliding_window` 4"));
    // A window longer than any sequence masks nothing: accepted.
    edit_config(&dir, |m| {
        m.insert("sliding_window".into(), serde_json::json!(4096));
    });
    HfModel::open(&dir).unwrap();
    let (_tmp, dir) = copy("qwen2");
    edit_config(&dir, |m| {
        m.insert("use_sliding_window".into(), serde_json::json!(true));
    });
    assert!(open_err(&dir).contains("`use_sliding_window`"));
}

/// Rewrites `file` of `dir` without tensor `drop` (and with `add` added).
fn rewrite(dir: &Path, file: &str, drop: Option<&str>, add: Option<&str>) {
    let path = dir.join(file);
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut kept: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| Some(n.as_str()) != drop)
        .collect();
    let extra = vec![0u8; 16];
    if let Some(a) = add {
        kept.push((
            a.to_string(),
            safetensors::tensor::TensorView::new(Dtype::F32, vec![4], &extra).unwrap(),
        ));
    }
    let out = safetensors::serialize(kept, None).unwrap();
    std::fs::write(&path, out).unwrap();
}

#[test]
fn bad_weights_name_the_tensor_and_file() {
    let (_tmp, dir) = copy("llama");
    rewrite(
        &dir,
        "model.safetensors",
        Some("model.layers.1.mlp.up_proj.weight"),
        None,
    );
    let err = open_err(&dir);
    assert!(
        err.contains("model.layers.1.mlp.up_proj.weight") && err.contains("is missing"),
        "{err}"
    );

    let (_tmp, dir) = copy("llama");
    rewrite(&dir, "model.safetensors", None, Some("model.extra.weight"));
    let err = open_err(&dir);
    assert!(
        err.contains("model.extra.weight") && err.contains("model.safetensors"),
        "{err}"
    );

    let (_tmp, dir) = copy("llama");
    let path = dir.join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 100).unwrap();
    let err = open_err(&dir);
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );

    let (_tmp, dir) = copy("llama");
    edit_config(&dir, |m| {
        m.insert("intermediate_size".into(), serde_json::json!(64));
    });
    let err = open_err(&dir);
    assert!(
        err.contains("gate_proj.weight") && err.contains("shape"),
        "{err}"
    );

    let (_tmp, dir) = copy("llama");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(open_err(&dir).contains("has neither model.safetensors"));
}

fn edit_index(dir: &Path, tensor: &str, file: &str) {
    let path = dir.join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["weight_map"][tensor] = serde_json::json!(file);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn shard_names_stay_inside_the_model_directory() {
    let t = "model.norm.weight";
    for (file, want) in [
        (
            "../qwen2/model-00003-of-00003.safetensors",
            "not a plain path",
        ),
        ("/etc/passwd", "not a plain path"),
        ("", "not a plain path"),
        ("model-00009-of-00009.safetensors", "cannot be opened"),
    ] {
        let (_tmp, dir) = copy("qwen2");
        edit_index(&dir, t, file);
        let err = open_err(&dir);
        assert!(err.contains(want) && err.contains(t), "{file}: {err}");
    }
    // A symlink out of the directory.
    let (tmp, dir) = copy("qwen2");
    let outside = tmp.path().join("outside.safetensors");
    std::fs::rename(dir.join("model-00003-of-00003.safetensors"), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, dir.join("model-00003-of-00003.safetensors")).unwrap();
    let err = open_err(&dir);
    assert!(err.contains("leads out of the model directory"), "{err}");
    // A tensor the index puts in the wrong shard.
    let (_tmp, dir) = copy("qwen2");
    edit_index(&dir, t, "model-00001-of-00003.safetensors");
    let err = open_err(&dir);
    assert!(err.contains(t) && err.contains("not in the file"), "{err}");
}

#[test]
fn tied_models_import_tied_and_export_without_lm_head() {
    let (model, gpt) = open("qwen2_tied");
    assert!(model.config().tie_embeddings && model.hf_config().tied);
    let embed = model.read("embed.tok").unwrap();
    let head = model.read("head.w").unwrap();
    assert_eq!(head.shape, embed.shape);
    assert_eq!(head.data, embed.data);
    let tmp = tempfile::tempdir().unwrap();
    hf::export_gpt(&gpt, tmp.path(), &ExportOptions::default()).unwrap();
    let files = hf::WeightFiles::open(tmp.path()).unwrap();
    assert!(!files.names().any(|n| n == "lm_head.weight"));
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(json["tie_word_embeddings"], serde_json::json!(true));

    // An untied config needs lm_head.weight.
    let (_tmp, dir) = copy("qwen2_tied");
    edit_config(&dir, |m| {
        m.insert("tie_word_embeddings".into(), serde_json::json!(false));
    });
    let err = open_err(&dir);
    assert!(
        err.contains("lm_head.weight") && err.contains("missing"),
        "{err}"
    );
}

/// f16 weights (as some checkpoints ship) read as their f32 values: the llama fixture's
/// tensors written back in f16 import to each value rounded to f16.
#[test]
fn f16_weights_read_as_their_values() {
    let (_tmp, dir) = copy("llama");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut halves: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        assert_eq!(view.dtype(), Dtype::F32, "{name}");
        let data: Vec<u8> = view
            .data()
            .chunks_exact(4)
            .flat_map(|b| {
                half::f16::from_f32(f32::from_le_bytes(b.try_into().unwrap())).to_le_bytes()
            })
            .collect();
        halves.push((name, view.shape().to_vec(), data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = halves
        .iter()
        .map(|(n, shape, data)| {
            let view =
                safetensors::tensor::TensorView::new(Dtype::F16, shape.clone(), data).unwrap();
            (n.clone(), view)
        })
        .collect();
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    let (f32_model, _) = open("llama");
    let f16_model = HfModel::open(&dir).unwrap();
    for (name, _) in hf::param_shapes(f16_model.config()) {
        let want: Vec<f32> = f32_model
            .read(&name)
            .unwrap()
            .data
            .iter()
            .map(|&v| half::f16::from_f32(v).to_f32())
            .collect();
        assert_eq!(f16_model.read(&name).unwrap().data, want, "{name}");
    }
}
