//! `pipefill export --overwrite` through the binary (issue 34, items 5 and 6): an export
//! into the checkpoint it reads (or into the run directory holding it, or a directory
//! inside it) is refused in one line before anything is written, and the run still
//! resumes; an export over an earlier one replaces the export's files and leaves the
//! user's.

mod common;

use std::path::Path;
use std::process::Output;

use common::{clean, export_hf, text};
use pipefill::model::checkpoint::Checkpoint;

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

const LLAMA: &[&str] = &[
    "model.d_model=16",
    "model.heads=2",
    "model.layers=2",
    "model.seq_len=32",
    "model.positions=\"rope\"",
    "model.activation=\"swiglu\"",
    "model.kv_heads=1",
    "train.micro_batch_size=2",
    "train.eval_tasks=0",
    "data.summary_tasks=50",
];

fn train(out: &Path, steps: &str, resume: bool) -> Output {
    let mut cmd = clean(EXE);
    cmd.args(["train", "--schedule", "none", "--steps", steps]);
    for s in LLAMA {
        cmd.args(["--set", s]);
    }
    if resume {
        cmd.arg("--resume").arg(out);
    }
    cmd.arg("--out-dir").arg(out).output().unwrap()
}

#[test]
fn an_export_into_the_checkpoint_it_reads_is_refused_and_the_run_still_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = train(&run, "2", false);
    assert!(out.status.success(), "{}", text(&out));
    let ckpt = run.join("checkpoint");
    let before = std::fs::read(ckpt.join("model.safetensors")).unwrap();
    for target in [ckpt.clone(), ckpt.join("hf"), run.clone()] {
        let out = export_hf(&run, &target, &["--overwrite"]);
        assert!(
            !out.status.success(),
            "{}: {}",
            target.display(),
            text(&out)
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(
            err.contains("the checkpoint being exported") && err.contains("choose an output"),
            "{err}"
        );
    }
    assert_eq!(
        std::fs::read(ckpt.join("model.safetensors")).unwrap(),
        before
    );
    assert!(!ckpt.join("hf").exists());
    assert_eq!(Checkpoint::load(&ckpt).unwrap().meta.step, 2);
    let out = train(&run, "3", true);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn an_export_over_an_earlier_one_keeps_the_users_files() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = train(&run, "2", false);
    assert!(out.status.success(), "{}", text(&out));
    let hf = dir.path().join("hf");
    let out = export_hf(&run, &hf, &[]);
    assert!(out.status.success(), "{}", text(&out));
    std::fs::write(hf.join("notes.md"), "mine").unwrap();
    std::fs::create_dir(hf.join("evals")).unwrap();
    std::fs::write(hf.join("evals/a.safetensors"), "mine").unwrap();
    let out = export_hf(&run, &hf, &["--overwrite", "--dtype", "bf16"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        std::fs::read_to_string(hf.join("notes.md")).unwrap(),
        "mine"
    );
    assert_eq!(
        std::fs::read_to_string(hf.join("evals/a.safetensors")).unwrap(),
        "mine"
    );
}
