use std::fs;

use super::*;
use crate::model::checkpoint::Checkpoint;
use crate::model::config::Positions;
use crate::model::hf::{ExportOptions, export_gpt};
use crate::model::{AdamW, AdamWConfig, Cut, Gpt, GptConfig};
use crate::tensor::{Activation, CpuBackend};

/// A small Llama-shaped model (exportable).
fn gpt() -> Gpt<CpuBackend> {
    let config = GptConfig {
        positions: Positions::Rope,
        activation: Activation::Swiglu,
        kv_heads: Some(1),
        vocab: 50,
        d_model: 8,
        heads: 2,
        layers: 2,
        seq_len: 8,
        ..GptConfig::default()
    };
    Gpt::new(&config, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap()
}

/// A whole-model checkpoint of [`gpt`] saved in `dir`.
fn save_checkpoint(dir: &Path) {
    let mut c = Checkpoint::capture(&gpt(), &AdamW::new(AdamWConfig::default()), 2, 5).unwrap();
    c.save(dir).unwrap();
}

fn overwrite_from(checkpoint: &Path) -> ExportOptions {
    ExportOptions {
        overwrite: true,
        checkpoint: Some(checkpoint.to_path_buf()),
        ..ExportOptions::default()
    }
}

#[test]
fn the_checkpoint_read_a_directory_inside_it_or_holding_it_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("run");
    let ckpt = run.join("checkpoint");
    save_checkpoint(&ckpt);
    let before = fs::read(ckpt.join(TENSOR_FILE)).unwrap();
    let link = root.path().join("link");
    std::os::unix::fs::symlink(&ckpt, &link).unwrap();
    let opts = overwrite_from(&ckpt);
    for (out, how) in [
        (ckpt.clone(), "it is the checkpoint"),
        (run.join("checkpoint/./"), "it is the checkpoint"),
        (link.clone(), "it is the checkpoint"),
        (run.join("checkpoint/hf"), "it lies inside the checkpoint"),
        (run.join("other/../checkpoint/hf/x"), "it lies inside"),
        (run.clone(), "it holds the checkpoint"),
        (root.path().to_path_buf(), "it holds the checkpoint"),
    ] {
        let err = export_gpt(&gpt(), &out, &opts).unwrap_err().to_string();
        assert!(
            err.contains(how) && err.contains(&ckpt.canonicalize().unwrap().display().to_string()),
            "{}: {err}",
            out.display()
        );
    }
    assert_eq!(fs::read(ckpt.join(TENSOR_FILE)).unwrap(), before);
    assert!(!run.join("checkpoint/hf").exists() && !run.join("other").exists());
    Checkpoint::load(&ckpt).unwrap();
    // Beside it is fine.
    export_gpt(&gpt(), &run.join("hf"), &opts).unwrap();
}

#[test]
fn overwrite_replaces_the_exports_files_and_keeps_every_other() {
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("hf");
    export_gpt(&gpt(), &out, &ExportOptions::default()).unwrap();
    fs::write(out.join("README.md"), "mine").unwrap();
    fs::create_dir(out.join("eval")).unwrap();
    fs::write(out.join("eval/results.json"), "{}").unwrap();
    export_gpt(&gpt(), &out, &overwrite_from(&root.path().join("ckpt"))).unwrap();
    let mut names: Vec<String> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["README.md", "config.json", "eval", SINGLE_FILE]);
    assert_eq!(fs::read_to_string(out.join("README.md")).unwrap(), "mine");
}

#[test]
fn overwrite_refuses_weights_it_does_not_write_and_another_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    let opts = overwrite_from(&root.path().join("elsewhere"));
    // Another tool's sharded weights: replacing model.safetensors beside them would leave a
    // reader their index.
    let sharded = root.path().join("sharded");
    fs::create_dir(&sharded).unwrap();
    for name in [INDEX_FILE, "model-00001-of-00002.safetensors"] {
        fs::write(sharded.join(name), "theirs").unwrap();
    }
    let err = export_gpt(&gpt(), &sharded, &opts).unwrap_err().to_string();
    assert!(
        err.contains("model-00001-of-00002.safetensors, model.safetensors.index.json")
            && err.contains("does not write"),
        "{err}"
    );
    assert_eq!(fs::read_dir(&sharded).unwrap().count(), 2);
    // Another run's checkpoint (not the one exported) and a sharded one's step directory.
    let other = root.path().join("other/checkpoint");
    save_checkpoint(&other);
    let err = export_gpt(&gpt(), &other, &opts).unwrap_err().to_string();
    assert!(
        err.contains("holds a pipefill checkpoint (checkpoint.json)"),
        "{err}"
    );
    fs::remove_file(other.join(META_FILE)).unwrap();
    let err = export_gpt(&gpt(), &other, &opts).unwrap_err().to_string();
    assert!(err.contains("model.safetensors of one"), "{err}");
    let step = root.path().join("step");
    fs::create_dir(&step).unwrap();
    fs::write(step.join(MANIFEST_FILE), "{}").unwrap();
    let err = export_gpt(&gpt(), &step, &opts).unwrap_err().to_string();
    assert!(err.contains("(manifest.json)"), "{err}");
}
