//! `pipefill export RUN_DIR --format hf -o DIR` through the binary: a run of a Llama-shaped
//! model (rotary positions, SwiGLU, grouped-query attention) exports to a directory whose
//! tensors re-import equal to the run's checkpoint; a non-empty output needs --overwrite; a
//! learned-positions model cannot be expressed and says so in one line.

mod common;

use std::path::Path;
use std::process::Output;

use common::{clean, export_hf, text};
use pipefill::model::checkpoint::{Checkpoint, MASTER_PREFIX};
use pipefill::model::hf::HfModel;

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

const TINY: &[&str] = &[
    "model.d_model=16",
    "model.heads=2",
    "model.layers=2",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.eval_tasks=2",
    "data.summary_tasks=50",
];

fn train(extra: &[&str], out: &Path) -> Output {
    let mut cmd = clean(EXE);
    cmd.args(["train", "--schedule", "none", "--steps", "2"]);
    for s in TINY.iter().chain(extra) {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(out).output().unwrap()
}

#[test]
fn a_llama_shaped_run_exports_and_reimports() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let llama = [
        "model.positions=\"rope\"",
        "model.activation=\"swiglu\"",
        "model.kv_heads=1",
    ];
    let out = train(&llama, &run);
    assert!(out.status.success(), "{}", text(&out));
    let hf_dir = dir.path().join("hf");
    let out = export_hf(&run, &hf_dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("exported step 2"),
        "{}",
        text(&out)
    );

    let ckpt = Checkpoint::load(&run.join("checkpoint")).unwrap();
    let model = HfModel::open(&hf_dir).unwrap();
    assert_eq!(model.config().d_model, 16);
    assert_eq!(model.config().kv_heads, Some(1));
    for (name, _) in pipefill::model::hf::param_shapes(model.config()) {
        let t = model.read(&name).unwrap();
        assert_eq!(Some(&t), ckpt.tensor(&name), "{name}");
    }

    // Again into the same directory: refused without --overwrite, in one line.
    let out = export_hf(&run, &hf_dir, &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("not empty"), "{err}");
    let out = export_hf(&run, &hf_dir, &["--overwrite", "--dtype", "bf16"]);
    assert!(out.status.success(), "{}", text(&out));
    HfModel::open(&hf_dir).unwrap();
}

/// A `train.precision = "bf16"` run exports its f32 master weights with `--dtype f32`, and
/// with `--dtype bf16` them rounded: the bf16 values the run computed with.
#[test]
fn a_bf16_run_exports_its_master_weights_or_them_rounded() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let bf16 = [
        "model.positions=\"rope\"",
        "model.activation=\"swiglu\"",
        "train.precision=\"bf16\"",
    ];
    let out = train(&bf16, &run);
    assert!(out.status.success(), "{}", text(&out));
    let ckpt = Checkpoint::load(&run.join("checkpoint")).unwrap();
    let master = |name: &str| {
        let t = ckpt.tensor(&format!("{MASTER_PREFIX}{name}"));
        t.unwrap_or_else(|| panic!("no master weights of `{name}`"))
    };
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (dtype, dir_name) in [("f32", "hf32"), ("bf16", "hf16")] {
        let hf_dir = dir.path().join(dir_name);
        let out = export_hf(&run, &hf_dir, &["--dtype", dtype]);
        assert!(out.status.success(), "{}", text(&out));
        let model = HfModel::open(&hf_dir).unwrap();
        let mut finer = false;
        for (name, _) in pipefill::model::hf::param_shapes(model.config()) {
            let got = model.read(&name).unwrap().data;
            let want = match dtype {
                "f32" => &master(&name).data,
                _ => &ckpt.tensor(&name).unwrap().data,
            };
            assert_eq!(bits(&got), bits(want), "--dtype {dtype}: {name}");
            finer |= bits(&master(&name).data) != bits(&ckpt.tensor(&name).unwrap().data);
        }
        assert!(
            finer,
            "the master weights are the bf16 values: nothing to tell apart"
        );
    }
}

#[test]
fn a_learned_positions_run_cannot_be_exported() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = train(&[], &run);
    assert!(out.status.success(), "{}", text(&out));
    let out = export_hf(&run, &dir.path().join("hf"), &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("positions") && err.contains("learned"),
        "{err}"
    );
    assert!(!dir.path().join("hf").exists());
}

#[test]
fn a_pipelined_runs_sharded_checkpoint_exports() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let extra = [
        "model.positions=\"rope\"",
        "model.activation=\"swiglu\"",
        "stages=2",
        "checkpoint_every=1",
    ];
    let mut cmd = clean(EXE);
    cmd.args(["train", "--schedule", "1f1b", "--steps", "2"]);
    for s in TINY.iter().chain(&extra) {
        cmd.args(["--set", s]);
    }
    let out = cmd.arg("--out-dir").arg(&run).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    // The run directory's newest checkpoint is the sharded step 2.
    let hf_dir = dir.path().join("hf");
    let out = export_hf(&run, &hf_dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("checkpoints/step-"),
        "{}",
        text(&out)
    );
    let whole = Checkpoint::load(&run.join("checkpoint")).unwrap();
    let model = HfModel::open(&hf_dir).unwrap();
    for (name, _) in pipefill::model::hf::param_shapes(model.config()) {
        assert_eq!(
            Some(&model.read(&name).unwrap()),
            whole.tensor(&name),
            "{name}"
        );
    }
}
